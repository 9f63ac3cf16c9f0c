"""``lora-sim``'s command line: argument parsing, input checks, and :func:`main`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from lora_core import AdapterFormatError, available_backends, load_peft_adapter
from lora_core.testing import DEVICE_NAMES

from ..models import TinyConfig, TinyDecoder
from .adapters import make_synthetic_adapters
from .bench import BENCHMARK_GROUP, run_benchmarks
from .errors import UsageError
from .report import format_devices, format_header, format_rows, to_json, write_plot
from .run import ROUNDS, run_simulation
from .serving import build_multilora
from lora_core.testing.timing import machine_info
from .workload import DEFAULT_CONFIG, Workload, default_workload

__all__ = ["TRANSFORMERS_KEYS", "build_parser", "check_adapters_fit", "main", "parse_adapters", "parse_config",
           "read_model_config"]

DESCRIPTION = "simulate a multi-LoRA serving run on every installed backend and device"

EPILOG = f"""\
The default run needs nothing but this package: a small seeded decoder-shaped
model, four synthetic PEFT adapters (ranks 8/16/32/64; one rsLoRA; one also on
the embedding and the LM head), a prefill of six prompts of different lengths on
mixed adapters (one on the base model; the LM head sees each prompt's last token
only) and greedy decode steps, each on a different adapter mix. Every output of
every backend x device row is checked against an fp32 reference that merges each
adapter into a copy of the base model, at the fp32 tolerance of
lora_core.testing.TOLERANCES (docs/layout.md) with atol scaled by the outputs'
magnitude (atol * max(1, max |ref|)), so large valid logits are not judged at
the tolerance of unit-scale ones.

Timings are medians over --rounds rounds with their min-max spread; in each round
the LoRA model and the base model run interleaved (prefill by prefill, decode step
by decode step). --json carries every per-round sample.

--model-config: a JSON file or inline JSON object of the model's sizes, either
lora-sim's own keys (vocab_size, hidden_size, intermediate_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, fused, seed; the rest keep the default)
or a transformers config.json (it has model_type or architectures): its
vocab_size, hidden_size, intermediate_size, num_hidden_layers,
num_attention_heads and num_key_value_heads are used, every other key is ignored
(a note on stderr says which). --adapter adapters are served at the largest rank
among them.

examples:
  lora-sim                       # the default run, a table on stdout
  lora-sim devices               # what was probed and found
  lora-sim bench --smoke         # the installed op benchmarks, tiny shapes
  lora-sim --adapter sql=path/to/peft_dir --model-config '{{"hidden_size": 512}}'
  lora-sim --adapter sql=path/to/peft_dir --model-config path/to/base_model/config.json

exit status:
  run      0 when every row that ran is within tolerance, 1 when one is not
           (or no row ran)
  devices  0
  bench    0 when every benchmark returns 0, else the status of the first that
           does not; 1 when none is installed (benchmarks are found through the
           entry-point group {BENCHMARK_GROUP!r})
  any      2 for bad input, with a one-line message
"""


TRANSFORMERS_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads")
"""The keys of a transformers ``config.json`` (Llama, Qwen2, Mistral, ... naming) that lora-sim's model reads."""


def _is_transformers_config(values: dict) -> bool:
    return "model_type" in values or "architectures" in values


def _from_transformers(values: dict) -> tuple[dict, str]:
    """The :class:`TinyConfig` fields of a transformers config, and a note saying what was ignored."""
    missing = [k for k in ("hidden_size", "num_attention_heads") if not isinstance(values.get(k), int)]
    if missing:
        raise UsageError(f"--model-config: this transformers config has no {', '.join(missing)} "
                         f"(lora-sim reads {', '.join(TRANSFORMERS_KEYS)})")
    fields = {k: values[k] for k in TRANSFORMERS_KEYS if values.get(k) is not None}
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    head_dim = values.get("head_dim")
    if head_dim is not None and head_dim * fields["num_attention_heads"] != fields["hidden_size"]:
        raise UsageError(f"--model-config: head_dim = {head_dim} is not hidden_size / num_attention_heads "
                         f"({fields['hidden_size']} / {fields['num_attention_heads']}); lora-sim's model derives it")
    ignored = sorted(set(values) - set(fields) - {"head_dim"})
    shown = ", ".join(ignored[:6]) + (", ..." if len(ignored) > 6 else "")
    kind = values.get("model_type") or (values.get("architectures") or ["?"])[0]
    note = (f"--model-config: a transformers config ({kind}): using {', '.join(sorted(fields))}; "
            f"ignoring {len(ignored)} other key(s) ({shown})" if ignored else
            f"--model-config: a transformers config ({kind}): using {', '.join(sorted(fields))}")
    return fields, note


def _read_file(text: str) -> str:
    try:
        return Path(text).read_text()
    except OSError:  # not a readable file: given as inline JSON, which json.loads judges
        return text


