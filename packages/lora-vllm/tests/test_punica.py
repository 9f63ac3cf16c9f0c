"""LoRAKitPunicaWrapper against vLLM's own CPU wrapper, method by method, on random steps.

Each step mixes requests on several adapter slots and on the base model (LoRA id 0),
with ranks zero-padded to the buffers' rank as vLLM loads them. vLLM's CPU ops read slot
``-1`` as the last slot, so the comparisons keep the last slot empty (all zeros), where
that reading gives the right answer; ``test_base_rows_get_no_delta_beside_an_adapter_in_the_last_slot``
covers the case where vLLM's own wrapper is wrong.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (bash ci/test-vllm.sh makes a venv with it)")

from vllm.lora.layers import LoRAMapping  # noqa: E402
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU  # noqa: E402
from vllm.lora.punica_wrapper.utils import convert_mapping  # noqa: E402

from lora_vllm import ENV_VAR  # noqa: E402
from lora_vllm.punica import LoRAKitPunicaWrapper  # noqa: E402

BACKENDS = ["torch_native", "ascend"]
MAX_TOKENS = 512


def _step(rng: random.Random, num_slots: int, *, last_slot_empty: bool = True):
    """A random step: ``(mapping, lora_index_to_id, ranks)``; slot ``s`` holds LoRA id ``100 + s``."""
    lora_index_to_id = [100 + s if rng.random() < 0.8 else None for s in range(num_slots)]
    lora_index_to_id[0] = 100
    lora_index_to_id[-1] = None if last_slot_empty else 100 + num_slots - 1
    ids = [0] + [i for i in lora_index_to_id if i is not None]
    seq_lens = [rng.choice([1, 1, 2, 5, 17]) for _ in range(rng.randint(1, 9))]
    request_ids = [rng.choice(ids) for _ in seq_lens]
    request_ids[0] = 100  # at least one adapter row
    index_mapping = [i for i, n in zip(request_ids, seq_lens) for _ in range(n)]
    return LoRAMapping(index_mapping, request_ids, is_prefill=True), lora_index_to_id


def _stacked(num_slots, rows, cols, rank_dim, lora_index_to_id, ranks, gen, dtype=torch.float32):
    """A vLLM stacked buffer ``(L, 1, rows, cols)``: each occupied slot's rank-``r`` block random, the
    rest zero (vLLM's zero padding); ``rank_dim`` 2 for ``lora_a`` (rows = R), 3 for ``lora_b``."""
    w = torch.zeros(num_slots, 1, rows, cols, dtype=dtype)
    for slot, lora_id in enumerate(lora_index_to_id):
        if lora_id is None:
            continue
        r = ranks[slot]
        block = torch.randn(r, cols, generator=gen) if rank_dim == 2 else torch.randn(rows, r, generator=gen)
        if rank_dim == 2:
            w[slot, 0, :r] = block
        else:
            w[slot, 0, :, :r] = block
    return w


def _wrappers(monkeypatch, backend, max_rank):
    monkeypatch.setenv(ENV_VAR, backend)
    theirs = PunicaWrapperCPU(MAX_TOKENS, 64, "cpu")
    ours = LoRAKitPunicaWrapper(MAX_TOKENS, 64, "cpu", lora_config=SimpleNamespace(max_lora_rank=max_rank))
    return theirs, ours


def _update(wrappers, mapping, lora_index_to_id, vocab_size=64):
    for w in wrappers:
        w.update_metadata(mapping, lora_index_to_id, len(lora_index_to_id) + 1, vocab_size)


@pytest.mark.parametrize("seed", range(6))
def test_metadata_equals_vllms_convert_mapping(monkeypatch, seed):
    rng = random.Random(seed)
    mapping, lora_index_to_id = _step(rng, rng.randint(1, 6), last_slot_empty=bool(seed % 2))
    theirs, ours = _wrappers(monkeypatch, "torch_native", 8)
    _update((theirs, ours), mapping, lora_index_to_id, vocab_size=77)
    expected = convert_mapping(mapping, lora_index_to_id, len(lora_index_to_id) + 1, 77, torch.device("cpu"))
    assert ours.indices_len == expected[4]
    torch.testing.assert_close(ours.token_lora_indices, expected[0])
    torch.testing.assert_close(ours.sampler_indices, expected[1])
    torch.testing.assert_close(ours.sampler_indices_padded, expected[2])
    torch.testing.assert_close(ours._embeddings_indices[: expected[4][3]], expected[3])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(4))
