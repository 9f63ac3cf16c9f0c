"""One backend x device row of ``lora-sim``, and the run over all of them.

A row serves the workload through :class:`~lora_layers.MultiLoRA` on one backend
and device, each request at its request scale (a weighted mix of adapters among them), checks
every output against the fp32 reference with the request's adapter, or mix, merged at that scale
(:mod:`.reference`) at the fp32 tolerance of ``lora_core.testing.TOLERANCES``, relative to the outputs' magnitude
(:class:`~lora_layers.sim.reference.ScaledCheck`) (docs/layout.md), and times the model with LoRA against the base model in
interleaved rounds (:mod:`lora_core.testing.timing`).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from lora_core.testing import (
    CaptureError,
    CompileCapture,
    compile_capture,
    count_launches,
    device_type,
    fastest_compile_backend,
    make_device,
    probe_device,
)

from ..models import TinyConfig, TinyDecoder
from .errors import UsageError
from .quantize import QUANTIZATIONS, Quantization, dequantized_model, quantize_model
from .reference import ReferenceKey, ScaledCheck, merged_reference_models, reference_keys, reference_logits
from .serving import AdapterSources, build_multilora, load_adapters
from lora_core.testing.timing import Interleaved, Spread, sync_device
from .workload import Entry, Workload

__all__ = ["COMPILE_BACKENDS", "ROUNDS", "SimRow", "check_compile_backend", "compile_backend_for", "run_row",
           "run_simulation"]

ROUNDS = 5
"""Timed rounds per phase (prefill, decode) by default."""
COMPILE_BACKENDS = ("auto", "inductor", "aot_eager")
"""``--compile-backend`` choices: ``auto`` is :func:`~lora_core.testing.fastest_compile_backend`'s pick."""
Request = tuple[Entry, float]
"""A request of the workload: its adapter (``None``: the base model) or weighted mix, and its request scale."""


def compile_backend_for(choice: str, device_type: str) -> tuple[str, str]:
    """The ``torch.compile`` backend a compile row uses on ``device_type`` for ``choice`` (one of
    :data:`COMPILE_BACKENDS`), and why; ``ValueError`` when ``inductor`` is asked for where it
    cannot generate code."""
    if choice not in COMPILE_BACKENDS:
        raise ValueError(f"compile backend must be one of {', '.join(COMPILE_BACKENDS)}, got {choice!r}")
    fastest, why = fastest_compile_backend(device_type)
    if choice == "auto":
        return fastest, why
    if choice == "inductor" and fastest != "inductor":
        raise ValueError(f"inductor cannot compile for {device_type} here ({why})")
    return choice, "asked for"


def check_compile_backend(choice: str | None, devices: Sequence[str]) -> str:
    """``--compile-backend`` (``None``: ``auto``), checked against the compile devices of ``devices``
    that are present: :class:`UsageError` where ``inductor`` cannot compile for one."""
    choice = choice or "auto"
    kinds = [device_type(name) for name in devices] if choice == "inductor" else []
    for kind in kinds:
        if isinstance(kind, CompileCapture) and probe_device(kind.name).available:
            try:
                compile_backend_for(choice, torch.device(kind.torch_device).type)
            except ValueError as err:
                raise UsageError(f"--compile-backend inductor: {err}") from None
    return choice


@dataclass
class SimRow:
    """The result of one backend on one device.

    ``status`` is ``"pass"`` (every output within tolerance), ``"fail"`` (one is
    not, or graph capture failed: ``reason``), ``"skipped"`` (the device is absent:
    ``reason``) or ``"error"`` (the run raised: ``reason``). The three timed
    figures are :class:`~lora_core.testing.timing.Spread` over rounds: prefill tokens/s,
    decode tokens/s (from each round's median step) and the LoRA overhead
    ``(prefill + one decode step) / (the same on the base model) - 1``.
    ``details["seconds"]`` holds the raw per-round seconds. On a compile device
    (``cpu-compile``, ``cuda-compile``) the decode step is ``torch.compile(fullgraph=True)``
    and ``compiled_decode`` says how it went: ``{"backend", "why", "compile_s", "compiles",
    "recompiles", "steps"}`` (the compile backend and why it was chosen, the seconds of the
    first call, which compiles, warm-up included; graphs compiled, compiles after the first,
    compiled steps served; any recompile fails the row, so a row that ran has 1 and 0), and
    ``decode_tokens_per_s`` is the compiled step's. ``quantize`` is the ``--quantize`` choice
    the base model's decoder projections were served in (``"none"``: fp32).
    ``max_abs_error`` is the largest absolute error of every output checked,
    ``max_abs_error_by_request`` each request's (by prompt, the mixed request's among them) over the
    outputs it had: its prefill row and its row of every decode step.
    """

    backend: str
    device: str
    status: str
    reason: str = ""
    quantize: str = "none"
    max_abs_error: float | None = None
    max_abs_error_by_request: list[float] | None = None
    tolerance: str = ""
    prefill_tokens_per_s: Spread | None = None
    decode_tokens_per_s: Spread | None = None
    lora_overhead: Spread | None = None
    launches_per_decode_step: int | None = None
    graph_safety: str = ""
    compiled_decode: dict | None = None
    details: dict = field(default_factory=dict)