def read_model_config(text: str | None) -> tuple[TinyConfig, str | None]:
    """The model config of ``--model-config`` and a note for the user (or ``None``).

    ``text`` is ``None`` (the default model), or a JSON file or inline JSON object that is
    either :class:`~lora_layers.TinyConfig` fields overriding the default (an unknown key is
    an error), or a transformers ``config.json`` (it has ``model_type`` or
    ``architectures``): its :data:`TRANSFORMERS_KEYS` override the default and every other
    key is ignored, which the note says.
    """
    if text is None:
        return DEFAULT_CONFIG, None
    source = text if text.lstrip().startswith("{") else _read_file(text)
    try:
        values = json.loads(source)
    except json.JSONDecodeError as err:
        raise UsageError(f"--model-config is neither a JSON file nor inline JSON: {err}") from None
    if not isinstance(values, dict):
        raise UsageError("--model-config must be a JSON object, e.g. '{\"hidden_size\": 512}'")
    note = None
    if _is_transformers_config(values):
        values, note = _from_transformers(values)
    known = {f.name for f in dataclasses.fields(TinyConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UsageError(f"--model-config: unknown keys {unknown}; known: {sorted(known)} "
                         "(or give a transformers config.json)")
    try:
        config = TinyConfig(**{**DEFAULT_CONFIG.to_dict(), **values})
        if config.hidden_size % config.num_attention_heads or config.num_attention_heads % config.num_key_value_heads:
            raise UsageError("--model-config: hidden_size must divide by num_attention_heads, "
                             "and num_attention_heads by num_key_value_heads")
    except (TypeError, ZeroDivisionError) as err:
        raise UsageError(f"--model-config: {err}") from None
    return config, note


def parse_config(text: str | None) -> TinyConfig:
    """The model config of ``--model-config`` (see :func:`read_model_config`)."""
    return read_model_config(text)[0]


def parse_adapters(specs: Sequence[str]) -> dict[str, Path]:
    """``--adapter NAME=PATH`` values as name -> directory, each loaded once to check it."""
    adapters = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--adapter expects NAME=PATH, got {spec!r}")
        if name in adapters:
            raise UsageError(f"--adapter {name!r} given twice")
        try:
            load_peft_adapter(path)
        except (FileNotFoundError, AdapterFormatError) as err:
            raise UsageError(f"--adapter {name}: {err}") from None
        adapters[name] = Path(path)
    return adapters


def check_adapters_fit(config: TinyConfig, adapters: dict[str, Path]) -> None:
    """Raise :class:`UsageError` (one line) when an adapter's modules or shapes do not fit a model of ``config``."""
    try:
        build_multilora(TinyDecoder(config), config, adapters)
    except (ValueError, RuntimeError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None


def _check_choice(kind: str, given: Sequence[str], known: Sequence[str]) -> list[str]:
    unknown = [g for g in given if g not in known]
    if unknown:
        raise UsageError(f"unknown {kind} {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
    return list(given) or list(known)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and status 2, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``lora-sim`` argument parser."""
    parser = _Parser(prog="lora-sim", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", choices=["run", "devices", "bench"], default="run",
                        help="run (default): the simulation; devices: the device matrix; bench: op benchmarks")
    parser.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                        help="a PEFT adapter directory to serve (repeatable; default: four synthetic adapters)")
    parser.add_argument("--model-config", metavar="JSON", help="model sizes, a JSON file or inline JSON object: "
                        "lora-sim's keys or a transformers config.json (see below)")
    parser.add_argument("--backend", action="append", default=[], help="restrict to these backends (repeatable)")
    parser.add_argument("--device", action="append", default=[], help="restrict to these devices (repeatable)")
    parser.add_argument("--decode-steps", type=int, default=Workload.decode_steps,
                        help=f"decode steps (default {Workload.decode_steps})")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help=f"timed rounds of prefill and of decode, at least 3 (default {ROUNDS})")
    parser.add_argument("--json", metavar="PATH", help="write the full results, per-round samples included, as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG chart of throughput and overhead (matplotlib)")
    parser.add_argument("--smoke", action="store_true", help="with bench: tiny shapes")
    return parser


def _run(args: argparse.Namespace) -> int:
    backends = _check_choice("backend", args.backend, available_backends())
    devices = _check_choice("device", args.device, DEVICE_NAMES)
    config, note = read_model_config(args.model_config)
    if note:
        print(f"lora-sim: {note}", file=sys.stderr)
    if args.decode_steps < 1:
        raise UsageError("--decode-steps must be at least 1")
    if args.rounds < 3:
        raise UsageError("--rounds must be at least 3 (a median and a spread need a few samples)")
    with tempfile.TemporaryDirectory(prefix="lora-sim-") as tmp:
        adapters = parse_adapters(args.adapter) if args.adapter else make_synthetic_adapters(config, Path(tmp))
        workload = dataclasses.replace(default_workload(list(adapters)), decode_steps=args.decode_steps)
        check_adapters_fit(config, adapters)
        rows = run_simulation(backends, devices, config, adapters, workload, rounds=args.rounds)
    machine = machine_info()
    print(format_header(config, list(adapters), workload, args.rounds, machine))
    print(format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(config, workload, rows, args.rounds, machine), indent=2))
    if args.plot:
        write_plot(rows, args.plot)
    ran = [r for r in rows if r.status != "skipped"]
    return 0 if ran and all(r.status == "pass" for r in ran) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``lora-sim`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status (see ``--help``)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or an argparse error, already printed in one line (2)
        return exc.code if isinstance(exc.code, int) else 0
    try:
        if args.command == "devices":
            print(format_devices())
            return 0
        if args.command == "bench":
            return run_benchmarks(args.smoke)
        return _run(args)
    except UsageError as err:
        print(f"lora-sim: error: {err}", file=sys.stderr)
        return 2
