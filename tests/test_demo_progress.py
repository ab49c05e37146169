"""The demo says how far a round is while it plays, and warns up front on a loaded machine.

Found by a tryout: on a loaded machine the demo printed nothing for its first 35 minutes. A
round now reports ``episodes done / total, elapsed`` every ``progress_interval_s`` while
episodes are pending (``trajgate.demo.results_reporting``, here over real threads whose
episodes wait for the test to release them), and the demo warns when the 1-minute load
average exceeds the CPU count (``load_warning``). A whole demo is not run.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from trajgate.demo import DemoConfig, load_warning, results_reporting


def test_a_round_reports_episodes_done_while_some_are_pending() -> None:
    release = threading.Event()
    reports: list[tuple[int, float]] = []

    def report(done: int, elapsed_s: float) -> None:
        reports.append((done, elapsed_s))
        release.set()  # the episodes finish only after the first report

    def episode(name: str) -> str:
        release.wait()
        return name

    with ThreadPoolExecutor(max_workers=2) as executor:
        futures = [executor.submit(episode, name) for name in ("g0-0", "g0-1", "g1-0")]
        played = results_reporting(futures, report, interval_s=0.01)
    assert played == ["g0-0", "g0-1", "g1-0"]  # in the order submitted
    assert reports[0][0] == 0  # nothing done before the release
    assert all(0 <= done < 3 and elapsed_s >= 0 for done, elapsed_s in reports)


def test_a_failed_episode_ends_the_round_without_waiting_for_the_others() -> None:
    release = threading.Event()

    def fails() -> str:
        raise RuntimeError("POST /api/trajectories -> 503")

    with ThreadPoolExecutor(max_workers=2) as executor:
        futures = [executor.submit(release.wait), executor.submit(fails)]
        with pytest.raises(RuntimeError, match="503"):
            results_reporting(futures, lambda done, elapsed_s: None, interval_s=60.0)
        assert not futures[0].done()  # raised while the other episode still ran
        release.set()


@pytest.mark.parametrize(
    ("load_1m", "cpus", "warned"),
    [(2.5, 2, True), (16.0, 2, True), (2.0, 2, False), (0.3, 16, False)],
)
def test_load_average_above_the_cpu_count_is_warned(
    load_1m: float, cpus: int, warned: bool
) -> None:
    warning = load_warning(load_1m, cpus)
    if warned:
        assert warning is not None
        assert f"load average is {load_1m:.1f} on {cpus} CPUs" in warning
        assert "slower than the README's estimate" in warning
    else:
        assert warning is None


def test_demo_config_refuses_a_progress_interval_that_is_not_positive() -> None:
    assert DemoConfig().progress_interval_s == 30.0
    with pytest.raises(ValueError, match="progress_interval_s must be > 0, got 0"):
        DemoConfig(progress_interval_s=0)
