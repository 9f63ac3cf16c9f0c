"""lora_core.testing.timing: the --clock option the end-to-end benchmarks share."""

import time

import pytest

from lora_core.testing.timing import add_clock_option, benchmark_parser, clock_from


def _parser():
    parser = benchmark_parser("bench", "a benchmark")
    parser.add_argument("--device", default="cpu")
    add_clock_option(parser)
    return parser


def test_the_wall_clock_by_default_and_the_thread_clock_for_one_thread():
    parser = _parser()
    assert clock_from(parser, parser.parse_args([])) is time.perf_counter
    assert clock_from(parser, parser.parse_args(["--clock", "thread", "--threads", "1"])) is time.thread_time


@pytest.mark.parametrize("argv", [["--clock", "thread"], ["--clock", "thread", "--threads", "1", "--device", "cuda"]])
def test_the_thread_clock_is_refused_off_one_cpu_thread(argv, capsys):
    parser = _parser()
    with pytest.raises(SystemExit) as exit_info:
        clock_from(parser, parser.parse_args(argv))
    assert exit_info.value.code == 2
    assert "use it with --threads 1 on the CPU" in capsys.readouterr().err
