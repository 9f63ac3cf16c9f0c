"""torch.compile of lora_cuda's ops (docs/compile.md).

Graph-mode ops compile with ``fullgraph=True`` for every kernel preference and
dtype, and a batch refilled in place (other splits, other slots, other
real-token counts) reuses the compiled code: zero recompiles, results equal to
eager calls and to the reference. Eager batches take the graph-safe kernels
under compile and recompile once at most (automatic dynamic shapes). The custom
ops pass ``torch.library.opcheck``; inductor compiles them too (one test: it is
slow on CPU).
"""

import random

import shutil

import pytest
import torch
import torch._dynamo

from lora_core import build_batch_info
from lora_core.reference import reference_lora_a, reference_lora_a_embedding, reference_lora_b
from lora_core.testing import (
    assert_close_to_reference,
    make_batch_info,
    random_embedding_weights,
    random_linear_weights,
    random_ranks,
    random_requests,
)
from lora_cuda import TorchNativeBackend, sgemm_lora_a_embedding_fwd, sgemm_lora_a_fwd, sgemm_lora_b_fwd
from lora_cuda.custom_ops import OPS
from lora_cuda.graph_plans import batch_key

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CAPACITY, L, R, IN, WIDTHS, V = 64, 4, 8, 32, [24, 8, 8], 50
SCALINGS = [0.5 + 0.25 * s for s in range(L)]  # make_batch_info's, for the reference batches
NEEDS_CXX = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                               reason="inductor's CPU code generation needs a C++ compiler")


class Counting:
    """A compile backend counting the graphs it compiles."""

    def __init__(self, backend="aot_eager"):
        self.backend, self.compiles = backend, 0

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)


def _case(dtype, seed=0):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ranks = random_ranks(rng, L, R)
    a, b, offsets = random_linear_weights(gen, num_slots=L, max_rank=R, in_features=IN, slice_widths=WIDTHS,
                                          lora_ranks=ranks, dtype=dtype, device="cpu")
    emb_a, _ = random_embedding_weights(gen, num_slots=L, max_rank=R, vocab_total=V, embedding_dim=8,
                                        lora_ranks=ranks, dtype=dtype, device="cpu")
    x = torch.randn(CAPACITY, IN, generator=gen).to(dtype)
    base = torch.randn(CAPACITY, offsets[-1], generator=gen).to(dtype)
    ids = torch.randint(-3, V + 3, (CAPACITY,), generator=gen)  # some out of vocabulary
    return rng, ranks, (a, b, offsets, emb_a), (x, base, ids)


def _batches(rng, count):
    """Batches of fewer real tokens than the capacity, each a different split and slot mix."""
    return [random_requests(rng, rng.randint(1, CAPACITY), L) for _ in range(count)]


def _step(weights, kernel):
    a, b, offsets, emb_a = weights

    def step(info, x, base, ids):
        shrunk = sgemm_lora_a_fwd(x, a, info, 3, graph_kernel=kernel)
        out = sgemm_lora_b_fwd(shrunk, b, info, offsets, base.clone(), graph_kernel=kernel)
        return shrunk, out, sgemm_lora_a_embedding_fwd(ids, emb_a, info, V)

    return step


def _check_against_reference(outs, info, weights, inputs, dtype):
    a, b, offsets, emb_a = weights
    x, base, ids = inputs
    shrunk, out, emb = outs
    T = info.num_real_tokens
    ref = make_batch_info(info.seq_lens, info.request_slots, info.lora_ranks_host, device="cpu")
    expected_shrink = reference_lora_a(x[:T], a, ref, 3)
    assert_close_to_reference(shrunk[:T], expected_shrink, dtype)
    assert_close_to_reference(out[:T], base[:T].float() + reference_lora_b(expected_shrink, b, ref, offsets), dtype)
    assert_close_to_reference(emb[:T], reference_lora_a_embedding(ids[:T], emb_a, ref, V, 0), dtype)
    torch.testing.assert_close(out[T:], base[T:])  # padding rows: no delta


