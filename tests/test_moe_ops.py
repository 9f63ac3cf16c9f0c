"""LoRA on fused experts through every registered backend, on every device parameter, against
lora_core's reference (docs/moe.md): the fused op and its two halves (the scaled shrink and the
expand, which a fully sharded tensor-parallel layer all-reduces between). Graph devices capture
batch A (its slots and router choices) and replay batch B; compiled with ``fullgraph=True`` a
refilled batch reuses the compiled code."""

import random

import pytest
import torch
import torch._dynamo

from lora_core import available_backends, build_batch_info, get_backend
from lora_core.reference_experts import reference_experts_lora, reference_experts_lora_a, reference_experts_lora_b
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


def _refill_with(device, holder, ids, ids_b, batch_b, ranks):
    """What turns batch A into batch B between the two runs: the router's choices copied in place, and
    the graph batch refilled in place (a capture replays it) or a new eager batch."""
    def refill():
        ids.copy_(ids_b)
        if device.is_graph:
            holder["info"].refill(*batch_b)
        else:
            holder["info"] = make_batch_info(*batch_b, ranks, device=device.torch_device)
    return refill


def _check_two_batches(device, backend, case, dtype):
    """Run batch A, then batch B in the same buffers (a replay where the device captures), and
    compare both with the reference: other requests and slots, other router choices."""
    ranks, (a, b), (batch_a, batch_b), (ids_a, ids_b), x, base = case
    holder = {"info": make_batch_info(*batch_a, ranks, device=device.torch_device, use_graph=device.is_graph)}
    ids = ids_a.clone()

    def step(x, ids, base):
        backend.prepare_batch(holder["info"])
        return backend.run_experts_lora(x, ids, a, b, base.clone())

    refill = _refill_with(device, holder, ids, ids_b, batch_b, ranks)

    out_a, out_b = device.run_two_batches(step, (x, ids, base), refill)
    for out, batch, picked in ((out_a, batch_a, ids_a), (out_b, batch_b, ids_b)):
        ref = make_batch_info(*batch, ranks, device="cpu")
        assert_close_to_reference(out, base.float().cpu() + reference_experts_lora(x, picked, a, b, ref), dtype)


def _outside_experts(ids, num_experts, gen):
    """``ids`` with about a quarter of the choices moved outside ``[0, E)`` (-1 or ``E``: an expert-parallel mask)."""
    moved = torch.rand(ids.shape, generator=gen) < 0.25
    outside = torch.where(torch.rand(ids.shape, generator=gen) < 0.5, -1, num_experts)
    return torch.where(moved.to(ids.device), outside.to(ids.device), ids)


