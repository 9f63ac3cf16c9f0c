"""The backend ABC: every method abstract (docs/upstream-failures.md, failure 2), and the entry-point registry."""

import inspect

import pytest

from lora_core import LoRABackend, available_backends, get_backend

ABSTRACT = {"batch_info", "prepare_batch", "init_graph_batch_info", "run_lora_a", "run_lora_b", "run_lm_head",
            "run_lora_a_embedding", "run_added_tokens", "run_packed", "run_dora_scale", "run_experts_lora",
            "run_experts_lora_a", "run_experts_lora_b"}


def test_every_backend_method_is_abstract():
    assert LoRABackend.__abstractmethods__ == frozenset(ABSTRACT)


@pytest.mark.parametrize("missing", sorted(ABSTRACT))
def test_a_backend_missing_any_method_cannot_be_instantiated(missing):
    # The upstream bug: a base-class method returned None and a later op crashed
    # with "'NoneType' object has no attribute 'shape'". Here it cannot even be built.
    methods = {name: (lambda self, *a, **k: None) for name in ABSTRACT - {missing}}
    Partial = type("Partial", (LoRABackend,), {"name": "partial", **methods})
    with pytest.raises(TypeError, match=missing):
        Partial()


@pytest.mark.parametrize("alias", ["run_qkv", "run_gate_up"])
def test_run_qkv_and_run_gate_up_are_the_packed_op_under_its_callers_names(alias):
    # one op, any number of slices: a backend implements run_packed and gets both names
    methods = {name: (lambda self, *a, **k: None) for name in ABSTRACT - {"run_packed"}}
    Packed = type("Packed", (LoRABackend,), {"name": "packed", **methods, "run_packed": lambda self, *a: a})
    args = ("x", "a", "b", [0, 3, 6, 9, 12], "base")
    assert getattr(Packed(), alias)(*args) == args


def test_unknown_backend_names_the_installed_ones():
    with pytest.raises(ValueError, match=r"unknown LoRA backend 'nope'; installed backends: ") as err:
        get_backend("nope")
    for name in available_backends():
        assert name in str(err.value)


def test_registered_backends_are_complete_subclasses():
    for name in available_backends():
        cls = get_backend(name)
        assert issubclass(cls, LoRABackend) and not inspect.isabstract(cls) and cls.name == name