@pytest.mark.parametrize("kernel", ["auto", "grouped", "blocked"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_graph_ops_compile_once_and_replay_refilled_batches(kernel, dtype):
    rng, ranks, weights, inputs = _case(dtype)
    first, *later = _batches(rng, 4)
    info = build_batch_info(*first, ranks, SCALINGS, device="cpu", use_graph=True, max_tokens=CAPACITY)
    step = _step(weights, kernel)
    with torch.no_grad():
        step(info, *inputs)  # warm-up: the plans, their tables and workspaces, the batch's key
        torch._dynamo.reset()
        backend = Counting()
        compiled = torch.compile(step, backend=backend, fullgraph=True)
        _check_against_reference(compiled(info, *inputs), info, weights, inputs, dtype)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for batch in later:
                info.refill(*batch)
                got = compiled(info, *inputs)
                for g, e in zip(got, step(info, *inputs)):
                    torch.testing.assert_close(g, e, rtol=0, atol=0)  # the same kernels as an eager call
                _check_against_reference(got, info, weights, inputs, dtype)
    assert backend.compiles == 1


def test_set_adapters_and_backend_calls_reuse_the_compiled_code():
    rng, ranks, weights, inputs = _case(torch.float32, seed=3)
    a, b, offsets, _ = weights
    x = inputs[0]
    backend = TorchNativeBackend("cpu")
    info = backend.init_graph_batch_info(CAPACITY, ranks, [1.0] * L)
    backend.prepare_batch(info)

    def layer(x):
        return backend.run_qkv(x, a, b, offsets)

    counting = Counting()
    compiled = torch.compile(layer, backend=counting, fullgraph=True)
    with torch.no_grad():
        torch._dynamo.reset()
        info.refill(*_batches(rng, 1)[0])
        compiled(x)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for batch in _batches(rng, 2):
                info.refill(*batch)
                new_ranks = [rng.randint(0, R) for _ in range(L)]
                info.set_adapters(new_ranks, [rng.uniform(0.1, 2.0) for _ in range(L)])
                torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)
    assert counting.compiles == 1


def test_an_unprepared_graph_batch_is_a_clear_compile_error():
    _, ranks, (a, *_), (x, *_) = _case(torch.float32)
    info = make_batch_info([CAPACITY], [0], ranks, device="cpu", use_graph=True)
    compiled = torch.compile(lambda x: sgemm_lora_a_fwd(x, a, info, 3), backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception, match="prepare_batch"):
        compiled(x)


def test_shape_errors_are_raised_at_compile_time_with_the_eager_message():
    _, ranks, (a, *_), (x, *_) = _case(torch.float32)
    info = make_batch_info([CAPACITY], [0], ranks, device="cpu", use_graph=True)
    TorchNativeBackend("cpu").prepare_batch(info)
    compiled = torch.compile(lambda x: sgemm_lora_a_fwd(x, a, info, 3), backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception, match=r"weights must have shape \(L, c\*R, 31\)"):
        compiled(x[:, :31])


def test_grad_mode_is_a_clear_error_not_silently_missing_gradients():
    _, ranks, (a, *_), (x, *_) = _case(torch.float32)
    info = make_batch_info([CAPACITY], [0], ranks, device="cpu", use_graph=True)
    TorchNativeBackend("cpu").prepare_batch(info)
    compiled = torch.compile(lambda x: sgemm_lora_a_fwd(x, a, info, 3), backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="inference-only under torch.compile"):
        compiled(x.clone().requires_grad_())


def test_strict_token_ids_are_checked_when_the_compiled_code_runs():
    _, ranks, (*_, emb_a), _ = _case(torch.float32)
    info = make_batch_info([4], [0], ranks, device="cpu", use_graph=True)
    good, bad = torch.tensor([1, 2, 3, 4]), torch.tensor([1, V + 7, 3, 4])
    step = torch.compile(lambda ids: sgemm_lora_a_embedding_fwd(ids, emb_a, info, V, strict_token_ids=True),
                         backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        sgemm_lora_a_embedding_fwd(good, emb_a, info, V)  # warm-up
        torch._dynamo.reset()
        step(good)
        with pytest.raises(ValueError, match=rf"ids\[1\] = {V + 7}"):
            step(bad)


def test_eager_batches_take_the_graph_safe_kernels_and_recompile_once(monkeypatch):
    """Eager (control-flow) batches under compile: routed to the graph-safe kernels, planned when
    the op runs; the second token count makes the sizes dynamic (one recompile), then none."""
    import lora_cuda.ops

    def no_host_loop(*args, **kwargs):
        raise AssertionError("the control-flow ops must not run under torch.compile")

    for name in ("sgemm_lora_a_control_fwd", "sgemm_lora_b_control_fwd", "sgemm_lora_a_embedding_control_fwd"):
        monkeypatch.setattr(lora_cuda.ops, name, no_host_loop)
    rng, ranks, weights, _ = _case(torch.float32, seed=5)
    a, b, offsets, emb_a = weights
    gen = torch.Generator().manual_seed(5)

    def step(x, ids):
        info = backend.batch_info
        shrunk = sgemm_lora_a_fwd(x, a, info, 3)
        return sgemm_lora_b_fwd(shrunk, b, info, offsets), sgemm_lora_a_embedding_fwd(ids, emb_a, info, V)

    backend = TorchNativeBackend("cpu")
    counting = Counting()
    compiled = torch.compile(step, backend=counting, fullgraph=True)
    torch._dynamo.reset()
    compiles = []
    with torch.no_grad():
        for T in [30, 12, 45, 12, 7, 64]:
            info = make_batch_info(*random_requests(rng, T, L), ranks, device="cpu")
            backend.prepare_batch(info)
            x, ids = torch.randn(T, IN, generator=gen), torch.randint(0, V, (T,), generator=gen)
            out, emb = compiled(x, ids)
            expected_shrink = reference_lora_a(x, a, info, 3)
            assert_close_to_reference(out, reference_lora_b(expected_shrink, b, info, offsets))
            assert_close_to_reference(emb, reference_lora_a_embedding(ids, emb_a, info, V, 0))
            compiles.append(counting.compiles)
    assert compiles == [1, 2, 2, 2, 2, 2], "one recompile (dynamic sizes) at the second batch, then none"


def _opcheck_args(dtype=torch.float32):
    _, ranks, (a, b, offsets, emb_a), (x, base, ids) = _case(dtype, seed=1)
    info = make_batch_info([CAPACITY - 5, 5], [0, 1], ranks, device="cpu", use_graph=True)
    TorchNativeBackend("cpu").prepare_batch(info)
    key = batch_key(info)
    shrunk = sgemm_lora_a_fwd(x, a, info, 3)
    eager = make_batch_info([20, 9], [2, None], ranks, device="cpu")
    host = [eager.token_slots_cpu, eager.lora_ranks_cpu, eager.scalings_cpu]
    return {
        "lora_cuda::shrink": [(x, a, key, [], 3, "auto"), (x[:29], a, 0, host, 3, "blocked")],
        "lora_cuda::expand_": [(shrunk, b, key, [], list(offsets), base.clone(), "grouped"),
                               (shrunk[:29], b, 0, host, list(offsets), base[:29].clone(), "auto")],
        "lora_cuda::embedding_shrink": [(ids.clamp(0, V - 1), emb_a, key, [], V, None, False),
                                        (ids[:29].clamp(0, V - 1), emb_a, 0, host, V, None, True)],
    }, info


@pytest.mark.parametrize("op", OPS)
def test_custom_ops_pass_opcheck(op):
    args, _info = _opcheck_args()
    packet = getattr(torch.ops.lora_cuda, op.split("::")[1])
    for call in args[op]:
        torch.library.opcheck(packet.default, call)


@pytest.mark.parametrize("op", OPS)
def test_custom_ops_have_no_python_wrapper_kernels(op):
    """Regression: defined with ``torch.library.custom_op`` the ops got Python ``Autograd`` (and, for
    ``expand_``, ``ADInplaceOrView``) kernels that ran on every call and made a compiled decode step
    ~1.2x slower than the eager one (docs/compile.md). One kernel, for every backend, and none else."""
    keys = ("Autograd", "AutogradCPU", "AutogradCUDA", "ADInplaceOrView", "CompositeExplicitAutograd")
    registered = [k for k in keys if torch._C._dispatch_has_kernel_for_dispatch_key(op, k)]
    assert registered == ["CompositeExplicitAutograd"]


@NEEDS_CXX
def test_inductor_compiles_the_graph_ops_in_every_dtype():
    """One inductor compile (slow on CPU) of shrink, expand and embedding in fp32, bf16 and fp16, the
    default kernel (the grouped GEMM on CPU), replayed on two refilled batches."""
    cases = [_case(dtype) for dtype in DTYPES]  # one seed: the same ranks for the one batch info
    rng, ranks = cases[0][0], cases[0][1]
    backend = TorchNativeBackend("cpu")
    info = backend.init_graph_batch_info(CAPACITY, ranks, SCALINGS)
    backend.prepare_batch(info)
    steps = [_step(weights, "auto") for _, _, weights, _ in cases]

    def all_dtypes(info):
        return [step(info, *inputs) for step, (_, _, _, inputs) in zip(steps, cases)]

    counting = Counting("inductor")
    compiled = torch.compile(all_dtypes, backend=counting, fullgraph=True)
    with torch.no_grad():
        torch._dynamo.reset()
        info.refill(*_batches(rng, 1)[0])
        compiled(info)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for batch in _batches(rng, 2):
                info.refill(*batch)
                for (_, _, weights, inputs), outs, dtype in zip(cases, compiled(info), DTYPES):
                    _check_against_reference(outs, info, weights, inputs, dtype)
    assert counting.compiles == 1
