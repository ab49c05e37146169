"""The fleet bench's CPU accounting over a process tree (``trajgate.bench.fleet``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from trajgate.bench.fleet import process_tree_cpu_s
from trajgate.bench.gateway import process_cpu_s

# A child that burns 50 ms of its own CPU, says so, then idles until killed.
_BURN_THEN_SLEEP = (
    "import time\n"
    "t = time.process_time()\n"
    "while time.process_time() - t < 0.05: pass\n"
    "print('burnt', flush=True)\n"
    "time.sleep(60)\n"
)


def _burn_cpu(seconds: float) -> None:
    started = time.thread_time()
    while time.thread_time() - started < seconds:
        pass


def test_process_tree_cpu_is_read_finer_than_a_clock_tick() -> None:
    """2 ms of CPU shows in the tree's reading each time: summed from /proc's 10 ms ticks it
    would read as 0.0 s in most of the five tries."""
    for _ in range(5):
        before = process_tree_cpu_s([os.getpid()])
        _burn_cpu(0.002)
        after = process_tree_cpu_s([os.getpid()])
        assert 0 < after - before < 1.0


def test_process_tree_cpu_counts_the_children() -> None:
    """A child's 50 ms (plus its interpreter's start-up) adds to its parent's reading."""
    child = subprocess.Popen(
        [sys.executable, "-c", _BURN_THEN_SLEEP], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "burnt\n"
        child_s = process_cpu_s(child.pid)
        own_s = process_cpu_s(os.getpid())
        tree_s = process_tree_cpu_s([os.getpid()])
        assert child_s is not None and own_s is not None and child_s >= 0.05
        assert tree_s >= own_s + 0.05
    finally:
        child.kill()
        child.wait()
