"""What ``lora-sim`` serves: the default model config and the requests, a weighted mix among them."""

from __future__ import annotations

from dataclasses import dataclass
from math import isfinite
from typing import Collection, Sequence

from lora_core.batch_requests import parse_mix

from ..mixes import is_mix
from ..models import TinyConfig

__all__ = ["DEFAULT_CONFIG", "DEFAULT_SCALES", "MIX_WEIGHTS", "Entry", "Mix", "Workload", "default_workload",
           "mix_pairs", "request_entry"]

DEFAULT_CONFIG = TinyConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=2, fused=True, seed=0)
"""The default model: fused ``qkv_proj`` / ``gate_up_proj``, as serving engines load Llama."""


DEFAULT_SCALES = (1.0, 1.0, 0.5, 1.0, 1.5, 0.0, 0.8)
"""The request scales of the default workload, by prompt: the second prompt is on the base
model (its scale has no delta to multiply); the first and the third to sixth put an adapter at 1,
0.5, 1, 1.5 and 0 (0: the base model's output), the seventh a weighted mix at 0.8."""

MIX_WEIGHTS = (0.7, 0.4)
"""The weights of the default workload's mixed request (the seventh), by adapter: not summing to 1,
as nothing makes a mix's weights do."""

Mix = tuple[tuple[str, float], ...]
"""A weighted mix of adapters as a workload holds it, ``((name, weight), ...)`` (one of the forms
``MultiLoRA.set_batch`` takes; hashable, so a request can key its reference model)."""
Entry = str | None | Mix
"""A request's adapter: a name, ``None`` (the base model), or a weighted mix."""


def request_entry(name: str, entry: object) -> Entry:
    """``entry`` (an adapter name, ``None``, or a mix ``{name: weight}`` / ``[(name, weight), ...]``)
    as a workload holds it, checked; ``ValueError`` naming ``name`` for an empty mix, a name that is
    not a string or is named twice, or a weight that is not finite or is negative."""
    if entry is None or isinstance(entry, str):
        return entry
    if not is_mix(entry):
        raise ValueError(f"{name} must be an adapter name, None or a weighted mix {{name: weight}}, got {entry!r}")
    items = parse_mix(name, entry)
    if not all(isinstance(adapter, str) for adapter, _ in items):
        raise ValueError(f"{name}: a mix names adapters by their names, got {entry!r}")
    return tuple(items)


def mix_pairs(entry: Entry) -> Mix:
    """A request's adapters and their weights: ``()`` for the base model, ``((name, 1.0),)`` for one
    adapter, a mix's ``((name, weight), ...)`` as it is. The request gets ``scale * sum_i w_i * delta_i``."""
    if entry is None:
        return ()
    return ((entry, 1.0),) if isinstance(entry, str) else entry


@dataclass(frozen=True)
class Workload:
    """One prefill of ``len(prompt_lens)`` prompts, then ``decode_steps`` greedy decode steps.

    ``adapters[i]`` is the adapter of prompt ``i`` (``None``: the base model), or a weighted mix of
    adapters (``{name: weight}`` or ``[(name, weight), ...]``, held as a :data:`Mix`), and
    ``scales[i]`` its request scale: the multiplier (finite, ``>= 0``) of the adapter's delta in
    every LoRA module, on top of the adapter's own scaling (``MultiLoRA.set_batch(..., scales=)``);
    a mix's request gets ``scale * sum_i w_i * delta_i``. Each decode step feeds one token per request
    and rotates the (adapter, scale) pairs by one request, so every step runs a different batch.
    ``seed`` seeds the prompt token ids (and the model's weights through its config).
    """

    prompt_lens: tuple[int, ...] = (17, 5, 33, 9, 1, 24, 12)
    adapters: tuple[Entry, ...] = ("r8", None, "r16", "r32-rslora", "r64-embed-head", "r8",
                                   tuple(zip(("r32-rslora", "r64-embed-head"), MIX_WEIGHTS)))
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
        entries = tuple(request_entry(f"adapters[{i}]", a) for i, a in enumerate(self.adapters))
        object.__setattr__(self, "adapters", entries)  # frozen: the mixes as hashable Mix

    def requests(self) -> list[tuple[Entry, float]]:
        """Each prompt's (adapter or mix, scale), in order: what a decode step rotates."""
        return list(zip(self.adapters, self.scales))

    def pairs(self, seq_lens: Sequence[int]) -> int:
        """The (token, adapter) pairs of a batch of the requests with ``seq_lens[i]`` tokens for request
        ``i``: one per token, and ``n * (k - 1)`` more for a request of ``n`` tokens mixing ``k``
        adapters (its pair rows); what a graph-mode batch of those requests needs as ``max_pairs``.
        The same total in any rotation of requests of equal lengths, such as the decode steps'."""
        return sum(n * max(1, len(mix_pairs(a))) for n, a in zip(seq_lens, self.adapters))


def default_workload(adapter_names: Sequence[str], unmixable: Collection[str] = ()) -> Workload:
    """The default requests over ``adapter_names``: seven prompts, the second on the base model,
    the first and the third to sixth cycling through the adapters in the given order, the seventh a
    weighted mix of the last two adapters that can be mixed (not in ``unmixable``: DoRA adapters,
    adapters with ``modules_to_save``), at :data:`MIX_WEIGHTS`; with fewer than two of those, the
    seventh is the last mixable adapter (or, with none, the last adapter) alone at the first weight,
    a mix of one. The request scales are :data:`DEFAULT_SCALES` by prompt whatever the adapters are
    (a scale belongs to a request, not to an adapter); all seven prompts are on the base model, at
    scale 1, when there is no adapter."""
    names = list(adapter_names)
    count = len(Workload.prompt_lens)
    if not names:
        return Workload(adapters=(None,) * count, scales=(1.0,) * count)
    picks = [names[i % len(names)] for i in range(5)]
    mixed = [n for n in names if n not in unmixable][-2:] or names[-1:]
    return Workload(adapters=(picks[0], None, picks[1], picks[2], picks[3], picks[4],
                              tuple(zip(mixed, MIX_WEIGHTS))))
