"""ExpertsWithLoRA against lora_core's whole-module reference (docs/moe.md), on every device
parameter and backend: captured with batch A (slots and router choices) and replayed with batch B;
and its base projection's three ways (grouped GEMM, eager loop, per-pair gather) agree."""

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lora_core import available_backends, get_backend
from lora_core.adapters import LoRAModuleWeights
from lora_core.reference_experts import reference_experts
from lora_core.testing import assert_close_to_reference, make_batch_info, random_ranks
from lora_core.testing.cases import random_requests
from lora_core.testing.expert_cases import random_expert_ids
from lora_layers.layers import ExpertsWithLoRA, LAYER_TYPES, LoRAContext, WrapTarget, wrap_module
from lora_layers.layers.expert_projection import expert_projection


class Experts(nn.Module):
    """transformers' fused experts layout (MixtralExperts' parameters), without transformers."""

    def __init__(self, gen, E, H, I, dtype):
        super().__init__()
        self.gate_up_proj = nn.Parameter((torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(dtype))
        self.down_proj = nn.Parameter((torch.randn(E, H, I, generator=gen) / I**0.5).to(dtype))
        self.act_fn = F.silu


def _weights(gen, E, r, in_f, out_f, dtype):
    return LoRAModuleWeights("x", "experts", (torch.randn(E, r, in_f, generator=gen) / in_f**0.5).to(dtype),
                             torch.randn(E, out_f, r, generator=gen).to(dtype), 1.0)


@pytest.mark.parametrize("backend_name", available_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("top_k", [1, 2])
def test_experts_layer_matches_the_reference(device, backend_name, dtype, top_k):
    rng, gen = random.Random(top_k), torch.Generator().manual_seed(top_k)
    E, H, I, L, R, T = 5, 16, 12, 3, 4, 10
    dev = device.torch_device
    ranks = random_ranks(rng, L, R)
    base = Experts(gen, E, H, I, dtype).to(dev)
    ctx = LoRAContext(get_backend(backend_name)(dev), num_slots=L, max_rank=R, dtype=dtype, device=dev)
    layer = wrap_module(base, ctx, WrapTarget("mlp.experts"))
    assert isinstance(layer, ExpertsWithLoRA)
    for slot, r in enumerate(ranks):
        if r:  # slot 0's adapter: gate_up only where it is odd (an adapter on one parameter)
            parts = {0: _weights(gen, E, r, H, 2 * I, dtype), 1: _weights(gen, E, r, I, H, dtype)}
            layer.load_slot(slot, {0: parts[0]} if slot % 2 else parts, 1.0)
    batches = [random_requests(rng, T, L) for _ in range(2)]
    picks = [random_expert_ids(rng, gen, T, top_k, E).to(dev) for _ in range(2)]
    x = torch.randn(T, H, generator=gen).to(dev, dtype)
    weights = torch.softmax(torch.randn(T, top_k, generator=gen), -1).to(dev, dtype)
    ids = picks[0].clone()
    holder = {"info": make_batch_info(*batches[0], ranks, device=dev, use_graph=device.is_graph)}

    def step(x, ids, weights):
        ctx.backend.prepare_batch(holder["info"])
        return layer(x, ids, weights)

    def refill():
        ids.copy_(picks[1])
        if device.is_graph:
            holder["info"].refill(*batches[1])
        else:
            holder["info"] = make_batch_info(*batches[1], ranks, device=dev)

    outs = device.run_two_batches(step, (x, ids, weights), refill)
    for out, batch, picked in zip(outs, batches, picks):
        ref = make_batch_info(*batch, ranks, device="cpu")
        want = reference_experts(x, picked, weights, base.gate_up_proj, base.down_proj, F.silu,
                                 (layer.gate_up.a, layer.gate_up.b), (layer.down.a, layer.down.b), ref)
        assert_close_to_reference(out, want, dtype)


@pytest.mark.parametrize("transposed", [False, True], ids=["(E, out, in)", "(E, in, out)"])
def test_the_base_projections_three_ways_agree(transposed):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 2, 8, generator=gen)
    ids = torch.randint(0, 5, (7, 2), generator=gen)
    ids[1, 0], ids[3, 1], ids[4, 0] = -1, 5, 9  # outside the 5 experts (an expert-parallel mask): zeros
    outside = (ids < 0) | (ids >= 5)
    for out_features in (12, 7):  # 12: the CPU's grouped GEMM; 7 (unaligned rows): the eager loop
        weight = torch.randn(5, out_features, 8, generator=gen)
        want = torch.einsum("tki,tkoi->tko", x, weight[ids.clamp(0, 4)]) * ~outside[..., None]
        assert (want[outside] == 0).all() and (want[~outside] != 0).all()
        stored = weight.transpose(1, 2).contiguous() if transposed else weight  # gpt-oss stores (E, in, out)
        for graph_safe in (False, True):  # eager loop or grouped GEMM; per-pair gather or grouped GEMM
            got = expert_projection(x, ids, stored, graph_safe=graph_safe, transposed=transposed)
            torch.testing.assert_close(got, want)


def test_the_eager_expert_loop_reads_the_router_choices_back_once():
    # docs/moe.md: one read back of the choices, whatever the experts picked (a read per picked
    # expert is a device sync each on a GPU)
    import functools

    from lora_core.testing import count_launches

    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(9, 2, 8, generator=gen), torch.randn(5, 7, 8, generator=gen)  # 7: the eager loop
    for ids in (torch.randint(0, 6, (9, 2), generator=gen), torch.full((9, 2), 3), torch.full((9, 2), 5)):
        assert count_launches(functools.partial(expert_projection, graph_safe=False), x, ids, weight).host_reads == 1


def test_a_module_in_another_layout_is_not_wrapped():
    gen = torch.Generator().manual_seed(0)
    transposed = Experts(gen, 2, 8, 4, torch.float32)
    transposed.is_transposed = True
    assert not ExpertsWithLoRA.can_wrap(transposed, WrapTarget("experts"))
    assert ExpertsWithLoRA in LAYER_TYPES
