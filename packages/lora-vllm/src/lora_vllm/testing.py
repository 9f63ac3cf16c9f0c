"""Tiny models, PEFT adapters and a tokenizer written to a directory, for tests and benchmarks
that start a real vLLM engine without downloading anything; and the engine runner they use
(:func:`start_engine`, over :mod:`lora_vllm.offline_run`). Test and benchmark tools, not part
of the plugin: nothing the plugin runs in vLLM imports them.

Needs ``transformers`` and ``peft`` (and ``tokenizers`` for :func:`write_tokenizer`), which
a vLLM environment has; imported only when called.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["ALL_LINEAR", "AdapterSpec", "DEFAULT_ADAPTERS", "FAMILIES", "engine_env", "peft_tokens", "start_engine",
           "write_adapters", "write_model", "write_tokenizer"]

ENGINE_TIMEOUT_S = 900

# Decoder families vLLM's CPU build runs; sizes keep a head dimension its CPU attention supports (64).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
}

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class AdapterSpec:
    """One PEFT LoRA adapter: ``LoraConfig`` arguments (``init_lora_weights=False``: random A and B)."""

    name: str
    r: int
    target_modules: tuple[str, ...]
    lora_alpha: int | None = None
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)

    def lora_config(self) -> Any:
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.lora_alpha or 2 * self.r, target_modules=list(self.target_modules),
                          use_rslora=self.use_rslora, rank_pattern=dict(self.rank_pattern), init_lora_weights=False)


DEFAULT_ADAPTERS = (
    AdapterSpec("qv-r8", 8, ("q_proj", "v_proj")),
    AdapterSpec("attn-r16-rslora", 16, ("q_proj", "k_proj", "v_proj", "o_proj"), lora_alpha=8, use_rslora=True),
    AdapterSpec("all-linear-r32", 32, tuple(ALL_LINEAR)),
    AdapterSpec("pattern-r12", 12, ("q_proj", "v_proj", "up_proj", "down_proj"),
                rank_pattern={"v_proj": 4, "down_proj": 24}),
    AdapterSpec("embed-head-r8", 8, ("embed_tokens", "lm_head", "q_proj")),
)


def write_model(path: str | Path, family: str = "llama", *, seed: int = 0, hidden_size: int = 128,
                intermediate_size: int = 256, num_hidden_layers: int = 2, num_attention_heads: int = 2,
                num_key_value_heads: int = 1, vocab_size: int = 512, max_position_embeddings: int = 512,
                initializer_range: float = 0.1) -> Path:
    """A randomly initialised causal LM of ``family`` (:data:`FAMILIES`) saved to ``path`` in float32."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    config = AutoConfig.for_model(
        FAMILIES[family]["model_type"], hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, initializer_range=initializer_range,
        tie_word_embeddings=False, dtype="float32", bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = Path(path)
    model.save_pretrained(path)
    return path


def write_adapters(model_path: str | Path, out_dir: str | Path, specs: tuple[AdapterSpec, ...] = DEFAULT_ADAPTERS,
                   *, seed: int = 0) -> dict[str, Path]:
    """Each spec's adapter on the model at ``model_path``, saved with PEFT under ``out_dir/<name>``."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    paths = {}
    for i, spec in enumerate(specs):
        torch.manual_seed(seed * 1000 + i)
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        peft_model = get_peft_model(base, spec.lora_config())
        paths[spec.name] = Path(out_dir) / spec.name
        peft_model.save_pretrained(paths[spec.name])
    return paths


def write_tokenizer(path: str | Path, vocab_size: int) -> Path:
    """A word-level tokenizer over the words ``t0`` ... ``t{vocab_size - 1}`` (ids = the numbers;
    ``t0`` unknown, ``t1`` begin, ``t2`` end), saved into the model directory ``path`` for ``vllm serve``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    path = Path(path)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "bos_token": "t1", "eos_token": "t2",
        "model_max_length": 4096}))
    return path


def engine_env(backend: str | None) -> dict[str, str]:
    """The environment of an engine subprocess: vLLM's own LoRA path, or the plugin on ``backend``."""
    env = {k: v for k, v in os.environ.items() if k != "LORA_KIT_VLLM_BACKEND"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    # offline_run sends its probes (which wrapper, timers) to the worker as functions, which vLLM
    # pickles only with this set: a test and benchmark process, never a server's setting.
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if backend is not None:
        env["LORA_KIT_VLLM_BACKEND"] = backend
    return env


def start_engine(spec: dict[str, Any], backend: str | None, workdir: Path, tag: str) -> Callable[[], dict[str, Any]]:
    """Start one engine subprocess (:mod:`lora_vllm.offline_run`) on ``spec``, in ``workdir``; the returned
    function waits for it and gives its result (the run's JSON plus ``log``, everything the process printed)."""
    spec_path, out_path, log_path = (workdir / f"{tag}.{ext}" for ext in ("spec.json", "out.json", "log"))
    spec_path.write_text(json.dumps(spec))
    log = open(log_path, "w")
    command = [sys.executable, "-m", "lora_vllm.offline_run", str(spec_path), str(out_path)]
    proc = subprocess.Popen(command, env=engine_env(backend),
                            stdout=log, stderr=subprocess.STDOUT, cwd=workdir)

    def wait() -> dict[str, Any]:
        try:
            code = proc.wait(timeout=ENGINE_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        text = log_path.read_text()
        if code != 0:
            raise AssertionError(f"engine {tag} exited {code}; its output ends:\n{text[-4000:]}")
        return {**json.loads(out_path.read_text()), "log": text}

    return wait


def peft_tokens(model_dir: str, adapters: dict[str, str], requests: list[dict[str, Any]],
                max_tokens: int) -> list[list[int]]:
    """Greedy tokens of each request run alone by transformers + PEFT on the same weights (float32)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = sorted(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.eval()
    out = []
    with torch.no_grad():
        for request in requests:
            ids = torch.tensor([request["prompt"]])
            kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            if request["adapter"] is None:
                with model.disable_adapter():
                    generated = model.generate(input_ids=ids, **kwargs)
            else:
                model.set_adapter(request["adapter"])
                generated = model.generate(input_ids=ids, **kwargs)
            out.append(generated[0, ids.shape[1]:].tolist())
    return out
