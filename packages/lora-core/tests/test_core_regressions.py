"""Regression tests for batch-construction and adapter-loading bugs the suite once missed
(docs/bug-classes.md): each checks the behaviour through the public API."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lora_core import AdapterFormatError, AdapterSlots, LinearLoRABuffers, build_batch_info, load_peft_adapter
from lora_core import EmbeddingLoRABuffers, save_peft_adapter

FIELDS = ("seg_lens", "seg_indptr", "weight_indices", "token_slots", "lora_ranks", "scalings")


def snapshot(info) -> dict:
    """Everything a rejected call must leave alone: host mirrors, device tensors (values and
    addresses), the request description, and the same of the pruned LM-head view."""
    state = {
        "requests": (info.seq_lens, info.request_slots, info.num_real_tokens, info.num_segments),
        "adapters": (info.lora_ranks_host, info.scalings_host),
    }
    for name in FIELDS:
        device, host = getattr(info, name), getattr(info, f"{name}_cpu")
        state[name] = (device.detach().cpu().clone(), host.clone(), device.data_ptr())
    view = info._lm_head.view if info._lm_head is not None else None  # built eagerly for graph-mode batches
    if view is not None and view is not info:
        state["view"] = snapshot(view)
    return state


def assert_same_state(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        if isinstance(value, dict):
            assert_same_state(value, after[key])
        elif isinstance(value[0], torch.Tensor):
            assert torch.equal(value[0], after[key][0]) and torch.equal(value[1], after[key][1]), key
            assert value[2] == after[key][2], f"{key} was reallocated"
        else:
            assert value == after[key], key


def graph_info(**kwargs):
    args = dict(seq_lens=[2, 1], slot_ids=[0, None], lora_ranks=[2, 3], scalings=[1.0, 0.5], device="cpu",
                use_graph=True, max_tokens=4)
    args.update(kwargs)
    return build_batch_info(**args)


# --------------------------------------------------------------------- bug class 2
@pytest.mark.parametrize(("seq_lens", "slot_ids"), [([5], [0]), ([2, 2, 1], [0, 1, None]), ([1] * 5, [0, 1] * 2 + [1])])
def test_refill_beyond_max_tokens_is_rejected_and_changes_nothing(seq_lens, slot_ids):
    """Class 2: refilling a graph-mode batch with more tokens than its capacity raises a
    ValueError naming max_tokens, and the batch (host and device, LM-head view) is unchanged."""
    info = graph_info()
    before = snapshot(info)
    with pytest.raises(ValueError, match=r"sum to 5 tokens, more than max_tokens = 4"):
        info.refill(seq_lens, slot_ids)
    assert_same_state(before, snapshot(info))
    info.refill([4], [1])  # exactly the capacity is fine
    assert info.token_slots_cpu.tolist() == [1, 1, 1, 1]


# --------------------------------------------------------------------- bug class 3
BOOLS = [True, False, np.True_, np.bool_(False)]


@pytest.mark.parametrize("flag", BOOLS, ids=repr)
@pytest.mark.parametrize("argument", ["seq_lens", "slot_ids", "lora_ranks", "scalings"])
def test_bools_are_not_ints_in_batch_construction(flag, argument):
    """Class 3: ``True`` is not a sequence length, a slot id, a rank or a scaling."""
    args = dict(seq_lens=[2, 1], slot_ids=[0, None], lora_ranks=[2, 3], scalings=[1.0, 0.5], device="cpu")
    args[argument] = [args[argument][0], flag]
    with pytest.raises(ValueError, match=rf"{argument}\[1\]"):
        build_batch_info(**args)


@pytest.mark.parametrize("flag", BOOLS, ids=repr)
def test_bools_are_not_ints_in_sizes_refill_and_set_adapters(flag):
    """Class 3: nor a max_tokens or max_rank; refill and set_adapters reject them and change nothing."""
    with pytest.raises(ValueError, match="max_tokens"):
        graph_info(max_tokens=flag)
    with pytest.raises(ValueError, match="max_rank"):
        graph_info(max_rank=flag)
    info = graph_info()
    before = snapshot(info)
    with pytest.raises(ValueError, match=r"seq_lens\[0\]"):
        info.refill([flag], [0])
    with pytest.raises(ValueError, match=r"slot_ids\[0\]"):
        info.refill([1], [flag])
    with pytest.raises(ValueError, match=r"lora_ranks\[1\]"):
        info.set_adapters([1, flag], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"scalings\[0\]"):
        info.set_adapters([1, 1], [flag, 1.0])
    assert_same_state(before, snapshot(info))


def test_bool_tensors_and_arrays_are_not_ints():
    for seq_lens in (torch.tensor([True, False]), np.array([True, True])):
        with pytest.raises(ValueError, match=r"seq_lens\[0\]"):
            build_batch_info(seq_lens, [0, 0], [1], [1.0], device="cpu")
    with pytest.raises(TypeError, match="use_graph must be a bool"):
        build_batch_info([1], [0], [1], [1.0], device="cpu", use_graph="False", max_tokens=2)
    with pytest.raises(TypeError, match="pruned must be a bool"):
        graph_info().lm_head_view("no")


# --------------------------------------------------------------------- bug class 5
def test_rank_and_alpha_patterns_match_module_name_suffixes_not_substrings(tmp_path):
    """Class 5: PEFT matches a pattern key against the end of the module name on a dot
    boundary (``(.*\\.)?key$``): ``q`` matches ``attn.q`` but not ``q_proj``, and ``proj``
    (a string suffix of ``q_proj``) matches neither."""
    g = torch.Generator().manual_seed(5)
    modules = {
        "model.layers.0.self_attn.q_proj": (torch.randn(4, 8, generator=g), torch.randn(8, 4, generator=g)),
        "model.layers.0.attn.q": (torch.randn(2, 8, generator=g), torch.randn(8, 2, generator=g)),
        "model.layers.0.mlp.down_proj": (torch.randn(4, 8, generator=g), torch.randn(8, 4, generator=g)),
        "lm_head": (torch.randn(4, 8, generator=g), torch.randn(16, 4, generator=g)),
    }
    save_peft_adapter(tmp_path, modules, r=4, lora_alpha=8, rank_pattern={"q": 2, "head": 3},
                      alpha_pattern={"q": 1, "proj": 100, "lm_head": 12})
    adapter = load_peft_adapter(tmp_path)
    got = {name: (m.rank, m.scaling) for name, m in adapter.modules.items()}
    assert got == {
        "model.layers.0.self_attn.q_proj": (4, 8 / 4),  # neither "q" nor "proj" applies
        "model.layers.0.attn.q": (2, 1 / 2),  # "q" applies to rank and alpha
        "model.layers.0.mlp.down_proj": (4, 8 / 4),
        "lm_head": (4, 12 / 4),  # "head" is not a name component of lm_head: r stays 4
    }


def test_a_pattern_key_that_would_wrongly_match_makes_the_declared_rank_disagree(tmp_path):
    """Class 5, the other way round: if ``q`` matched ``q_proj``, a correct adapter would be
    rejected for a rank mismatch; if ``q`` did not match ``attn.q``, likewise."""
    g = torch.Generator().manual_seed(6)
    save_peft_adapter(tmp_path, {"a.q_proj": (torch.randn(4, 3, generator=g), torch.randn(5, 4, generator=g)),
                                 "a.q": (torch.randn(1, 3, generator=g), torch.randn(5, 1, generator=g))},
                      r=4, lora_alpha=4, rank_pattern={"q": 1})
    assert {n: m.rank for n, m in load_peft_adapter(tmp_path).modules.items()} == {"a.q_proj": 4, "a.q": 1}


# --------------------------------------------------------------------- fuzz findings
def test_rejected_set_adapters_changes_nothing():
    """Fuzz finding: ``set_adapters([2**40], [1.0])`` raised after updating the host copy."""
    for use_graph in (False, True):
        info = graph_info(use_graph=use_graph, max_tokens=4 if use_graph else None, max_rank=8)
        before = snapshot(info)
        for ranks, scalings, match in [([2**40, 1], [1.0, 1.0], r"lora_ranks\[0\]"),
                                       ([1, 9], [1.0, 1.0], r"lora_ranks\[1\] = 9 exceeds max_rank = 8"),
                                       ([1, 1, 1], [1.0, 1.0, 1.0], "lora_ranks has 3 slots"),
                                       ([1, 1], [1.0, 1e39], r"scalings\[1\] must be finite in float32"),
                                       ([1, 1], [1.0], "one entry per slot"),
                                       ([1, -1], [1.0, 1.0], r"lora_ranks\[1\]")]:
            with pytest.raises(ValueError, match=match):
                info.set_adapters(ranks, scalings)
            assert_same_state(before, snapshot(info))
        # without a max_rank nothing but the int32 bound stops a huge rank before it is written
        info = graph_info(use_graph=use_graph, max_tokens=4 if use_graph else None)
        before = snapshot(info)
        with pytest.raises(ValueError, match=r"lora_ranks\[0\] must be an int <= 2147483647"):
            info.set_adapters([2**40, 1], [1.0, 1.0])
        assert_same_state(before, snapshot(info))


@pytest.mark.parametrize("scaling", [1e39, -1e39, np.float64(4e38), float("inf"), float("nan")])
def test_scalings_must_be_finite_in_float32(scaling):
    """Fuzz finding: a scaling finite in Python but not in float32 (1e39) became inf on the device."""
    with pytest.raises(ValueError, match=r"scalings\[0\] must be (a )?finite"):
        build_batch_info([1], [0], [1], [scaling], device="cpu")
    info = build_batch_info([1], [0], [1], [3.0e38], device="cpu")  # the float32 maximum is fine
    assert torch.isfinite(info.scalings).all()


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(use_graph=True, max_tokens=2**40), "max_tokens must be a positive int <= 2"),
    (dict(use_graph=True, max_tokens=2**31), "max_tokens must be a positive int <= 2"),
    (dict(seq_lens=[2**31, 0]), r"seq_lens sum to 2147483648 tokens"),
    (dict(seq_lens=[2**30, 2**30]), r"seq_lens sum to 2147483648 tokens"),
    (dict(lora_ranks=[2**31, 1]), r"lora_ranks\[0\] must be an int <= 2147483647"),
    (dict(device="bogus"), "device must be .* got 'bogus'"),
    (dict(device=""), "device must be"),
    (dict(device=None), "device must be"),
    (dict(device=3.5), "device must be"),
    (dict(device=True), "device must be"),
    (dict(max_rank=2.0), "max_rank must be an int >= 0, got 2.0"),
    (dict(max_rank="8"), "max_rank must be an int >= 0"),
    (dict(max_rank=-1), "max_rank must be an int >= 0"),
    (dict(max_tokens=4), "max_tokens is only meaningful with use_graph=True"),
])
def test_bad_sizes_and_devices_are_value_errors_naming_the_argument(kwargs, match):
    """Fuzz findings: huge sizes gave MemoryError, an unknown device torch's RuntimeError, a
    non-int max_rank a TypeError naming nothing."""
    args = dict(seq_lens=[2, 1], slot_ids=[0, None], lora_ranks=[2, 3], scalings=[1.0, 0.5], device="cpu")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        build_batch_info(**args)


def test_a_device_this_torch_build_lacks_is_a_value_error():
    """``device="cuda"`` on a CPU-only build (or an absent index) fails at construction, naming the device."""
    missing = "cuda:99" if torch.cuda.is_available() else "cuda"
    with pytest.raises(ValueError, match=rf"device must be .* got '{missing}'"):
        build_batch_info([1], [0], [1], [1.0], device=missing)


def test_an_allocation_failure_names_the_argument_that_asked_for_it(monkeypatch):
    """A size within bounds that this machine cannot allocate is a ValueError naming it (the
    allocator's RuntimeError / MemoryError is chained), not a bare MemoryError."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        size = args[0] if args and isinstance(args[0], int) else 0
        if size > 10**6:
            raise RuntimeError(f"[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: can't allocate memory: "
                               f"you tried to allocate {size} bytes")
        return real_empty(*args, **kwargs)

    real_np_empty = np.empty

    def np_empty(shape, *args, **kwargs):  # an eager CPU batch's fields are NumPy arrays
        if math.prod(shape if isinstance(shape, tuple) else (shape,)) > 10**6:
            raise MemoryError(f"Unable to allocate an array with shape {shape}")
        return real_np_empty(shape, *args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(np, "empty", np_empty)
    with pytest.raises(ValueError, match="max_tokens = 100000000: cannot allocate"):
        graph_info(max_tokens=10**8)
    with pytest.raises(ValueError, match=r"seq_lens \(100000000 tokens\): cannot allocate"):
        build_batch_info([10**8], [0], [1], [1.0], device="cpu")


@pytest.mark.parametrize("container", [{1: 0, 2: 0}, {1, 2}, frozenset([1])], ids=type)
def test_unordered_containers_are_not_request_lists(container):
    with pytest.raises(TypeError, match="seq_lens must be a sequence of numbers"):
        build_batch_info(container, [0] * len(container), [1], [1.0], device="cpu")


def test_numpy_integers_and_host_tensors_are_accepted():
    info = build_batch_info(np.array([2, 1], dtype=np.int16), [np.int8(0), None], torch.tensor([2, 3]),
                            np.array([1.0, 0.5], dtype=np.float32), device=torch.device("cpu"),
                            use_graph=np.True_, max_tokens=np.uint16(4), max_rank=np.int64(3))
    assert info.seq_lens == (2, 1) and info.token_slots_cpu.tolist() == [0, 0, -1, -1]
    assert all(type(v) is int for v in info.seq_lens + info.request_slots + info.lora_ranks_host)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(dtype=torch.float64), "dtype has dtype torch.float64; supported dtypes are float32, float16, bfloat16"),
    (dict(dtype=torch.int32), "dtype has dtype torch.int32"),
    (dict(dtype="float32"), "dtype must be a torch.dtype"),
    (dict(device="bogus"), "device must be"),
    (dict(num_slots=True), "num_slots must be a positive int"),
    (dict(max_rank=0), "max_rank must be a positive int"),
    (dict(num_slots=2**40), r"num_slots = 1099511627776, .*: cannot allocate"),
])
def test_buffers_reject_unsupported_dtypes_devices_and_sizes(kwargs, match):
    args = dict(num_slots=2, max_rank=4, in_features=8, slice_widths=[8, 4], dtype=torch.float32, device="cpu")
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        LinearLoRABuffers(**args)
    emb = dict(num_slots=2, max_rank=4, vocab_size=8, embedding_dim=4, dtype=torch.float32, device="cpu")
    emb.update({k: v for k, v in kwargs.items() if k in emb})
    if emb != dict(num_slots=2, max_rank=4, vocab_size=8, embedding_dim=4, dtype=torch.float32, device="cpu"):
        with pytest.raises((ValueError, TypeError), match=match.split(",")[0]):
            EmbeddingLoRABuffers(**emb)


