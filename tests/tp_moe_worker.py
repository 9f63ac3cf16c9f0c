"""One rank of the tensor-parallel experts check (run by test_tensor_parallel.py, 2 gloo processes).

ParallelExpertsWithLoRA over the group, each rank holding its shard of the intermediate
dimension, must give the output of the unsharded ExpertsWithLoRA for a batch with adapters
of mixed ranks (one on both expert parameters, one on down_proj only), on every backend.
"""

import sys

import torch
import torch.distributed as dist

from lora_core import build_batch_info, get_backend
from lora_core.adapters import LoRAModuleWeights
from lora_layers import ExpertsWithLoRA, LoRAContext, ParallelExpertsWithLoRA, TensorParallel
from tp_common import Experts, experts_shard

E, H, I, K, R = 4, 16, 12, 2, 4
RANKS, SCALINGS = [4, 2, 0], [0.5, 2.0, 1.0]
SEQ_LENS, SLOTS = [3, 2, 4], [0, None, 1]
T = sum(SEQ_LENS)


def _weights(gen, in_f, out_f, r):
    return LoRAModuleWeights("experts", "experts", torch.randn(E, r, in_f, generator=gen),
                             torch.randn(E, out_f, r, generator=gen), 1.0)


def main(rank: int, world: int, init_method: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    tp = TensorParallel.from_distributed()
    gen = torch.Generator().manual_seed(0)  # identical on every rank
    gate_up, down = torch.randn(E, 2 * I, H, generator=gen) / H**0.5, torch.randn(E, H, I, generator=gen) / I**0.5
    adapters = [{0: _weights(gen, H, 2 * I, 4), 1: _weights(gen, I, H, 4)}, {1: _weights(gen, I, H, 2)}]
    x = torch.randn(T, H, generator=gen)
    top_k_index = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    top_k_weights = torch.softmax(torch.randn(T, K, generator=gen), -1)
    local = experts_shard(gate_up, down, tp.rank, tp.size)
    for backend_name in ("torch_native", "ascend"):
        ctx = LoRAContext(get_backend(backend_name)(), num_slots=3, max_rank=R, dtype=torch.float32, device="cpu")
        ctx.backend.prepare_batch(build_batch_info(SEQ_LENS, SLOTS, RANKS, SCALINGS, device="cpu"))
        full, sharded = ExpertsWithLoRA(Experts(gate_up, down), ctx), ParallelExpertsWithLoRA(local, ctx, tp)
        for slot, parts in enumerate(adapters):
            full.load_slot(slot, parts, 1.0)
            sharded.load_slot(slot, parts, 1.0)
        want = full(x, top_k_index, top_k_weights)
        got = sharded(x, top_k_index, top_k_weights)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{backend_name} rank {rank}: {m}")
    print(f"rank {rank}: experts match on torch_native and ascend", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