def _forward_prefill(model: TinyDecoder, ids: torch.Tensor, last_rows: torch.Tensor) -> torch.Tensor:
    """Prefill with LM-head pruning: the head sees the last token of each prompt only."""
    return model.lm_head(model.model(ids).index_select(0, last_rows))


def _replayer(static_out: torch.Tensor, replay: Callable[[], None]) -> Callable[[], torch.Tensor]:
    """A decode step on a graph device: replay the capture, return its static output."""

    def step() -> torch.Tensor:
        replay()
        return static_out

    return step


def _chunks(values: Sequence[float], size: int) -> list[list[float]]:
    return [list(values[i : i + size]) for i in range(0, len(values), size)]


def _figures(tokens: int, requests: int, prefill: Mapping[str, list[float]],
             decode: Mapping[str, list[list[float]]]) -> dict[str, Spread]:
    """Per-round figures from per-round seconds (round ``r`` of prefill pairs with round ``r`` of decode)."""
    step = [statistics.median(r) for r in decode["lora"]]
    base_step = [statistics.median(r) for r in decode["base"]]
    overhead = [(p + s) / (bp + bs) - 1 for p, s, bp, bs in zip(prefill["lora"], step, prefill["base"], base_step)]
    return {"prefill_tokens_per_s": Spread.of([tokens / s for s in prefill["lora"]]),
            "decode_tokens_per_s": Spread.of([requests / s for s in step]),
            "lora_overhead": Spread.of(overhead)}


def _time_prefill(model: TinyDecoder, base_model: TinyDecoder, ids: torch.Tensor, last_rows: torch.Tensor,
                  want: torch.Tensor, rounds: int, sync: Callable[[], None],
                  check: ScaledCheck) -> tuple[torch.Tensor, Interleaved]:
    """A warm-up prefill of each model, then ``rounds`` interleaved rounds; returns the
    LoRA model's warm-up logits and the timer. Each LoRA output (a row per request, its last
    token's) is checked against ``want``."""
    calls = {"lora": lambda: _forward_prefill(model, ids, last_rows),
             "base": lambda: _forward_prefill(base_model, ids, last_rows)}
    logits = calls["lora"]()
    calls["base"]()
    order = list(range(len(last_rows)))
    check(logits, want, order)
    timer = Interleaved(["lora", "base"], sync)
    for _ in range(rounds):
        check(timer.round(calls)["lora"], want, order)
    return logits, timer


def _time_decode(steps: Mapping[str, Callable[[], torch.Tensor]], step_ids: torch.Tensor, first_ids: torch.Tensor,
                 set_batch: Callable[[list[Request]], object], want: Callable[[torch.Tensor, list], torch.Tensor],
                 requests: Sequence[Request], decode_steps: int, rounds: int, sync: Callable[[], None],
                 check: ScaledCheck) -> Interleaved:
    """A warm-up step of each model, then ``rounds`` rounds of ``decode_steps`` greedy
    steps from ``first_ids`` (written into the static input ``step_ids``), the (adapter,
    scale) pairs of ``requests`` rotated by one request each step; the two models
    interleaved step by step. Each output row is checked as its request's."""
    for fn in steps.values():
        fn()
    timer = Interleaved(["lora", "base"], sync)
    for _ in range(rounds):
        step_ids.copy_(first_ids)
        order = list(range(len(requests)))  # row j of a step: request order[j]
        for _ in range(decode_steps):
            order = order[1:] + order[:1]  # a different batch every step
            rotated = [requests[i] for i in order]
            set_batch(rotated)
            out = timer.round(steps)["lora"]
            check(out, want(step_ids.cpu(), rotated), order)
            step_ids.copy_(out.argmax(-1))
    return timer


