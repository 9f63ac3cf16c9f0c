"""Regression tests for bug classes the suite once missed, and for fuzz findings (docs/bug-classes.md).

Each test states the behaviour that the bug broke and checks it through the public
API only (backends, batch infos, MultiLoRA), on every backend and device parameter.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from lora_core import available_backends, build_batch_info, get_backend, save_peft_adapter
from lora_core.reference import reference_lora_a, reference_lora_a_embedding, reference_lora_b
from lora_core.testing import assert_close_to_reference, random_linear_weights

BACKENDS = available_backends()
KERNELS = ("auto", "grouped", "blocked")

pytestmark = pytest.mark.skipif(not BACKENDS, reason="no LoRA backend is installed")


def _backend(name, device, kernel="auto"):
    cls = get_backend(name)
    options = {"graph_kernel": kernel} if "graph_kernel" in inspect.signature(cls).parameters else {}
    return cls(device.torch_device, **options)


def _info(seq_lens, slots, ranks, device, use_graph, scalings=None, capacity=None):
    scalings = scalings if scalings is not None else [0.5 + 0.25 * s for s in range(len(ranks))]
    return build_batch_info(seq_lens, slots, ranks, scalings, device=device, use_graph=use_graph,
                            max_tokens=(capacity or max(sum(seq_lens), 1)) if use_graph else None)


def _run(device, use_graph, fn, info, *inputs):
    """``fn(info, *inputs)`` eagerly, or captured and replayed on graph devices."""
    return device.run(lambda *xs: fn(info, *xs), *inputs) if use_graph else fn(info, *inputs)


# --------------------------------------------------------------------- bug class 1
@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("num_slices", [2, 3])
@pytest.mark.parametrize("plan", ["segments", "slot groups"])
def test_expand_reads_only_each_slots_rank_in_every_slice(device, backend_name, num_slices, plan):
    """Class 1: the expand (eager control path included) reads ``x[:, i*R : i*R + r]`` and
    ``B[:, :r]`` of *every* slice ``i``, never the columns beyond the rank, which here hold a
    non-zero input and garbage weights (a shrink output would be zero there and hide it)."""
    ranks, R = [3, 1, 5], 6
    if plan == "segments":  # long segments: one GEMM per segment and slice
        seq_lens, slots = [9, 7, 6], [0, 1, 2]
    else:  # many single-token requests on few slots: one GEMM per slot and slice
        seq_lens, slots = [1] * 24, [t % 3 for t in range(24)]
    gen = torch.Generator().manual_seed(num_slices)
    widths = [7, 5, 4][:num_slices]
    _, b, offsets = random_linear_weights(gen, num_slots=3, max_rank=R, in_features=8, slice_widths=widths,
                                          lora_ranks=ranks, dtype=torch.float32, device=device.torch_device)
    T = sum(seq_lens)
    y = torch.randn(T, num_slices * R, generator=gen).to(device.torch_device)  # non-zero beyond every rank
    info = _info(seq_lens, slots, ranks, device.torch_device, device.is_graph)
    ref = _info(seq_lens, slots, ranks, "cpu", False)
    backend = _backend(backend_name, device)

    def expand(info, y):
        backend.prepare_batch(info)
        return backend.run_lora_b(y, b, offsets)

    assert_close_to_reference(_run(device, device.is_graph, expand, info, y), reference_lora_b(y, b, ref, offsets))


# --------------------------------------------------------------------- bug class 4
@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_static_expand_gives_rows_without_an_adapter_a_zero_delta_whatever_their_input(device, backend_name, kernel):
    """Class 4: in a graph-mode batch, rows on slot -1 (None and -1), rows of a rank-0 slot and
    padding rows get exactly their base output from the expand, even when the expand input is
    non-zero there (the shrink would give zeros and hide a non-zero planned rank)."""
    ranks = [4, 0, 2, 4]  # the last slot has a rank: rows without an adapter sort into its group
    seq_lens, slots = [3, 2, 4, 1, 2, 3], [0, None, 3, -1, 1, 2]
    T, capacity = sum(seq_lens), sum(seq_lens) + 5
    gen = torch.Generator().manual_seed(4)
    _, b, offsets = random_linear_weights(gen, num_slots=4, max_rank=4, in_features=8, slice_widths=[8, 4, 4],
                                          lora_ranks=ranks, dtype=torch.float32, device=device.torch_device)
    y = torch.randn(capacity, 12, generator=gen).to(device.torch_device)
    base = torch.randn(capacity, 16, generator=gen).to(device.torch_device)
    info = _info(seq_lens, slots, ranks, device.torch_device, True, capacity=capacity)
    backend = _backend(backend_name, device, kernel)

    def expand(info, y, base):
        backend.prepare_batch(info)
        return backend.run_lora_b(y, b, offsets, base.clone())

    out = device.run(lambda *xs: expand(info, *xs), y, base).cpu()
    token_slots = info.token_slots_cpu.tolist()
    no_adapter = [t for t, s in enumerate(token_slots) if s < 0 or ranks[s] == 0]
    assert len(no_adapter) == 2 + 1 + 2 + 5  # None, -1, the rank-0 slot, padding
    assert torch.equal(out[no_adapter], base.cpu()[no_adapter]), "rows without an adapter got a non-zero delta"
    ref = _info(seq_lens, slots, ranks, "cpu", False)
    assert_close_to_reference(out, base.cpu() + reference_lora_b(y, b, ref, offsets))
    assert T < capacity


# --------------------------------------------------------------------- bug class 7
@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("use_graph", [False, True], ids=["eager", "graph"])
def test_added_token_rows_only_for_tokens_with_an_adapter(device, backend_name, use_graph):
    """Class 7: a base-model row (slot None / -1) whose id falls in the added-token range keeps
    its base row (the added tokens belong to the adapters), as do graph padding rows; a row
    with an adapter gets that slot's added embedding times ``scale``."""
    if device.is_graph and not use_graph:
        pytest.skip("graph devices run graph-mode batches")
    V, added, D = 10, 3, 4
    seq_lens, slots = [2, 2, 1, 2], [None, 0, -1, 1]
    ids = torch.tensor([V, V + 2, V + 1, 3, V, V + 2, V + 1])  # rows 0, 1 and 4: no adapter, added-range ids
    gen = torch.Generator().manual_seed(7)
    extra = torch.randn(2, added, D, generator=gen).to(device.torch_device)
    capacity = 9
    info = _info(seq_lens, slots, [2, 2], device.torch_device, use_graph, capacity=capacity)
    rows = capacity if use_graph else 7
    ids_in = torch.cat([ids, torch.full((rows - 7,), V + 1)]).to(device.torch_device)  # padding: added range too
    base = torch.randn(rows, D, generator=gen).to(device.torch_device)
    backend = _backend(backend_name, device)

    def added_rows(info, ids, base):
        backend.prepare_batch(info)
        return backend.run_added_tokens(ids, extra, V, base.clone(), 2.0)

    out = _run(device, use_graph, added_rows, info, ids_in, base).cpu()
    want = base.cpu().clone()
    want[2], want[5], want[6] = 2.0 * extra[0, 1].cpu(), 2.0 * extra[1, 2].cpu(), 2.0 * extra[1, 1].cpu()
    torch.testing.assert_close(out, want)
    unchanged = [0, 1, 3, 4, *range(7, rows)]
    assert torch.equal(out[unchanged], base.cpu()[unchanged]), "a row without an adapter took an added embedding"