def _check_halves_two_batches(device, backend, case, dtype, seed):
    """Batch A then batch B (a replay where the device captures) through ``run_experts_lora_a`` and
    ``run_experts_lora_b``: the shrink, the expand of that shrink into a base, the expand of an
    input with garbage beyond every rank, and the fused op, each against the reference; and the
    two halves against the fused op. Router choices include ids outside ``[0, E)``."""
    ranks, (a, b), (batch_a, batch_b), (ids_a, ids_b), x, base = case
    gen = torch.Generator().manual_seed(seed)
    E, R = a.shape[1], a.shape[2]
    ids_a, ids_b = _outside_experts(ids_a, E, gen), _outside_experts(ids_b, E, gen)
    y_in = torch.randn(*ids_a.shape, R, generator=gen).to(x.device, dtype)  # non-zero beyond every rank < R,
    # where B holds GARBAGE: an expand that reads a column beyond a slot's rank is far off
    holder = {"info": make_batch_info(*batch_a, ranks, device=device.torch_device, use_graph=device.is_graph)}
    ids = ids_a.clone()

    def step(x, ids, y_in, base):
        backend.prepare_batch(holder["info"])
        shrunk = backend.run_experts_lora_a(x, ids, a)
        return (shrunk, backend.run_experts_lora_b(shrunk, ids, b, base.clone()),
                backend.run_experts_lora_b(y_in, ids, b), backend.run_experts_lora(x, ids, a, b, base.clone()))

    refill = _refill_with(device, holder, ids, ids_b, batch_b, ranks)

    outs = device.run_two_batches(step, (x, ids, y_in, base), refill)
    for (shrunk, halves, expanded, fused), batch, picked in zip(outs, (batch_a, batch_b), (ids_a, ids_b)):
        ref = make_batch_info(*batch, ranks, device="cpu")
        want_shrunk = reference_experts_lora_a(x, picked, a, ref)
        assert_close_to_reference(shrunk, want_shrunk, dtype)
        assert_close_to_reference(halves, base.float().cpu() + reference_experts_lora_b(shrunk, picked, b, ref), dtype)
        assert_close_to_reference(expanded, reference_experts_lora_b(y_in, picked, b, ref), dtype)
        want = base.float().cpu() + reference_experts_lora(x, picked, a, b, ref)
        assert_close_to_reference(fused, want, dtype)
        assert_close_to_reference(halves, fused.float(), dtype)  # shrink then expand is the fused op


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("seed", range(2))
def test_experts_shrink_and_expand_match_reference(device, backend_name, dtype, top_k, seed):
    case = _case(seed, dtype, device.torch_device, top_k)
    _check_halves_two_batches(device, get_backend(backend_name)(device.torch_device), case, dtype, seed)


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


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_halves_give_no_delta_without_adapter_or_expert(backend_name):
    ranks, (a, b), _, (ids, _), x, base = _case(5, torch.float32, "cpu", 2)
    T, K = ids.shape
    R = a.shape[2]
    y = torch.randn(T, K, R)
    backend = get_backend(backend_name)("cpu")
    full = ranks.index(max(ranks))
    outside = torch.full_like(ids, a.shape[1])  # expert ids outside [0, E): no delta (an expert-parallel mask)
    for slot, picked in ((None, ids), (ranks.index(0), ids), (full, outside)):
        backend.prepare_batch(make_batch_info([T], [slot], ranks, device="cpu"))
        assert torch.equal(backend.run_experts_lora_a(x, picked, a), torch.zeros(T, K, R))
        assert torch.equal(backend.run_experts_lora_b(y, picked, b, base.clone()), base)


