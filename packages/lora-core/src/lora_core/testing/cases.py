"""Random test cases for LoRA ops, shared by every package's tests and benchmarks.

Cases follow the testing rules of the project: mixed ranks (0 and R included),
slot -1 requests, zero-length requests, several slices of unequal widths, and
large finite garbage beyond each slot's rank in A and B, so an op that reads
past a rank gives a visibly wrong answer.
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from ..batch_builder import build_batch_info
from ..batch_requests import validate_requests
from ..batch_info import BatchInfo
from ..layout import slice_offsets_from_widths

__all__ = [
    "GARBAGE",
    "TOLERANCES",
    "assert_close_to_reference",
    "random_requests",
    "random_scales",
    "random_mix",
    "random_ranks",
    "fill_linear_garbage",
    "fill_embedding_garbage",
    "fill_expand_input_garbage",
    "random_linear_weights",
    "random_embedding_weights",
    "default_scalings",
    "make_batch_info",
    "BatchPair",
    "random_batch_pair",
]

GARBAGE = 1.0e3
"""Value written beyond each slot's rank: large, finite in fp16/bf16."""

TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 2e-2),
}
"""(rtol, atol) against the fp32 reference, per dtype (docs/testing.md)."""


def assert_close_to_reference(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """Compare an op's output with fp32 reference math at the :data:`TOLERANCES` of ``dtype``
    (``actual``'s by default)."""
    dtype = dtype or actual.dtype
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.detach().float().cpu(), expected.float().cpu(), rtol=rtol, atol=atol)


def random_requests(
    rng: random.Random, num_tokens: int, num_slots: int, *, max_requests: int | None = None
) -> tuple[list[int], list[int | None]]:
    """Split ``num_tokens`` into requests (some of length 0) on random slots (some ``None``/-1)."""
    max_requests = max_requests or max(1, min(num_tokens, 12))
    n = rng.randint(1, max_requests)
    cuts = sorted(rng.randint(0, num_tokens) for _ in range(n - 1))
    seq_lens = [b - a for a, b in zip([0, *cuts], [*cuts, num_tokens])]
    slots: list[int | None] = []
    for _ in seq_lens:
        roll = rng.random()
        slots.append(None if roll < 0.1 else -1 if roll < 0.15 else rng.randrange(num_slots))
    return seq_lens, slots


def random_ranks(rng: random.Random, num_slots: int, max_rank: int) -> list[int]:
    """Mixed ranks: 1, ``max_rank`` and an empty slot (rank 0) whenever there is room."""
    fixed = [1, max_rank, 0][:num_slots]
    rest = [rng.randint(0, max_rank) for _ in range(num_slots - len(fixed))]
    ranks = fixed + rest
    rng.shuffle(ranks)
    return ranks


def fill_linear_garbage(a: torch.Tensor, b: torch.Tensor, lora_ranks: Sequence[int], num_slices: int,
                        value: float = GARBAGE) -> None:
    """Write ``value`` into A rows and B columns beyond each slot's rank (in place)."""
    R = b.shape[2]
    for slot, r in enumerate(lora_ranks):
        for i in range(num_slices):
            a[slot, i * R + r : (i + 1) * R] = value
        b[slot, :, r:] = value


def fill_embedding_garbage(a: torch.Tensor, b: torch.Tensor, lora_ranks: Sequence[int],
                           value: float = GARBAGE) -> None:
    """Embedding layout: garbage in A rows and B columns beyond each slot's rank."""
    for slot, r in enumerate(lora_ranks):
        a[slot, r:] = value
        b[slot, :, r:] = value


def fill_expand_input_garbage(y: torch.Tensor, lora_ranks: Sequence[int], num_slices: int,
                              *token_slots: Sequence[int | None], value: float = GARBAGE) -> torch.Tensor:
    """Write ``value`` into the expand input ``y (rows, c*R)`` beyond each row's rank in *every*
    slice (columns ``[i*R + r, (i+1)*R)`` of slice ``i``), in place, and return ``y``.

    ``r`` is the largest rank row ``t`` has in any of the batches ``token_slots`` (each the
    slot of every token, ``None``/-1 for none), so that no batch may read the garbage; rows
    without an adapter in every batch (slot -1, rank-0 slots, rows beyond a batch's tokens
    such as graph padding) get it in every column. A shrink output is zero there, which
    hides an expand that reads past a rank: this input does not."""
    rows, cR = y.shape
    R = cR // num_slices
    limit = torch.zeros(rows, dtype=torch.long)
    for slots in token_slots:
        for t, s in enumerate(list(slots)[:rows]):
            if s is not None and s >= 0:
                limit[t] = max(int(limit[t]), int(lora_ranks[s]))
    beyond = torch.arange(R).repeat(num_slices)[None, :] >= limit[:, None]
    return y.masked_fill_(beyond.to(y.device), value)


