"""Real vLLM engines (offline ``LLM``) with the plugin against vLLM's own LoRA path and PEFT.

Per model family, three engines on the same settings and requests run side by side, one
process each: vLLM's own CPU wrapper, the plugin on ``torch_native`` and on ``ascend``.
The settings make vLLM do what serving does: 5 adapters (ranks 4-32, one rsLoRA, one on all
linear layers, one with ``rank_pattern``, one on ``embed_tokens`` and ``lm_head``) for 2
adapter slots (swapped between steps), ``max_lora_rank`` 64 above every rank, prompts
chunked at 32 tokens a step, prefix caching on with shared prefixes, base-model requests in
the same batches. After the batch each engine is sent an adapter of rank 128 > 64.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (bash ci/test-vllm.sh makes a venv with it)")

from lora_vllm.testing import peft_tokens, start_engine  # noqa: E402

BACKENDS = ("torch_native", "ascend")
LOGPROB_RTOL = 1e-4  # of max(1, |logprob|)


def _lora_kit_frames(log: str) -> list[str]:
    frame = re.compile(r'File ".*/(lora_core|lora_cuda|lora_ascend|lora_vllm)/')
    return [line for line in log.splitlines() if frame.search(line)]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_plugin_equals_vllm_and_peft(family, vllm_spec, tmp_path):
    spec = vllm_spec(family)
    requests = spec["requests"]
    waits = {backend: start_engine(spec, backend, tmp_path, backend or "vllm") for backend in (None, *BACKENDS)}
    expected = peft_tokens(spec["model"], spec["adapters"], requests, spec["max_tokens"])
    unadapted = peft_tokens(spec["model"], spec["adapters"], [{**r, "adapter": None} for r in requests],
                            spec["max_tokens"])
    runs = {backend: wait() for backend, wait in waits.items()}
    for name in spec["adapters"]:  # every adapter changes what its requests generate
        assert any(expected[i] != unadapted[i] for i, r in enumerate(requests) if r["adapter"] == name), name

    theirs = runs[None]
    assert theirs["wrapper"] == "PunicaWrapperCPU"
    for backend in BACKENDS:
        ours = runs[backend]
        assert ours["wrapper"] == "LoRAKitPunicaWrapper"
        announced = re.findall(rf"lora-kit: vLLM's LoRA layers run on lora-kit backend '{backend}'", ours["log"])
        assert len(announced) == 1, f"the backend is logged once, got {len(announced)} lines"
        for i, r in enumerate(requests):
            what = f"{family}, {backend}, request {i} (adapter {r['adapter']})"
            assert ours["tokens"][i] == expected[i], f"{what}: PEFT alone gives {expected[i]}, got {ours['tokens'][i]}"
            if r["adapter"] is None:
                continue  # vLLM's own CPU wrapper adds the last slot's adapter to base rows: test_punica.py
            assert ours["tokens"][i] == theirs["tokens"][i], f"{what}: vLLM's own wrapper differs"
            for mine, ref in zip(ours["logprobs"][i], theirs["logprobs"][i]):
                assert abs(mine - ref) <= LOGPROB_RTOL * max(1.0, abs(ref)), f"{what}: logprob {mine} vs {ref}"
        # bad input: vLLM's own error, unchanged, and no lora-kit frame in any traceback
        assert ours["errors"] == theirs["errors"]
        assert ours["errors"]["rank-128"] is not None
        assert not _lora_kit_frames(ours["log"])


def test_default_mode_runs_the_same_eager_path(vllm_spec, tmp_path):
    """Without ``enforce_eager`` vLLM's CPU platform turns compilation off for any engine with LoRA
    (docs/vllm.md); the plugin gives the same tokens there."""
    spec = {**vllm_spec("llama", enforce_eager=False), "bad_adapters": {}}
    spec["requests"] = spec["requests"][:6]
    run = start_engine(spec, "torch_native", tmp_path, "default")()
    assert "'mode': <CompilationMode.NONE: 0>" in run["log"]  # vLLM's engine config line
    assert run["tokens"] == peft_tokens(spec["model"], spec["adapters"], spec["requests"], spec["max_tokens"])
