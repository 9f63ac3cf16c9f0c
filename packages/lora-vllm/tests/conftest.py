"""Fixtures for the tests that start real vLLM engines: tiny models, adapters and a workload
(engines run through lora_vllm.testing.start_engine, one subprocess each)."""

from __future__ import annotations

import random
from typing import Any, Callable

import pytest

MAX_TOKENS = 8
# vLLM's scheduler may hold 2 adapters at once: the workload's 5 adapters are swapped in and out.
ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=64, max_cpu_loras=2, enforce_eager=True, dtype="float32",
              max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, enable_chunked_prefill=True,
              enable_prefix_caching=True)


def workload(adapters: dict[str, str], seed: int = 0) -> list[dict[str, Any]]:
    """Two requests per adapter and two on the base model, interleaved; each adapter's first
    request and the base's share a 40-token prefix (prefix caching), prompts up to 60 tokens
    (chunked at 32 tokens a step)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    requests = []
    for j in range(2):
        for name in [*sorted(adapters), None]:
            prompt = (shared if j == 0 else []) + [rng.randrange(3, 512) for _ in range(rng.randint(4, 20))]
            requests.append({"prompt": prompt, "adapter": name})
    return requests


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory) -> Callable[[str], dict[str, Any]]:
    """``family -> {"model": dir, "adapters": {name: dir}, "bad_adapters": {name: dir}}``, written once."""
    from lora_vllm.testing import DEFAULT_ADAPTERS, AdapterSpec, write_adapters, write_model, write_tokenizer

    made: dict[str, dict[str, Any]] = {}

    def get(family: str) -> dict[str, Any]:
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            model = write_model(root / "model", family)
            write_tokenizer(model, 512)
            # vLLM takes LoRA on the embedding and LM head only for models that declare
            # `embedding_modules` (Llama does, Qwen2 does not: it refuses such an adapter at load)
            specs = DEFAULT_ADAPTERS if family == "llama" else tuple(
                s for s in DEFAULT_ADAPTERS if not {"embed_tokens", "lm_head"} & set(s.target_modules))
            adapters = write_adapters(model, root / "adapters", specs)
            bad = write_adapters(model, root / "bad", (AdapterSpec("rank-128", 128, ("q_proj",)),))
            made[family] = {"model": str(model), "adapters": {k: str(v) for k, v in adapters.items()},
                            "bad_adapters": {k: str(v) for k, v in bad.items()}}
        return made[family]

    return get


@pytest.fixture(scope="session")
def vllm_spec(vllm_models) -> Callable[..., dict[str, Any]]:
    """``(family, **engine_overrides) -> spec`` for lora_vllm.offline_run: the family's model and adapters,
    :data:`ENGINE` settings, the :func:`workload` and :data:`MAX_TOKENS`; ``bad_adapters`` is the
    rank-128 adapter."""

    def get(family: str, **engine_overrides: Any) -> dict[str, Any]:
        models = vllm_models(family)
        return {"model": models["model"], "engine": {**ENGINE, **engine_overrides}, "adapters": models["adapters"],
                "requests": workload(models["adapters"]), "max_tokens": MAX_TOKENS,
                "bad_adapters": models["bad_adapters"]}

    return get