def run_row(backend: str, device_name: str, config: TinyConfig, adapters: AdapterSources,
            workload: Workload, references: Mapping[ReferenceKey, TinyDecoder], rounds: int = ROUNDS,
            compile_backend: str = "auto", quantization: Quantization = QUANTIZATIONS["none"]) -> SimRow:
    """Serve ``workload`` with ``backend`` on device ``device_name`` and check and time it.

    Every batch gives each request's adapter or weighted mix and its scale (``workload.adapters``,
    ``workload.scales``), so eager batches apply them and graph mode takes them
    (``enable_graph(..., scales=True, max_pairs=)``, ``max_pairs`` the decode batch's (token,
    adapter) pairs, :meth:`Workload.pairs`, so the mix's pair rows fit). Prefill (eager in every
    mode: its batch holds exactly its pairs), then ``rounds`` rounds of the LoRA and the base model,
    interleaved. Decode: on graph devices the step is captured (on compile devices compiled) once,
    with the batch in graph mode; then ``rounds`` rounds of ``workload.decode_steps`` greedy steps
    from the prefill's tokens, a different order of (adapter, scale) each step, the LoRA and
    the base model interleaved step by step. Every timed output is checked against
    ``references``, which must hold the merged model of every (adapter or mix, scale) of the
    workload (:func:`~lora_layers.sim.reference.merged_reference_models`). ``compile_backend``: see
    :func:`compile_backend_for`. ``quantization``: the base model's decoder projections are
    quantized on the host (:func:`~lora_layers.sim.quantize.quantize_model`) before it moves to
    the device; ``references`` must then hold its dequantized weights (:func:`run_simulation`); on
    the graph simulator a quantization it cannot judge is a ``"skipped"`` row saying why.
    """
    probe = probe_device(device_name)
    if not probe.available:
        return SimRow(backend, device_name, "skipped", reason=probe.reason, quantize=quantization.name)
    device = make_device(device_name)
    if device.simulated and quantization.not_simulated:
        return SimRow(backend, device_name, "skipped", reason=quantization.not_simulated, quantize=quantization.name)
    dev = device.torch_device
    sync = sync_device(torch.device(dev).type)
    torch.manual_seed(workload.seed)
    model = quantize_model(TinyDecoder(config), quantization).to(dev)
    base_model = copy.deepcopy(model)
    mlora = build_multilora(model, config, adapters, backend)

    gen = torch.Generator().manual_seed(workload.seed)
    lens, adapters, scales = list(workload.prompt_lens), list(workload.adapters), list(workload.scales)
    requests = workload.requests()
    B = len(lens)
    prompt_ids = torch.randint(0, config.vocab_size, (sum(lens),), generator=gen)
    last_rows = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(B)])
    check = ScaledCheck()
    wanted: dict[tuple, torch.Tensor] = {}  # rounds repeat the same steps: one reference per input

    def want_step(ids: torch.Tensor, mix: list[Request]) -> torch.Tensor:
        key = (tuple(ids.tolist()), tuple(mix))
        if key not in wanted:
            wanted[key] = reference_logits(references, ids, [1] * B, mix, last_only=False)
        return wanted[key]

    with torch.no_grad():
        mlora.set_batch(lens, adapters, scales)
        want = reference_logits(references, prompt_ids, lens, requests, last_only=True)
        logits, prefill = _time_prefill(model, base_model, prompt_ids.to(dev), last_rows.to(dev), want, rounds,
                                        sync, check)
        first_ids = logits.argmax(-1)
        step_ids = first_ids.clone()
        if device.is_graph:
            mlora.enable_graph(B, scales=True, max_pairs=workload.pairs([1] * B))
        mlora.set_batch([1] * B, adapters, scales)
        launches = count_launches(model, step_ids).ops
        step, verdict, compiled = (lambda: model(step_ids)), "eager", None
        if isinstance(device.device_type, CompileCapture):
            compiler, why = compile_backend_for(compile_backend, torch.device(dev).type)
            started = time.perf_counter()
            static_out, replay = compile_capture(model, step_ids, backend=compiler, sync=sync)
            compiled = {"backend": compiler, "why": why, "compile_s": time.perf_counter() - started}
            step, verdict = _replayer(static_out, replay), f"compiled (fullgraph, {compiler})"
        elif device.is_graph:
            try:
                static_out, replay = device.capture(model, step_ids)
            except CaptureError as err:
                return SimRow(backend, device_name, "fail", reason=str(err), graph_safety=f"unsafe: {err}",
                              quantize=quantization.name)
            step = _replayer(static_out, replay)
            verdict = "safe (strict simulated capture)" if device.simulated else "captured"
        decode = _time_decode({"lora": step, "base": lambda: base_model(step_ids)}, step_ids, first_ids,
                              lambda mix: mlora.set_batch([1] * B, [a for a, _ in mix], [s for _, s in mix]),
                              want_step, requests,
                              workload.decode_steps, rounds, sync, check)
    mlora.unwrap()
    if compiled is not None:
        compiled.update(compiles=replay.compiles, recompiles=replay.recompiles, steps=replay.replays)
    seconds = {"prefill": prefill.samples,
               "decode_step": {k: _chunks(v, workload.decode_steps) for k, v in decode.samples.items()}}
    return SimRow(backend, device_name, "pass" if check.ok else "fail", quantize=quantization.name,
                  max_abs_error=check.max_error, max_abs_error_by_request=check.max_error_by_request,
                  tolerance=check.tolerance, launches_per_decode_step=launches, graph_safety=verdict,
                  compiled_decode=compiled, details={"rounds": rounds, "seconds": seconds},
                  **_figures(sum(lens), B, prefill.samples, seconds["decode_step"]))


