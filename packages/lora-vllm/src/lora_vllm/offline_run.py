"""Run one offline vLLM engine on a JSON spec and write what it generated (and timed) as JSON:
the engine process of the plugin's tests and of examples/bench_vllm.py, not part of the plugin.

    python -m lora_vllm.offline_run RUN.json OUT.json

One engine per process: vLLM loads its plugins once per process, so vLLM's own LoRA path and
the lora-kit plugin (``LORA_KIT_VLLM_BACKEND`` in the environment) each need their own.

RUN.json keys (the run spec): ``model`` (directory); ``engine`` (``vllm.LLM`` keyword arguments); ``adapters``
(name -> directory); ``requests`` (``[{"prompt": [token ids], "adapter": name or null}]``);
``max_tokens``; optional ``bad_adapters`` (name -> directory: each sent after the main batch
to record vLLM's error); optional ``timed`` (``[{"name", "requests", "max_tokens"}]``) and
``rounds``: workloads timed after the main batch.

OUT keys: ``tokens`` and ``logprobs`` (the chosen tokens' log-probabilities) per request;
``wrapper`` (the punica wrapper class the worker built); ``errors`` (per bad adapter,
``[exception type, first line]``, or null); ``start_s`` and ``generate_s``; with ``timed``,
``timed``: per workload name, ``lora`` and ``base`` (seconds per round of the requests as
given, and of the same requests without adapters; in each round both, the order alternating
between rounds) and ``worker_s`` (the worker's seconds over the LoRA rounds in
``execute_model``, and inside it in vLLM's per-step LoRA bookkeeping ``set_active_loras``,
which includes the wrapper's ``update_metadata``, and in ``update_metadata`` alone).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

__all__ = ["main"]


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def _model_runner(worker: Any) -> Any:
    return worker.model_runner if hasattr(worker, "model_runner") else worker.worker.model_runner


def _wrapper(worker: Any) -> Any:
    manager = _model_runner(worker).lora_manager._adapter_manager
    return next(iter(manager.punica_wrapper_mapping.values()))


def _wrapper_name(worker: Any) -> str:
    return type(_wrapper(worker)).__qualname__


def _install_timers(worker: Any) -> None:
    """Wrap the worker's ``execute_model``, ``set_active_loras`` and the wrapper's ``update_metadata``
    with timers whose sums :func:`_read_timers` returns (and resets)."""
    runner, wrapper = _model_runner(worker), _wrapper(worker)
    totals = {"execute_model": 0.0, "set_active_loras": 0.0, "update_metadata": 0.0}

    def timed(obj: Any, name: str) -> None:
        inner = getattr(obj, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - t0

        setattr(obj, name, call)

    target = worker if hasattr(worker, "execute_model") else worker.worker
    timed(target, "execute_model")
    timed(runner, "set_active_loras")
    timed(wrapper, "update_metadata")
    runner._lora_kit_timers = totals


def _read_timers(worker: Any) -> dict[str, float]:
    totals = _model_runner(worker)._lora_kit_timers
    out = dict(totals)
    for key in totals:
        totals[key] = 0.0
    return out


def _inputs(requests: list[dict[str, Any]], ids: dict[str, int], adapters: dict[str, str]) -> tuple[list, list]:
    """vLLM prompts and LoRA requests (None for the base model) of ``requests``."""
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in requests]
    loras = [None if r["adapter"] is None else LoRARequest(r["adapter"], ids[r["adapter"]], adapters[r["adapter"]])
             for r in requests]
    return prompts, loras


def _time_workload(llm: Any, workload: dict[str, Any], rounds: int, ids: dict[str, int],
                   adapters: dict[str, str]) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=workload["max_tokens"], detokenize=False, ignore_eos=True)
    prompts, loras = _inputs(workload["requests"], ids, adapters)
    times: dict[str, list[float]] = {"lora": [], "base": []}
    worker_s = {"execute_model": 0.0, "set_active_loras": 0.0, "update_metadata": 0.0}
    for k in range(rounds + 1):  # round 0 warms both up and is not kept
        for kind in (("lora", "base") if k % 2 else ("base", "lora")):
            llm.collective_rpc(_read_timers)  # resets them
            t0 = time.perf_counter()
            llm.generate(prompts, params, lora_request=loras if kind == "lora" else None, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            spent = llm.collective_rpc(_read_timers)[0]
            if k == 0:
                continue
            times[kind].append(elapsed)
            if kind == "lora":
                for key, value in spent.items():
                    worker_s[key] += value
    return {**times, "worker_s": worker_s}


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    with open(spec_path) as f:
        spec = json.load(f)
    ids = {name: i + 1 for i, name in enumerate(sorted(spec["adapters"]))}
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, **spec["engine"])
    start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=0, detokenize=False,
                            ignore_eos=True)
    prompts, loras = _inputs(spec["requests"], ids, spec["adapters"])

    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    generate_s = time.perf_counter() - t0
    result: dict[str, Any] = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "logprobs": [[step[tok].logprob for step, tok in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                     for o in outputs],
        "wrapper": llm.collective_rpc(_wrapper_name)[0],
        "start_s": start_s,
        "generate_s": generate_s,
    }

    if spec.get("timed"):
        llm.collective_rpc(_install_timers)
        result["timed"] = {w["name"]: _time_workload(llm, w, int(spec["rounds"]), ids, spec["adapters"])
                           for w in spec["timed"]}

    errors: dict[str, Any] = {}
    for k, (name, path) in enumerate(sorted(spec.get("bad_adapters", {}).items())):
        try:
            llm.generate([prompts[0]], params, lora_request=[LoRARequest(name, 1000 + k, path)], use_tqdm=False)
            errors[name] = None
        except Exception as exc:  # what vLLM raises is the record
            errors[name] = [type(exc).__name__, _first_line(exc)]
    result["errors"] = errors
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
