"""``lora-sim``'s command line: argument parsing, input checks, and :func:`main`.

Every option and every ``--model-config`` field is checked (:mod:`.checks`) before any
work starts; bad input is one line naming the option and what it accepts, and exit
status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from lora_core import PeftAdapter, available_backends, load_peft_adapter
from lora_core.testing import DEVICE_NAMES

from ..models import TinyConfig, TinyDecoder
from .adapters import SYNTHETIC_ADAPTERS, make_synthetic_adapters
from .bench import run_benchmarks
from .checks import (
    MAX_DECODE_STEPS,
    MAX_MEMORY_GIB,
    MAX_ROUNDS,
    MIN_ROUNDS,
    PLOT_SUFFIXES,
    MemoryEstimate,
    check_config_fields,
    check_output_path,
    check_plot_support,
    estimate_memory,
    float_in,
    int_in,
    one_line,
    read_config_text,
)
from .errors import UsageError
from .help_text import DESCRIPTION, EPILOG
from .quantize import QUANTIZATIONS, Quantization, check_quantization
from .reference import reference_keys
from .report import format_devices, format_header, format_rows, to_json, write_plot
from .run import COMPILE_BACKENDS, ROUNDS, check_compile_backend, run_simulation
from .serving import AdapterSources, build_multilora, saved_modules, unmixable
from lora_core.testing.timing import machine_info
from .workload import DEFAULT_CONFIG, Workload, default_workload

__all__ = ["OPTION_COMMANDS", "TRANSFORMERS_KEYS", "RunPlan", "build_parser", "check_adapters_fit", "check_run",
           "main", "parse_adapters", "parse_config", "read_model_config"]

TRANSFORMERS_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "num_experts_per_tok")
"""The keys of a transformers ``config.json`` (Llama, Qwen2, Mistral, ... naming) that lora-sim's model reads."""

OPTION_COMMANDS: dict[str, tuple[str, ...]] = {
    **{dest: ("run",) for dest in ("adapter", "model_config", "backend", "device", "decode_steps", "rounds", "json",
                                   "plot", "max_memory_gib", "compile_backend", "quantize")},
    "smoke": ("bench",),
    "quiet": ("run", "bench"),
}
"""Each option (by its argparse ``dest``) and the commands that use it; given to another, it is an error."""


def _is_transformers_config(values: dict) -> bool:
    return "model_type" in values or "architectures" in values


def _from_transformers(values: dict) -> tuple[dict, str]:
    """The :class:`TinyConfig` fields of a transformers config, and a note saying what was ignored."""
    missing = [k for k in ("hidden_size", "num_attention_heads") if values.get(k) is None]
    if missing:
        nested = [k for k in ("text_config", "llm_config", "language_config") if isinstance(values.get(k), dict)]
        hint = f"; its language model's sizes are under {nested[0]!r}: give that object" if nested else ""
        raise UsageError(f"--model-config: this transformers config has no {', '.join(missing)} "
                         f"(lora-sim reads {', '.join(TRANSFORMERS_KEYS)}){hint}")
    fields = {k: values[k] for k in TRANSFORMERS_KEYS if values.get(k) is not None}
    if values.get("num_local_experts") is not None:  # Mixtral's name for the expert count
        fields["num_experts"] = values["num_local_experts"]
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    head_dim = values.get("head_dim")
    if head_dim is not None:
        heads, hidden = fields["num_attention_heads"], fields["hidden_size"]
        if not isinstance(head_dim, int) or isinstance(head_dim, bool):
            raise UsageError(f"--model-config: head_dim must be an integer (hidden_size / num_attention_heads), "
                             f"got {json.dumps(head_dim)}")
        sizes = all(isinstance(v, int) and not isinstance(v, bool) for v in (heads, hidden))
        if sizes and head_dim * heads != hidden:  # sizes of another type: the field checks name them
            raise UsageError(f"--model-config: head_dim = {head_dim} is not hidden_size / num_attention_heads "
                             f"({hidden} / {heads}); lora-sim's model derives it")
    ignored = sorted(set(values) - set(fields) - {"head_dim", "num_local_experts"})
    shown = ", ".join(ignored[:6]) + (", ..." if len(ignored) > 6 else "")
    architectures = values.get("architectures")
    kind = values.get("model_type") or (architectures[0] if isinstance(architectures, list) and architectures
                                        else "?")
    note = (f"--model-config: a transformers config ({kind}): using {', '.join(sorted(fields))}; "
            f"ignoring {len(ignored)} other key(s) ({shown})" if ignored else
            f"--model-config: a transformers config ({kind}): using {', '.join(sorted(fields))}")
    return fields, note


