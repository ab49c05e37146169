"""The README's first command, reduced: ``trajgate demo`` closes the RL loop on the real vLLM.

Agents act through the gateway, rewards are backfilled by the registered reward function, a GRPO
batch is leased and trained on (LoRA), the adapter is hot-loaded, and the next round's steps
carry the new policy version. Whether the reward rises is measured by the full demo (closing
note of the trainer issue), not asserted here: two updates are too few to tell.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests_support import free_port

from datapool.db import make_engine
from datapool.queries import charts
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore
from trajgate.vllm_server import VLLMServer


def test_demo_closes_the_loop_from_agents_to_new_policy_versions(
    vllm: VLLMServer, tmp_path: Path
) -> None:
    vllm_port = vllm.url.rsplit(":", 1)[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJGATE_DATA")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trajgate.cli",
            "demo",
            "--model",
            "tiny",
            "--exit",
            "--json",
            "--rounds",
            "2",
            "--groups",
            "4",
            "--group-size",
            "4",
            "--agents",
            "4",
            "--no-control",
            "--port",
            str(free_port()),
            "--vllm-port",
            vllm_port,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["batches_trained"] == 2
    assert summary["policy_versions"] == [0, 1, 2]
    # Three measured versions (v0, v1, v2) of rounds of 4 groups x 4 rollouts, every one
    # rewarded; a version plays another round when no group had a reward spread (dynamic
    # sampling), so n is a multiple of 16.
    curve = summary["reward_by_policy_version"]
    assert [v for v, _, _ in curve] == [0, 1, 2]
    assert all(n > 0 and n % 16 == 0 for _, _, n in curve)
    assert all(0.0 <= mean <= 1.0 for _, mean, _ in curve)
    assert summary["trajectories"] == sum(n for _, _, n in curve)
    assert summary["logprob_gap_mean_abs"] < 1e-4  # fp32 sampler and trainer agree
    means = [mean for _, mean, _ in curve]
    assert summary["gain"] == round(sum(means[-2:]) / 2 - means[0], 4)
    assert summary["control_gain"] is None  # --no-control
    assert summary["model"] == "tiny"
    # Read back from the pool per version: as many episodes as the reward curve counts. (Not
    # asserted: that every forced call parses and none is tool_call_truncated; a run on
    # 2026-12-02 had at least one that did not.)
    tool_calls = summary["tool_calls_by_policy_version"]
    assert [(v, n) for v, n, _, _ in tool_calls] == [(v, n) for v, _, n in curve]
    assert summary["control_tool_calls_by_policy_version"] == []
    pool = PoolSettings(data_dir=tmp_path / summary["pool"])
    store = PoolStore(make_engine(pool.resolved_database_url()), pool)
    # each round was served by one version, the one trained before it, in round order
    served: list[int] = []
    for round_index in range(summary["trajectories"] // 16):
        versions = {
            step.policy_version
            for group in range(4)
            for member in range(4)
            for step in store.steps_of(f"train-r{round_index}-g{group}-{member}")
        }
        assert len(versions) == 1, (round_index, versions)
        served.append(versions.pop())
    assert served == sorted(served)
    assert [served.count(v) * 16 for v in (0, 1, 2)] == [n for _, _, n in curve]
    # each update's metrics reached the pool (the inspector's training chart), finite
    posted = charts.training_metrics(store.sessions, "train", 0, 100)
    assert [(m.step, m.policy_version) for m in posted] == [(1, 1), (2, 2)]
    assert all(math.isfinite(v) for m in posted for v in m.metrics.values())
    assert all(m.metrics["grad_norm"] > 0 and "loss" in m.metrics for m in posted)


def test_a_start_that_fails_part_way_stops_what_it_started(monkeypatch: Any) -> None:
    """Found by a review: ``run_demo`` called ``start`` outside its ``finally``, so a failure
    after vLLM had started (the gateway's port taken in between) left vLLM running after
    ``--exit``. Now what started is stopped, and only that (``stop`` of a part-way run)."""
    import pytest

    from trajgate import demo

    stopped: list[str] = []

    class _Started:
        def stop(self) -> None:
            stopped.append("vllm")

    def start_then_fail(self: demo.DemoRun) -> None:
        self.vllm = _Started()  # type: ignore[assignment]
        raise demo.DemoError("the gateway did not start")

    monkeypatch.setattr(demo.DemoRun, "start", start_then_fail)
    config = demo.DemoConfig.for_model("tiny", gateway_port=free_port(), vllm_port=free_port())
    with pytest.raises(demo.DemoError, match="the gateway did not start"):
        demo.run_demo(config, echo=False)
    assert stopped == ["vllm"]
