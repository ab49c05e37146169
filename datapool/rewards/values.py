"""Rewards: append-only records on steps, trajectories and lineages, current values, functions.

Owns: appending reward records (never updating one), the current value per (target, name) as a
query (the latest record without an error), bulk import from JSONL/Parquet, and running
registered reward functions on completed trajectories. Never: invents a value. A target without
a record is *unrewarded* (None, case C16), and a reward function that raised is recorded with its
error and ``value`` NULL, which never reads as 0.0.

Reward functions are Python callables ``fn(context: RewardContext) -> float | None |
Mapping[str, float | None]`` (sync or async), registered by an entry point in the group
``trajgate.rewards`` or named by module path ``pkg.mod:fn``. A float is recorded under the
function's name; a mapping records one reward per key; None records nothing (unrewarded).
A value that is not a finite number, or a reward name outside 1-100 characters, is recorded as
that function's failure (the other functions' rewards still land). trajgate's own reward
functions live in ``datapool.rewards.functions``.

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal, get_args

import pyarrow.parquet as pq
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from datapool.db import chunks
from datapool.errors import InvalidPoolRequestError, UnknownTargetError
from datapool.models import Reward, RewardSource, Step, Trajectory, utc_now
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore, StoredStep

TargetKind = Literal["step", "trajectory", "lineage"]
TARGET_KINDS: tuple[str, ...] = get_args(TargetKind)
# A lineage (one conversation of a trajectory, ``steps.lineage_id``) is addressed as
# ``<trajectory_id>/<lineage_id>``: lineage ids repeat across trajectories (a session's
# ``X-Trajgate-Lineage: planner``), trajectory ids hold no ``/``. Within ``rewards.target_id``.
LINEAGE_TARGET_MAX_CHARS = 200


def lineage_target(trajectory_id: str, lineage_id: str) -> str:
    """The reward target id of lineage ``lineage_id`` of trajectory ``trajectory_id``."""
    return f"{trajectory_id}/{lineage_id}"


ENTRY_POINT_GROUP = "trajgate.rewards"


@dataclass(frozen=True)
class RewardIn:
    """One reward to append."""

    target_kind: str
    target_id: str
    name: str
    value: float | None
    source: str = RewardSource.HUMAN.value
    author: str | None = None
    error: str | None = None


def check_reward(reward: RewardIn, where: str = "") -> None:
    """Raise ``InvalidPoolRequestError`` for a bad kind, source, name (1-100 characters), author
    (over 200 characters) or value (not a finite number, unless an error is recorded instead);
    ``where`` prefixes the message (e.g. the position in a batch)."""
    if reward.target_kind not in TARGET_KINDS:
        raise InvalidPoolRequestError(
            f"{where}target must be one of {TARGET_KINDS}, got {reward.target_kind!r}",
            param="target",
        )
    if reward.source not in {s.value for s in RewardSource}:
        raise InvalidPoolRequestError(
            f"{where}source must be one of {[s.value for s in RewardSource]}, "
            f"got {reward.source!r}",
            param="source",
        )
    if reward.target_kind == "lineage" and (
        "/" not in reward.target_id.strip("/") or len(reward.target_id) > LINEAGE_TARGET_MAX_CHARS
    ):
        raise InvalidPoolRequestError(
            f"{where}a lineage target is '<trajectory_id>/<lineage_id>' of at most "
            f"{LINEAGE_TARGET_MAX_CHARS} characters, got {reward.target_id[:80]!r}",
            param="target_id",
        )
    if not reward.name or len(reward.name) > 100:
        raise InvalidPoolRequestError(
            f"{where}name must be 1-100 characters, got {reward.name!r}", param="name"
        )
    if reward.author is not None and len(reward.author) > 200:
        raise InvalidPoolRequestError(
            f"{where}author must be at most 200 characters, got {len(reward.author)}",
            param="author",
        )
    if reward.error is None and (reward.value is None or not math.isfinite(reward.value)):
        raise InvalidPoolRequestError(
            f"{where}value must be a finite number, got {reward.value!r} "
            "(a missing reward is no record, never a null or NaN value)",
            param="value",
        )


def add_rewards(sessions: sessionmaker[Session], rewards: Sequence[RewardIn]) -> list[int]:
    """Append ``rewards`` in one transaction (all or none); returns their record ids.

    Raises ``UnknownTargetError`` naming every unknown step, trajectory or lineage (one with no
    step: ``lineage_target``), and
    ``InvalidPoolRequestError`` for a bad kind, source, name or value (with its position).
    """
    for i, reward in enumerate(rewards):
        check_reward(reward, f"reward {i}: " if len(rewards) > 1 else "")
    with sessions.begin() as session:
        step_ids = sorted({r.target_id for r in rewards if r.target_kind == "step"})
        trajectory_ids = sorted({r.target_id for r in rewards if r.target_kind == "trajectory"})
        step_trajectory: dict[str, str] = {}
        for chunk in chunks(step_ids):
            step_trajectory.update(
                {
                    sid: tid
                    for sid, tid in session.execute(
                        select(Step.id, Step.trajectory_id).where(Step.id.in_(chunk))
                    )
                }
            )
        known: dict[str, Trajectory] = {}
        for chunk in chunks(trajectory_ids):
            known.update(
                {
                    t.id: t
                    for t in session.scalars(select(Trajectory).where(Trajectory.id.in_(chunk)))
                }
            )
        lineages = sorted({r.target_id for r in rewards if r.target_kind == "lineage"})
        for target in lineages:
            trajectory_id, lineage_id = target.split("/", 1)
            found = session.scalar(
                select(Step.id)
                .where(Step.trajectory_id == trajectory_id, Step.lineage_id == lineage_id)
                .limit(1)
            )
            if found is not None:
                step_trajectory[target] = trajectory_id
        unknown = (
            [f"step {s}" for s in step_ids if s not in step_trajectory]
            + [f"trajectory {t}" for t in trajectory_ids if t not in known]
            + [f"lineage {t}" for t in lineages if t not in step_trajectory]
        )
        if unknown:
            shown = ", ".join(unknown[:10]) + (" ..." if len(unknown) > 10 else "")
            raise UnknownTargetError(
                f"{len(unknown)} reward target(s) not in the pool: {shown}", param="target_id"
            )
        # No ``empty`` flag here: it marks a *closed* trajectory without a step, set when it
        # closes (``datapool.lifecycle.transitions``); a reward given before the first step must
        # not stick.
        now = utc_now()
        records = [
            Reward(
                target_kind=r.target_kind,
                target_id=r.target_id,
                trajectory_id=(
                    r.target_id if r.target_kind == "trajectory" else step_trajectory[r.target_id]
                ),
                name=r.name,
                value=None if r.error is not None else float(r.value),  # type: ignore[arg-type]
                source=r.source,
                author=r.author,
                error=r.error,
                created_at=now,
            )
            for r in rewards
        ]
        session.add_all(records)
        session.flush()
        return [record.id for record in records]


def current_rewards(
    session: Session, target_kind: str, target_ids: Sequence[str]
) -> dict[str, dict[str, float]]:
    """``{target_id: {name: value}}``: per name the latest record without an error.

    A target or name absent from the result is unrewarded (never 0.0).
    """
    result: dict[str, dict[str, float]] = {}
    for chunk in chunks(list(target_ids)):
        latest = (
            select(func.max(Reward.id).label("id"))
            .where(
                Reward.target_kind == target_kind,
                Reward.target_id.in_(chunk),
                Reward.error.is_(None),
            )
            .group_by(Reward.target_id, Reward.name)
            .subquery()
        )
        rows = session.execute(
            select(Reward.target_id, Reward.name, Reward.value).join(
                latest, Reward.id == latest.c.id
            )
        )
        for target_id, name, value in rows:
            if value is not None:
                result.setdefault(target_id, {})[name] = value
    return result


def current_rewards_query(target_kind: str, name: str) -> Any:
    """A subquery ``(target_id, value)`` of the current value of reward ``name`` (for filters)."""
    latest = (
        select(func.max(Reward.id).label("id"))
        .where(Reward.target_kind == target_kind, Reward.name == name, Reward.error.is_(None))
        .group_by(Reward.target_id)
        .subquery()
    )
    return (
        select(Reward.target_id.label("target_id"), Reward.value.label("value"))
        .join(latest, Reward.id == latest.c.id)
        .subquery()
    )


REWARD_FILE_COLUMNS = ("target", "target_id", "name", "value", "source", "author")


def read_reward_file(path: Path) -> list[RewardIn]:
    """Rewards from JSONL (one object per line) or Parquet (one row each), columns: ``target``
    ('step'/'trajectory'/'lineage'), ``target_id``, ``name``, ``value``, optional ``source``
    (default 'model'), ``author``.

    Read as strictly as ``POST /api/rewards``: raises ``InvalidPoolRequestError`` naming the row
    and column for a row that is not an object, a column it does not know (a misspelt
    ``sorce`` would record the default source), a ``value`` that is not a number (``true`` or
    ``"0.7"`` is not read as one), or a text column that is not a string.
    """
    if path.suffix == ".parquet":
        rows: list[Any] = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".ndjson"):
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise InvalidPoolRequestError(f"{path}:{n}: not JSON: {exc}") from exc
    else:
        raise InvalidPoolRequestError(
            f"reward file must end in .jsonl, .ndjson or .parquet, got {path.name!r}"
        )
    return [_reward_of_row(row, f"{path} row {n}") for n, row in enumerate(rows, start=1)]


def _reward_of_row(row: Any, where: str) -> RewardIn:
    """One row of a reward file as a ``RewardIn``; ``where`` names the row in an error."""
    if not isinstance(row, dict):
        raise InvalidPoolRequestError(f"{where}: must be an object, got {type(row).__name__}")
    unknown = sorted(set(row) - set(REWARD_FILE_COLUMNS))
    if unknown:
        raise InvalidPoolRequestError(
            f"{where}: unknown column(s) {unknown}; expected {list(REWARD_FILE_COLUMNS)}"
        )
    missing = {"target", "target_id", "name", "value"} - set(row)
    if missing:
        raise InvalidPoolRequestError(f"{where}: missing {sorted(missing)}")
    value = row["value"]
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise InvalidPoolRequestError(
            f"{where}: value must be a number, got {type(value).__name__} {value!r}",
            param="value",
        )
    for column in ("target", "target_id", "name", "source", "author"):
        text = row.get(column)
        if not (isinstance(text, str) or (text is None and column in ("source", "author"))):
            raise InvalidPoolRequestError(
                f"{where}: {column} must be a string, got {type(text).__name__} {text!r}",
                param=column,
            )
    return RewardIn(
        target_kind=row["target"],
        target_id=row["target_id"],
        name=row["name"],
        value=None if value is None else float(value),
        source=row.get("source") or RewardSource.MODEL.value,
        author=row.get("author"),
    )


# ---- reward functions ------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardContext:
    """What a reward function sees: the completed trajectory and its steps (exact payloads).

    ``settings``: the pool's settings when the completion hooks run the function (reward
    functions that call a service read its URL there); None where a context is built without
    them (curation predicates).
    """

    trajectory_id: str
    group_id: str | None
    channel: str
    metadata: dict[str, Any]
    steps: list[StoredStep]
    settings: PoolSettings | None = None

    @property
    def final_step(self) -> StoredStep | None:
        """The last ok step with a generated message, if any."""
        for step in reversed(self.steps):
            if step.outcome == "ok" and step.response_message is not None:
                return step
        return None

    @property
    def final_message(self) -> dict[str, Any] | None:
        """The last ok step's generated message (content, tool calls), if any."""
        step = self.final_step
        if step is None:
            return None
        message: dict[str, Any] = step.response_message
        return message