# --------------------------------------------------------------------- bug class 8
def test_fused_adapter_on_a_packed_module_splits_b_in_slice_order(tmp_path):
    """Class 8: a PEFT adapter trained on the fused ``qkv_proj`` itself (one A/B pair) loaded
    onto a packed module with unequal slices (GQA: q 32, k 16, v 16) gives the fused LoRA's
    delta ``s * x @ A.T @ B.T``: B's rows go to the slices in order."""
    lora_layers = pytest.importorskip("lora_layers")
    config = lora_layers.TinyConfig(vocab_size=32, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, fused=True)
    model = lora_layers.TinyDecoder(config)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert tuple(qkv.output_sizes) == (32, 16, 16)
    r, alpha = 4, 8
    gen = torch.Generator().manual_seed(8)
    a = torch.randn(r, 32, generator=gen)
    b = torch.cat([torch.randn(32, r, generator=gen), 3 + torch.randn(16, r, generator=gen),
                   -3 + torch.randn(16, r, generator=gen)])  # distinct per slice
    path = save_peft_adapter(tmp_path / "fused", {"model.layers.0.self_attn.qkv_proj": (a, b)}, lora_alpha=alpha)
    mlora = lora_layers.MultiLoRA(model, ["qkv_proj"], max_loras=2, max_rank=8,
                                  packed_modules={"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    mlora.load_adapter("fused", path)
    mlora.set_batch([3, 2], ["fused", None])
    x = torch.randn(5, 32, generator=gen)
    wrapped = model.model.layers[0].self_attn.qkv_proj
    with torch.no_grad():
        out = wrapped(x)
        base = qkv(x)
    want = base.clone()
    want[:3] += (alpha / r) * x[:3] @ a.T @ b.T
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------- fuzz findings
def _all_ops(backend, info, x, rows, L, R, c=3):
    """Every op on ``rows`` rows with (L, ...) weights: shrink, expand, qkv, LM head, embedding."""
    offsets = [0, 5, 7, 9][: c + 1]
    a = torch.randn(L, c * R, x.shape[1], device=x.device)
    b = torch.randn(L, offsets[-1], R, device=x.device)
    base = torch.randn(rows, offsets[-1], device=x.device)
    shrunk = backend.run_lora_a(x, a, c)
    expanded = backend.run_lora_b(torch.randn(rows, c * R, device=x.device), b, offsets)
    packed = backend.run_qkv(x, a, b, offsets, base.clone())
    head = backend.run_lm_head(x, a[:, :R].contiguous(), b, pruned=False)
    pruned_rows = rows if info.use_graph else info.lm_head_view(pruned=True).num_tokens
    head_pruned = backend.run_lm_head(x[:pruned_rows], a[:, :R].contiguous(), b, pruned=True)
    ids = torch.arange(rows, device=x.device) % 12
    emb = backend.run_lora_a_embedding(ids, torch.randn(L, R, 12, device=x.device), 10,
                                       torch.randn(L, 2, 4, device=x.device))
    return dict(shrunk=shrunk, expanded=expanded, packed=packed - base, head=head, head_pruned=head_pruned, emb=emb)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("use_graph", [False, True], ids=["eager", "graph"])
def test_zero_rows_give_empty_or_unchanged_outputs(device, backend_name, kernel, use_graph):
    """Fuzz finding: a batch of zero tokens (requests of length 0; a graph batch refilled with
    none) crashed the static kernels in index_select. Every op gives the base output."""
    if device.is_graph and not use_graph:
        pytest.skip("graph devices run graph-mode batches")
    info = _info([4], [0], [2, 3], device.torch_device, use_graph, capacity=4) if use_graph else \
        _info([0, 0], [0, None], [2, 3], device.torch_device, False)
    if use_graph:
        info.refill([0, 0], [0, None])
    rows = 4 if use_graph else 0
    backend = _backend(backend_name, device, kernel)

    def ops(info, x):
        backend.prepare_batch(info)
        return _all_ops(backend, info, x, rows, L=2, R=4)

    outs = _run(device, use_graph, ops, info, torch.randn(rows, 6, device=device.torch_device))
    for name, out in outs.items():
        assert out.shape[0] == (rows if name != "head_pruned" or use_graph else 0), name
        assert not out.abs().sum(), f"{name}: a batch without tokens got a non-zero delta"


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("use_graph", [False, True], ids=["eager", "graph"])
def test_no_adapter_slots_give_a_batch_without_adapters(device, backend_name, kernel, use_graph):
    """Fuzz finding: ``lora_ranks=[]`` (no slots) builds a batch whose requests are all on the
    base model; every op with (0, ...) weights gives no delta."""
    if device.is_graph and not use_graph:
        pytest.skip("graph devices run graph-mode batches")
    info = _info([3, 2], [None, -1], [], device.torch_device, use_graph)
    assert info.num_slots == 0 and info.token_slots_cpu.tolist() == [-1] * 5
    backend = _backend(backend_name, device, kernel)

    def ops(info, x):
        backend.prepare_batch(info)
        return _all_ops(backend, info, x, 5, L=0, R=4)

    outs = _run(device, use_graph, ops, info, torch.randn(5, 6, device=device.torch_device))
    for name, out in outs.items():
        assert not out.abs().sum(), f"{name}: a batch without adapters got a non-zero delta"


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 2, 4), (2, 0, 4)], ids=["no slots", "no added tokens"])
def test_added_tokens_with_empty_extra_embeddings_keep_the_base_rows(backend_name, shape):
    """Fuzz finding: extra embeddings of shape (0, added, D) (no slots) or (L, 0, D) (no added
    tokens) are valid: every row keeps its base row."""
    L = shape[0]
    info = build_batch_info([3, 2], [None, 0 if L else -1], [2] * L, [1.0] * L, device="cpu")
    backend = get_backend(backend_name)("cpu")
    backend.prepare_batch(info)
    base = torch.randn(5, 4)
    out = backend.run_added_tokens(torch.tensor([10, 11, 1, 10, 12]), torch.randn(*shape), 10, base.clone())
    assert torch.equal(out, base)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("use_graph", [False, True], ids=["eager", "graph"])
