"""The backend ABC: every method abstract (docs/upstream-failures.md, failure 2), and the entry-point registry."""

import inspect

import pytest

from lora_core import LoRABackend, available_backends, get_backend

ABSTRACT = {"batch_info", "prepare_batch", "init_graph_batch_info", "run_lora_a", "run_lora_b", "run_qkv",
            "run_gate_up", "run_lm_head", "run_lora_a_embedding", "run_added_tokens",
            "run_experts_lora"}


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


def test_unknown_backend_names_the_installed_ones():
    with pytest.raises(ValueError, match=r"unknown LoRA backend 'nope'; installed backends: ") as err:
        get_backend("nope")
    for name in available_backends():
        assert name in str(err.value)


def test_registered_backends_are_complete_subclasses():
    for name in available_backends():
        cls = get_backend(name)
        assert issubclass(cls, LoRABackend) and not inspect.isabstract(cls) and cls.name == name