RewardFunction = Callable[[RewardContext], Any]


def resolve_reward_function(name: str, group: str = ENTRY_POINT_GROUP) -> RewardFunction:
    """``pkg.mod:fn`` by import, else an entry point called ``name`` in ``group``
    (``trajgate.rewards``; step reward functions: ``trajgate.step_rewards``).

    Raises ``InvalidPoolRequestError`` when neither finds a callable.
    """
    if ":" in name:
        module_name, _, attribute = name.partition(":")
        try:
            target = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as exc:
            raise InvalidPoolRequestError(
                f"reward function {name!r} cannot be imported: {exc}"
            ) from exc
    else:
        points = [ep for ep in metadata.entry_points(group=group) if ep.name == name]
        if not points:
            raise InvalidPoolRequestError(
                f"no reward function {name!r}: expected an entry point in group "
                f"{group!r} or a module path 'pkg.mod:fn'"
            )
        target = points[0].load()
    if not callable(target):
        raise InvalidPoolRequestError(f"reward function {name!r} is not callable")
    fn: RewardFunction = target
    return fn


def reward_label(name: str) -> str:
    """The reward name a function's records carry: ``fn`` of ``pkg.mod:fn``, else ``name``."""
    return name.rpartition(":")[2] if ":" in name else name


async def load_context(store: PoolStore, trajectory_id: str) -> RewardContext:
    """What a reward function sees of a trajectory: its fields and every step, read in worker
    threads. Raises ``UnknownTargetError`` for an unknown trajectory."""
    trajectory = await asyncio.to_thread(store.get_trajectory, trajectory_id)
    if trajectory is None:
        raise UnknownTargetError(f"no trajectory {trajectory_id!r}", param="trajectory_id")
    steps = await asyncio.to_thread(store.steps_of, trajectory_id)
    return RewardContext(
        trajectory_id,
        trajectory.group_id,
        trajectory.channel,
        dict(trajectory.metadata_json),
        steps,
        store.settings,
    )


