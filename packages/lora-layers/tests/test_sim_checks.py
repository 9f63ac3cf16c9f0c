"""lora-sim checks every input before any work: one line naming the option and what it
accepts, exit status 2, within a second, never a traceback (issue #34's cases, driving the
real command line: ``sim.main(argv)`` in process, and the ``lora-sim`` module in a subprocess)."""

import json
import subprocess
import sys
import time

import pytest
import torch

from lora_core import available_backends, save_peft_adapter
from lora_layers import sim
from lora_layers.sim import checks, cli

SMALL = '{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4}'
LLAMA_7B = ('{"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, '
            '"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32}')


@pytest.fixture(autouse=True, scope="module")
def _backends_imported():
    """The backends' entry points load once per process (imports, not checks): before the timing."""
    available_backends()


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the run starts: no adapters written, no reference built, no row run."""
    def refuse(*args, **kwargs):
        raise AssertionError("bad input must be refused before any work starts")

    for name in ("make_synthetic_adapters", "run_simulation", "write_plot"):
        monkeypatch.setattr(cli, name, refuse)


def _bad(capsys, argv, message):
    """``lora-sim argv`` exits 2 within a second with one line on stderr containing ``message``."""
    started = time.perf_counter()
    code = sim.main(argv)
    seconds = time.perf_counter() - started
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert len(err.splitlines()) == 1 and err.startswith("lora-sim: error: ") and "Traceback" not in err, err
    assert message in err, err
    assert out == ""
    assert seconds < 1.0, f"{argv} took {seconds:.2f} s"
    return err


@pytest.mark.parametrize(("config", "message"), [
    ('{"hidden_size": -64}', "--model-config: hidden_size must be an integer from 1 to 65536, got -64"),
    ('{"hidden_size": 0}', "--model-config: hidden_size must be an integer from 1 to 65536, got 0"),
    ('{"hidden_size": 1e10}', "--model-config: hidden_size must be an integer from 1 to 65536, got 10000000000.0"),
    ('{"vocab_size": 1e12}', "--model-config: vocab_size must be an integer from 1 to 1048576, got 1000000000000.0"),
    ('{"vocab_size": 64.0}', "vocab_size must be an integer from 1 to 1048576, got 64.0"),
    ('{"num_hidden_layers": 100000}', "--model-config: num_hidden_layers must be an integer from 1 to 512, got 100000"),
    ('{"hidden_size": "64"}', '--model-config: hidden_size must be an integer from 1 to 65536, got "64" (a string)'),
    ('{"hidden_size": true}', "hidden_size must be an integer from 1 to 65536, got true"),
    ('{"num_hidden_layers": 0}', "--model-config: num_hidden_layers must be an integer from 1 to 512, got 0"),
    ('{"num_key_value_heads": 0}', "--model-config: num_key_value_heads must be an integer from 1 to 8, got 0"),
    ('{"num_key_value_heads": 16}', "num_key_value_heads must be an integer from 1 to 8, got 16"),
    ('{"num_key_value_heads": 3}', "num_key_value_heads must divide num_attention_heads (from 1 to 8), got 3"),
    ('{"num_attention_heads": 7}', "num_attention_heads must divide hidden_size (from 1 to 256), got 7"),
    ('{"seed": "x"}', '--model-config: seed must be an integer from 0 to 9223372036854775807, got "x" (a string)'),
    ('{"seed": -1}', "seed must be an integer from 0 to"),
    ('{"fused": "yes"}', '--model-config: fused must be true or false, got "yes"'),
    ('{"intermediate_size": null}', "intermediate_size must be an integer from 1 to 262144, got null"),
    ("[1, 2]", "must be a JSON object"),
    ('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "head_dim": "16"}',
     '--model-config: head_dim must be an integer (hidden_size / num_attention_heads), got "16"'),
    ('{"model_type": "llama", "hidden_size": "64", "num_attention_heads": 4, "head_dim": 16}',
     'hidden_size must be an integer from 1 to 65536, got "64" (a string)'),
    ('{"model_type": "llava", "text_config": {"hidden_size": 64}}', "its language model's sizes are under 'text_config'"),
])
def test_bad_model_config_values_are_one_line_exit_2(capsys, no_work, config, message):
    _bad(capsys, ["--model-config", config], message)


def test_model_config_files_that_are_missing_binary_or_directories(capsys, no_work, tmp_path):
    _bad(capsys, ["--model-config", str(tmp_path / "config.json")],
         f"--model-config: no such file: {tmp_path / 'config.json'} (give a JSON file, or an inline JSON object")
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    _bad(capsys, ["--model-config", str(binary)], f"--model-config: {binary} is not a text file")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(SMALL)
    _bad(capsys, ["--model-config", str(tmp_path / "model")],
         f"is a directory, not a JSON file; did you mean {tmp_path / 'model' / 'config.json'}?")
    broken = tmp_path / "broken.json"
    broken.write_text('{"hidden_size": 32,}')
    _bad(capsys, ["--model-config", str(broken)], f"--model-config: {broken} is not valid JSON: Expecting")
    huge = tmp_path / "huge.json"
    huge.write_text(" " * (checks.MAX_CONFIG_BYTES + 1))
    _bad(capsys, ["--model-config", str(huge)], "a model config is a JSON file of at most 1,048,576 bytes")


@pytest.mark.parametrize(("argv", "message"), [
    (["--decode-steps", "1e9"], "argument --decode-steps: must be an integer from 1 to 1000, got '1e9'"),
    (["--decode-steps", "1000000000"], "argument --decode-steps: must be an integer from 1 to 1000"),
    (["--decode-steps", "0"], "argument --decode-steps: must be an integer from 1 to 1000, got '0'"),
    (["--rounds", "1e9"], "argument --rounds: must be an integer from 3 to 100, got '1e9'"),
    (["--rounds", "2"], "argument --rounds: must be an integer from 3 to 100, got '2'"),
    (["--max-memory-gib", "0"], "argument --max-memory-gib: must be a number above 0 and at most 65536, got '0'"),
    (["--max-memory-gib", "nan"], "argument --max-memory-gib: must be a number above 0"),
    (["--device", "cpu", "--device", "cpu"], "--device cpu given twice"),
    (["--backend", "ascend", "--backend", "ascend"], "--backend ascend given twice"),
    (["--json", "/nonexistent/dir/x.json"], "--json: no such directory: /nonexistent/dir (create it first)"),
    (["--json", "/"], "--json: / is a directory; give a file path"),
    (["--json", ""], "--json needs a file path"),
    (["--plot", "chart.txt"], "--plot: chart.txt must end in .png, .svg or .pdf"),
    (["--plot", "/nonexistent/dir/p.png"], "--plot: no such directory: /nonexistent/dir"),
    (["--plot", "-"], "--plot: - must end in .png, .svg or .pdf"),
    # options a command does not use are refused, not ignored
    (["bench", "--device", "nosuch"], "--device is an option of run, not of bench"),
    (["bench", "--json", "b.json"], "--json is an option of run, not of bench"),
    (["devices", "--json", "F"], "--json is not an option of devices (lora-sim devices takes no options)"),
    (["devices", "--smoke"], "--smoke is not an option of devices"),
    (["devices", "--quiet"], "--quiet is not an option of devices"),
    (["--smoke"], "--smoke is an option of bench, not of run"),
])
def test_bad_options_are_one_line_exit_2(capsys, no_work, monkeypatch, tmp_path, argv, message):
    monkeypatch.chdir(tmp_path)
    _bad(capsys, argv, message)


@pytest.mark.parametrize(("option", "low", "high", "step"), [
    ("--decode-steps", 1, 1000, 1), ("--rounds", 3, 100, 1), ("--max-memory-gib", 0.001, 65536, 0.001),
])
def test_both_ends_of_each_documented_range_are_accepted(option, low, high, step):
    """The ends of each range ``lora-sim --help`` gives parse (a bound off by one would refuse a
    documented value); one step outside either end is refused with exit status 2."""
    parser = cli.build_parser()
    if step == 1:  # the integer options' help gives the range as "LOW to HIGH"
        assert f"{low} to {high}" in " ".join(parser.format_help().split())
    dest = option.lstrip("-").replace("-", "_")
    for value in (low, high):
        assert getattr(parser.parse_args([option, str(value)]), dest) == value
    for value in (low - step, high + step):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([option, str(value)])
        assert exc.value.code == 2


def test_plot_without_matplotlib_is_refused_before_the_run(capsys, no_work, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    _bad(capsys, ["--plot", str(tmp_path / "p.png")],
         "--plot needs matplotlib, which is not installed: pip install matplotlib")
    assert not (tmp_path / "p.png").exists()
    _bad(capsys, ["--plot", str(tmp_path / "same.png"), "--json", str(tmp_path / "same.png")],
         "--plot and --json name the same file")


def test_an_output_directory_that_cannot_be_written_is_refused(capsys, no_work, monkeypatch, tmp_path):
    def unwritable(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(checks.tempfile, "NamedTemporaryFile", unwritable)  # root may write anywhere: simulate
    _bad(capsys, ["--json", str(tmp_path / "r.json")], f"--json: cannot write {tmp_path / 'r.json'}: Permission denied")
    assert list(tmp_path.iterdir()) == []


def test_the_memory_estimate_is_refused_above_the_limit_which_can_be_raised(capsys, no_work):
    err = _bad(capsys, ["--model-config", LLAMA_7B], "of memory (")
    assert "above --max-memory-gib 4; raise the limit (a number of GiB) or give a smaller --model-config" in err
    gib = float(err.split("needs about ")[1].split(" GiB")[0].replace(",", ""))
    assert 100 < gib < 400  # ten fp32 copies of a 6.7e9-parameter model, give or take
    _bad(capsys, ["--max-memory-gib", "0.001"], "above --max-memory-gib 0.001")
    estimate = checks.estimate_memory(sim.DEFAULT_CONFIG.to_dict(), [8, 16, 32, 64], sum(sim.Workload().prompt_lens))
    assert estimate.bytes < 128 * 2**20 and estimate.size().endswith(" MiB")  # the default run: tens of MiB


def test_raising_the_memory_limit_lets_the_checks_pass(monkeypatch):
    args = cli.build_parser().parse_args(["--model-config", LLAMA_7B, "--max-memory-gib", "1000", "--quiet"])
    plan = cli.check_run(args)
    assert plan.config.hidden_size == 4096 and 100 < plan.memory.gib < 1000 and not plan.progress


def _adapter_of(tmp_path, config_json, name="r16"):
    return sim.make_synthetic_adapters(sim.parse_config(config_json), tmp_path)[name]


def test_adapter_paths_that_are_files_or_unreadable(capsys, no_work, tmp_path):
    adapter = _adapter_of(tmp_path, SMALL)
    config_file = adapter / "adapter_config.json"
    _bad(capsys, ["--adapter", f"a={config_file}"],
         f"--adapter a: {config_file} is a file; give the PEFT adapter's directory (the one holding "
         f"adapter_config.json and adapter_model.safetensors); did you mean its directory, {adapter}?")
    (tmp_path / "empty").mkdir()
    _bad(capsys, ["--adapter", f"e={tmp_path / 'empty'}"], "--adapter e: ")
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "adapter_config.json").write_text(config_file.read_text())
    (garbage / "adapter_model.safetensors").write_bytes(b"\x00" * 100)
    _bad(capsys, ["--adapter", f"g={garbage}"], "--adapter g: ")
    _bad(capsys, ["--adapter", f"a={adapter}", "--adapter", f"a={adapter}"], "--adapter 'a' given twice")


def test_an_adapter_for_another_model_without_model_config_says_what_is_missing(capsys, no_work, tmp_path):
    adapter = _adapter_of(tmp_path, SMALL)  # hidden_size 32: not the default model's 256
    err = _bad(capsys, ["--adapter", f"a={adapter}"], "does not fit")
    assert err.rstrip().endswith("give the adapters' base model with --model-config path/to/config.json")
    err = _bad(capsys, ["--adapter", f"a={adapter}", "--model-config", '{"hidden_size": 64}'], "does not fit")
    assert err.rstrip().endswith("; is --model-config the config of the adapters' base model?")


def test_an_adapter_of_a_layer_the_model_lacks(capsys, no_work, tmp_path):
    path = save_peft_adapter(tmp_path / "deep", {"model.layers.5.self_attn.q_proj": (torch.ones(2, 32),
                                                                                      torch.ones(32, 2))},
                             lora_alpha=2)
    _bad(capsys, ["--adapter", f"d={path}", "--model-config", SMALL],
         "--adapter: adapter 'd' targets 'model.layers.5.self_attn.q_proj', which is not wrapped")


# The real command, as a user runs it: a fresh interpreter (most of its time is importing torch).
@pytest.mark.parametrize(("argv", "message"), [
    (["--model-config", '{"num_hidden_layers": 100000}'], "num_hidden_layers must be an integer from 1 to 512"),
    (["--json", "/nonexistent/dir/x.json"], "--json: no such directory: /nonexistent/dir"),
    (["--decode-steps", "1e9"], "argument --decode-steps: must be an integer from 1 to 1000"),
    (["bench", "--device", "nosuch"], "--device is an option of run, not of bench"),
])
def test_the_command_in_a_subprocess(argv, message):
    run = subprocess.run([sys.executable, "-m", "lora_layers.sim", *argv], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and run.stdout == "", run.stderr
    assert run.stderr.count("\n") == 1 and message in run.stderr, run.stderr


def test_progress_lines_on_stderr_and_quiet(capsys, tmp_path):
    argv = ["--device", "cpu", "--device", "npu", "--backend", "torch_native", "--model-config", SMALL,
            "--decode-steps", "1", "--rounds", "3"]
    assert sim.main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("lora-sim: writing 4 synthetic adapters; 1 backend(s) x 2 device(s) to run, about ")
    assert err[1] == "lora-sim: building 7 fp32 reference models"  # the base, 5 (adapter, scale) pairs, the mix
    assert err[2].startswith("lora-sim: [1/2] torch_native / cpu: pass, ") and err[2].endswith(" s")
    assert err[3].startswith("lora-sim: [2/2] torch_native / npu: skipped: torch_npu")
    assert err[4].startswith("lora-sim: 2 rows in ") and len(err) == 5
    assert sim.main([*argv, "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_json_on_stdout_is_the_only_output(capsys):
    assert sim.main(["--device", "cpu", "--backend", "torch_native", "--model-config", SMALL,
                     "--decode-steps", "1", "--rounds", "3", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    document = json.loads(out)
    assert [r["status"] for r in document["rows"]] == ["pass"] and document["rounds"] == 3


def test_bench_prints_a_line_per_benchmark_unless_quiet(capsys, monkeypatch):
    class EntryPoint:
        def __init__(self, name):
            self.name, self.value = name, f"fake_{name}:main"

        def load(self):
            return lambda argv: 0

    monkeypatch.setattr(sim.bench, "entry_points", lambda group: [EntryPoint("b"), EntryPoint("a")])
    assert sim.main(["bench", "--smoke"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "lora-sim bench: [1/2] a: running fake_a:main --smoke"
    assert err[1].startswith("lora-sim bench: [1/2] a: exit status 0, ") and err[1].endswith(" s")
    assert err[2] == "lora-sim bench: [2/2] b: running fake_b:main --smoke" and len(err) == 4
    assert sim.main(["bench", "--quiet"]) == 0
    assert capsys.readouterr().err == ""
