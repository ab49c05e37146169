"""``trajgate bench export``: how fast the pool turns stored steps into trainer-ready rows.

Owns: the synthetic data (10-turn tool-use trajectories from ``trajgate.bench.pool``, written
through
``PoolStore.record_call``, completed with rewards, in groups whose rollouts share the task
prompt) and the measurement. Never: used by
the gateway.

Measured, per layout, the wall time of ``build_rows`` (select ready trajectories, read the exact
payloads, score groups, compute advantages, assemble the Arrow columns) after one warm-up:
``rows_per_s``, ``tokens_per_s`` (row tokens per second: per_step rows repeat each prompt, so
per_step moves more tokens than merged for the same steps) and ``merge_ratio`` (tokens in
per_step rows ÷ tokens in merged rows). ``materialise_s`` adds writing the Parquet file and the
lineage rows. ``compacted`` repeats the read after compaction into Parquet payload files.
``anchor_state`` repeats the per_step build from SQL payloads with GiGPO's anchor-state grouping
(``step_advantage: anchor_state``: a state key hashed per step, sub-groups, step returns), so
its ``rows_per_s`` beside the plain per_step figure is the extra cost of anchor grouping.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from datapool import db
from datapool.batches.build import BatchSpec, build_rows, materialise
from datapool.batches.settings import BatchSettings
from datapool.db import make_engine
from datapool.lifecycle import transitions as lifecycle
from datapool.models import TrajectoryStatus
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore
from trajgate.bench.pool import synthetic_call, synthetic_trajectory


def _measure(store: PoolStore, spec: BatchSpec, repeats: int) -> tuple[float, int, int]:
    build_rows(store, spec)  # warm-up: imports, caches
    best = float("inf")
    rows = tokens = 0
    for _ in range(repeats):
        started = time.perf_counter()
        table, manifest = build_rows(store, spec)
        best = min(best, time.perf_counter() - started)
        rows, tokens = table.num_rows, int(manifest["counts"]["tokens"])
    return best, rows, tokens


def bench_export(
    trajectories: int = 200,
    turns: int = 10,
    group_size: int = 4,
    repeats: int = 3,
    database_url: str | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Write the synthetic pool (SQLite in a temporary directory unless ``database_url`` names
    an empty database), then measure both layouts before and after compaction."""
    with tempfile.TemporaryDirectory(prefix="trajgate-bench-export-") as tmp:
        url = database_url or f"sqlite:///{Path(tmp) / 'pool.sqlite3'}"
        db.upgrade(url)
        settings = PoolSettings(data_dir=Path(tmp), database_url=url, compaction_interval_s=0)
        store = PoolStore(make_engine(url), settings)
        rng = np.random.default_rng(seed)
        started = time.perf_counter()
        for i in range(trajectories):
            trajectory_id = f"bench-{i}"
            group_id = f"task-{i // group_size}"
            calls = synthetic_trajectory(rng, turns, response_tokens=150, tool_tokens=300)
            if i % group_size == 0:
                task = calls[0][0]  # the group's task: system prompt and task tokens
            # every rollout of a task starts from its prompt (anchor grouping finds the first steps)
            calls = [([*task, *p[len(task) :]], r, lp) for p, r, lp in calls]
            for k, (prompt, response, logprobs) in enumerate(calls):
                store.record_call(
                    trajectory_id,
                    synthetic_call(trajectory_id, prompt, response, logprobs, k),
                    group_id=group_id,
                )
            lifecycle.close_trajectory(
                store.sessions,
                trajectory_id,
                TrajectoryStatus.COMPLETE,
                final_reward=float(rng.integers(0, 2)),
            )
        write_s = time.perf_counter() - started
        base = BatchSpec(
            algorithm="grpo", drop_degenerate_groups=False, exclude_batched=False, apply_rules=False
        )
        report: dict[str, Any] = {
            "backend": store.engine.dialect.name,
            "trajectories": trajectories,
            "turns": turns,
            "steps": trajectories * turns,
            "write_s": round(write_s, 2),
        }
        for phase in ("sql_payloads", "compacted"):
            if phase == "compacted":
                while store.payloads.compact(settings.compaction_max_steps) is not None:
                    pass
            figures: dict[str, Any] = {}
            for layout in ("per_step", "merged"):
                seconds, rows, tokens = _measure(
                    store, base.model_copy(update={"layout": layout}), repeats
                )
                figures[layout] = {
                    "rows": rows,
                    "tokens": tokens,
                    "seconds": round(seconds, 4),
                    "rows_per_s": round(rows / seconds),
                    "tokens_per_s": round(tokens / seconds),
                }
            report[phase] = figures
            if phase == "sql_payloads":
                anchored = base.model_copy(update={"step_advantage": "anchor_state"})
                seconds, rows, tokens = _measure(store, anchored, repeats)
                _table, manifest = build_rows(store, anchored)
                report["anchor_state"] = {
                    "rows": rows,
                    "seconds": round(seconds, 4),
                    "rows_per_s": round(rows / seconds),
                    "tokens_per_s": round(tokens / seconds),
                    "steps_in_subgroups": manifest["step_credit"]["anchor"]["steps_in_subgroups"],
                }
        sql = report["sql_payloads"]
        report["rows_per_s"] = sql["per_step"]["rows_per_s"]
        report["tokens_per_s"] = sql["per_step"]["tokens_per_s"]
        report["merged_tokens_per_s"] = sql["merged"]["tokens_per_s"]
        report["merge_ratio"] = round(sql["per_step"]["tokens"] / sql["merged"]["tokens"], 2)
        report["anchor_rows_per_s"] = report["anchor_state"]["rows_per_s"]
        report["anchor_cost_ratio"] = round(
            report["anchor_state"]["seconds"] / sql["per_step"]["seconds"], 3
        )
        started = time.perf_counter()
        materialise(store, base, BatchSettings(batch_uri=str(Path(tmp) / "batches")))
        report["materialise_per_step_s"] = round(time.perf_counter() - started, 3)
        report["goals_met"] = {
            "tokens_per_s>=1e7": report["tokens_per_s"] >= 1e7,
            "merge_ratio>=4": report["merge_ratio"] >= 4,
        }
        store.engine.dispose()
    return report
