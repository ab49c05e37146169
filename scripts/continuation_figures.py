"""Exact continuation's figures on a pool: prefix breaks among non-first steps, merged
rows per trajectory, and how many prompts each mode built.

Usage: ``.venv/bin/python scripts/continuation_figures.py DATA_DIR`` (a pool directory, e.g. the
one ``trajgate demo`` prints).
"""

from __future__ import annotations

import sys
from collections import Counter

import numpy as np
from sqlalchemy import select

from datapool.batches.rows import StepTokens, segments
from datapool.db import make_engine
from datapool.models import Trajectory
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore


def main(data_dir: str) -> str:
    settings = PoolSettings(data_dir=data_dir)
    store = PoolStore(make_engine(settings.resolved_database_url()), settings)
    with store.sessions() as session:
        trajectory_ids = list(session.scalars(select(Trajectory.id)))
    non_first = breaks = 0
    rows: Counter[int] = Counter()
    modes: Counter[str | None] = Counter()
    kinds: Counter[str | None] = Counter()
    for trajectory_id in trajectory_ids:
        steps = [s for s in store.steps_of(trajectory_id) if s.outcome == "ok"]
        for step in steps:
            modes[step.continuation] += 1
            if step.step_index > 0:
                non_first += 1
                if "prefix_break" in step.flags:
                    breaks += 1
                    kinds[step.divergence_kind] += 1
        trainable = [
            StepTokens(
                s.row,
                np.asarray(s.prompt_token_ids),
                np.asarray(s.response_token_ids),
                np.asarray(s.response_logprobs, dtype=np.float32),
            )
            for s in steps
            if s.prompt_token_ids and s.response_token_ids and s.response_logprobs is not None
        ]
        merged, _dropped = segments(trainable, "merged", None)
        rows[len(merged)] += 1
    per_trajectory = sum(k * v for k, v in rows.items()) / max(1, len(trajectory_ids))
    return (
        f"trajectories {len(trajectory_ids)}; prefix breaks among non-first steps "
        f"{breaks}/{non_first} {dict(kinds)}; merged rows per trajectory {per_trajectory:.3f} "
        f"{dict(rows)}; prompts built by {dict(modes)}"
    )


if __name__ == "__main__":
    print(main(sys.argv[1]))
