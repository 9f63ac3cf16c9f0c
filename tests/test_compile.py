"""Wrapped models under torch.compile (docs/compile.md).

A MultiLoRA-wrapped model in graph mode (``enable_graph``) compiles with
``fullgraph=True`` once and serves three different mixed batches, each
described by ``set_batch`` (an in-place refill: other splits, other adapters,
other real-token counts under the same capacity), without a recompile and
matching the same model called eagerly: lora-layers' TinyDecoder, unfused and
fused, and a tiny random transformers ``LlamaForCausalLM`` (no download). The
compiles are counted by the backend; ``error_on_recompile`` fails any other.
Inductor compiles the fused TinyDecoder once (slow on CPU: one test).
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch._dynamo

from lora_core import available_backends
from lora_core.testing import TOLERANCES
from lora_layers import TinyConfig, TinyDecoder
from lora_layers.sim.adapters import make_synthetic_adapters
from lora_layers.sim.serving import build_multilora

CAPACITY = 24
BATCHES = [  # (seq_lens, adapters): mixed, padded to CAPACITY rows, a different mix each time
    ([5, 9, 3], ["r8", None, "r16"]),
    ([1, 1, 1, 1, 1, 1, 1, 10], ["r64-embed-head", "r32-rslora", None, "r8", "r16", "r8", None, "r32-rslora"]),
    ([20, 0, 4], ["r32-rslora", "r8", "r64-embed-head"]),
]
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)

BACKENDS = available_backends()
NEEDS_CXX = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                               reason="inductor's CPU code generation needs a C++ compiler")


class Counting:
    """A compile backend counting the graphs it compiles."""

    def __init__(self, backend: str = "aot_eager") -> None:
        self.backend, self.compiles = backend, 0

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)


@pytest.fixture(scope="module")
def adapter_paths(tmp_path_factory):
    return make_synthetic_adapters(TinyConfig(**TINY), tmp_path_factory.mktemp("adapters"))


def _tiny_decoder(fused: bool):
    return TinyDecoder(TinyConfig(**TINY, fused=fused)).eval(), TinyConfig(**TINY, fused=fused)


def _llama():
    transformers = pytest.importorskip("transformers", reason="needs transformers (tests/requirements.txt)")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=None)
    model = transformers.LlamaForCausalLM(config).eval()
    return model, TinyConfig(**TINY)  # the same module names and shapes as the tiny decoder


def _serve(model, config, adapter_paths, backend, compile_backend="aot_eager"):
    """Compile the wrapped model once, then serve every batch: ``[(compiled, eager)]`` logits and the compile count."""
    mlora = build_multilora(model, config, adapter_paths, backend)
    mlora.enable_graph(CAPACITY)
    ids = torch.zeros(CAPACITY, dtype=torch.long)
    if isinstance(model, TinyDecoder):
        def step(ids):
            return model(ids)
    else:
        def step(ids):
            return model(input_ids=ids[None], use_cache=False).logits[0]
    counting = Counting(compile_backend)
    compiled = torch.compile(step, backend=counting, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    results = []
    torch._dynamo.reset()
    with torch.no_grad():
        for i, batch in enumerate(BATCHES):
            mlora.set_batch(*batch)  # the graph-mode batch, refilled in place
            ids.copy_(torch.randint(0, config.vocab_size, (CAPACITY,), generator=gen))
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                got = compiled(ids).clone()
            results.append((got, step(ids)))
    mlora.unwrap()
    return results, counting.compiles


def _check(results, compiles):
    assert compiles == 1, f"{compiles} compiles for {len(BATCHES)} batches"
    rtol, atol = TOLERANCES[torch.float32]
    for (got, eager), (seq_lens, _) in zip(results, BATCHES):
        real = sum(seq_lens)
        torch.testing.assert_close(got[:real], eager[:real], rtol=rtol, atol=atol)
    assert not torch.equal(results[0][1], results[1][1]), "the batches must give different logits"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_tiny_decoder_compiles_once_and_serves_three_batches(adapter_paths, backend, fused):
    _check(*_serve(*_tiny_decoder(fused), adapter_paths, backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_llama_compiles_once_and_serves_three_batches(adapter_paths, backend):
    _check(*_serve(*_llama(), adapter_paths, backend))


@NEEDS_CXX
def test_inductor_compiles_the_wrapped_model_once(adapter_paths):
    """One inductor compile (slow on CPU) of the fused decoder on the default backend."""
    _check(*_serve(*_tiny_decoder(True), adapter_paths, "torch_native", compile_backend="inductor"))


@pytest.mark.parametrize("graph", [True, False], ids=["graph-mode", "eager-batches"])
def test_two_wrapped_models_compile_in_one_function(adapter_paths, graph):
    """Two MultiLoRA instances (a draft and a target model, say) traced into one fullgraph function:
    each layer hands its own batch to lora_cuda's ops, and the results are each model's own."""
    models = [_tiny_decoder(False)[0] for _ in range(2)]
    config = TinyConfig(**TINY)
    wrapped = [build_multilora(model, config, adapter_paths, "torch_native") for model in models]
    for mlora, adapters in zip(wrapped, (["r8", None], ["r16", "r32-rslora"])):
        if graph:
            mlora.enable_graph(CAPACITY)
        mlora.set_batch([CAPACITY - 4, 4], adapters)
    ids = torch.randint(0, config.vocab_size, (CAPACITY,), generator=torch.Generator().manual_seed(0))

    def step(ids):
        return torch.stack([model(ids) for model in models])

    counting = Counting()
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            want = step(ids)
            got = torch.compile(step, backend=counting, fullgraph=True)(ids)
    finally:
        for mlora in wrapped:
            mlora.unwrap()
    assert counting.compiles == 1
    rtol, atol = TOLERANCES[torch.float32]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
