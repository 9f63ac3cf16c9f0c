"""One rank of the fully sharded tensor-parallel check (run by test_tensor_parallel.py, 2 gloo processes).

Each tensor-parallel wrapper built with ``fully_sharded=True`` (column, gate_up, qkv, row,
vocab-parallel embedding, fused experts) must give the output of the unsharded replicated wrapper, on both backends, for an eager batch and for a graph-mode
batch refilled with another one, with adapters of mixed ranks (a rank-0 slot, a base
request); and hold ``1/tp`` of the adapters' A and B where today's wrapper replicates one
of them. Prints one line per wrapper with its per-process adapter bytes, today's and fully sharded.
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

from lora_ascend import AscendBackend
from lora_core import build_batch_info
from lora_core.adapters import LoRAModuleWeights
from lora_cuda import TorchNativeBackend
from lora_layers import (
    ColumnParallelLinearWithLoRA,
    EmbeddingWithLoRA,
    ExpertsWithLoRA,
    LinearWithLoRA,
    LoRAContext,
    MergedColumnParallelLinearWithLoRA,
    ParallelExpertsWithLoRA,
    QKVParallelLinearWithLoRA,
    RowParallelLinearWithLoRA,
    TensorParallel,
)
from lora_layers.parallel import shard_range
from tp_common import (
    RANKS,
    SCALINGS,
    R,
    Experts,
    column_shard_rows,
    experts_shard,
    load_adapters,
    random_adapters,
    random_linear,
)

BATCHES = [([3, 2, 4], [0, None, 1]), ([1, 5, 2, 1], [1, 2, 0, None])]  # (seq_lens, slots); slot 2 has rank 0
T = 9
H = 16
E, I, K = 4, 12, 2  # fused experts: experts, (unsharded) intermediate size, top-k


def _bytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def _expert_pair(gen, in_features, out_features, r):
    """One expert parameter's unsharded LoRA weights of rank ``r``: ``A (E, r, in)``, ``B (E, out, r)``."""
    return LoRAModuleWeights("experts", "experts", torch.randn(E, r, in_features, generator=gen),
                             torch.randn(E, out_features, r, generator=gen), 1.0)


def _expert_buffer_bytes(wrapper):
    """``(A, B)`` bytes of each expert parameter's LoRA buffers: gate_up's, then down's."""
    return [(_bytes(buf.a), _bytes(buf.b)) for buf in (wrapper.gate_up, wrapper.down)]


def _contexts(backend_cls):
    """An eager context, one whose LoRA runs in bf16 beside the float32 model (the deltas are added in the
    model's dtype), and a graph-mode one whose batch is refilled between the two batches."""
    eager = LoRAContext(backend_cls(), num_slots=3, max_rank=R, dtype=torch.float32, device="cpu")
    bf16 = LoRAContext(backend_cls(), num_slots=3, max_rank=R, dtype=torch.bfloat16, device="cpu")
    graph = LoRAContext(backend_cls(), num_slots=3, max_rank=R, dtype=torch.float32, device="cpu")
    graph.backend.prepare_batch(build_batch_info(*BATCHES[0], RANKS, SCALINGS, device="cpu", use_graph=True,
                                                 max_tokens=16, max_rank=R))
    return {"eager": eager, "eager bf16-lora": bf16, "graph": graph}


def _set_batch(ctx, mode, index):
    if mode.startswith("eager"):
        ctx.backend.prepare_batch(build_batch_info(*BATCHES[index], RANKS, SCALINGS, device="cpu"))
    else:
        ctx.backend.batch_info.refill(*BATCHES[index])


