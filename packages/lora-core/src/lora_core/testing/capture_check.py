"""The capture check: every graph-capture violation of one call, grouped and counted.

Where the ``cpu-graphsim`` device stops at the first capture-unsafe call, the capture
check records one whole capture with a lenient :class:`~.graphsim.GraphSimulator` and
reports everything it saw: each rule broken, the op, and the file:line of the code that
made the call (the innermost frame outside torch and this package), with how often.

From Python::

    report = check_capture(fn, *inputs)
    print(report.format())

From the command line (``lora-capture-check`` or ``python -m lora_core.testing.capture_check``)::

    lora-capture-check --call mypkg.mymodule:step          # a function taking no arguments
    lora-capture-check --call mypkg.mymodule:step --host-resident offsets_cpu   # CPU metadata it reads
    lora-capture-check --model-config path/to/config.json  # a transformers causal LM forward,
                                                           # random weights from the config

Exit status: 0 when the capture is clean, 1 when it found violations (or the call
raised under capture), 2 on bad arguments. What each rule means on a real CUDA graph,
and the check's false positives and negatives: docs/graph-simulator.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .graphsim import GraphSimulator
from .rules import Violation, call_site
from .timing import positive_int

__all__ = ["CaptureReport", "Finding", "check_capture", "transformers_forward", "main"]


@dataclass(frozen=True)
class Finding:
    """One place that broke one rule: ``rule``, ``op``, ``where`` (file:line in function), ``count`` times."""

    rule: str
    op: str
    where: str
    count: int


def _short(where: str) -> str:
    """``where`` with its path shortened: below ``site-packages/``, or relative to the working directory."""
    path, sep, rest = where.partition(":")
    if "site-packages" + os.sep in path:
        path = path.split("site-packages" + os.sep, 1)[1]
    else:
        try:
            rel = os.path.relpath(path)
            path = rel if not rel.startswith("..") else path
        except ValueError:
            pass
    return f"{path}{sep}{rest}"


@dataclass(frozen=True)
class CaptureReport:
    """What one capture check found.

    ``target``: what was checked; ``findings``: every (rule, op, where) with its count, in
    the order first seen; ``ops``: aten ops recorded (what a replay would launch, views
    included); ``aborted``: the exception the call raised under capture, if it did (the
    findings then cover the part that ran).
    """

    target: str
    findings: tuple[Finding, ...]
    ops: int
    aborted: str | None = None

    @property
    def violations(self) -> int:
        """Capture-unsafe calls in all (a call in a loop counts each time)."""
        return sum(f.count for f in self.findings)

    @property
    def clean(self) -> bool:
        return not self.findings and self.aborted is None

    def by_rule(self) -> dict[str, list[Finding]]:
        """The findings grouped by rule, rules in the order first seen."""
        groups: dict[str, list[Finding]] = {}
        for finding in self.findings:
            groups.setdefault(finding.rule, []).append(finding)
        return groups

    def format(self) -> str:
        """The report as text: a summary line, then each rule with its places and counts."""
        groups = self.by_rule()
        lines = [f"capture check: {self.target}",
                 f"recorded {self.ops} aten ops; {self.violations} capture-unsafe call(s) at "
                 f"{len(self.findings)} place(s), {len(groups)} rule(s)"]
        if self.aborted:
            lines.append(f"the call raised under capture (findings cover what ran before): {self.aborted}")
        for rule, findings in groups.items():
            lines += ["", f"{rule}  [{sum(f.count for f in findings)}]"]
            lines += [f"  {f.count:>3}x  {f.op:<34} {_short(f.where)}" for f in findings]
        if self.clean:
            lines += ["", "no capture-unsafe calls: the simulator saw nothing a graph capture would bake in"]
        return "\n".join(lines) + "\n"


def _findings(violations: Sequence[Violation]) -> tuple[Finding, ...]:
    counts = Counter((v.rule, v.op, v.where) for v in violations)
    return tuple(Finding(rule, op, where, n) for (rule, op, where), n in counts.items())


def check_capture(fn: Callable[..., Any], *inputs: Any, host_resident: Sequence[torch.Tensor] = (),
                  warm_up: bool = True, target: str | None = None) -> CaptureReport:
    """Capture ``fn(*inputs)`` once on the lenient graph simulator and report every violation.

    ``warm_up``: run ``fn`` eagerly first (as the graph harnesses do), so lazy set-up is not
    counted, and capture it a second time to compare what the two captures baked in (host
    data that changes between calls: "stale host state"); ``host_resident``: tensors that live in host memory on real hardware (their
    reads are allowed); ``target``: the name in the report (``fn``'s qualified name by default).
    An exception raised under capture is reported as ``aborted``, not raised.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    name = target or f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    if warm_up:
        failed = _warm_up(fn, inputs)
        if failed is not None:
            return CaptureReport(name, (failed,), 0)
    sim = GraphSimulator(strict=False, host_resident=host_resident)
    aborted = None
    try:
        sim.capture(fn, *inputs)
    except Exception as exc:  # the report says where the capture stopped
        aborted = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    findings = _findings(sim.violations)
    if aborted is None and warm_up:  # without a warm-up the first capture holds first-call set-up too
        findings += _second_capture_differs(fn, inputs, host_resident, sim.recorded_ops())
    return CaptureReport(name, findings, sim.num_ops, aborted)


def _second_capture_differs(fn: Callable[..., Any], inputs: tuple, host_resident: Sequence[torch.Tensor],
                            first: list[tuple[str, tuple]]) -> tuple[Finding, ...]:
    """Capture ``fn`` again and compare what the two captures baked in. A call that reads host
    data which changes from call to call (a Python list or counter, the next request's length)
    records other shapes or constants the second time: a real graph would replay the first
    call's values on every step. In-place updates of tensors do not show here (the same ops
    on the same shapes), so a step that writes its buffers is not flagged."""
    again = GraphSimulator(strict=False, host_resident=host_resident)
    try:
        again.capture(fn, *inputs)
    except Exception as exc:  # the first capture ran: the second one failing is the same kind of finding
        message = str(exc).splitlines()[0] if str(exc) else ""
        return (Finding("stale host state: a second capture of the call raised "
                        f"({type(exc).__name__}: {message}) where the first did not", type(exc).__name__,
                        "second capture", 1),)
    second = again.recorded_ops()
    for i, (a, b) in enumerate(zip(first, second)):
        if a != b:
            return (Finding(f"stale host state: a second capture recorded other constants or shapes at op {i + 1} "
                            f"of {len(first)} ({a[0]}): the call reads host data that changes between calls (a "
                            "Python list or number); a graph replays the first call's values", a[0],
                            f"op {i + 1}: {_short_args(a[1])} then {_short_args(b[1])}", 1),)
    if len(first) != len(second):
        return (Finding(f"stale host state: a second capture recorded {len(second)} ops where the first recorded "
                        f"{len(first)}: the call branches on host data that changes between calls", "capture",
                        "second capture", 1),)
    return ()


def _short_args(signature: tuple, limit: int = 80) -> str:
    text = repr(signature)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _warm_up(fn: Callable[..., Any], inputs: tuple) -> Finding | None:
    """Run ``fn`` once eagerly, as the graph harnesses do before a capture; an exception is
    returned as a finding at the file:line that raised it (not captured: nothing was).
    ``torch.cuda.synchronize()`` is legal outside a capture: on a torch without CUDA it waits
    for nothing here instead of raising, so the capture can report it where it is illegal."""
    real_sync = torch.cuda.synchronize
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *args, **kwargs: None
    try:
        with torch.no_grad():
            fn(*inputs)
    except Exception as exc:  # the report says where the call failed, as one line
        frames = traceback.extract_tb(exc.__traceback__)
        message = str(exc).splitlines()[0] if str(exc) else ""
        return Finding(f"the warm-up call raised (eager, before any capture): {type(exc).__name__}: {message}",
                       type(exc).__name__, call_site(frames), 1)
    finally:
        torch.cuda.synchronize = real_sync
    return None


def transformers_forward(config_path: str | Path, *, tokens: int = 8, batch: int = 2,
                         attention_mask: bool = True, seed: int = 0) -> tuple[Callable[..., Any], tuple, str]:
    """A transformers causal LM built from ``config_path`` (a ``config.json`` or its directory) with
    random weights, nothing downloaded: ``(forward, inputs, label)`` for :func:`check_capture`.

    ``forward(input_ids[, attention_mask])`` returns the logits (``use_cache=False``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(config_path)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"--model-config {config_path}: expected a config.json file or a directory holding one")
    data = json.loads(path.read_text())
    if "model_type" not in data:
        raise ValueError(f"--model-config {config_path}: config.json has no 'model_type'")
    if tokens < 1 or batch < 1:
        raise ValueError(f"tokens and batch must be at least 1, got tokens={tokens}, batch={batch}")
    config = AutoConfig.for_model(**data)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, tokens), generator=gen)
    label = f"{type(model).__name__} forward from {config_path} (batch {batch}, {tokens} tokens"
    if attention_mask:
        mask = torch.ones(batch, tokens, dtype=torch.long)

        def forward(input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits

        return forward, (ids, mask), label + ", attention_mask of ones)"

    def forward_without_mask(input_ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids, use_cache=False).logits

    return forward_without_mask, (ids,), label + ", no attention_mask)"


def _resolve(option: str, spec: str, example: str, default_module: str | None = None) -> Any:
    """The object ``MODULE:ATTR`` names (``ATTR`` alone: in ``default_module``)."""
    module_name, sep, attr = spec.rpartition(":") if ":" in spec else (default_module or "", ":", spec)
    if not module_name or not attr:
        raise ValueError(f"{option} {spec}: expected {example}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like python -m: the working directory's modules are importable
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{option} {spec}: cannot import {module_name}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{option} {spec}: {module_name} has no attribute {attr}")
        obj = getattr(obj, part)
    return obj


def _load_callable(spec: str) -> Callable[[], Any]:
    obj = _resolve("--call", spec, "MODULE:FUNCTION, e.g. mypkg.ops:step")
    if not callable(obj):
        raise ValueError(f"--call {spec}: {spec.partition(':')[2]} is {type(obj).__name__}, expected a function "
                         "taking no arguments")
    return obj


def _load_host_resident(specs: Sequence[str], call: str | None) -> list[torch.Tensor]:
    """The tensors ``--host-resident`` names: ``MODULE:ATTR``, or ``ATTR`` of ``--call``'s module."""
    tensors = []
    for spec in specs:
        default = call.partition(":")[0] if call else None
        obj = _resolve("--host-resident", spec, "MODULE:ATTR (or, with --call, an ATTR of its module)", default)
        if not isinstance(obj, torch.Tensor):
            raise ValueError(f"--host-resident {spec}: is {type(obj).__name__}, expected a torch.Tensor")
        tensors.append(obj)
    return tensors


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: check one callable or one transformers forward, print the report."""
    parser = argparse.ArgumentParser(
        prog="lora-capture-check",
        description="Capture one call on the CPU graph simulator and report every graph-capture violation, "
                    "grouped by rule and counted (docs/graph-simulator.md).")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--call", metavar="MODULE:FUNCTION", help="a function taking no arguments, run under capture")
    what.add_argument("--model-config", metavar="CONFIG.json",
                      help="a transformers causal LM built from this config (random weights, no download)")
    parser.add_argument("--tokens", type=positive_int, default=8, help="sequence length of the model forward (default 8)")
    parser.add_argument("--batch", type=positive_int, default=2, help="batch size of the model forward (default 2)")
    parser.add_argument("--no-attention-mask", action="store_true", help="call the model without attention_mask")
    parser.add_argument("--no-warm-up", action="store_true", help="capture the first call (default: warm up first)")
    parser.add_argument("--host-resident", action="append", default=[], metavar="NAME",
                        help="a tensor that lives in host memory on real hardware (CPU metadata), whose reads "
                             "are legal and baked in: MODULE:ATTR, or with --call an ATTR of its module "
                             "(repeatable)")
    args = parser.parse_args(argv)
    try:
        if args.call:
            fn, inputs, label = _load_callable(args.call), (), args.call
        else:
            fn, inputs, label = transformers_forward(args.model_config, tokens=args.tokens, batch=args.batch,
                                                     attention_mask=not args.no_attention_mask)
        host_resident = _load_host_resident(args.host_resident, args.call)
    except (ValueError, ImportError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    report = check_capture(fn, *inputs, host_resident=host_resident, warm_up=not args.no_warm_up, target=label)
    sys.stdout.write(report.format())
    return 0 if report.clean else 1


if __name__ == "__main__":
    sys.exit(main())
