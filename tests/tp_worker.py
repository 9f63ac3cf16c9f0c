"""One rank of the tensor-parallel check (run by test_tensor_parallel.py, 2 gloo processes).

Every parallel wrapper, sharded over the group, must give the output of the
unsharded replicated wrapper for a batch with adapters of mixed ranks.
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

from lora_core import build_batch_info
from lora_cuda import TorchNativeBackend
from lora_layers import (
    ColumnParallelLinearWithLoRA,
    EmbeddingWithLoRA,
    LinearWithLoRA,
    LMHeadWithLoRA,
    LoRAContext,
    MergedColumnParallelLinearWithLoRA,
    QKVParallelLinearWithLoRA,
    RowParallelLinearWithLoRA,
    TensorParallel,
)
from lora_layers.parallel import shard_range
from tp_common import RANKS, SCALINGS, R, column_shard_rows, load_adapters, random_adapters, random_linear

SEQ_LENS, SLOTS = [3, 2, 4], [0, None, 1]
T = sum(SEQ_LENS)


def main(rank: int, world: int, init_method: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    tp = TensorParallel.from_distributed()
    ctx = LoRAContext(TorchNativeBackend(), num_slots=3, max_rank=R, dtype=torch.float32, device="cpu")
    ctx.backend.prepare_batch(build_batch_info(SEQ_LENS, SLOTS, RANKS, SCALINGS, device="cpu"))
    gen = torch.Generator().manual_seed(0)  # identical on every rank
    H, checked = 16, []

    def check(name, got, want):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} on rank {rank}: {m}")
        checked.append(name)

    x = torch.randn(T, H, generator=gen)

    # column parallel (gathered), gate_up, qkv with sharded and with replicated kv heads, a 4-part packed one
    for name, widths, local_out, make in [
        ("column", [24], 12, lambda base: ColumnParallelLinearWithLoRA(base, ctx, tp, gather_output=True)),
        ("gate_up", [20, 20], 20, lambda base: MergedColumnParallelLinearWithLoRA(base, ctx, tp, [20, 20], True)),
        ("qkv kv-sharded", [16, 8, 8], 16, lambda base: QKVParallelLinearWithLoRA(
            base, ctx, tp, num_heads=4, num_kv_heads=2, head_dim=4, gather_output=True)),
        ("qkv kv-replicated", [16, 4, 4], 16, lambda base: QKVParallelLinearWithLoRA(
            base, ctx, tp, num_heads=4, num_kv_heads=1, head_dim=4)),
        ("qkvg (4 packed parts)", [16, 8, 8, 16], 24, lambda base: ColumnParallelLinearWithLoRA(
            base, ctx, tp, [16, 8, 8, 16], gather_output=True)),
    ]:
        full = random_linear(gen, H, sum(widths))
        adapters = random_adapters(gen, H, widths)
        reference = LinearWithLoRA(full, ctx, widths)
        load_adapters(reference, adapters)
        want = reference(x)
        wrapper = make(nn.Linear(H, local_out))
        index = column_shard_rows(widths, wrapper._row_ranges)
        with torch.no_grad():  # this rank's rows of the full base layer
            wrapper.base_layer.weight.copy_(full.weight[index])
            wrapper.base_layer.bias.copy_(full.bias[index])
        load_adapters(wrapper, adapters)
        got = wrapper(x)
        check(name, got, want if wrapper.gather_output else want[:, index])

    # row parallel: input columns sharded, bias once
    full = random_linear(gen, H, 12)
    adapters = random_adapters(gen, H, [12])
    reference = LinearWithLoRA(full, ctx)
    load_adapters(reference, adapters)
    s, e = shard_range(H, rank, world)
    shard = nn.Linear(e - s, 12)
    with torch.no_grad():
        shard.weight.copy_(full.weight[:, s:e])
        shard.bias.copy_(full.bias)
    wrapper = RowParallelLinearWithLoRA(shard, ctx, tp)
    load_adapters(wrapper, adapters)
    check("row", wrapper(x[:, s:e]), reference(x))

    # vocab-parallel embedding and LM head
    V, D = 20, 6
    table = torch.randn(V, D, generator=gen)
    emb_adapters = [(torch.randn(r, V, generator=gen), torch.randn(D, r, generator=gen)) if r else None for r in RANKS]
    reference = EmbeddingWithLoRA(nn.Embedding.from_pretrained(table), ctx)
    vs, ve = shard_range(V, rank, world)
    wrapper = EmbeddingWithLoRA(nn.Embedding.from_pretrained(table[vs:ve]), ctx, tp=tp)
    for slot, pair in enumerate(emb_adapters):
        if pair is not None:
            reference.set_lora(slot, *pair)
            wrapper.set_lora(slot, *pair)
    ids = torch.randint(-2, V + 2, (T,), generator=gen)  # out-of-vocab ids included
    check("embedding", wrapper(ids), reference(ids))

    head_full = nn.Linear(D, V, bias=False)
    with torch.no_grad():
        head_full.weight.copy_(torch.randn(V, D, generator=gen))
    head_adapters = random_adapters(gen, D, [V])
    reference = LMHeadWithLoRA(head_full, ctx)
    load_adapters(reference, head_adapters)
    shard = nn.Linear(D, ve - vs, bias=False)
    with torch.no_grad():
        shard.weight.copy_(head_full.weight[vs:ve])
    wrapper = LMHeadWithLoRA(shard, ctx, tp)
    load_adapters(wrapper, head_adapters)
    hidden = torch.randn(T, D, generator=gen)
    check("lm_head", wrapper(hidden), reference(hidden))
    last = torch.randn(3, D, generator=gen)  # pruned: one row per request
    check("lm_head pruned", wrapper(last), reference(last))

    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: {len(checked)} wrappers match the unsharded layer: {', '.join(checked)}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
