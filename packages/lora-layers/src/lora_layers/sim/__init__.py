"""``lora-sim``: simulate a multi-LoRA serving run on every installed backend and device.

Serves a workload (:mod:`.workload`) of synthetic or given PEFT adapters
(:mod:`.adapters`) through :class:`~lora_layers.MultiLoRA` over the modules of
:mod:`.serving` (their base fp32 or quantized, ``--quantize``: :mod:`.quantize`), on every backend of ``lora_core.available_backends()`` and every
device of ``lora_core.testing.DEVICE_NAMES``; checks each row against merged fp32
reference models (:mod:`.reference`) and times it against the base model in
interleaved rounds (:mod:`lora_core.testing.timing`, :mod:`.run`); writes tables, JSON and a plot
(:mod:`.report`); ``lora-sim bench`` runs the benchmarks registered under the
``lora_core.benchmarks`` entry points (:mod:`.bench`). The command line, its
options and exit statuses are in :mod:`.cli` (``lora-sim --help``).

    from lora_layers import sim
    sim.main(["--device", "cpu"])      # as the lora-sim command, returns the exit status
"""

from __future__ import annotations

from lora_core.testing.timing import Interleaved, Spread, machine_info

from .adapters import make_synthetic_adapters
from .bench import discover_benchmarks, run_benchmarks
from .checks import MAX_DECODE_STEPS, MAX_MEMORY_GIB, MAX_ROUNDS, estimate_memory
from .cli import build_parser, check_run, main, parse_adapters, parse_config
from .errors import UsageError
from .quantize import QUANTIZATIONS, Quantization
from .reference import merged_reference_models, reference_logits
from .report import format_rows, write_plot
from .run import ROUNDS, SimRow, run_row, run_simulation
from .workload import DEFAULT_CONFIG, Workload, default_workload

__all__ = ["main", "run_simulation", "SimRow", "Workload", "default_workload"]

_parse_config = parse_config  # the name the module had before it became a package