def test_add_lora_linear_equals_vllm_on_every_slice_count(monkeypatch, backend, seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    num_slots, R, in_features = rng.randint(2, 5), rng.choice([8, 16]), rng.choice([24, 32])
    mapping, lora_index_to_id = _step(rng, num_slots)
    ranks = [rng.randint(1, R) for _ in range(num_slots)]
    theirs, ours = _wrappers(monkeypatch, backend, R)
    _update((theirs, ours), mapping, lora_index_to_id)
    T = len(mapping.index_mapping)
    for output_slices in [(40,), (32, 16), (24, 8, 8)]:
        a = tuple(_stacked(num_slots, R, in_features, 2, lora_index_to_id, ranks, gen) for _ in output_slices)
        b = tuple(_stacked(num_slots, n, R, 3, lora_index_to_id, ranks, gen) for n in output_slices)
        x = torch.randn(T, in_features, generator=gen)
        y0 = torch.randn(T, sum(output_slices), generator=gen)
        expected, got = y0.clone(), y0.clone()
        theirs.add_lora_linear(expected, x, a, b, 1.0, output_slices)
        ours.add_lora_linear(got, x, a, b, 1.0, output_slices)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert not torch.equal(got, y0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shrink_then_expand_with_an_offset_equals_vllm(monkeypatch, backend):
    """The row-parallel and fully sharded layers' path: ``add_shrink`` into a ``(c, T, R)`` float32 buffer,
    then ``add_expand`` at ``offset_start`` into a wider output."""
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    num_slots, R = 4, 16
    mapping, lora_index_to_id = _step(rng, num_slots)
    ranks = [3, 16, 5, 9]
    theirs, ours = _wrappers(monkeypatch, backend, R)
    _update((theirs, ours), mapping, lora_index_to_id)
    T, slices = len(mapping.index_mapping), (12, 20)
    a = tuple(_stacked(num_slots, R, 32, 2, lora_index_to_id, ranks, gen) for _ in slices)
    b = tuple(_stacked(num_slots, n, R, 3, lora_index_to_id, ranks, gen) for n in slices)
    x = torch.randn(T, 32, generator=gen)
    buffers = [torch.zeros(len(slices), T, R) for _ in range(2)]
    theirs.add_shrink(buffers[0], x, a, 0.5)
    ours.add_shrink(buffers[1], x, a, 0.5)
    torch.testing.assert_close(buffers[1], buffers[0], rtol=1e-5, atol=1e-5)
    y0 = torch.randn(T, 40, generator=gen)
    expected, got = y0.clone(), y0.clone()
    theirs.add_expand(expected, buffers[0], b, slices, offset_start=5)
    ours.add_expand(got, buffers[1], b, slices, offset_start=5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, :5], y0[:, :5])


@pytest.mark.parametrize("backend", BACKENDS)
def test_embedding_and_logits_equal_vllm(monkeypatch, backend):
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    num_slots, R, D, V = 3, 8, 24, 50
    mapping, lora_index_to_id = _step(rng, num_slots)
    ranks = [8, 2, 5]
    theirs, ours = _wrappers(monkeypatch, backend, R)
    _update((theirs, ours), mapping, lora_index_to_id)
    T, N = len(mapping.index_mapping), len(mapping.prompt_mapping)
    b = _stacked(num_slots, D, R, 3, lora_index_to_id, ranks, gen)
    shrunk = torch.randn(T, R, generator=gen)
    y0 = torch.randn(T, D, generator=gen)
    expected, got = y0.clone(), y0.clone()
    theirs.add_lora_embedding(expected, shrunk, b)
    ours.add_lora_embedding(got, shrunk, b)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    a_head = _stacked(num_slots, R, D, 2, lora_index_to_id, ranks, gen)
    b_head = _stacked(num_slots, V, R, 3, lora_index_to_id, ranks, gen)
    hidden = torch.randn(N, D, generator=gen)
    logits0 = torch.randn(N, V + 14, generator=gen)  # the model's logits padded past the vocabulary
    expected, got = logits0.clone(), logits0.clone()
    theirs.add_lora_logits(expected, hidden, a_head, b_head, 1.0)
    ours.add_lora_logits(got, hidden, a_head, b_head, 1.0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_linear_classifier_rows_equal_vllm(monkeypatch, backend):
    rng, gen = random.Random(11), torch.Generator().manual_seed(11)
    num_slots, labels, H = 3, 6, 16
    mapping, lora_index_to_id = _step(rng, num_slots)
    theirs, ours = _wrappers(monkeypatch, backend, 8)
    _update((theirs, ours), mapping, lora_index_to_id)
    N = len(mapping.prompt_mapping)
    weight = torch.randn(num_slots, 1, labels, H, generator=gen)
    bias = torch.randn(num_slots, labels, generator=gen)
    enabled = torch.tensor([True, False, True])
    x, y0 = torch.randn(N, H, generator=gen), torch.randn(N, labels, generator=gen)
    expected, got = y0.clone(), y0.clone()
    theirs.apply_lora_full_linear(expected, x, weight, bias, enabled)
    ours.apply_lora_full_linear(got, x, weight, bias, enabled)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_base_rows_get_no_delta_beside_an_adapter_in_the_last_slot(monkeypatch, backend):
    """vLLM's CPU ops index the stacked weights with -1 (its 'no adapter'), i.e. the last slot:
    a base-model row batched beside an adapter in the last slot gets that adapter's delta.
    Rows without an adapter must keep the base output exactly."""
    gen = torch.Generator().manual_seed(0)
    lora_index_to_id = [100, 101]
    mapping = LoRAMapping([100, 100, 0, 0, 0, 101], [100, 0, 101], is_prefill=True)
    theirs, ours = _wrappers(monkeypatch, backend, 4)
    _update((theirs, ours), mapping, lora_index_to_id)
    a = (_stacked(2, 4, 8, 2, lora_index_to_id, [4, 4], gen),)
    b = (_stacked(2, 6, 4, 3, lora_index_to_id, [4, 4], gen),)
    x, y0 = torch.randn(6, 8, generator=gen), torch.randn(6, 6, generator=gen)
    got, theirs_y = y0.clone(), y0.clone()
    ours.add_lora_linear(got, x, a, b, 1.0, (6,))
    theirs.add_lora_linear(theirs_y, x, a, b, 1.0, (6,))
    torch.testing.assert_close(got[2:5], y0[2:5], rtol=0, atol=0)
    for t, slot in [(0, 0), (1, 0), (5, 1)]:
        expected = y0[t] + b[0][slot, 0] @ (a[0][slot, 0] @ x[t])
        torch.testing.assert_close(got[t], expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(theirs_y[2:5], y0[2:5])  # vLLM's own CPU wrapper, for the record


def test_a_step_without_adapters_leaves_every_output_alone(monkeypatch):
    theirs, ours = _wrappers(monkeypatch, "torch_native", 4)
    mapping = LoRAMapping([0, 0, 0], [0], is_prefill=True)
    _update((ours,), mapping, [None, 100])
    assert ours.no_lora
    a, b = (torch.randn(2, 1, 4, 8),), (torch.randn(2, 1, 6, 4),)
    y0 = torch.randn(3, 6)
    got = y0.clone()
    ours.add_lora_linear(got, torch.randn(3, 8), a, b, 1.0, (6,))
    assert torch.equal(got, y0)


def test_padded_rows_beyond_the_step_are_left_alone(monkeypatch):
    """vLLM may pad a step's rows (e.g. to a captured size): rows past the mapping get no delta."""
    theirs, ours = _wrappers(monkeypatch, "torch_native", 4)
    _update((ours,), LoRAMapping([100, 100], [100], is_prefill=True), [100])
    a, b = (torch.randn(1, 1, 4, 8),), (torch.randn(1, 1, 6, 4),)
    x, y0 = torch.randn(5, 8), torch.randn(5, 6)
    got = y0.clone()
    ours.add_lora_linear(got, x, a, b, 1.0, (6,))
    torch.testing.assert_close(got[:2], y0[:2] + x[:2] @ a[0][0, 0].T @ b[0][0, 0].T)
    assert torch.equal(got[2:], y0[2:])


def test_an_unknown_backend_name_is_one_line_naming_the_variable(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "no_such_backend")
    with pytest.raises(ValueError, match=rf"^{ENV_VAR}='no_such_backend' is not an installed lora-kit backend; "
                                         r"expected one of .*torch_native"):
        LoRAKitPunicaWrapper(MAX_TOKENS, 8, "cpu", lora_config=SimpleNamespace(max_lora_rank=8))


def test_an_engine_that_compiles_or_captures_graphs_is_refused(monkeypatch):
    """The wrapper builds eager batches: an engine that compiles (vLLM's CUDA default) is told to run eagerly."""
    from vllm.config import CompilationMode, CUDAGraphMode

    import lora_vllm.punica as punica

    monkeypatch.setenv(ENV_VAR, "torch_native")
    compiling = [(CompilationMode.VLLM_COMPILE, CUDAGraphMode.NONE), (CompilationMode.NONE, CUDAGraphMode.FULL)]
    for mode, graphs in compiling:
        config = SimpleNamespace(compilation_config=SimpleNamespace(mode=mode, cudagraph_mode=graphs))
        monkeypatch.setattr(punica, "get_current_vllm_config_or_none", lambda: config)
        with pytest.raises(ValueError, match=r"runs eager batches, but this engine compiles its model .* "
                                             r"start vLLM with --enforce-eager"):
            LoRAKitPunicaWrapper(MAX_TOKENS, 8, "cpu", lora_config=SimpleNamespace(max_lora_rank=8))
    eager = SimpleNamespace(compilation_config=SimpleNamespace(mode=CompilationMode.NONE,
                                                               cudagraph_mode=CUDAGraphMode.NONE))
    monkeypatch.setattr(punica, "get_current_vllm_config_or_none", lambda: eager)
    LoRAKitPunicaWrapper(MAX_TOKENS, 8, "cpu", lora_config=SimpleNamespace(max_lora_rank=8))


def _experts_reference(x, ids, a, b, token_slots):
    """``out[t, k] = b[slot_t, e] @ a[slot_t, e] @ x[t, k]`` (0 where ``slot_t == -1``), ``e = ids[t, k]``."""
    out = torch.zeros(*ids.shape, b.shape[2])
    for t, slot in enumerate(token_slots):
        for k, e in enumerate(ids[t].tolist()):
            if slot >= 0:
                out[t, k] = b[slot, e] @ (a[slot, e] @ x[t, k])
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_lora_w13_then_w2_against_the_math(monkeypatch, backend):
    """vLLM's experts call add_lora_w13 on each token's input for its top-k experts (two slices: gate, up),
    then add_lora_w2 on each choice's activation, weighted by the router. On vLLM's CPU build no experts
    class calls them (docs/vllm.md, "Mixture of experts"): this is the math alone."""
    gen = torch.Generator().manual_seed(5)
    L, E, R, H, inter, K = 3, 4, 8, 16, 12, 2
    lora_index_to_id = [100, None, 102]
    mapping = LoRAMapping([100] * 3 + [0] * 2 + [102] * 4, [100, 0, 102], is_prefill=True)
    _, ours = _wrappers(monkeypatch, backend, R)
    _update((ours,), mapping, lora_index_to_id)
    token_slots = ours.token_lora_indices.tolist()
    T = len(token_slots)

    def stacked(rows, cols, rank_dim):  # (L, E, rows, cols), zero beyond rank 5 and in the empty slot
        w = torch.randn(L, E, rows, cols, generator=gen)
        if rank_dim == 2:
            w[:, :, 5:] = 0
        else:
            w[:, :, :, 5:] = 0
        w[1] = 0
        return w

    x = torch.randn(T, H, generator=gen)
    topk_ids = torch.randint(0, E, (T, K), generator=gen)
    topk_weights = torch.rand(T, K, generator=gen)
    a13 = (stacked(R, H, 2), stacked(R, H, 2))
    b13 = (stacked(inter, R, 3), stacked(inter, R, 3))
    y13 = torch.randn(T, K, 2 * inter, generator=gen)
    expected = y13.clone()
    for i in range(2):
        expected[..., i * inter:(i + 1) * inter] += _experts_reference(
            x[:, None].expand(T, K, H), topk_ids, a13[i], b13[i], token_slots)
    got = y13.clone()
    result = ours.add_lora_w13(got, x, a13, b13, topk_ids, topk_weights, None, None, None, T, K, L, None, E, K, 2,
                               False, False)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert result[1].tolist() == topk_ids.reshape(-1).tolist() and result[0] is result[2] is result[3] is None

    act = torch.randn(T * K, inter, generator=gen)
    a2, b2 = stacked(R, inter, 2), stacked(H, R, 3)
    y2 = torch.randn(T, K, H, generator=gen)
    expected = y2 + topk_weights[..., None] * _experts_reference(act.view(T, K, inter), topk_ids, a2, b2, token_slots)
    got = y2.clone()
    ours.add_lora_w2(got, act, (a2,), (b2,), topk_weights, None, result[1], None, None, T, None, None, K, L, None, K,
                     False, 0, False)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_experts_lora_refuses_expert_parallelism_and_sharding(monkeypatch):
    _, ours = _wrappers(monkeypatch, "torch_native", 4)
    _update((ours,), LoRAMapping([100], [100], is_prefill=True), [100])
    args = (torch.zeros(1, 1, 4), torch.zeros(1, 4), (torch.zeros(1, 2, 4, 4),), (torch.zeros(1, 2, 4, 4),),
            torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1))
    with pytest.raises(NotImplementedError, match=r"without expert_map \(expert parallelism\), fully_sharded_loras; "
                                                  rf"unset {ENV_VAR}"):
        ours.add_lora_w13(*args, torch.zeros(2, dtype=torch.int32), None, None, 1, 1, 1, None, 2, 1, 1, True, False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_logprobs_rows_get_the_one_requests_lm_head_adapter(monkeypatch, backend):
    """For prompt log-probabilities vLLM sends every prompt position of a request through the LM head
    while the step maps one sampled row: that row's adapter applies to all of them (vLLM's ops broadcast it)."""
    gen = torch.Generator().manual_seed(8)
    lora_index_to_id = [100, 101, None]
    theirs, ours = _wrappers(monkeypatch, backend, 8)
    _update((theirs, ours), LoRAMapping([101] * 7, [101], is_prefill=True), lora_index_to_id)
    a = _stacked(3, 8, 16, 2, lora_index_to_id, [8, 3, 0], gen)
    b = _stacked(3, 40, 8, 3, lora_index_to_id, [8, 3, 0], gen)
    x, y0 = torch.randn(7, 16, generator=gen), torch.randn(7, 40, generator=gen)
    expected, got = y0.clone(), y0.clone()
    theirs.add_lora_logits(expected, x, a, b, 1.0)
    ours.add_lora_logits(got, x, a, b, 1.0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[6], y0[6])
    _update((ours,), LoRAMapping([101] * 4 + [100] * 3, [101, 100], is_prefill=True), lora_index_to_id)
    with pytest.raises(ValueError, match="7 rows reached the LM head but the step maps 2 sampled rows"):
        ours.add_lora_logits(y0.clone(), x, a, b, 1.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_linear_is_within_bfloat16_rounding_of_vllm(monkeypatch, backend):
    """A bf16 model: vLLM's CPU ops keep the shrink in a float32 buffer, lora-kit's in bf16, so the two differ
    by bf16 rounding of the shrunk values, relative to the delta's magnitude."""
    rng, gen = random.Random(2), torch.Generator().manual_seed(2)
    num_slots, R = 3, 16
    mapping, lora_index_to_id = _step(rng, num_slots)
    ranks = [16, 4, 9]
    theirs, ours = _wrappers(monkeypatch, backend, R)
    _update((theirs, ours), mapping, lora_index_to_id)
    T, slices = len(mapping.index_mapping), (32, 16, 16)
    a = tuple(_stacked(num_slots, R, 64, 2, lora_index_to_id, ranks, gen, torch.bfloat16) for _ in slices)
    b = tuple(_stacked(num_slots, n, R, 3, lora_index_to_id, ranks, gen, torch.bfloat16) for n in slices)
    x = torch.randn(T, 64, generator=gen).bfloat16()
    y0 = torch.zeros(T, sum(slices), dtype=torch.bfloat16)
    expected, got = y0.clone(), y0.clone()
    theirs.add_lora_linear(expected, x, a, b, 1.0, slices)
    ours.add_lora_linear(got, x, a, b, 1.0, slices)
    scale = expected.float().abs().max()
    assert (got.float() - expected.float()).abs().max() <= 2e-2 * scale


@pytest.mark.parametrize("backend", BACKENDS)
def test_expand_without_add_inputs_writes_the_delta(monkeypatch, backend):
    """``add_inputs=False``: the output's columns become the delta (zero for rows without an adapter)."""
    rng, gen = random.Random(4), torch.Generator().manual_seed(4)
    mapping, lora_index_to_id = _step(rng, 3)
    theirs, ours = _wrappers(monkeypatch, backend, 8)
    _update((theirs, ours), mapping, lora_index_to_id)
    T = len(mapping.index_mapping)
    b = (_stacked(3, 10, 8, 3, lora_index_to_id, [8, 8, 8], gen),)
    shrunk = torch.randn(1, T, 8, generator=gen)
    y0 = torch.randn(T, 14, generator=gen)
    expected, got = y0.clone(), y0.clone()
    theirs.add_expand(expected, shrunk, b, (10,), offset_start=2, add_inputs=False)
    ours.add_expand(got, shrunk, b, (10,), offset_start=2, add_inputs=False)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_live_ranks_end_at_the_last_component_with_both_factors_nonzero():
    from lora_vllm.slot_ranks import live_ranks

    a = torch.zeros(4, 6, 3)
    b = torch.zeros(4, 5, 6)
    a[0, :4], b[0, :, :4] = 1, 1  # rank 4 zero-padded to 6
    a[1, :6], b[1, :, :2] = 1, 1  # b's padding decides
    a[2, 1], b[2, :, 1] = float("nan"), 1  # a NaN is live: it must reach the output
    assert live_ranks(a, b) == (4, 2, 2, 0)  # slot 3: all zero (a module the adapter does not target)
    assert live_ranks(a, None) == (4, 6, 2, 0)
    assert live_ranks(None, b) == (4, 2, 2, 0)
    assert live_ranks(torch.zeros(2, 0, 3), None) == (0, 0)


class _RecordingBackend:
    """Wraps the step's backends: records the rank dimension of every weight the wrapper hands them."""

    def __init__(self, monkeypatch, wrapper):
        self.ranks = []
        for batches in (wrapper._tokens, wrapper._sampled):
            make = batches._make_backend
            monkeypatch.setattr(batches, "_make_backend", lambda make=make: self._wrap(make()))

    def _wrap(self, backend):
        run_a, run_b = backend.run_lora_a, backend.run_lora_b

        def lora_a(x, weights, *args, **kwargs):
            self.ranks.append(("a", weights.shape[1]))
            return run_a(x, weights, *args, **kwargs)

        def lora_b(x, weights, *args, **kwargs):
            self.ranks.append(("b", weights.shape[2]))
            return run_b(x, weights, *args, **kwargs)

        backend.run_lora_a, backend.run_lora_b = lora_a, lora_b
        return backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_zero_padding_is_not_read_and_an_untargeted_module_is_skipped(monkeypatch, backend):
    """vLLM pads every adapter to max_lora_rank and zero-fills the modules it does not target: the wrapper
    reads each buffer pair up to the largest live rank among the step's slots, and skips a pair with none."""
    gen = torch.Generator().manual_seed(12)
    lora_index_to_id = [100, 101, 102, None]  # (the last slot empty: vLLM's own ops read slot -1 there)
    mapping = LoRAMapping([100, 100, 0, 101, 101, 100], [100, 0, 101], is_prefill=False)
    theirs, ours = _wrappers(monkeypatch, backend, 32)
    recorded = _RecordingBackend(monkeypatch, ours)
    _update((theirs, ours), mapping, lora_index_to_id)
    ranks = [8, 12, 32, 0]  # slot 2's rank 32 is not in the step: the reads stop at 12
    a = (_stacked(4, 32, 16, 2, lora_index_to_id, ranks, gen),)
    b = (_stacked(4, 10, 32, 3, lora_index_to_id, ranks, gen),)
    x, y0 = torch.randn(6, 16, generator=gen), torch.randn(6, 10, generator=gen)
    expected, got = y0.clone(), y0.clone()
    theirs.add_lora_linear(expected, x, a, b, 1.0, (10,))
    ours.add_lora_linear(got, x, a, b, 1.0, (10,))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert recorded.ranks == [("a", 12), ("b", 12)]

    recorded.ranks.clear()
    head_a, head_b = torch.zeros(4, 1, 32, 16), torch.zeros(4, 1, 40, 32)  # no adapter targets the LM head
    logits = torch.randn(3, 40, generator=gen)
    got = logits.clone()
    ours.add_lora_logits(got, torch.randn(3, 16, generator=gen), head_a, head_b, 1.0)
    assert torch.equal(got, logits) and recorded.ranks == []
    got = y0.clone()
    ours.add_expand(got, torch.randn(1, 6, 32, generator=gen), (head_b[:, :, :10],), (10,), add_inputs=False)
    assert torch.equal(got, torch.zeros_like(got)) and recorded.ranks == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_buffer_rewritten_in_place_is_read_at_its_new_rank(monkeypatch, backend):
    """vLLM writes a slot's buffers in place when it loads an adapter there; the slot layout, and so the
    mapping the wrapper sees, may stay the same (an adapter removed and re-added under its id). The live
    ranks follow the buffers' contents, not the mapping."""
    gen = torch.Generator().manual_seed(13)
    lora_index_to_id = [100, None]
    mapping = LoRAMapping([100, 100, 0], [100], is_prefill=True)
    theirs, ours = _wrappers(monkeypatch, backend, 16)
    _update((theirs, ours), mapping, lora_index_to_id)
    a = (_stacked(2, 16, 8, 2, lora_index_to_id, [4, 0], gen),)
    b = (_stacked(2, 6, 16, 3, lora_index_to_id, [4, 0], gen),)
    x, y0 = torch.randn(3, 8, generator=gen), torch.randn(3, 6, generator=gen)
    ours.add_lora_linear(y0.clone(), x, a, b, 1.0, (6,))
    a[0][0, 0, :16].copy_(torch.randn(16, 8, generator=gen))  # as vLLM's set_lora: a rank-16 adapter now
    b[0][0, 0, :, :16].copy_(torch.randn(6, 16, generator=gen))
    expected, got = y0.clone(), y0.clone()
    theirs.add_lora_linear(expected, x, a, b, 1.0, (6,))
    ours.add_lora_linear(got, x, a, b, 1.0, (6,))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    a[0][0].zero_()  # as vLLM's reset_lora
    got = y0.clone()
    ours.add_lora_linear(got, x, a, b, 1.0, (6,))
    assert torch.equal(got, y0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shrink_and_expand_called_apart_read_their_own_live_ranks(monkeypatch, backend):
    """vLLM's row-parallel and fully sharded layers call add_shrink and add_expand apart: the shrink's live
    ranks come from A alone, the expand's from B alone, and the two may differ."""
    gen = torch.Generator().manual_seed(14)
    lora_index_to_id = [100, 101, 102, None]
    mapping = LoRAMapping([100, 100, 0, 101, 101, 102, 100], [100, 0, 101, 102], is_prefill=True)
    theirs, ours = _wrappers(monkeypatch, backend, 16)
    _update((theirs, ours), mapping, lora_index_to_id)
    a, b = torch.zeros(4, 1, 16, 24), torch.zeros(4, 1, 10, 16)
    a[0, 0, :12], b[0, 0, :, :5] = torch.randn(12, 24, generator=gen), torch.randn(10, 5, generator=gen)
    a[1, 0, :3], b[1, 0, :, :14] = torch.randn(3, 24, generator=gen), torch.randn(10, 14, generator=gen)
    a[2, 0, [0, 7]], b[2, 0, :, [0, 3, 9]] = torch.randn(2, 24, generator=gen), torch.randn(10, 3, generator=gen)
    x, y0 = torch.randn(7, 24, generator=gen), torch.randn(7, 15, generator=gen)
    results = []
    for wrapper in (theirs, ours):
        shrunk = torch.zeros(1, 7, 16)
        wrapper.add_shrink(shrunk, x, (a,), 1.0)
        y = y0.clone()
        wrapper.add_expand(y, shrunk, (b,), (10,), offset_start=2)
        results.append((shrunk, y))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-5)


def test_buffers_that_differ_only_in_slots_the_step_does_not_use_share_one_batch(monkeypatch):
    gen = torch.Generator().manual_seed(15)
    lora_index_to_id = [100, 101, None]
    _, ours = _wrappers(monkeypatch, "torch_native", 16)
    made = []
    make = ours._tokens._make_backend
    monkeypatch.setattr(ours._tokens, "_make_backend", lambda: made.append(1) or make())
    _update((ours,), LoRAMapping([100, 100, 0], [100], is_prefill=True), lora_index_to_id)
    x = torch.randn(3, 8, generator=gen)
    for idle_rank in (16, 0, 4):  # slot 1 is not in the step: its rank must not split the batch
        a = _stacked(3, 16, 8, 2, lora_index_to_id, [8, idle_rank, 0], gen)
        b = _stacked(3, 6, 16, 3, lora_index_to_id, [8, idle_rank, 0], gen)
        ours.add_lora_linear(torch.zeros(3, 6), x, (a,), (b,), 1.0, (6,))
    assert len(made) == 1


def test_inference_tensor_buffers_are_read_at_their_full_rank(monkeypatch):
    """Inference tensors have no version counter to cache live ranks by: every slot the step uses is read
    at the buffers' rank, with the same result."""
    gen = torch.Generator().manual_seed(16)
    lora_index_to_id = [100, None]
    theirs, ours = _wrappers(monkeypatch, "torch_native", 8)
    _update((theirs, ours), LoRAMapping([100, 0, 100], [100], is_prefill=True), lora_index_to_id)
    with torch.inference_mode():
        a = (_stacked(2, 8, 8, 2, lora_index_to_id, [3, 0], gen),)
        b = (_stacked(2, 6, 8, 3, lora_index_to_id, [3, 0], gen),)
        x, y0 = torch.randn(3, 8, generator=gen), torch.randn(3, 6, generator=gen)
        expected, got = y0.clone(), y0.clone()
        theirs.add_lora_linear(expected, x, a, b, 1.0, (6,))
        ours.add_lora_linear(got, x, a, b, 1.0, (6,))
    assert a[0].is_inference()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
