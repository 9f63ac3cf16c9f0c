"""One rank of the replicated-kv-heads check (run by test_tp_kv_heads.py over gloo).

QKV column parallelism when ``tp_size > num_kv_heads``: each kv head lives on
``tp_size / num_kv_heads`` consecutive ranks. The rows a rank must hold are written
out here independently of the wrapper (q: an even shard; k and v: head
``rank // (tp_size / num_kv_heads)``, or an even shard when the heads divide over the
ranks), and the sharded wrapper's output must equal those rows of the unsharded layer.
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

from lora_core import build_batch_info
from lora_cuda import TorchNativeBackend
from lora_layers import LinearWithLoRA, LoRAContext, QKVParallelLinearWithLoRA, TensorParallel

RANKS, SCALINGS, R = [4, 2, 0], [0.5, 2.0, 1.0], 4
SEQ_LENS, SLOTS = [3, 2, 4], [0, None, 1]
NUM_HEADS, HEAD_DIM, HIDDEN = 4, 3, 10

# the kv head of each rank, written out for the configurations the test runs
KV_HEAD_OF_RANK = {(2, 1): [0, 0], (4, 1): [0, 0, 0, 0], (4, 2): [0, 0, 1, 1]}


def expected_rows(rank: int, world: int, num_kv_heads: int) -> list[int]:
    """Indices into the unsharded [q | k | v] output that this rank computes."""
    q, kv = NUM_HEADS * HEAD_DIM, num_kv_heads * HEAD_DIM
    q_rows = list(range(rank * q // world, (rank + 1) * q // world))
    if num_kv_heads >= world:
        kv_rows = list(range(rank * kv // world, (rank + 1) * kv // world))
    else:
        head = KV_HEAD_OF_RANK[(world, num_kv_heads)][rank]
        assert head == rank // (world // num_kv_heads)
        kv_rows = list(range(head * HEAD_DIM, (head + 1) * HEAD_DIM))
    return q_rows + [q + r for r in kv_rows] + [q + kv + r for r in kv_rows]


def main(rank: int, world: int, init_method: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    tp = TensorParallel.from_distributed()
    ctx = LoRAContext(TorchNativeBackend(), num_slots=3, max_rank=R, dtype=torch.float32, device="cpu")
    ctx.backend.prepare_batch(build_batch_info(SEQ_LENS, SLOTS, RANKS, SCALINGS, device="cpu"))
    checked = []
    for num_kv_heads in (1, 2, 4):
        gen = torch.Generator().manual_seed(num_kv_heads)  # identical on every rank
        widths = [NUM_HEADS * HEAD_DIM, num_kv_heads * HEAD_DIM, num_kv_heads * HEAD_DIM]
        full = nn.Linear(HIDDEN, sum(widths))
        with torch.no_grad():
            full.weight.copy_(torch.randn(sum(widths), HIDDEN, generator=gen))
            full.bias.copy_(torch.randn(sum(widths), generator=gen))
        # per slot: one (A, B) per slice, every kv head's B rows distinct
        adapters = [[(torch.randn(r, HIDDEN, generator=gen), 1 + torch.randn(w, r, generator=gen) * (i + 1))
                     for i, w in enumerate(widths)] if r else None for r in RANKS]
        reference = LinearWithLoRA(full, ctx, widths)
        for slot, slices in enumerate(adapters):
            if slices is not None:
                reference.set_lora(slot, slices)
        x = torch.randn(sum(SEQ_LENS), HIDDEN, generator=gen)
        with torch.no_grad():
            want = reference(x)
        index = torch.tensor(expected_rows(rank, world, num_kv_heads))
        local = nn.Linear(HIDDEN, len(index))
        with torch.no_grad():  # this rank's rows of the full base layer, as a checkpoint loader shards them
            local.weight.copy_(full.weight[index])
            local.bias.copy_(full.bias[index])
        wrapper = QKVParallelLinearWithLoRA(local, ctx, tp, num_heads=NUM_HEADS, num_kv_heads=num_kv_heads,
                                            head_dim=HEAD_DIM)
        for slot, slices in enumerate(adapters):
            if slices is not None:
                wrapper.set_lora(slot, slices)
        with torch.no_grad():
            got = wrapper(x)
        name = f"tp={world} kv_heads={num_kv_heads}"
        torch.testing.assert_close(got, want[:, index], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name} on rank {rank}: {m}")
        checked.append(name)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: {len(checked)} qkv layouts match the unsharded layer: {', '.join(checked)}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
