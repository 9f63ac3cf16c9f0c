"""LoRA on fused experts through every registered backend, on every device parameter, against
lora_core's reference (docs/moe.md). Graph devices capture batch A (its slots and router choices)
and replay batch B; compiled with ``fullgraph=True`` a refilled batch reuses the compiled code."""

import random

import pytest
import torch
import torch._dynamo

from lora_core import available_backends, build_batch_info, get_backend
from lora_core.reference_experts import reference_experts_lora
from lora_core.testing import assert_close_to_reference, count_launches, make_batch_info, random_ranks
from lora_core.testing.cases import default_scalings, random_requests
from lora_core.testing.expert_cases import random_expert_ids, random_expert_weights

BACKENDS = available_backends()
DTYPES = [torch.float32, torch.bfloat16]


def _case(seed, dtype, device, top_k, aligned=False):
    """Random sizes; ``aligned``: feature sizes and rank of 16-byte rows (the grouped GEMM's rule)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    L, E, R = rng.randint(2, 4), rng.randint(3, 6), 8 if aligned else rng.choice([4, 8])
    T, in_f, out_f = rng.randint(4, 24), rng.randint(4, 24), rng.randint(4, 24)
    if aligned:
        in_f, out_f = 8 * rng.randint(1, 3), 8 * rng.randint(1, 3)
    ranks = random_ranks(rng, L, R)
    a, b = random_expert_weights(gen, num_slots=L, num_experts=E, max_rank=R, in_features=in_f,
                                 out_features=out_f, lora_ranks=ranks, dtype=dtype, device=device)
    batches = [random_requests(rng, T, L) for _ in range(2)]
    ids = [random_expert_ids(rng, gen, T, top_k, E).to(device) for _ in range(2)]
    x = torch.randn(T, top_k, in_f, generator=gen).to(device, dtype)
    base = torch.randn(T, top_k, out_f, generator=gen).to(device, dtype)
    return ranks, (a, b), batches, ids, x, base


def _check_two_batches(device, backend, case, dtype):
    """Run batch A, then batch B in the same buffers (a replay where the device captures), and
    compare both with the reference: other requests and slots, other router choices."""
    ranks, (a, b), (batch_a, batch_b), (ids_a, ids_b), x, base = case
    holder = {"info": make_batch_info(*batch_a, ranks, device=device.torch_device, use_graph=device.is_graph)}
    ids = ids_a.clone()

    def step(x, ids, base):
        backend.prepare_batch(holder["info"])
        return backend.run_experts_lora(x, ids, a, b, base.clone())

    def refill():
        ids.copy_(ids_b)
        if device.is_graph:
            holder["info"].refill(*batch_b)
        else:
            holder["info"] = make_batch_info(*batch_b, ranks, device=device.torch_device)

    out_a, out_b = device.run_two_batches(step, (x, ids, base), refill)
    for out, batch, picked in ((out_a, batch_a, ids_a), (out_b, batch_b, ids_b)):
        ref = make_batch_info(*batch, ranks, device="cpu")
        assert_close_to_reference(out, base.float().cpu() + reference_experts_lora(x, picked, a, b, ref), dtype)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("seed", range(2))
def test_experts_lora_matches_reference(device, backend_name, dtype, top_k, seed):
    case = _case(seed, dtype, device.torch_device, top_k)
    _check_two_batches(device, get_backend(backend_name)(device.torch_device), case, dtype)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_no_delta_without_adapter_or_expert(backend_name):
    ranks, (a, b), _, (ids, _), x, base = _case(5, torch.float32, "cpu", 2)
    T = x.shape[0]
    backend = get_backend(backend_name)("cpu")
    backend.prepare_batch(make_batch_info([T], [None], ranks, device="cpu"))
    torch.testing.assert_close(backend.run_experts_lora(x, ids, a, b, base.clone()), base, rtol=0, atol=0)
    rank0 = ranks.index(0)
    backend.prepare_batch(make_batch_info([T], [rank0], ranks, device="cpu"))
    torch.testing.assert_close(backend.run_experts_lora(x, ids, a, b), torch.zeros_like(base), rtol=0, atol=0)
    full = ranks.index(max(ranks))
    backend.prepare_batch(make_batch_info([T], [full], ranks, device="cpu"))
    outside = torch.full_like(ids, a.shape[1])  # expert ids outside [0, E): no delta (an expert-parallel mask)
    torch.testing.assert_close(backend.run_experts_lora(x, outside, a, b), torch.zeros_like(base), rtol=0, atol=0)


@pytest.mark.parametrize("kernel", ["grouped", "blocked"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_both_graph_safe_kernels_match_reference(device, kernel, dtype):
    """The ascend backend (graph-safe for every batch) with each kernel preference."""
    case = _case(4, dtype, device.torch_device, 2, aligned=True)
    _check_two_batches(device, get_backend("ascend")(device.torch_device, graph_kernel=kernel), case, dtype)


def test_the_eager_kernel_reads_the_groups_back_once():
    # one read back of the (slot, expert) group sizes per call: a read is a device sync on a GPU
    from lora_cuda import experts_lora_fwd

    ranks, (a, b), (batch_a, batch_b), (ids_a, ids_b), x, _ = _case(1, torch.float32, "cpu", 2, aligned=True)
    for batch, ids in ((batch_a, ids_a), (batch_b, ids_b)):
        info = make_batch_info(*batch, ranks, device="cpu")
        assert count_launches(experts_lora_fwd, x, ids, a, b, info).host_reads == 1


@pytest.mark.parametrize("kernel", ["grouped", "blocked"])
def test_graph_safe_kernel_has_constant_launches_and_pair_proportional_flops(kernel):
    from lora_cuda import experts_lora_fwd

    ranks, (a, b), (batch_a, batch_b), (ids_a, ids_b), x, _ = _case(1, torch.float32, "cpu", 2, aligned=True)
    counts = []
    for batch, ids in ((batch_a, ids_a), (batch_b, ids_b), (([x.shape[0]], [None]), ids_a)):
        info = make_batch_info(*batch, ranks, device="cpu")
        run = lambda *args: experts_lora_fwd(*args, graph_safe=True, graph_kernel=kernel)  # noqa: E731
        counts.append(count_launches(run, x, ids, a, b, info))
    assert counts[0].by_op["aten._grouped_mm.default" if kernel == "grouped" else "aten.bmm.default"] == 2
    assert len({(c.ops, c.signatures, c.matmul_macs) for c in counts}) == 1
    assert all(c.host_reads == 0 for c in counts)
    T, K, in_f = x.shape
    L, E, R, _ = a.shape
    assert counts[0].matmul_macs == T * K * R * (in_f + b.shape[2])  # pairs x rank, never x every expert and slot


def test_invalid_inputs_are_named():
    ranks, (a, b), (batch, _), (ids, _), x, base = _case(2, torch.float32, "cpu", 2)
    backend = get_backend("torch_native")("cpu")
    backend.prepare_batch(make_batch_info(*batch, ranks, device="cpu"))
    with pytest.raises(ValueError, match="expert_ids must have shape"):
        backend.run_experts_lora(x, ids[:, :1], a, b)
    with pytest.raises(ValueError, match="expert_ids must be an int32 or int64"):
        backend.run_experts_lora(x, ids.float(), a, b)
    with pytest.raises(ValueError, match="a_weights must have shape"):
        backend.run_experts_lora(x[..., :-1], ids, a, b)
    with pytest.raises(ValueError, match="base_output must have shape"):
        backend.run_experts_lora(x, ids, a, b, base[:, :, :-1])


class _Counting:
    def __init__(self):
        self.compiles = 0

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_compiled_fullgraph_reuses_code_for_refilled_batches(backend_name):
    rng = random.Random(7)
    ranks, (a, b), _, (ids, _), x, base = _case(3, torch.float32, "cpu", 2)
    T, K = ids.shape
    L, E = a.shape[:2]
    backend = get_backend(backend_name)("cpu")
    info = build_batch_info(*random_requests(rng, T, L), ranks, default_scalings(L), device="cpu",
                            use_graph=True, max_tokens=T)
    backend.prepare_batch(info)

    def step(x, ids, base):
        return backend.run_experts_lora(x, ids, a, b, base.clone())

    counter = _Counting()
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    with torch.no_grad():
        compiled(x, ids, base)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(3):
                batch = random_requests(rng, T, L)
                info.refill(*batch)
                ids.copy_(random_expert_ids(rng, torch.Generator().manual_seed(rng.randrange(99)), T, K, E))
                ref = make_batch_info(*batch, ranks, device="cpu")
                assert_close_to_reference(compiled(x, ids, base),
                                          base + reference_experts_lora(x, ids, a, b, ref), torch.float32)
    assert counter.compiles == 1