@pytest.mark.parametrize("kernel", ["grouped", "blocked"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_both_graph_safe_kernels_match_reference(device, kernel, dtype):
    """The ascend backend (graph-safe for every batch) with each kernel preference."""
    case = _case(4, dtype, device.torch_device, 2, aligned=True)
    _check_two_batches(device, get_backend("ascend")(device.torch_device, graph_kernel=kernel), case, dtype)


@pytest.mark.parametrize("kernel", ["grouped", "blocked"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_both_graph_safe_kernels_of_the_halves_match_reference(device, kernel, dtype):
    """The shrink and the expand on the ascend backend (graph-safe for every batch) with each kernel preference."""
    case = _case(4, dtype, device.torch_device, 2, aligned=True)
    _check_halves_two_batches(device, get_backend("ascend")(device.torch_device, graph_kernel=kernel), case, dtype, 4)


def _ops_and_macs(x, a, b):
    """Each experts op of lora_cuda as ``run(info, ids, **options)``, with its matmul MACs for all
    ``T*K`` pairs (pairs x rank, never x every expert and slot) and its matmul launches."""
    from lora_cuda import experts_lora_a_fwd, experts_lora_b_fwd, experts_lora_fwd

    T, K, in_f = x.shape
    R, out_f = a.shape[2], b.shape[2]
    y = torch.randn(T, K, R)
    return {
        "fused": (lambda info, ids, **kw: experts_lora_fwd(x, ids, a, b, info, **kw), T * K * R * (in_f + out_f), 2),
        "shrink": (lambda info, ids, **kw: experts_lora_a_fwd(x, ids, a, info, **kw), T * K * R * in_f, 1),
        "expand": (lambda info, ids, **kw: experts_lora_b_fwd(y, ids, b, info, **kw), T * K * R * out_f, 1),
    }


@pytest.mark.parametrize("op", ["fused", "shrink", "expand"])
def test_the_eager_kernel_reads_the_groups_back_once(op):
    # one read back of the (slot, expert) group sizes per call: a read is a device sync on a GPU
    ranks, (a, b), (batch_a, batch_b), (ids_a, ids_b), x, _ = _case(1, torch.float32, "cpu", 2, aligned=True)
    run, _, _ = _ops_and_macs(x, a, b)[op]
    for batch, ids in ((batch_a, ids_a), (batch_b, ids_b)):
        info = make_batch_info(*batch, ranks, device="cpu")
        assert count_launches(run, info, ids).host_reads == 1


@pytest.mark.parametrize("op", ["fused", "shrink", "expand"])
@pytest.mark.parametrize("kernel", ["grouped", "blocked"])
def test_graph_safe_kernel_has_constant_launches_and_pair_proportional_flops(kernel, op):
    ranks, (a, b), (batch_a, batch_b), (ids_a, ids_b), x, _ = _case(1, torch.float32, "cpu", 2, aligned=True)
    run, macs, matmuls = _ops_and_macs(x, a, b)[op]
    counts = []
    for batch, ids in ((batch_a, ids_a), (batch_b, ids_b), (([x.shape[0]], [None]), ids_a)):
        info = make_batch_info(*batch, ranks, device="cpu")
        graph_safe = lambda info, ids: run(info, ids, graph_safe=True, graph_kernel=kernel)  # noqa: E731
        counts.append(count_launches(graph_safe, info, ids))
    assert counts[0].by_op["aten._grouped_mm.default" if kernel == "grouped" else "aten.bmm.default"] == matmuls
    assert len({(c.ops, c.signatures, c.matmul_macs) for c in counts}) == 1
    assert all(c.host_reads == 0 for c in counts)
    assert counts[0].matmul_macs == macs


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
    R = a.shape[2]
    with pytest.raises(ValueError, match=r"expert_ids must have shape \(\d+, 2\)"):
        backend.run_experts_lora_a(x, ids[:, :1], a)
    with pytest.raises(ValueError, match=r"a_weights must have shape \(L, E, R, \d+\)"):
        backend.run_experts_lora_a(x[..., :-1], ids, a)
    with pytest.raises(ValueError, match=r"a_weights has dtype torch.bfloat16 but x has torch.float32"):
        backend.run_experts_lora_a(x, ids, a.bfloat16())
    y = torch.zeros(*ids.shape, R)
    with pytest.raises(ValueError, match=rf"b_weights must have shape \(L, E, out, {R - 1}\)"):
        backend.run_experts_lora_b(y[..., :-1], ids, b)
    with pytest.raises(ValueError, match="expert_ids must be an int32 or int64"):
        backend.run_experts_lora_b(y, ids.float(), b)
    with pytest.raises(ValueError, match=r"base_output must have shape"):
        backend.run_experts_lora_b(y, ids, b, base[:, :, :-1])
    with pytest.raises(ValueError, match=r"b_weights has \d+ slots \(dim 0\) but the batch info has"):
        backend.run_experts_lora_b(y, ids, b[:1])


class _Counting:
    def __init__(self):
        self.compiles = 0

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


@pytest.mark.parametrize("op", ["fused", "halves"])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_compiled_fullgraph_reuses_code_for_refilled_batches(backend_name, op):
    rng = random.Random(7)
    ranks, (a, b), _, (ids, _), x, base = _case(3, torch.float32, "cpu", 2)
    T, K = ids.shape
    L, E = a.shape[:2]
    backend = get_backend(backend_name)("cpu")
    info = build_batch_info(*random_requests(rng, T, L), ranks, default_scalings(L), device="cpu",
                            use_graph=True, max_tokens=T)
    backend.prepare_batch(info)

    def step(x, ids, base):
        if op == "fused":
            return backend.run_experts_lora(x, ids, a, b, base.clone())
        return backend.run_experts_lora_b(backend.run_experts_lora_a(x, ids, a), ids, b, base.clone())

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