async def run_reward_functions(
    store: PoolStore,
    trajectory_id: str,
    names: Sequence[str],
    on_outcome: Callable[[str, bool], None] | None = None,
) -> list[int]:
    """Run each named function on the trajectory and append what it returned, or its error.

    Runs sync functions in a worker thread. Returns the appended record ids. ``on_outcome``
    is told ``(name, succeeded)`` per function (the hooks' per-function counters).
    """
    if not names:
        return []
    context = await load_context(store, trajectory_id)
    records: list[RewardIn] = []
    for name in names:
        label = reward_label(name)
        try:
            fn = resolve_reward_function(name)
            value = (
                await fn(context)
                if inspect.iscoroutinefunction(fn)
                else await asyncio.to_thread(fn, context)
            )
            records.extend(records_of("trajectory", trajectory_id, label, value))
        except Exception as exc:  # recorded as a failed reward, never as a value
            records.append(
                RewardIn("trajectory", trajectory_id, label, None, "rule", "reward_fn", repr(exc))
            )
            if on_outcome is not None:
                on_outcome(name, False)
        else:
            if on_outcome is not None:
                on_outcome(name, True)
    if not records:
        return []
    return await asyncio.to_thread(add_rewards, store.sessions, records)


def records_of(
    target_kind: str, target_id: str, label: str, value: Any, author: str = "reward_fn"
) -> list[RewardIn]:
    """The records of what a reward function returned for one target: none for None, one per
    key of a mapping, else one; raises TypeError/ValueError for anything but finite numbers
    (the caller records that as the function's failure)."""
    if value is None:
        return []
    if isinstance(value, Mapping):
        return [
            r
            for key, v in value.items()
            for r in records_of(target_kind, target_id, str(key), v, author)
        ]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"reward function returned {type(value).__name__}, expected a number")
    # Checked here, not only in add_rewards: there one bad value would fail the whole batch, so
    # the hooks would retry every lease and no function's reward would ever land.
    if not math.isfinite(value):
        raise ValueError(
            f"reward function returned {value!r} for {label!r}, expected a finite number"
        )
    if not 1 <= len(label) <= 100:
        raise ValueError(f"reward name must be 1-100 characters, got {label!r}")
    return [RewardIn(target_kind, target_id, label, float(value), "rule", author)]