def run_simulation(backends: Sequence[str], devices: Sequence[str], config: TinyConfig,
                   adapters: AdapterSources, workload: Workload, progress: bool = True,
                   rounds: int = ROUNDS, compile_backend: str = "auto",
                   quantization: Quantization = QUANTIZATIONS["none"]) -> list[SimRow]:
    """One :func:`run_row` per backend x device, in that order; a row that raises
    ``ValueError``/``RuntimeError``/``TypeError`` becomes an ``"error"`` row.

    The fp32 references are one model per (adapter or mix, request scale) of ``workload`` and the
    unmerged one. ``quantization``: every row serves a base quantized with it, and the references are
    built from that base's dequantized weights (:func:`~lora_layers.sim.quantize.dequantized_model`).

    ``progress``: a line on stderr when the fp32 references are built and one per row as
    it finishes (``lora-sim: [3/16] ascend / cpu-compile: pass, 4.1 s``); on a terminal
    the row's line shows while it runs.
    """
    jobs = [(b, d) for b in backends for d in devices]
    say = _Progress(len(jobs)) if progress else None
    loaded = load_adapters(adapters)  # each adapter read once per run, whatever number of rows
    if say:
        base = "" if quantization.name == "none" else f" from the dequantized {quantization.name} base"
        say.line(f"building {len(reference_keys(workload.requests()))} fp32 reference models{base}")
    references = merged_reference_models(dequantized_model(quantize_model(TinyDecoder(config), quantization)),
                                         loaded, workload.requests())
    rows = []
    for backend, device_name in jobs:
        if say:
            say.start(f"{backend} / {device_name}" + ("" if quantization.name == "none" else
                                                      f" ({quantization.name} base)"))
        try:
            rows.append(run_row(backend, device_name, config, loaded, workload, references, rounds,
                                compile_backend, quantization))
        except (ValueError, RuntimeError, TypeError) as err:
            rows.append(SimRow(backend, device_name, "error", reason=f"{type(err).__name__}: {err}",
                               quantize=quantization.name))
        if say:
            row = rows[-1]
            say.finish(row.status if row.status == "pass" else f"{row.status}: {row.reason}"[:100])
    if say:
        say.line(f"{len(rows)} rows in {say.elapsed():.1f} s")
    return rows


class _Progress:
    """``lora-sim``'s progress lines on stderr: one per row, written when it finishes
    (on a terminal its label shows from the start and the line is completed in place)."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.started = self.row_started = time.perf_counter()
        self.label = ""
        self.tty = sys.stderr.isatty()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def line(self, text: str) -> None:
        print(f"lora-sim: {text}", file=sys.stderr, flush=True)

    def _prefix(self) -> str:
        width = len(str(self.total))
        return f"lora-sim: [{self.done + 1:>{width}}/{self.total}] {self.label}"

    def start(self, label: str) -> None:
        self.label, self.row_started = label, time.perf_counter()
        if self.tty:
            print(f"{self._prefix()} ...", end="", file=sys.stderr, flush=True)

    def finish(self, result: str) -> None:
        text = f"{self._prefix()}: {result}, {time.perf_counter() - self.row_started:.1f} s"
        print(f"\r{text}" if self.tty else text, file=sys.stderr, flush=True)
        self.done += 1