def main(rank: int, world: int, init_method: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    tp = TensorParallel.from_distributed()
    checked, sizes = [], {}

    def check(name, got, want):
        if "bf16" in name:  # the shards' partial shrinks are each rounded to bf16 before their sum
            tolerance = dict(rtol=0, atol=2e-2 * want.abs().max().item())
        else:
            tolerance = dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, want, **tolerance, msg=lambda m: f"{name} on rank {rank}: {m}")
        checked.append(name)

    for backend_cls in (TorchNativeBackend, AscendBackend):
        for mode, ctx in _contexts(backend_cls).items():
            gen = torch.Generator().manual_seed(0)  # identical on every rank
            tag = f"{backend_cls.name} {mode}"
            x = torch.randn(T, H, generator=gen)

            column_kinds = [
                ("column", [24], 12, lambda base, **kw: ColumnParallelLinearWithLoRA(base, ctx, tp, gather_output=True,
                                                                                    **kw)),
                ("gate_up", [20, 20], 20, lambda base, **kw: MergedColumnParallelLinearWithLoRA(
                    base, ctx, tp, [20, 20], True, **kw)),
                ("qkv kv-sharded", [16, 8, 8], 16, lambda base, **kw: QKVParallelLinearWithLoRA(
                    base, ctx, tp, num_heads=4, num_kv_heads=2, head_dim=4, gather_output=True, **kw)),
                ("qkv kv-replicated", [16, 4, 4], 16, lambda base, **kw: QKVParallelLinearWithLoRA(
                    base, ctx, tp, num_heads=4, num_kv_heads=1, head_dim=4, **kw)),
            ]
            for name, widths, local_out, make in column_kinds:
                full = random_linear(gen, H, sum(widths))
                adapters = random_adapters(gen, H, widths)
                reference = LinearWithLoRA(full, ctx, widths)
                load_adapters(reference, adapters)
                today, fully = make(nn.Linear(H, local_out)), make(nn.Linear(H, local_out), fully_sharded=True)
                index = column_shard_rows(widths, fully._row_ranges)
                for wrapper in (today, fully):
                    with torch.no_grad():
                        wrapper.base_layer.weight.copy_(full.weight[index])
                        wrapper.base_layer.bias.copy_(full.bias[index])
                    load_adapters(wrapper, adapters)
                for b in range(2):
                    _set_batch(ctx, mode, b)
                    want = reference(x)
                    check(f"{name} ({tag}, batch {b})", fully(x), want if fully.gather_output else want[:, index])
                assert _bytes(fully.buffers.a) * world == _bytes(reference.buffers.a), name
                assert _bytes(fully.buffers.b) == _bytes(today.buffers.b), name
                sizes[name] = (_bytes(today.buffers.a, today.buffers.b), _bytes(fully.buffers.a, fully.buffers.b))

            full = random_linear(gen, H, 12)  # row parallel: input columns sharded, bias once
            adapters = random_adapters(gen, H, [12])
            reference = LinearWithLoRA(full, ctx)
            load_adapters(reference, adapters)
            s, e = shard_range(H, rank, world)
            wrappers = []
            for fully_sharded in (False, True):
                shard = nn.Linear(e - s, 12)
                with torch.no_grad():
                    shard.weight.copy_(full.weight[:, s:e])
                    shard.bias.copy_(full.bias)
                wrappers.append(RowParallelLinearWithLoRA(shard, ctx, tp, fully_sharded=fully_sharded))
                load_adapters(wrappers[-1], adapters)
            today, fully = wrappers
            for b in range(2):
                _set_batch(ctx, mode, b)
                check(f"row ({tag}, batch {b})", fully(x[:, s:e]), reference(x))
            assert _bytes(fully.buffers.b) * world == _bytes(reference.buffers.b)
            assert _bytes(fully.buffers.a) == _bytes(today.buffers.a)
            sizes["row"] = (_bytes(today.buffers.a, today.buffers.b), _bytes(fully.buffers.a, fully.buffers.b))

            V, D = 20, 6  # vocab-parallel embedding
            table = torch.randn(V, D, generator=gen)
            pairs = [(torch.randn(r, V, generator=gen), torch.randn(D, r, generator=gen)) if r else None
                     for r in RANKS]
            reference = EmbeddingWithLoRA(nn.Embedding.from_pretrained(table), ctx)
            vs, ve = shard_range(V, rank, world)
            today = EmbeddingWithLoRA(nn.Embedding.from_pretrained(table[vs:ve]), ctx, tp=tp)
            fully = EmbeddingWithLoRA(nn.Embedding.from_pretrained(table[vs:ve]), ctx, tp=tp, fully_sharded=True)
            for slot, pair in enumerate(pairs):
                if pair is not None:
                    for wrapper in (reference, today, fully):
                        wrapper.set_lora(slot, *pair)
            ids = torch.randint(-2, V + 2, (T,), generator=gen)  # out-of-vocab ids included
            for b in range(2):
                _set_batch(ctx, mode, b)
                check(f"embedding ({tag}, batch {b})", fully(ids), reference(ids))
            assert _bytes(fully.buffers.b) * world == _bytes(reference.buffers.b)
            assert _bytes(fully.buffers.a) == _bytes(today.buffers.a)
            sizes["embedding"] = (_bytes(today.buffers.a, today.buffers.b), _bytes(fully.buffers.a, fully.buffers.b))

            # fused experts: intermediate-parallel; fully sharded, gate_up's A and down's B split by H
            gate_up, down = torch.randn(E, 2 * I, H, generator=gen) / H**0.5, torch.randn(E, H, I, generator=gen) / I**0.5
            adapters = {slot: {0: _expert_pair(gen, H, 2 * I, r), 1: _expert_pair(gen, I, H, r)}
                        for slot, r in enumerate(RANKS) if r}  # slot 2 (rank 0) holds no adapter
            routes = [(torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]),
                       torch.softmax(torch.randn(T, K, generator=gen), -1)) for _ in range(2)]
            reference = ExpertsWithLoRA(Experts(gate_up, down), ctx)
            today = ParallelExpertsWithLoRA(experts_shard(gate_up, down, rank, world), ctx, tp)
            fully = ParallelExpertsWithLoRA(experts_shard(gate_up, down, rank, world), ctx, tp, fully_sharded=True)
            for slot, parts in adapters.items():
                for wrapper in (reference, today, fully):
                    wrapper.load_slot(slot, parts, 1.0)
            for b, (top_k_index, top_k_weights) in enumerate(routes):
                _set_batch(ctx, mode, b)
                check(f"experts ({tag}, batch {b})", fully(x, top_k_index, top_k_weights),
                      reference(x, top_k_index, top_k_weights))
            for (a_fully, b_fully), (a_full, b_full) in zip(_expert_buffer_bytes(fully),
                                                            _expert_buffer_bytes(reference)):
                assert a_fully * world == a_full and b_fully * world == b_full, "experts"
            sizes["experts"] = tuple(sum(map(sum, _expert_buffer_bytes(w))) for w in (today, fully))

    dist.barrier()
    dist.destroy_process_group()
    for name, (today, fully) in sizes.items():
        print(f"rank {rank}: {name}: adapter bytes per process {today} today, {fully} fully sharded")
    print(f"rank {rank}: {len(checked)} fully sharded checks match the unsharded layer")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