def test_strided_weights_on_the_grouped_kernel_match_the_reference(backend_name, use_graph):
    """Fuzz finding: a strided A stack (``torch.randn(1, 4, 11)[..., :8]``) reached the grouped
    GEMM, which requires 16-byte aligned strides; such weights must take another kernel."""
    a = torch.randn(2, 4, 11)[..., :8]
    b = torch.randn(2, 10, 11)[..., :4]
    assert not a.is_contiguous() and not b.is_contiguous()
    info = _info([3, 2], [1, 0], [4, 3], "cpu", use_graph)
    ref = _info([3, 2], [1, 0], [4, 3], "cpu", False)
    backend = get_backend(backend_name)("cpu", graph_kernel="grouped")
    backend.prepare_batch(info)
    x = torch.randn(5, 8)
    shrunk = backend.run_lora_a(x, a)
    assert_close_to_reference(shrunk, reference_lora_a(x, a, ref))
    assert_close_to_reference(backend.run_lora_b(shrunk, b, [0, 10]), reference_lora_b(shrunk, b, ref, [0, 10]))


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("use_graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32], ids=str)
def test_unsupported_activation_dtypes_are_rejected_naming_the_dtype(backend_name, use_graph, dtype):
    """Fuzz finding: float64 passed validation and crashed in torch._grouped_mm (graph path) while
    the eager path computed it; every path rejects it, naming the dtype and the supported ones."""
    info = _info([3, 2], [1, 0], [4, 3], "cpu", use_graph)
    backend = get_backend(backend_name)("cpu")
    backend.prepare_batch(info)
    x, a, b = torch.ones(5, 8, dtype=dtype), torch.ones(2, 12, 8, dtype=dtype), torch.ones(2, 9, 4, dtype=dtype)
    for call in (lambda: backend.run_lora_a(x, a, 3), lambda: backend.run_lora_b(torch.ones(5, 12, dtype=dtype), b,
                                                                                  [0, 5, 7, 9]),
                 lambda: backend.run_qkv(x, a, b, [0, 5, 7, 9]),
                 lambda: backend.run_lora_a_embedding(torch.zeros(5, dtype=torch.long), a[:, :4], 8)):
        with pytest.raises(ValueError, match=rf"has dtype {dtype}; supported dtypes are float32, float16, bfloat16"):
            call()
    with pytest.raises(ValueError, match=rf"base_output has dtype {dtype}"):
        backend.run_added_tokens(torch.zeros(5, dtype=torch.long), torch.ones(2, 2, 4, dtype=dtype), 8,
                                 torch.ones(5, 4, dtype=dtype))


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("use_graph", [False, True], ids=["eager", "graph"])
def test_token_ids_are_int32_or_int64(backend_name, use_graph):
    """Fuzz finding: int16 ids passed validation and crashed in index_select on the eager path.
    int32 and int64 ids give the same result; narrower integer dtypes are rejected naming ids."""
    info = _info([3, 2], [1, None], [4, 3], "cpu", use_graph)
    ref = _info([3, 2], [1, None], [4, 3], "cpu", False)
    backend = get_backend(backend_name)("cpu")
    backend.prepare_batch(info)
    weights = torch.randn(2, 4, 12)
    ids = torch.tensor([3, 11, -1, 10, 40])
    want = reference_lora_a_embedding(ids, weights, ref, 10, 2)
    extra = torch.zeros(2, 2, 4)
    for dtype in (torch.int32, torch.int64):
        assert_close_to_reference(backend.run_lora_a_embedding(ids.to(dtype), weights, 10, extra), want)
    for dtype in (torch.int16, torch.int8, torch.uint8):
        with pytest.raises(ValueError, match=rf"ids must be an int32 or int64 tensor .*got {dtype}"):
            backend.run_lora_a_embedding(ids.to(dtype).abs(), weights, 10, extra)
        with pytest.raises(ValueError, match=rf"ids must be an int32 or int64 tensor .*got {dtype}"):
            backend.run_added_tokens(ids.to(dtype).abs(), extra, 10, torch.zeros(5, 4))


_OFFSETS = {"int": 9, "0-d tensor": torch.tensor(9), "None": None, "str": "0,9", "floats": [0.0, 9.0],
            "bool": [0, True]}


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize(("op", "offsets"), [
    pytest.param(op, value, id=f"{op}-{name}")
    for op in ("lora_b", "qkv", "gate_up") for name, value in _OFFSETS.items()
])
def test_malformed_slice_offsets_raise_naming_slice_offsets(backend_name, op, offsets):
    """Fuzz finding: ``slice_offsets=9`` (an int) gave a TypeError naming nothing (``len()``)."""
    info = _info([3], [0], [2], "cpu", False)
    backend = get_backend(backend_name)("cpu")
    backend.prepare_batch(info)
    c = {"lora_b": 1, "qkv": 3, "gate_up": 2}[op]
    x, a, b = torch.randn(3, 8), torch.randn(1, c * 2, 8), torch.randn(1, 9, 2)
    with pytest.raises((ValueError, TypeError), match="slice_offsets"):
        if op == "lora_b":
            backend.run_lora_b(torch.randn(3, 2), b, offsets)
        else:
            getattr(backend, f"run_{op}")(x, a, b, offsets)