def read_model_config(text: str | None) -> tuple[TinyConfig, str | None]:
    """The model config of ``--model-config`` and a note for the user (or ``None``).

    ``text`` is ``None`` (the default model), or a JSON file or inline JSON object that is
    either :class:`~lora_layers.TinyConfig` fields overriding the default (an unknown key is
    an error), or a transformers ``config.json`` (it has ``model_type`` or
    ``architectures``): its :data:`TRANSFORMERS_KEYS` override the default and every other
    key is ignored, which the note says. Every field is checked against
    :data:`~lora_layers.sim.checks.CONFIG_RANGES` (:class:`UsageError` naming it otherwise).
    """
    if text is None:
        return DEFAULT_CONFIG, None
    values, where = read_config_text(text)
    if not isinstance(values, dict):
        raise UsageError(f"--model-config: {where} must be a JSON object, e.g. '{{\"hidden_size\": 512}}'")
    note = None
    if _is_transformers_config(values):
        values, note = _from_transformers(values)
    known = {f.name for f in dataclasses.fields(TinyConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UsageError(f"--model-config: unknown keys {unknown}; known: {sorted(known)} "
                         "(or give a transformers config.json)")
    return TinyConfig(**check_config_fields(values, DEFAULT_CONFIG.to_dict())), note


def parse_config(text: str | None) -> TinyConfig:
    """The model config of ``--model-config`` (see :func:`read_model_config`)."""
    return read_model_config(text)[0]


def parse_adapters(specs: Sequence[str]) -> dict[str, Path]:
    """``--adapter NAME=PATH`` values as name -> directory, each loaded once to check it."""
    return {name: adapter.path for name, (adapter, _) in _load_adapters(specs).items()}


def _load_adapters(specs: Sequence[str]) -> dict[str, tuple[PeftAdapter, int]]:
    """``--adapter NAME=PATH`` values as name -> (the adapter, its rank), each read once: the
    run uses what is read here."""
    adapters: dict[str, tuple[PeftAdapter, int]] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--adapter expects NAME=PATH (a name and a PEFT adapter directory), got {spec!r}")
        if name in adapters:
            raise UsageError(f"--adapter {name!r} given twice")
        directory = Path(path)
        if not directory.exists():
            raise UsageError(f"--adapter {name}: no such directory: {path}")
        if not directory.is_dir():
            hint = (f"; did you mean its directory, {directory.parent}?"
                    if directory.name.startswith("adapter_") else "")
            raise UsageError(f"--adapter {name}: {path} is a file; give the PEFT adapter's directory (the one "
                             f"holding adapter_config.json and adapter_model.safetensors){hint}")
        try:
            adapter = load_peft_adapter(directory)  # target_parameters: named by the model later, declared ranks
            declared = [adapter.config["r"], *(adapter.config.get("rank_pattern") or {}).values()]
            rank = max([m.rank for m in adapter.modules.values()] + (declared if adapter.parameter_pairs else []))
        except Exception as err:  # whatever a bad adapter raises, it is bad input: one line
            message = str(err) if str(path) in str(err) else f"{path}: {err}"
            raise UsageError(f"--adapter {name}: {one_line(message)}") from None
        if adapter.use_dora:  # lora-sim checks every output against plain LoRA math
            raise UsageError(f"--adapter {name}: {path} is a DoRA adapter (use_dora); lora-sim serves plain LoRA "
                             "adapters only (serve DoRA with MultiLoRA.from_adapters: docs/transformers.md)")
        adapters[name] = (adapter, rank)
    return adapters


def check_adapters_fit(config: TinyConfig, adapters: AdapterSources, hint: str = "") -> None:
    """Raise :class:`UsageError` (one line) when an adapter's modules or shapes do not fit a model of ``config``;
    ``hint`` is added to the message."""
    try:
        build_multilora(TinyDecoder(config), config, adapters)
    except (ValueError, RuntimeError, FileNotFoundError, KeyError) as err:
        raise UsageError(one_line(f"--adapter: {err}{hint}")) from None


def _check_choice(option: str, given: Sequence[str], known: Sequence[str]) -> list[str]:
    unknown = [g for g in given if g not in known]
    if unknown:
        raise UsageError(f"unknown {option[2:]} {', '.join(map(repr, unknown))}; {option} accepts "
                         f"{', '.join(known)}")
    twice = sorted({g for g in given if given.count(g) > 1})
    if twice:
        raise UsageError(f"{option} {twice[0]} given twice")
    return list(given) or list(known)


def _check_command_options(args: argparse.Namespace) -> None:
    """An option given to a command that does not use it is an error, not ignored."""
    for dest, commands in OPTION_COMMANDS.items():
        value = getattr(args, dest)
        if args.command in commands or value is None or value is False or value == []:
            continue
        flag = "--" + dest.replace("_", "-")
        if args.command == "devices":
            raise UsageError(f"{flag} is not an option of devices (lora-sim devices takes no options)")
        raise UsageError(f"{flag} is an option of {' and '.join(commands)}, not of {args.command}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and status 2, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``lora-sim`` argument parser. Options a command does not use default to
    ``None`` / ``[]`` / ``False``, so that giving one can be refused (:data:`OPTION_COMMANDS`)."""
    parser = _Parser(prog="lora-sim", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", choices=["run", "devices", "bench"], default="run",
                        help="run (default): the simulation; devices: the device matrix; bench: op benchmarks")
    parser.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                        help="a PEFT adapter directory to serve (repeatable; default: four synthetic adapters), "
                        "in the default workload's requests at their request scales (see below)")
    parser.add_argument("--model-config", metavar="JSON", help="model sizes, a JSON file or inline JSON object: "
                        "lora-sim's keys or a transformers config.json (see below)")
    parser.add_argument("--backend", action="append", default=[], help="restrict to these backends (repeatable)")
    parser.add_argument("--device", action="append", default=[], help="restrict to these devices (repeatable)")
    parser.add_argument("--decode-steps", type=int_in(1, MAX_DECODE_STEPS), metavar="N",
                        help=f"decode steps, 1 to {MAX_DECODE_STEPS} (default {Workload.decode_steps})")
    parser.add_argument("--rounds", type=int_in(MIN_ROUNDS, MAX_ROUNDS), metavar="N",
                        help=f"timed rounds of prefill and of decode, {MIN_ROUNDS} to {MAX_ROUNDS} (default {ROUNDS})")
    parser.add_argument("--max-memory-gib", type=float_in(0, 65536), metavar="GIB",
                        help=f"refuse a run estimated to need more memory than this (default {MAX_MEMORY_GIB:g})")
    parser.add_argument("--compile-backend", choices=COMPILE_BACKENDS,
                        help="torch.compile backend of the compile devices' decode step (default auto: inductor "
                             "where it can generate code, i.e. a C++ compiler on CPU or Triton on CUDA, else "
                             "aot_eager; the table says which)")
    parser.add_argument("--quantize", choices=list(QUANTIZATIONS),
                        help="serve the decoder layers' projections quantized (default none: fp32); each row is "
                             "checked against fp32 references built from the dequantized weights; int8 and int4 "
                             "need torchao, nf4 and fp4 bitsandbytes (see below)")
    parser.add_argument("--json", metavar="PATH", help="write the full results, per-round samples included, as JSON "
                        "('-': on stdout, instead of the table)")
    parser.add_argument("--plot", metavar="PATH", help="write a chart of throughput and overhead "
                        f"({', '.join(PLOT_SUFFIXES)}; needs matplotlib)")
    parser.add_argument("--smoke", action="store_true", help="with bench: tiny shapes")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    return parser


@dataclasses.dataclass
class RunPlan:
    """A run, every input checked: what :func:`check_run` returns and the run executes.

    ``adapters`` is ``None`` for the synthetic adapters; ``workload`` is the default workload over
    the adapters (its mixed request of adapters that can be mixed), with ``--decode-steps``;
    ``json_path`` is ``"-"`` for stdout; ``progress`` says whether lines go to stderr; ``quantization`` is the base's
    ``--quantize`` choice, its library importable.
    """

    backends: list[str]
    devices: list[str]
    config: TinyConfig
    note: str | None
    adapters: dict[str, PeftAdapter] | None
    workload: Workload
    rounds: int
    json_path: Path | str | None
    plot_path: Path | None
    progress: bool
    memory: MemoryEstimate
    compile_backend: str = "auto"
    quantization: Quantization = QUANTIZATIONS["none"]


def check_run(args: argparse.Namespace) -> RunPlan:
    """Check every input of a run, cheapest first, before any work; :class:`UsageError` for the first bad one."""
    backends = _check_choice("--backend", args.backend, available_backends())
    devices = _check_choice("--device", args.device, DEVICE_NAMES)
    json_path = args.json if args.json == "-" else (
        check_output_path("--json", args.json) if args.json is not None else None)
    plot_path = check_output_path("--plot", args.plot) if args.plot is not None else None
    if plot_path is not None:
        if plot_path == json_path or (isinstance(json_path, Path) and plot_path.resolve() == json_path.resolve()):
            raise UsageError("--plot and --json name the same file; give two paths")
        check_plot_support(plot_path)
    compile_backend = check_compile_backend(args.compile_backend, devices)
    config, note = read_model_config(args.model_config)
    quantization = check_quantization(args.quantize, config)
    given = _load_adapters(args.adapter) if args.adapter else None
    ranks = [rank for _, rank in given.values()] if given else [spec[0] for spec in SYNTHETIC_ADAPTERS.values()]
    adapters = {name: adapter for name, (adapter, _) in given.items()} if given else None
    saved = sum(saved_modules(adapters).values()) if adapters else 0
    workload = default_workload(list(adapters) if adapters else list(SYNTHETIC_ADAPTERS),  # synthetic: all mixable
                                unmixable(adapters) if adapters else ())
    if args.decode_steps is not None:
        workload = dataclasses.replace(workload, decode_steps=args.decode_steps)
    memory = estimate_memory(config.to_dict(), ranks, sum(workload.prompt_lens), saved,
                             merged_references=len(reference_keys(workload.requests())) - 1)
    limit = MAX_MEMORY_GIB if args.max_memory_gib is None else args.max_memory_gib
    if memory.gib > limit:
        raise UsageError(f"this run needs about {memory.size()} of memory ({memory.describe()}), above "
                         f"--max-memory-gib {limit:g}; raise the limit (a number of GiB) or give a smaller "
                         "--model-config")
    if adapters:
        hint = ("; the model is lora-sim's default (hidden_size "
                f"{DEFAULT_CONFIG.hidden_size}, {DEFAULT_CONFIG.num_hidden_layers} layers): give the adapters' base "
                "model with --model-config path/to/config.json") if args.model_config is None else (
                "; is --model-config the config of the adapters' base model?")
        check_adapters_fit(config, adapters, hint)
    return RunPlan(backends=backends, devices=devices, config=config, note=note, adapters=adapters,
                   workload=workload, rounds=ROUNDS if args.rounds is None else args.rounds, json_path=json_path,
                   plot_path=plot_path, progress=not args.quiet and json_path != "-", memory=memory,
                   compile_backend=compile_backend, quantization=quantization)


def _run(plan: RunPlan) -> int:
    if plan.note:
        print(f"lora-sim: {plan.note}", file=sys.stderr)
    config = plan.config
    with tempfile.TemporaryDirectory(prefix="lora-sim-") as tmp:
        if plan.adapters is None:
            if plan.progress:
                print(f"lora-sim: writing {len(SYNTHETIC_ADAPTERS)} synthetic adapters; {len(plan.backends)} "
                      f"backend(s) x {len(plan.devices)} device(s) to run, about {plan.memory.size()} of memory",
                      file=sys.stderr, flush=True)
            adapters = make_synthetic_adapters(config, Path(tmp))
        else:
            adapters = plan.adapters
        workload = plan.workload
        rows = run_simulation(plan.backends, plan.devices, config, adapters, workload, progress=plan.progress,
                              rounds=plan.rounds, compile_backend=plan.compile_backend,
                              quantization=plan.quantization)
    machine = machine_info()
    document = to_json(config, workload, rows, plan.rounds, machine, plan.quantization)
    if plan.json_path == "-":
        print(json.dumps(document, indent=2))
    else:
        print(format_header(config, list(adapters), workload, plan.rounds, machine, plan.memory,
                            plan.quantization))
        print(format_rows(rows))
        if plan.json_path is not None:
            plan.json_path.write_text(json.dumps(document, indent=2))
    if plan.plot_path is not None:
        write_plot(rows, str(plan.plot_path))
    ran = [r for r in rows if r.status != "skipped"]
    return 0 if ran and all(r.status == "pass" for r in ran) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``lora-sim`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status (see ``--help``)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or an argparse error, already printed in one line (2)
        return exc.code if isinstance(exc.code, int) else 0
    try:
        _check_command_options(args)
        if args.command == "devices":
            print(format_devices())
            return 0
        if args.command == "bench":
            return run_benchmarks(args.smoke, progress=not args.quiet)
        return _run(check_run(args))
    except UsageError as err:
        print(f"lora-sim: error: {one_line(err)}", file=sys.stderr)
        return 2