def random_linear_weights(
    gen: torch.Generator,
    *,
    num_slots: int,
    max_rank: int,
    in_features: int,
    slice_widths: Sequence[int],
    lora_ranks: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str,
    garbage: float | None = GARBAGE,
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """Random ``a (L, c*R, in)``, ``b (L, out, R)`` (unit-scale outputs) and the slice offsets."""
    offsets = slice_offsets_from_widths(slice_widths)
    c = len(slice_widths)
    a = torch.randn(num_slots, c * max_rank, in_features, generator=gen) / in_features**0.5
    b = torch.randn(num_slots, offsets[-1], max_rank, generator=gen) / max_rank**0.5
    if garbage is not None:
        fill_linear_garbage(a, b, lora_ranks, c, garbage)
    return a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype), offsets


def random_embedding_weights(
    gen: torch.Generator,
    *,
    num_slots: int,
    max_rank: int,
    vocab_total: int,
    embedding_dim: int,
    lora_ranks: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str,
    garbage: float | None = GARBAGE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random embedding ``a (L, R, V_total)`` and ``b (L, D, R)``."""
    a = torch.randn(num_slots, max_rank, vocab_total, generator=gen)
    b = torch.randn(num_slots, embedding_dim, max_rank, generator=gen) / max_rank**0.5
    if garbage is not None:
        fill_embedding_garbage(a, b, lora_ranks, garbage)
    return a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)


def default_scalings(num_slots: int) -> list[float]:
    """Distinct per-slot scalings for tests: ``0.5 + 0.25 * slot``."""
    return [0.5 + 0.25 * s for s in range(num_slots)]


def make_batch_info(
    seq_lens: Sequence[int],
    slot_ids: Sequence[int | None],
    lora_ranks: Sequence[int],
    *,
    device: torch.device | str,
    use_graph: bool = False,
    scalings: Sequence[float] | None = None,
    scales: Sequence[float] | None = None,
    with_scales: bool = False,
    max_pairs: int | None = None,
) -> BatchInfo:
    """A batch info with distinct per-slot scalings (``0.5 + 0.25 * slot`` by default) and the
    requests' ``scales``; in graph mode its capacity is exactly ``sum(seq_lens)`` tokens and
    ``max_pairs`` (default: the batch's own) (token, adapter) pairs."""
    scalings = list(scalings) if scalings is not None else default_scalings(len(lora_ranks))
    total = sum(seq_lens)
    if use_graph and max_pairs is None:
        max_pairs = total + validate_requests(seq_lens, slot_ids, len(lora_ranks)).num_pairs
    return build_batch_info(
        seq_lens, slot_ids, lora_ranks, scalings, device=device, use_graph=use_graph,
        max_tokens=total if use_graph else None, scales=scales, with_scales=with_scales,
        max_pairs=max_pairs if use_graph else None,
    )


def random_mix(rng: random.Random, num_slots: int) -> dict[int, float] | list[tuple[int, float]]:
    """A weighted mix of 1 to 3 distinct slots (weights 0, 1 or in (0, 1.5]), as a dict or a list of pairs."""
    slots = rng.sample(range(num_slots), rng.randint(1, min(3, num_slots)))
    pairs = [(slot, rng.choice([0.0, 1.0, round(rng.uniform(0.05, 1.5), 3)])) for slot in slots]
    return dict(pairs) if rng.random() < 0.5 else pairs


class BatchPair:
    """Two batches of the same token count on the same adapters, A and B: each
    ``(seq_lens, slot_ids)``, or ``(seq_lens, slot_ids, scales)`` with request scales (then
    both are built ``with_scales``, so a capture of A replays B's scales).

    :meth:`run` gives ``fn(batch_info, *inputs)`` batch A, then switches to batch B
    the way the device requires (a graph-mode batch info refilled in place on
    graph devices, a fresh eager one elsewhere) and runs again, through
    ``TestDevice.run_two_batches``. On graph devices it does so in both orders --
    capture A and replay B, then capture B and replay A -- so a replay that goes
    wrong only when the replayed batch has more (or fewer) segments or adapters than
    the captured one is caught whichever of A and B is the richer.
    :meth:`reference_infos` are eager CPU batch infos of A and B for the reference math.
    A slot id may be a weighted mix (``{slot: weight}``): then both are built ``with_scales``,
    and a graph-mode batch holds the pairs of the richer of A and B.
    """

    def __init__(
        self,
        lora_ranks: Sequence[int],
        batch_a: tuple[Sequence[int], Sequence[int | None]],
        batch_b: tuple[Sequence[int], Sequence[int | None]],
        scalings: Sequence[float] | None = None,
    ) -> None:
        if sum(batch_a[0]) != sum(batch_b[0]):
            raise ValueError(f"batches must have the same token count, got {sum(batch_a[0])} and {sum(batch_b[0])}")
        self.lora_ranks = list(lora_ranks)
        self.scalings = list(scalings) if scalings is not None else default_scalings(len(lora_ranks))
        self.batch_a, self.batch_b = batch_a, batch_b
        self.max_pairs = self.num_tokens + max(validate_requests(*batch[:2], len(self.lora_ranks)).num_pairs
                                               for batch in (batch_a, batch_b))
        self.with_scales = len(batch_a) > 2 or len(batch_b) > 2 or self.max_pairs > self.num_tokens or any(
            isinstance(slot, (dict, list, tuple)) for slot in (*batch_a[1], *batch_b[1]))

    @property
    def num_tokens(self) -> int:
        return sum(self.batch_a[0])

    def build(self, batch: tuple, device: torch.device | str, use_graph: bool = False) -> BatchInfo:
        seq_lens, slot_ids, *scales = batch
        return make_batch_info(seq_lens, slot_ids, self.lora_ranks, device=device, use_graph=use_graph,
                               scalings=self.scalings, scales=scales[0] if scales else None,
                               with_scales=self.with_scales, max_pairs=self.max_pairs if use_graph else None)

    def reference_infos(self) -> tuple[BatchInfo, BatchInfo]:
        return self.build(self.batch_a, "cpu"), self.build(self.batch_b, "cpu")

    def _run_from(self, device, fn, inputs, first, second) -> tuple:
        """``fn`` on ``first``, then (refilled, or rebuilt on eager devices) on ``second``."""
        holder = {"info": self.build(first, device.torch_device, use_graph=device.is_graph)}

        def refill() -> None:
            if device.is_graph:
                holder["info"].refill(*second)
            else:
                holder["info"] = self.build(second, device.torch_device)

        return device.run_two_batches(lambda *xs: fn(holder["info"], *xs), inputs, refill)

    def run(self, device, fn, *inputs):
        """``(out_a, out_b)`` of ``fn(batch_info, *inputs)`` on ``device`` (a ``TestDevice``).

        On a graph device ``out_b`` is B replayed on the capture made with A, and ``out_a``
        is A replayed on a second capture made with B; ``fn`` must therefore give the same
        result when called again on the same inputs (no accumulation into them).
        """
        out_a, out_b = self._run_from(device, fn, inputs, self.batch_a, self.batch_b)
        if device.is_graph:
            _, out_a = self._run_from(device, fn, inputs, self.batch_b, self.batch_a)
        return out_a, out_b


def random_scales(rng: random.Random, num_requests: int) -> list[float]:
    """A request scale each: 0 (the base model's output), 1, or a strength in (0, 2]."""
    return [rng.choice([0.0, 1.0, round(rng.uniform(0.05, 2.0), 3)]) for _ in range(num_requests)]


def random_batch_pair(rng: random.Random, num_tokens: int, lora_ranks: Sequence[int], *,
                      scaled: bool = False, mixed: bool = False) -> BatchPair:
    """Two different random request mixes over ``num_tokens`` tokens; ``scaled``: with random
    request scales (:func:`random_scales`); ``mixed``: about a third of the requests with a weighted
    mix of slots (:func:`random_mix`), and B with more mixed requests than A."""
    a = random_requests(rng, num_tokens, len(lora_ranks))
    b = random_requests(rng, num_tokens, len(lora_ranks))
    while b == a and num_tokens > 1:
        b = random_requests(rng, num_tokens, len(lora_ranks))
    if mixed:
        a, b = ((lens, [random_mix(rng, len(lora_ranks)) if rng.random() < share else slot for slot in slots])
                for (lens, slots), share in ((a, 0.3), (b, 0.5)))
    if scaled:
        a, b = (*a, random_scales(rng, len(a[0]))), (*b, random_scales(rng, len(b[0])))
    return BatchPair(lora_ranks, a, b)
