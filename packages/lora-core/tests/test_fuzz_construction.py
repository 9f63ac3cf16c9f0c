"""Fuzzed construction: batch infos, refills, adapter updates and adapter directories.

Every call either works and matches an independent model of the result, or raises
``ValueError`` / ``TypeError`` whose message names one of the arguments the model
says are wrong. A rejected ``refill`` or ``set_adapters`` changes nothing (host
mirrors, device tensors and their addresses, the LM-head view). ``load_peft_adapter``
on a malformed directory raises ``AdapterFormatError`` (a ``ValueError``) or
``FileNotFoundError``, never another exception. Budgets and profiles:
lora_core.testing.hypothesis_profiles.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import event, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lora_core import AdapterFormatError, build_batch_info, load_peft_adapter, peft_scaling  # noqa: E402
from lora_core.testing.hypothesis_profiles import budget  # noqa: E402

MAX_TOKENS = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
NOT_INTS = [True, False, np.True_, 1.0, 2.5, float("nan"), "3", None, [1], b"1", 1j]


# ----------------------------------------------------------------------------- the model
def is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def is_real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def finite32(v) -> bool:
    return is_real(v) and math.isfinite(float(v)) and abs(float(v)) <= FLOAT32_MAX


def requests_blame(lens, slots, num_slots) -> set[str]:
    blame = set()
    if len(lens) != len(slots):
        blame |= {"seq_lens", "slot_ids"}
    if not all(is_int(n) and n >= 0 for n in lens):
        blame.add("seq_lens")
    elif sum(int(n) for n in lens) > MAX_TOKENS:
        blame.add("seq_lens")
    if num_slots is not None and not all(s is None or (is_int(s) and -1 <= s < num_slots) for s in slots):
        blame.add("slot_ids")
    return blame


def adapters_blame(ranks, scalings, max_rank) -> set[str]:
    blame = set()
    if len(ranks) != len(scalings):
        blame |= {"lora_ranks", "scalings"}
    if not all(is_int(r) and 0 <= r <= MAX_TOKENS for r in ranks):
        blame.add("lora_ranks")
    elif is_int(max_rank) and max_rank >= 0 and any(r > max_rank for r in ranks):
        blame |= {"lora_ranks", "max_rank"}
    if not all(finite32(s) for s in scalings):
        blame.add("scalings")
    return blame


def expected_segments(lens, slots):
    segs = []
    for n, s in zip(lens, slots):
        if n == 0:
            continue
        if segs and segs[-1][1] == s:
            segs[-1][0] += n
        else:
            segs.append([n, s])
    return segs


def check_matches_model(info, lens, slots, ranks, scalings, capacity):
    lens = [int(n) for n in lens]
    slots = [-1 if s is None else int(s) for s in slots]
    T = sum(lens)
    assert info.seq_lens == tuple(lens) and info.request_slots == tuple(slots)
    assert info.num_real_tokens == T and info.num_tokens == (capacity if capacity is not None else T)
    rows = info.num_tokens
    token_slots = [s for n, s in zip(lens, slots) for _ in range(n)] + [-1] * (rows - T)
    segs = expected_segments(lens, slots)
    S = len(segs)
    assert info.num_segments == S
    assert info.token_slots_cpu.tolist() == token_slots
    seg_lens = info.seg_lens_cpu.tolist()
    assert seg_lens[:S] == [n for n, _ in segs] and not any(seg_lens[S:])
    assert info.weight_indices_cpu.tolist()[:S] == [s for _, s in segs]
    assert all(s == -1 for s in info.weight_indices_cpu.tolist()[S:])
    indptr = np.cumsum([0] + [n for n, _ in segs]).tolist()
    assert info.seg_indptr_cpu.tolist()[: S + 1] == indptr and all(v == T for v in info.seg_indptr_cpu.tolist()[S + 1:])
    assert info.lora_ranks_cpu.tolist() == [int(r) for r in ranks]
    assert info.lora_ranks_host == tuple(int(r) for r in ranks)
    np.testing.assert_array_equal(info.scalings_cpu.numpy(), np.array([float(s) for s in scalings], dtype=np.float32))
    for name in ("seg_lens", "seg_indptr", "weight_indices", "token_slots", "lora_ranks", "scalings"):
        assert torch.equal(getattr(info, name).cpu(), getattr(info, f"{name}_cpu")), name
    view = info.lm_head_view(pruned=True)
    kept = [s for n, s in zip(lens, slots) if n > 0]
    assert view.seq_lens == (1,) * len(kept) and view.request_slots == tuple(kept)
    assert view.token_slots_cpu.tolist()[: len(kept)] == kept


def assert_names(err: Exception, blame: set[str]) -> None:
    assert isinstance(err, (ValueError, TypeError)), f"{type(err).__name__} is neither ValueError nor TypeError"
    message = str(err)
    assert any(re.search(rf"\b{name}\b", message) for name in blame), \
        f"{type(err).__name__}({message!r}) names none of {sorted(blame)}"


FIELDS = ("seg_lens", "seg_indptr", "weight_indices", "token_slots", "lora_ranks", "scalings")


def snapshot(info, depth: int = 0) -> list:
    state = [info.seq_lens, info.request_slots, info.lora_ranks_host, info.scalings_host, info.num_segments]
    for name in FIELDS:
        t = getattr(info, name)
        state += [t.detach().cpu().clone(), getattr(info, f"{name}_cpu").clone(), t.data_ptr()]
    view = info._lm_head.view if info._lm_head is not None else None
    if depth == 0 and view is not None:
        state.append(snapshot(view, 1))
    return state


def assert_unchanged(before, after) -> None:
    assert len(before) == len(after)
    for b, a in zip(before, after):
        if isinstance(b, list):
            assert_unchanged(b, a)
        elif isinstance(b, torch.Tensor):
            assert torch.equal(b, a), "a rejected call changed a tensor"
        else:
            assert b == a, f"a rejected call changed {b!r} into {a!r}"


# ----------------------------------------------------------------------------- strategies
def int_types(value: int):
    """``value`` as a Python int or as one of the NumPy integer types that hold it."""
    options = [st.just(value)]
    for t in (np.int64, np.int32, np.int16, np.uint8, np.uint32):
        info = np.iinfo(t)
        if info.min <= value <= info.max:
            options.append(st.just(t(value)))
    return st.one_of(options)


def ints(lo: int, hi: int):
    return st.integers(lo, hi).flatmap(int_types)


good_scaling = st.one_of(st.floats(-1e3, 1e3, allow_nan=False), st.integers(-5, 5),
                         st.floats(-4, 4, width=32).map(np.float32), st.just(3.4e38))
bad_int = st.one_of(st.sampled_from([True, False, np.True_]), st.sampled_from(NOT_INTS + [-1, -(2**40)]))  # bools first
bad_scaling = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e39, -1e39, True, np.False_, "1", None,
                               1j, [1.0]])
bad_container = st.sampled_from([None, 3, "12", b"\x01", {1: 2}, {1}, torch.tensor(1), np.array(2)])


def good_slot(num_slots: int):
    return st.one_of(st.none(), st.just(-1), ints(0, num_slots - 1)) if num_slots else st.sampled_from([None, -1])


def container(values, choice: str):
    """``values`` as a list, tuple, NumPy array, CPU tensor or iterator (where it converts)."""
    if choice == "tuple":
        return tuple(values)
    if choice == "iter":
        return iter(values)
    if choice in ("ndarray", "tensor") and values and all(is_int(v) for v in values) \
            and all(-(2**63) <= int(v) < 2**63 for v in values):
        arr = np.array([int(v) for v in values], dtype=np.int64)
        return arr if choice == "ndarray" else torch.from_numpy(arr)
    return list(values)


CONTAINERS = st.sampled_from(["list", "list", "tuple", "ndarray", "tensor", "iter"])


def break_list(draw, values: list, bad_element, name: str) -> list:
    """``values`` with one fault: a bad element, an entry too many or too few."""
    how = draw(st.sampled_from(["element", "element", "length"]), f"{name} fault")
    if how == "element" and values:
        values = list(values)
        values[draw(st.integers(0, len(values) - 1))] = draw(bad_element, f"bad {name}")
        return values
    return values[:-1] if values and draw(st.booleans()) else [*values, values[0] if values else 1]


@st.composite
def adapter_args(draw, faults=frozenset(), num_slots=None):
    L = num_slots if num_slots is not None else draw(st.integers(0, 6), "num_slots")
    ranks = draw(st.lists(ints(0, 16), min_size=L, max_size=L), "lora_ranks")
    scalings = draw(st.lists(good_scaling, min_size=L, max_size=L), "scalings")
    if "lora_ranks" in faults:
        ranks = break_list(draw, ranks, st.one_of(bad_int, st.sampled_from([2**31, 2**63, 2**80])), "lora_ranks")
    if "scalings" in faults:
        scalings = break_list(draw, scalings, bad_scaling, "scalings")
    return ranks, scalings


@st.composite
def request_args(draw, num_slots: int, faults=frozenset()):
    n = draw(st.integers(0, 12), "num_requests")
    lens = draw(st.lists(ints(0, 60), min_size=n, max_size=n), "seq_lens")
    slots = draw(st.lists(good_slot(num_slots), min_size=n, max_size=n), "slot_ids")
    if "seq_lens" in faults:
        lens = break_list(draw, lens, st.one_of(bad_int, st.sampled_from([2**31, 2**40, 2**70])), "seq_lens")
    if "slot_ids" in faults:
        slots = break_list(draw, slots, st.sampled_from([num_slots, num_slots + 1, -2, True, 0.0, "0", 2**40]),
                           "slot_ids")
    return lens, slots


def total_tokens(lens) -> int | None:
    return sum(int(n) for n in lens) if all(is_int(n) and n >= 0 for n in lens) else None


ARGUMENTS = ("seq_lens", "slot_ids", "lora_ranks", "scalings", "use_graph", "max_tokens", "max_rank", "device",
             "containers")
faults_strategy = st.one_of(st.just(frozenset()), st.sampled_from(ARGUMENTS).map(lambda a: frozenset([a])),
                            st.frozensets(st.sampled_from(ARGUMENTS), min_size=2, max_size=2))


# ----------------------------------------------------------------------------- build_batch_info
@given(data=st.data())
@budget(ci=200, long=6000)
def test_build_batch_info_works_and_matches_the_model_or_names_a_bad_argument(data):
    faults = data.draw(faults_strategy, "faults")
    ranks, scalings = data.draw(adapter_args(faults), "adapters")
    num_slots = len(ranks)
    lens, slots = data.draw(request_args(num_slots, faults), "requests")
    total = total_tokens(lens)
    use_graph = data.draw(st.sampled_from(["yes", 1, None, 0] if "use_graph" in faults else
                                          [False, True, np.True_, np.False_]), "use_graph")
    graph = use_graph is True or use_graph is np.True_
    if "max_tokens" in faults:
        choices = [0, -1, True, 3.0, 2**31, 2**40, "8"] + ([max(total - 1, 0)] if total else []) + \
                  ([] if graph or total is None else [total + 1])
    else:
        choices = [None] if not graph else [max(total or 0, 1) + k for k in (0, 1, 7)]
    max_tokens = data.draw(st.sampled_from(choices), "max_tokens")
    top = max([int(r) for r in ranks if is_int(r) and r >= 0], default=0)
    max_rank = data.draw(st.sampled_from([-1, True, 2.0, "4"] + ([top - 1] if top else []) if "max_rank" in faults
                                         else [None, top, top + 3, np.int8(16) if top <= 16 else top]), "max_rank")
    device = data.draw(st.sampled_from(["bogus", None, "", 3.5, True] if "device" in faults
                                       else ["cpu", torch.device("cpu"), "cpu:0"]), "device")
    kind = data.draw(st.tuples(CONTAINERS, CONTAINERS, CONTAINERS, CONTAINERS), "containers")
    args = [container(lens, kind[0]), container(slots, kind[1]), container(ranks, kind[2]),
            container(scalings, kind[3])]

    blame = requests_blame(lens, slots, num_slots) | adapters_blame(ranks, scalings, max_rank)
    if "containers" in faults:  # one argument is not a sequence at all
        which = data.draw(st.integers(0, 3), "bad container")
        args[which] = data.draw(bad_container, "container")
        blame.add(("seq_lens", "slot_ids", "lora_ranks", "scalings")[which])
    if not isinstance(use_graph, (bool, np.bool_)):
        blame.add("use_graph")
    if max_rank is not None and not (is_int(max_rank) and max_rank >= 0):
        blame.add("max_rank")
    if graph:
        if not (is_int(max_tokens) and 0 < max_tokens <= MAX_TOKENS):
            blame.add("max_tokens")
        elif total is not None and total > max_tokens:
            blame |= {"max_tokens", "seq_lens"}
    elif max_tokens is not None:
        blame.add("max_tokens")
    if str(device) not in ("cpu", "cpu:0"):
        blame.add("device")

    try:
        info = build_batch_info(*args, device=device, use_graph=use_graph, max_tokens=max_tokens, max_rank=max_rank)
    except Exception as err:  # noqa: BLE001 - the type is what is checked
        assert blame, f"a valid batch was rejected: {type(err).__name__}: {err}"
        assert_names(err, blame)
        event(f"rejected ({len(blame)} bad argument(s))")
        return
    assert not blame, f"accepted although {sorted(blame)} are wrong"
    event(f"accepted ({'graph' if graph else 'eager'})")
    check_matches_model(info, lens, slots, ranks, scalings, int(max_tokens) if graph else None)


# ----------------------------------------------------------------------------- refill / set_adapters
@given(data=st.data())
@budget(ci=60, long=3000)
def test_refill_and_set_adapters_work_or_change_nothing(data):
    L = data.draw(st.integers(0, 5), "num_slots")
    ranks0 = data.draw(st.lists(st.integers(0, 8), min_size=L, max_size=L), "ranks")
    use_graph = data.draw(st.booleans(), "use_graph")
    capacity = data.draw(st.integers(1, 64), "capacity") if use_graph else None
    max_rank = data.draw(st.sampled_from([None, 8, 12]), "max_rank")
    info = build_batch_info([], [], ranks0, [1.0] * L, device="cpu", use_graph=use_graph, max_tokens=capacity,
                            max_rank=max_rank)
    state = dict(lens=[], slots=[], ranks=ranks0, scalings=[1.0] * L)
    for step in range(data.draw(st.integers(1, 6), "steps")):
        before = snapshot(info)
        faults = data.draw(faults_strategy, f"faults {step}")
        if data.draw(st.booleans(), f"refill {step}"):
            lens, slots = data.draw(request_args(L, faults), f"requests {step}")
            blame = requests_blame(lens, slots, L)
            total = total_tokens(lens)
            if not use_graph:  # eager batches are rebuilt, not refilled
                with pytest.raises(RuntimeError, match="graph-mode"):
                    info.refill(lens, slots)
                assert_unchanged(before, snapshot(info))
                continue
            if total is not None and total > capacity:
                blame |= {"max_tokens", "seq_lens"}
            call, update = (lambda: info.refill(lens, slots)), dict(lens=lens, slots=slots)
        else:
            same = data.draw(st.integers(0, 4), f"slot count {step}") > 0  # mostly the batch's slot count
            ranks, scalings = data.draw(adapter_args(faults, num_slots=L if same else None), f"adapters {step}")
            if max_rank is not None and "lora_ranks" in faults and data.draw(st.booleans(), f"above max {step}"):
                ranks = [*ranks[:-1], max_rank + 1] if ranks else ranks
            blame = adapters_blame(ranks, scalings, max_rank)
            if len(ranks) != L or len(scalings) != L:
                blame |= {"lora_ranks", "scalings"}
            call, update = (lambda: info.set_adapters(ranks, scalings)), dict(ranks=ranks, scalings=scalings)
        try:
            call()
        except Exception as err:  # noqa: BLE001
            assert blame, f"a valid call was rejected: {type(err).__name__}: {err}"
            assert_names(err, blame)
            assert_unchanged(before, snapshot(info))
            event("rejected call")
            continue
        assert not blame, f"accepted although {sorted(blame)} are wrong"
        event("accepted call")
        state.update(update)
        check_matches_model(info, state["lens"], state["slots"], state["ranks"], state["scalings"], capacity)


# ----------------------------------------------------------------------------- adapter directories
junk = st.one_of(st.integers(-3, 0), st.sampled_from([float("nan"), float("inf"), -1.5, 0.0, 1e300, -1e300]),
                 st.booleans(),
                 st.none(), st.text(max_size=3), st.lists(st.integers(0, 3), max_size=2), st.just({"a": 1}))
MODULES = ["fc", "model.q_proj", "model.layers.0.fc", "lm_head", "a.q", "model.embed_tokens"]
PATTERN_KEYS = ["fc", "q", "proj", "q_proj", "layers.0.fc", "head", "lm_head", ".*_proj", "embed_tokens"]
BAD_PATTERN_KEYS = ["(", "[a-", "*", "\\"]
ADAPTER_FAULTS = ("config value", "pattern value", "pattern key", "peft type", "unsupported feature", "dtype",
                  "shape", "missing side", "extra tensor", "duplicate", "mixed kinds", "config file", "weights file",
                  "no config", "no weights")


def _declared(patterns: dict, module: str, default):
    return next((v for k, v in patterns.items() if re.match(rf"(.*\.)?({k})$", module)), default)


@st.composite
def adapter_dirs(draw):
    """A well-formed adapter directory (config, tensors), then 0-2 faults."""
    r = draw(st.integers(1, 4), "r")
    config = {"peft_type": "LORA", "r": r, "lora_alpha": draw(st.one_of(st.integers(1, 32), st.floats(0.5, 64)))}
    if draw(st.booleans()):
        config["use_rslora"] = draw(st.booleans())
    for key, value in (("rank_pattern", st.integers(1, 4)), ("alpha_pattern", st.floats(0.5, 64))):
        if draw(st.booleans()):
            config[key] = draw(st.dictionaries(st.sampled_from(PATTERN_KEYS), value, max_size=3))
    tensors = {}
    for module in draw(st.lists(st.sampled_from(MODULES), min_size=1, max_size=4, unique=True), "modules"):
        rank = _declared(config.get("rank_pattern") or {}, module, r)
        prefix = draw(st.sampled_from(["base_model.model.", ""]))
        dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
        if module == "model.embed_tokens":
            tensors[f"{prefix}{module}.lora_embedding_A"] = torch.randn(rank, 11).to(dtype)
            tensors[f"{prefix}{module}.lora_embedding_B"] = torch.randn(4, rank).to(dtype)
        else:
            tensors[f"{prefix}{module}.lora_A.weight"] = torch.randn(rank, 3).to(dtype)
            tensors[f"{prefix}{module}.lora_B.weight"] = torch.randn(5, rank).to(dtype)
    faults = draw(st.one_of(st.just(()), st.lists(st.sampled_from(ADAPTER_FAULTS), min_size=1, max_size=2)), "faults")
    files = {"config": True, "weights": True, "corrupt config": False, "corrupt weights": False}
    names = sorted(tensors)
    for fault in faults:
        name = draw(st.sampled_from(names))
        if fault == "config value":
            config[draw(st.sampled_from(["r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern"]))] = \
                draw(junk)
        elif fault in ("pattern value", "pattern key"):
            key = draw(st.sampled_from(["rank_pattern", "alpha_pattern"]))
            patterns = dict(config.get(key) or {}) if isinstance(config.get(key), dict) else {}
            if fault == "pattern value":
                patterns[draw(st.sampled_from(PATTERN_KEYS))] = draw(junk)
            else:
                patterns[draw(st.sampled_from(BAD_PATTERN_KEYS))] = 2
            config[key] = patterns
        elif fault == "peft type":
            config["peft_type"] = draw(st.sampled_from(["IA3", None, 3, ["LORA"], "LOHA"]))
        elif fault == "unsupported feature":
            config[draw(st.sampled_from(["use_dora", "lora_bias", "modules_to_save", "trainable_token_indices",
                                         "target_parameters"]))] = draw(st.sampled_from([True, ["lm_head"], [1]]))
        elif fault == "dtype" and name in tensors:
            tensors[name] = tensors[name].to(draw(st.sampled_from([torch.int32, torch.bool, torch.uint8])))
        elif fault == "shape" and name in tensors:
            shape = draw(st.lists(st.integers(0, 4), max_size=3))
            tensors[name] = torch.ones(shape)
        elif fault == "missing side":
            tensors.pop(name, None)
        elif fault == "extra tensor":
            tensors[draw(st.sampled_from(["base_model.model.fc.lora_magnitude_vector", "x.lora_A.default.weight",
                                          "base_model.model..lora_A.weight", ".lora_B.weight",
                                          "model.norm.weight"]))] = torch.ones(2, 2)
        elif fault == "duplicate" and name in tensors:
            other = name[len("base_model.model."):] if name.startswith("base_model.model.") \
                else f"base_model.model.{name}"
            tensors[other] = tensors[name].clone()
        elif fault == "mixed kinds" and name in tensors:
            swap = {".lora_A.weight": ".lora_embedding_A", ".lora_embedding_A": ".lora_A.weight",
                    ".lora_B.weight": ".lora_embedding_B", ".lora_embedding_B": ".lora_B.weight"}
            for old, new in swap.items():
                if name.endswith(old):
                    tensors[name[: -len(old)] + new] = tensors.pop(name)
                    break
        elif fault == "config file":
            files["corrupt config"] = True
        elif fault == "weights file":
            files["corrupt weights"] = True
        elif fault == "no config":
            files["config"] = False
        elif fault == "no weights":
            files["weights"] = False
    return config, tensors, files, tuple(faults)


@pytest.mark.filterwarnings("ignore:.*ignoring base-model weights saved with the adapter")
@given(case=adapter_dirs())
@budget(ci=80, long=3000)
def test_load_peft_adapter_works_consistently_or_raises_a_format_error(tmp_path_factory, case):
    from safetensors.torch import save_file

    config, tensors, files, faults = case
    path = tmp_path_factory.mktemp("adapter")
    if files["config"]:
        text = json.dumps(config)
        (path / "adapter_config.json").write_text(text[: len(text) // 2] + "\ufffd" if files["corrupt config"] else text)
    if files["weights"]:
        if files["corrupt weights"]:
            (path / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":1}garbage")
        else:
            save_file(tensors, str(path / "adapter_model.safetensors"))
    try:
        adapter = load_peft_adapter(path)
    except (AdapterFormatError, FileNotFoundError) as err:
        assert faults, f"a well-formed adapter was rejected: {err}"
        event(f"rejected: {type(err).__name__}")
        return
    except Exception as err:  # noqa: BLE001
        raise AssertionError(f"load_peft_adapter raised {type(err).__name__}: {err}") from err
    event("loaded" + (" despite faults" if faults else ""))
    rslora = config.get("use_rslora", False)
    assert rslora is None or isinstance(rslora, bool)  # JSON null is PEFT's default, False
    rslora = bool(rslora)
    for name, module in adapter.modules.items():
        assert name and module.lora_a.dim() == module.lora_b.dim() == 2
        assert module.lora_a.shape[0] == module.lora_b.shape[1] == module.rank > 0
        assert module.rank == _declared(config.get("rank_pattern") or {}, name, config["r"])
        assert module.lora_a.is_floating_point() and module.lora_b.is_floating_point()
        assert math.isfinite(module.scaling) and abs(module.scaling) <= FLOAT32_MAX
        alpha = _declared(config.get("alpha_pattern") or {}, name, config["lora_alpha"])
        assert module.scaling == pytest.approx(peft_scaling(alpha, module.rank, rslora))
