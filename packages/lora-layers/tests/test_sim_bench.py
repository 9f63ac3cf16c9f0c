"""`lora-sim bench` finds benchmarks through the lora_core.benchmarks entry points."""

import pytest

from lora_layers import sim
from lora_layers.sim import bench


class FakeEntryPoint:
    def __init__(self, name, main=None, error=None):
        self.name, self.value, self.group = name, f"fake_{name}.bench:main", bench.BENCHMARK_GROUP
        self._main, self._error = main, error

    def load(self):
        if self._error:
            raise self._error
        return self._main


@pytest.fixture
def installed(monkeypatch):
    """Install fake benchmarks: installed(ep, ...) replaces the entry-point group."""
    def install(*eps):
        def entry_points(group):
            assert group == "lora_core.benchmarks"
            return list(eps)
        monkeypatch.setattr(bench, "entry_points", entry_points)
    return install


def test_benchmarks_run_in_name_order_with_smoke_under_a_header(installed, capsys):
    calls = []

    def recorder(name):
        def main(argv):
            calls.append((name, argv))
            print(f"table of {name}")
            return 0
        return main

    installed(FakeEntryPoint("zeta", recorder("zeta")), FakeEntryPoint("alpha", recorder("alpha")))
    assert sim.main(["bench", "--smoke"]) == 0
    assert calls == [("alpha", ["--smoke"]), ("zeta", ["--smoke"])]
    out = capsys.readouterr().out
    assert out.index("## benchmark alpha") < out.index("table of alpha") < out.index("## benchmark zeta")
    assert sim.main(["bench"]) == 0 and calls[-1] == ("zeta", [])


def test_a_failing_benchmark_status_propagates_and_the_others_still_run(installed, capsys):
    ran = []
    installed(FakeEntryPoint("a", lambda argv: ran.append("a") or 3),
              FakeEntryPoint("b", lambda argv: ran.append("b") or 0))
    assert sim.main(["bench", "--smoke"]) == 3
    assert ran == ["a", "b"] and "a exited with status 3" in capsys.readouterr().err


def test_a_benchmark_that_cannot_load_raises_or_exits_is_a_failure(installed, capsys):
    def rejects(argv):
        raise SystemExit(2)

    def raises(argv):
        raise RuntimeError("boom")

    installed(FakeEntryPoint("a", error=ImportError("no module named fake_a")), FakeEntryPoint("b", raises),
              FakeEntryPoint("c", rejects), FakeEntryPoint("d", lambda argv: 0))
    assert sim.main(["bench"]) == 1  # the first failure: a could not be loaded
    err = capsys.readouterr().err
    assert "cannot load a" in err and "RuntimeError: boom" in err and "c exited with status 2" in err


def test_no_benchmark_installed_says_so_and_exits_1(installed, capsys):
    installed()
    assert sim.main(["bench"]) == 1
    assert "no benchmarks are installed" in capsys.readouterr().err


def test_the_installed_backends_register_their_benchmarks():
    names = [ep.name for ep in bench.discover_benchmarks()]
    assert "torch_native" in names and names == sorted(names)
