"""Aggregates for the inspector's charts, and the trainer's metrics (append-only).

Owns: reward by policy version (mean, standard error and n per channel), steps and tokens per
time bucket, length histograms, flag rates per policy version, and ``training_metrics`` rows.
Never: samples or estimates; every number is an exact SQL aggregate over the window asked for
(``since``). Each reads a narrow index of ``steps`` rather than the rows with their requests
(migration 0009: ``ix_steps_trajectory_version``, ``ix_steps_charts``, ``ix_steps_flagged``), so
a chart of a large pool costs a few index scans of the window's steps.

A trajectory's policy version here is the newest version among its steps (the weights that
finished it); its reward is the current value of ``reward_name`` (by default the trajectory
reward recorded last; unrewarded ones are left out of means, never counted as 0).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy import Text, bindparam, cast, func, select, text
from sqlalchemy.orm import Session

from datapool.db import Sessions
from datapool.models import FLAGGED_STEP, Step, TrainingMetric, Trajectory
from datapool.queries.rewards import reward_names
from datapool.rewards.values import current_rewards_query

HISTOGRAM_BINS = 30
T = TypeVar("T")
MAX_BUCKETS = 500


def charts(
    sessions: Sessions, *, since: datetime | None, bucket_s: int, reward_name: str | None
) -> dict[str, Any]:
    """Every chart's series; see the module docstring for what each number means.
    ``reward_name`` None: the trajectory reward recorded last (``reward_names`` lists every one
    present, that one first).

    The four aggregates are independent index scans, so they run at once, each in its own
    session on its own pooled connection (SQLite and psycopg release the GIL while a query
    runs): the wall time is the slowest scan's rather than their sum when cores are free. Each
    series is exact for its own snapshot; steps committed between the reads may be in one series
    and not yet in another.
    """
    with sessions() as session:
        names = reward_names(session)
    chosen = reward_name if reward_name is not None else (names[0] if names else None)

    def read(part: Callable[[Session], T]) -> Callable[[], T]:
        def run() -> T:
            with sessions() as session:
                return part(session)

        return run

    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="charts") as pool:
        over_time = pool.submit(read(lambda s: _steps_over_time(s, since, bucket_s)))
        by_version = pool.submit(
            read(lambda s: [] if chosen is None else _reward_by_version(s, since, chosen))
        )
        histograms = pool.submit(read(lambda s: _histograms(s, since)))
        flag_rates = pool.submit(read(lambda s: _flag_rates(s, since)))
        bucket_s, steps_over_time = over_time.result()
        return {
            "bucket_s": bucket_s,
            "reward_names": names,
            "reward_name": chosen,
            "reward_by_version": by_version.result(),
            "steps_over_time": steps_over_time,
            **{f"{name}_histogram": h for name, h in histograms.result().items()},
            "flag_rates": flag_rates.result(),
        }


def _reward_by_version(
    session: Session, since: datetime | None, reward_name: str
) -> list[dict[str, Any]]:
    """``[{channel, policy_version, n, mean, stderr}]`` per channel and version, over the
    rewarded trajectories with a step since ``since``; ``stderr`` is the standard error of the
    mean, ``sqrt(s^2 / n)`` with the sample variance ``s^2 = n / (n - 1) * (mean(v^2) -
    mean(v)^2)`` (None when ``n < 2``)."""
    versions = select(
        Step.trajectory_id.label("trajectory_id"),
        func.max(Step.policy_version).label("version"),
    ).group_by(Step.trajectory_id)
    if since is not None:
        versions = versions.where(Step.created_at >= since)
    by_trajectory = versions.subquery()
    reward = current_rewards_query("trajectory", reward_name)
    value = reward.c.value
    query = (
        select(
            Trajectory.channel,
            by_trajectory.c.version,
            func.count(value),
            func.avg(value),
            func.avg(value * value),
        )
        .select_from(Trajectory)
        .join(by_trajectory, by_trajectory.c.trajectory_id == Trajectory.id)
        .join(reward, reward.c.target_id == Trajectory.id)
        .where(value.is_not(None))
        .group_by(Trajectory.channel, by_trajectory.c.version)
        .order_by(Trajectory.channel, by_trajectory.c.version)
    )
    out = []
    for channel, version, n, mean, mean_sq in session.execute(query):
        n, mean = int(n), float(mean)
        stderr = None
        if n > 1:
            variance = max(0.0, n / (n - 1) * (float(mean_sq) - mean * mean))
            stderr = math.sqrt(variance / n)
        out.append(
            {"channel": channel, "policy_version": version, "n": n, "mean": mean, "stderr": stderr}
        )
    return out


def _steps_over_time(
    session: Session, since: datetime | None, bucket_s: int
) -> tuple[int, list[dict[str, Any]]]:
    """``(bucket_s, [{t, steps, prompt_tokens, completion_tokens}])``: one range sum over
    ``ix_steps_charts`` per bucket with steps (``t``: the bucket's start, epoch seconds).
    ``bucket_s`` is widened to a multiple of itself when the window would need more than
    ``MAX_BUCKETS`` buckets (a chart is narrower than that)."""
    where = [] if since is None else [Step.created_at >= since]
    first, last = session.execute(
        select(func.min(Step.created_at), func.max(Step.created_at)).where(*where)
    ).one()
    if first is None or last is None:
        return bucket_s, []
    start = int(first.timestamp()) // bucket_s * bucket_s
    buckets = (int(last.timestamp()) - start) // bucket_s + 1
    if buckets > MAX_BUCKETS:
        bucket_s *= -(-buckets // MAX_BUCKETS)  # ceil: at most MAX_BUCKETS buckets
        start = int(first.timestamp()) // bucket_s * bucket_s
    lo, hi = (
        bindparam("lo", type_=Step.created_at.type),
        bindparam("hi", type_=Step.created_at.type),
    )
    # A range per bucket instead of GROUP BY a time expression: the index is already in time
    # order, and grouping by an expression would compute it per step and sort them all.
    query = select(
        func.count(),
        func.coalesce(func.sum(Step.prompt_tokens), 0),
        func.coalesce(func.sum(Step.completion_tokens), 0),
    ).where(Step.created_at >= lo, Step.created_at < hi)
    out = []
    t = start
    while t <= last.timestamp():
        lower = (
            max(datetime.fromtimestamp(t, UTC), since) if since else datetime.fromtimestamp(t, UTC)
        )
        upper = datetime.fromtimestamp(t + bucket_s, UTC)
        n, p, c = session.execute(query, {"lo": lower, "hi": upper}).one()
        if n:
            out.append(
                {"t": t, "steps": n, "prompt_tokens": int(p or 0), "completion_tokens": int(c or 0)}
            )
        t += bucket_s
    return bucket_s, out


def _histograms(session: Session, since: datetime | None) -> dict[str, dict[str, Any]]:
    """Prompt and response lengths in ``HISTOGRAM_BINS`` equal-width bins from 0 to each
    maximum: ``{prompt_tokens: {width, counts}, completion_tokens: {width, counts}}``. Counted
    per distinct length over that length's index (``ix_steps_prompt_tokens``,
    ``ix_steps_completion_tokens``: in order, so no sort), then binned here."""
    columns: dict[str, Any] = {
        "prompt_tokens": Step.prompt_tokens,
        "completion_tokens": Step.completion_tokens,
    }
    where = [] if since is None else [Step.created_at >= since]
    out = {}
    for name, column in columns.items():
        query = select(column, func.count()).where(column.is_not(None), *where).group_by(column)
        lengths = [(int(length), int(n)) for length, n in session.execute(query)]
        top = max((length for length, _ in lengths), default=0)
        width = max(1, -(-(top + 1) // HISTOGRAM_BINS))  # ceil((top + 1) / bins)
        counts = [0] * HISTOGRAM_BINS
        for length, n in lengths:
            counts[min(length // width, HISTOGRAM_BINS - 1)] += n
        out[name] = {"width": width, "counts": counts}
    return out


def _flag_rates(session: Session, since: datetime | None) -> dict[str, Any]:
    """Per policy version: steps, and the share of them carrying each flag. Steps per version
    come from ``ix_steps_charts``; the flags only from the flagged steps (``ix_steps_flagged``,
    whose predicate the query repeats verbatim)."""
    where = [] if since is None else [Step.created_at >= since]
    totals: dict[int | None, int] = defaultdict(int)
    for version, n in session.execute(
        select(Step.policy_version, func.count()).where(*where).group_by(Step.policy_version)
    ):
        totals[version] += int(n)
    # Grouped by the JSON text: PostgreSQL's json type has no equality operator.
    flags_text = cast(Step.flags, Text)
    query = (
        select(Step.policy_version, flags_text, func.count())
        .where(text(FLAGGED_STEP), *where)
        .group_by(Step.policy_version, flags_text)
    )
    flagged: dict[int | None, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for version, flags, n in session.execute(query):
        for flag in json.loads(flags) if flags else []:
            flagged[version][str(flag)] += int(n)
    names = sorted({f for counts in flagged.values() for f in counts})
    versions = sorted(totals, key=lambda v: (v is None, v or 0))
    return {
        "flags": names,
        "versions": [
            {
                "policy_version": v,
                "steps": totals[v],
                "rates": {f: flagged[v].get(f, 0) / totals[v] for f in names},
            }
            for v in versions
        ],
    }


# ---- training metrics ----------------------------------------------------------------------


def add_training_metrics(sessions: Sessions, rows: Sequence[dict[str, Any]]) -> list[int]:
    """Append rows ``{run, policy_version, step, metrics}`` in one transaction; their ids."""
    with sessions.begin() as session:
        records = [TrainingMetric(**row) for row in rows]
        session.add_all(records)
        session.flush()
        return [r.id for r in records]


def training_metrics(
    sessions: Sessions, run: str | None, after_id: int, limit: int
) -> list[TrainingMetric]:
    """At most ``limit`` rows of ``run`` (None: every run), oldest first (by id), after
    ``after_id`` so a chart can poll for new ones."""
    query = select(TrainingMetric).where(TrainingMetric.id > after_id)
    if run is not None:
        query = query.where(TrainingMetric.run == run)
    with sessions() as session:
        return list(session.scalars(query.order_by(TrainingMetric.id).limit(limit)))
