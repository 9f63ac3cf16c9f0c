"""Target matching against PEFT's own ``check_target_module_exists``, on module names built to
tell the rules apart (docs/bug-classes.md, classes 10 and 11):

* a string ``target_modules`` is a regex that must match the *whole* name (``re.fullmatch``,
  not ``re.search``): ``"q_proj"`` matches no ``model.layers.0.self_attn.q_proj``;
* a list entry matches a name equal to it or ending in ``"." + entry``, never a bare string
  suffix: ``["proj"]`` selects no ``...q_proj``.

Compared name by name, and end to end through ``MultiLoRA.from_adapters`` on a tiny model
whose module names make the wrong rules select other modules than PEFT does.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft", reason="needs peft (tests/requirements.txt)")
from peft.tuners.tuners_utils import check_target_module_exists  # noqa: E402

# The one import of the matching function: move this line if the matching moves.
from lora_core.adapter_config import matches_target  # noqa: E402
from lora_layers import MultiLoRA  # noqa: E402

NAMES = [
    "q_proj", "proj", "xproj", "proj.q", "proj_out",
    "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.proj", "model.layers.0.self_attn.kproj",
    "model.layers.1.mlp.down_proj", "model.layers.1.mlp.down_proj.inner", "model.layers.1.mlp.up_proj_extra",
    "model.layers.10.self_attn.q_proj", "model.layers.1.self_attn.q_proj", "lm_head", "model.lm_head_norm",
    "encoder.proj", "encoderproj", "a.b.proj", "a.bproj", "a.b.c_proj",
]
"""Names where a substring, a prefix or a bare suffix is not a whole-name or dotted-suffix match."""

TARGETS = [
    # regexes: search and fullmatch differ
    "q_proj", "proj", r".*\.q_proj", r"model\.layers\.1\..*", r"layers\.1", r".*_proj", r".*proj$", r"^model\..*",
    r"(q|k)_proj", r".*\.layers\.1\.mlp\.(down|up)_proj", r"lm_head", r".*\.(proj|q_proj)",
    # lists: a dotted suffix and a bare suffix differ
    ["proj"], ["q_proj"], ["_proj"], ["roj", "head"], ["self_attn.q_proj"], ["attn.q_proj"], ["b.proj", "c_proj"],
    ["mlp.down_proj", "lm_head"], ["layers.1.mlp.down_proj"], ["bproj"], ["q"], ["proj", "proj_out"],
    ["model.layers.0.self_attn.q_proj"], ["1.self_attn.q_proj"],
]


def _peft_config(target_modules):
    return peft.LoraConfig(r=2, lora_alpha=4, target_modules=copy.deepcopy(target_modules))


def _ids(targets):
    return [repr(t) for t in targets]


@pytest.mark.parametrize("target_modules", TARGETS, ids=_ids(TARGETS))
def test_target_matching_equals_peft_on_names_that_tell_the_rules_apart(target_modules):
    config = _peft_config(target_modules)
    want = {name for name in NAMES if check_target_module_exists(config, name)}
    got = {name for name in NAMES if matches_target({"target_modules": target_modules}, name)}
    assert got == want, f"extra: {sorted(got - want)}, missing: {sorted(want - got)}"


def test_the_name_set_tells_the_rules_apart():
    """The names above are the ones the wrong rules get wrong: some regex target selects a name
    by ``re.search`` that PEFT's fullmatch does not, and some list target selects a name by a
    bare string suffix that PEFT's dotted suffix does not."""
    import re

    regexes = [t for t in TARGETS if isinstance(t, str)]
    lists = [t for t in TARGETS if isinstance(t, list)]
    assert any(re.search(t, n) and not re.fullmatch(t, n) for t in regexes for n in NAMES)
    assert any(n.endswith(e) and n != e and not n.endswith("." + e) for t in lists for e in t for n in NAMES)


class _Block(nn.Module):
    """Module names chosen so that a bare suffix (``proj`` of ``q_proj``) and a regex found
    inside a name (``q_proj`` in ``...q_proj_gate``) select other modules than PEFT."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8, bias=False)
        self.proj = nn.Linear(8, 8, bias=False)
        self.kproj = nn.Linear(8, 8, bias=False)
        self.q_proj_gate = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return self.q_proj_gate(self.kproj(self.proj(self.q_proj(x))))


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


MODEL_TARGETS = [
    ["proj"],  # PEFT: layers.*.proj only; a bare suffix adds q_proj and kproj
    ["q_proj", "gate"],  # PEFT: every q_proj; a bare suffix adds q_proj_gate (ends in "gate", no dot before it)
    "q_proj",  # PEFT: nothing (no whole name is q_proj); re.search: every q_proj and q_proj_gate
    r"layers\.1\..*proj",  # PEFT: layer 1's q_proj, proj, kproj; re.search would also take q_proj_gate
]


@pytest.mark.parametrize("target_modules", MODEL_TARGETS, ids=_ids(MODEL_TARGETS))
def test_from_adapters_wraps_what_peft_wraps_on_names_that_tell_the_rules_apart(tmp_path, target_modules):
    torch.manual_seed(0)
    base = _Tiny().eval()
    config = _peft_config(target_modules)
    config.init_lora_weights = False
    expected = sorted(name for name, _ in base.named_modules() if name and check_target_module_exists(config, name))
    if not expected:  # PEFT refuses an adapter that targets nothing, and so does lora-kit
        with pytest.raises(ValueError):
            peft.get_peft_model(copy.deepcopy(base), config)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.get_peft_model(copy.deepcopy(base), config)
        peft_model.save_pretrained(str(tmp_path / "a"))
    peft_wrapped = sorted(name.removeprefix("base_model.model.") for name, m in peft_model.named_modules()
                          if isinstance(m, peft.tuners.lora.LoraLayer))
    assert peft_wrapped == expected
    model = copy.deepcopy(base)
    with warnings.catch_warnings():  # a target matched without weights is a warning: here, a wrong match
        warnings.simplefilter("error")
        mlora = MultiLoRA.from_adapters(model, {"a": tmp_path / "a"})
    assert sorted(mlora.wrapped) == expected