@pytest.mark.parametrize("scaling", [float("nan"), 1e39, "1.5", True])
def test_adapter_slots_take_finite_float32_scalings(scaling):
    slots = AdapterSlots(2, 4)
    with pytest.raises(ValueError, match="scaling of adapter 'a'"):
        slots.assign("a", 2, scaling)
    assert slots.loaded == {} and slots.lora_ranks == (0, 0)


def test_malformed_pattern_keys_are_format_errors(tmp_path):
    save_peft_adapter(tmp_path, {"fc": (torch.ones(2, 3), torch.ones(4, 2))}, r=2, lora_alpha=4,
                      rank_pattern={"(": 2})
    with pytest.raises(AdapterFormatError, match=r"rank_pattern key '\(' is not a valid pattern"):
        load_peft_adapter(tmp_path)


def test_a_null_use_rslora_is_peft_default_false(tmp_path):
    """Long-profile finding: ``"use_rslora": null`` loads as PEFT reads it (falsy: alpha / r)."""
    g = torch.Generator().manual_seed(0)
    save_peft_adapter(tmp_path, {"fc": (torch.randn(2, 3, generator=g), torch.randn(5, 2, generator=g))},
                      r=2, lora_alpha=4, use_rslora=None)
    adapter = load_peft_adapter(tmp_path)
    assert adapter.use_rslora is False
    assert adapter.modules["fc"].scaling == pytest.approx(4 / 2)


def test_the_callers_lists_are_read_never_written():
    """Validation reads the caller's lists without copying them: building, refilling and
    updating adapters must leave them as they were."""
    seq_lens, slot_ids, ranks, scalings = [2, 0, 1, 3], [0, None, -1, 1], [2, 3], [1.0, 0.5]
    given = [list(seq_lens), list(slot_ids), list(ranks), list(scalings)]
    info = build_batch_info(seq_lens, slot_ids, ranks, scalings, device="cpu", use_graph=True, max_tokens=8)
    info.refill(seq_lens, slot_ids)
    info.set_adapters(ranks, scalings)
    build_batch_info(tuple(seq_lens), tuple(slot_ids), tuple(ranks), tuple(scalings), device="cpu")
    assert [seq_lens, slot_ids, ranks, scalings] == given
