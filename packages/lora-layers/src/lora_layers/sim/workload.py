"""What ``lora-sim`` serves: the default model config and the request mix."""

from __future__ import annotations

from dataclasses import dataclass
from math import isfinite
from typing import Sequence

from ..models import TinyConfig

__all__ = ["DEFAULT_CONFIG", "DEFAULT_SCALES", "Workload", "default_workload"]

DEFAULT_CONFIG = TinyConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=2, fused=True, seed=0)
"""The default model: fused ``qkv_proj`` / ``gate_up_proj``, as serving engines load Llama."""


DEFAULT_SCALES = (1.0, 1.0, 0.5, 1.0, 1.5, 0.0)
"""The request scales of the default workload, by prompt: the second prompt is on the base
model (its scale has no delta to multiply); the others put an adapter at 1, 0.5, 1, 1.5 and 0
(0: the base model's output)."""


@dataclass(frozen=True)
class Workload:
    """One prefill of ``len(prompt_lens)`` prompts, then ``decode_steps`` greedy decode steps.

    ``adapters[i]`` is the adapter of prompt ``i`` (``None``: the base model) and
    ``scales[i]`` its request scale: the multiplier (finite, ``>= 0``) of the adapter's
    delta in every LoRA module, on top of the adapter's own scaling
    (``MultiLoRA.set_batch(..., scales=)``). Each decode step feeds one token per request
    and rotates the (adapter, scale) pairs by one request, so every step runs a different
    mix. ``seed`` seeds the prompt token ids (and the model's weights through its config).
    Requests name one adapter each: weighted mixes of several adapters in one request are
    not served by lora-kit yet, so no request here is one.
    """

    prompt_lens: tuple[int, ...] = (17, 5, 33, 9, 1, 24)
    adapters: tuple[str | None, ...] = ("r8", None, "r16", "r32-rslora", "r64-embed-head", "r8")
    scales: tuple[float, ...] = DEFAULT_SCALES
    decode_steps: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if not len(self.prompt_lens) == len(self.adapters) == len(self.scales):
            raise ValueError(f"prompt_lens, adapters and scales must have one entry per prompt; got "
                             f"{len(self.prompt_lens)}, {len(self.adapters)} and {len(self.scales)}")
        bad = [s for s in self.scales if not (isfinite(s) and s >= 0)]
        if bad:
            raise ValueError(f"scales must be finite and >= 0, got {bad[0]!r}")

    def requests(self) -> list[tuple[str | None, float]]:
        """Each prompt's (adapter, scale), in order: what a decode step rotates."""
        return list(zip(self.adapters, self.scales))


def default_workload(adapter_names: Sequence[str]) -> Workload:
    """The default request mix over ``adapter_names``: six prompts, the second on the
    base model, the other five cycling through the adapters in the given order, at the
    request scales of :data:`DEFAULT_SCALES` by prompt whatever the adapters are (a scale
    belongs to a request, not to an adapter); all six on the base model, at scale 1, when
    there is no adapter."""
    names = list(adapter_names)
    if not names:
        return Workload(adapters=(None,) * len(Workload.prompt_lens), scales=(1.0,) * len(Workload.prompt_lens))
    picks = [names[i % len(names)] for i in range(5)]
    return Workload(adapters=(picks[0], None, picks[1], picks[2], picks[3], picks[4]))
