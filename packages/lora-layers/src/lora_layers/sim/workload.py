"""What ``lora-sim`` serves: the default model config and the request mix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..models import TinyConfig

__all__ = ["DEFAULT_CONFIG", "Workload", "default_workload"]

DEFAULT_CONFIG = TinyConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=2, fused=True, seed=0)
"""The default model: fused ``qkv_proj`` / ``gate_up_proj``, as serving engines load Llama."""


@dataclass(frozen=True)
class Workload:
    """One prefill of ``len(prompt_lens)`` prompts, then ``decode_steps`` greedy decode steps.

    ``adapters[i]`` is the adapter of prompt ``i`` (``None``: the base model).
    Each decode step feeds one token per request and rotates the adapter mix by
    one request, so every step runs a different mix. ``seed`` seeds the prompt
    token ids (and the model's weights through its config).
    """

    prompt_lens: tuple[int, ...] = (17, 5, 33, 9, 1, 24)
    adapters: tuple[str | None, ...] = ("r8", None, "r16", "r32-rslora", "r64-embed-head", "r8")
    decode_steps: int = 8
    seed: int = 0


def default_workload(adapter_names: Sequence[str]) -> Workload:
    """The default request mix over ``adapter_names``: six prompts, the second on the
    base model, the other five cycling through the adapters in the given order
    (all six on the base model when there is no adapter)."""
    names = list(adapter_names)
    if not names:
        return Workload(adapters=(None,) * len(Workload.prompt_lens))
    picks = [names[i % len(names)] for i in range(5)]
    return Workload(adapters=(picks[0], None, picks[1], picks[2], picks[3], picks[4]))
