"""``lora-sim --help``: the description and the text after the options (limits, examples,
exit status), with the limits taken from :mod:`.checks` so the help cannot drift from them."""

from __future__ import annotations

import textwrap

from .bench import BENCHMARK_GROUP
from .checks import CONFIG_RANGES, MAX_DECODE_STEPS, MAX_MEMORY_GIB, MAX_ROUNDS, MIN_ROUNDS, PLOT_SUFFIXES
from .quantize import INT4_GROUP_SIZE, QUANTIZATIONS

__all__ = ["DESCRIPTION", "EPILOG"]

DESCRIPTION = "simulate a multi-LoRA serving run on every installed backend and device"

_RANGES = "; ".join(f"{k} {lo}-{hi}" for k, (lo, hi) in CONFIG_RANGES.items() if k != "seed")

_QUANTIZE = "\n".join(textwrap.fill(f"{q.name:<5} {q.describe}" + (f"; needs {q.package}" if q.package else ""),
                                     width=84, initial_indent="  ", subsequent_indent=" " * 8)
                       for q in QUANTIZATIONS.values())

EPILOG = f"""\
The default run needs nothing but this package: a small seeded decoder-shaped
model, four synthetic PEFT adapters (ranks 8/16/32/64; one rsLoRA; one also on
the embedding and the LM head), a prefill of seven prompts of different lengths
on different adapters (one on the base model, one on a weighted mix; the LM head
sees each prompt's last token only) and greedy decode steps, each on another
order of the requests. Each request has a scale, the multiplier of its adapter's
delta (MultiLoRA.set_batch(..., scales=)): the five single-adapter requests are at
1, 0.5, 1, 1.5 and 0 (0: no delta; a modules_to_save copy is not scaled). The
seventh request mixes the last two adapters, 0.7 r32-rslora + 0.4 r64-embed-head
(the embedding and LM head among its modules), at scale 0.8: it gets 0.8 * (0.7
delta_a + 0.4 delta_b), PEFT's add_weighted_adapter(combination_type="cat") for
that request alone; --adapter adapters mix the same way (DoRA and modules_to_save
adapters are left out of the mix; with fewer than two left, it is one adapter at
weight 0.7). All of it in every mode (eager, graph mode with enable_graph(...,
scales=True, max_pairs=) sized for the decode batch's (token, adapter) pairs,
compiled); the header lists each request's adapter or mix and scale, and --json's
"workload" its "adapters" (a mix as [[name, weight], ...]) and "scales". --adapter
adapters are served at the same scales, a scale being a request's, not an
adapter's. Every output of every backend x device row is checked against an fp32
reference that merges the request's adapter, or each adapter of its mix at its
weight, at its scale into a copy of the base model, at the fp32 tolerance of
lora_core.testing.TOLERANCES (docs/layout.md) with atol scaled by the outputs'
magnitude (atol * max(1, max |ref|)), so large valid logits are not judged at the
tolerance of unit-scale ones; --json's rows give each request's largest error
("max_abs_error_by_request").

Timings are medians over --rounds rounds with their min-max spread; in each round
the LoRA model and the base model run interleaved (prefill by prefill, decode step
by decode step). --json carries every per-round sample. A line per row goes to
stderr as the rows finish (none with --quiet or --json -).

--model-config: a JSON file or inline JSON object of the model's sizes, either
lora-sim's own keys (vocab_size, hidden_size, intermediate_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, fused, seed, num_experts (> 0: a Mixtral
MoE MLP, docs/moe.md), num_experts_per_tok; the rest keep the default) or a
transformers config.json (it has model_type or architectures): the sizes among those
keys (not fused or seed; Mixtral's num_local_experts as num_experts) are used, every
other key is ignored (a note on stderr says which). --adapter adapters are served at
the largest rank among them.

--quantize: the base model's decoder-layer projections (q/k/v/o_proj or qkv_proj,
gate/up/down_proj or gate_up_proj) are served quantized, made on the host and moved
to each device; the embedding, the LM head, the norms and, in a mixture-of-experts
model, the router and the fused experts (3-D parameters, not linear layers) stay
fp32. The references are fp32 models holding each quantized layer's dequantized
weight, so every row is checked at the same fp32 tolerance. Choices:
{_QUANTIZE}
bitsandbytes' layers are kept on its fp32 path (dequantize, then an fp32 matmul):
its eval-mode CPU kernel computes in bfloat16. On cpu-graphsim the bitsandbytes
rows are skipped (its 4-bit matmul is an opaque custom op the simulator cannot
judge). The header and --json's "quantize" say which base ran.

limits (checked before anything runs; bad input exits 2 with one line):
  --decode-steps 1-{MAX_DECODE_STEPS}; --rounds {MIN_ROUNDS}-{MAX_ROUNDS}
  --model-config integers: {_RANGES}; seed 0-2**63-1;
    num_attention_heads divides hidden_size, num_key_value_heads divides
    num_attention_heads; num_experts_per_tok at most num_experts; fused is true or false
  memory: a run estimated to need more than --max-memory-gib (default {MAX_MEMORY_GIB:g})
    GiB is refused (fp32 copies of the model per adapter or mix and request scale,
    plus LoRA buffers)
  --quantize int8/int4 need torchao, nf4/fp4 bitsandbytes (pip install torchao,
    pip install bitsandbytes); int4 needs hidden_size and intermediate_size
    multiples of {INT4_GROUP_SIZE}
  --json and --plot: writable paths, checked first; --plot ends in
    {', '.join(PLOT_SUFFIXES)} and needs matplotlib (pip install matplotlib)

examples:
  lora-sim                       # the default run, a table on stdout
  lora-sim devices               # what was probed and found
  lora-sim bench --smoke         # the installed op benchmarks, tiny shapes
  lora-sim --json - --quiet      # the results as JSON on stdout, nothing on stderr
  lora-sim --quantize nf4 --device cpu   # a bitsandbytes NF4 base, on the CPU
  lora-sim --adapter sql=path/to/peft_dir --model-config '{{"hidden_size": 512}}'
  lora-sim --adapter sql=path/to/peft_dir --model-config path/to/base_model/config.json

options by command: run takes every option but --smoke; bench takes --smoke and
--quiet; devices takes none. An option given to a command that does not use it
is an error.

exit status:
  run      0 when every row that ran is within tolerance, 1 when one is not
           (or no row ran)
  devices  0
  bench    0 when every benchmark returns 0, else the status of the first that
           does not; 1 when none is installed (benchmarks are found through the
           entry-point group {BENCHMARK_GROUP!r})
  any      2 for bad input, with a one-line message
"""
