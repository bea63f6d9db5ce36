"""bench/context_parallel.py's machinery on the CPU: the largest-N search against a memory model,
and a smoke run of both implementations over 2 gloo ranks (rows and plot written). No timings are
asserted."""
from __future__ import annotations

import argparse
import json

import pytest

from tpfkit.benchmarks import context_parallel as bench


class FakeRunner:
    """Peak memory a + b N^2 GiB; a size fits up to `limit` (below the fit when transients bite)."""

    def __init__(self, limit: int, a: float = 2.0, b: float = 8e-6, free: float = 139.0):
        self.limit, self.a, self.b, self.free = limit, a, b, free
        self.rows, self.attempts = [], 0

    def run(self, impl, sizes, stop_at_failure=True):
        self.attempts += 1
        rows = []
        for n in sizes:
            fits = n <= self.limit
            rows.append(dict(impl=impl, N=n, fits=fits, gpu_free_gib=self.free,
                             peak_gib_per_gpu=self.a + self.b * n * n if fits else None,
                             error=None if fits else bench.OUT_OF_MEMORY))
        self.rows += rows
        return rows


@pytest.mark.parametrize("limit", [1100, 1536, 2000, 2700, 3333, 4100])
def test_search_finds_the_largest_fitting_size(limit):
    runner = FakeRunner(limit)
    first = runner.run("single", [512, 1024, 1536, 2048])
    found = bench.search_largest(runner, "single", first, n_step=128)
    assert found <= limit < found + 128, f"limit {limit}: found {found}"
    assert runner.attempts <= 1 + bench.MAX_ATTEMPTS


def test_search_stops_on_an_error_that_is_not_memory():
    runner = FakeRunner(4000)
    first = runner.run("single", [512, 1024])
    runner.run = lambda impl, sizes, stop_at_failure=True: [dict(
        impl=impl, N=sizes[0], fits=False, peak_gib_per_gpu=None, gpu_free_gib=139.0,
        error="RuntimeError: kernel failed")]
    assert bench.search_largest(runner, "single", first, n_step=128) == 1024


def test_smoke_run_on_gloo_ranks(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "rows.json"
    args = parser.parse_args(["--device", "cpu", "--gpus", "2", "--sizes", "12", "21",
                              "--repeats", "1", "--c-z", "16", "--c-s", "8", "--json", str(out)])
    assert bench.run(args) == 0
    rows = json.loads(out.read_text())
    assert {(r["impl"], r["N"]) for r in rows} == {(impl, n) for impl in bench.IMPLS
                                                   for n in (12, 21)}
    for r in rows:
        assert r["fits"] and r["step_ms"] > 0 and r["error"] is None, r
        assert {"impl", "gpus", "N", "step_ms", "peak_gib_per_gpu", "exposed_comm_ms", "commit",
                "date"} <= set(r)
        assert r["gpus"] == (1 if r["impl"] == "single" else 2)
        assert r["step_peak_gib"] > 0, r
    assert out.with_suffix(".png").stat().st_size > 0


def test_refuses_fewer_than_two_ranks():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(ValueError, match="--gpus"):
        bench.run(parser.parse_args(["--device", "cpu", "--gpus", "1"]))
