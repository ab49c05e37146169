"""``trajgate bench inspector`` at a tiny scale: it fills a pool, every endpoint it times answers
200 (the bench asserts it), and the report counts what it filled."""

from __future__ import annotations

from pathlib import Path

from trajgate.bench.inspector import run_inspector_benchmark


def test_inspector_bench_runs_every_timed_endpoint(tmp_path: Path) -> None:
    report = run_inspector_benchmark(
        trajectories=40, steps_per_trajectory=3, repeats=1, data_dir=tmp_path
    )
    assert (report["trajectories"], report["steps"]) == (40, 120)
    assert report["fill_s"] is not None  # filled now; a second run reuses the pool
    for key in ("list_p50_ms", "list_p99_ms", "trajectory_view_p50_ms", "charts_ms"):
        assert report[key] > 0, key
    again = run_inspector_benchmark(
        trajectories=40, steps_per_trajectory=3, repeats=1, data_dir=tmp_path
    )
    assert again["fill_s"] is None
