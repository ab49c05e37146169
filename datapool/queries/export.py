"""``trajgate export trajectories``: steps of chosen trajectories to Parquet or JSONL.

Owns: the export schema (documented in docs/datapool.md) and writing it in chunks of
trajectories. Never: fills a missing reward with 0.0 (rewards are null when unrewarded), re-encodes
text, or splices across a prefix break; rows carry ``flags`` and ``trainable`` so a reader can
drop what must not be trained on.

One row per step:

    trajectory_id, step_id, call_id, parent_step_id: string; step_index, choice_index: int32
        (call_id: the logical call; a re-send, flagged ``resend``, has its earlier step's)
    lineage_id, lineage_parent_id, lineage_kind: string (the step's conversation, ``steps``)
    group_id, channel, trajectory_status: string; trajectory_flags: list<string>
    policy_version: int32 (null); model, finish_reason, outcome: string
    prompt_token_ids, response_token_ids: list<int32> (null = engine reported none)
    response_logprobs: list<float64>; flags: list<string>; extends_parent: bool
    trainable: bool   (outcome ok, ids present, no integrity flag, trajectory not empty/incomplete)
    step_rewards_json, trajectory_rewards_json: string (JSON {name: value}; "{}" = unrewarded)
    messages_json, response_message_json: string; created_at: timestamp[us, UTC]
    sampling_json: string (JSON: effective sampling fields, ``logprobs_temperature``, what
        narrowed them; "null" = written before they were recorded)
    policy_version_spans_json: string (JSON [[version, start, end), ...] over the response
        tokens; "null" = every token is ``policy_version``'s)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import select

from datapool.curation import rules as curation_rules
from datapool.models import EMPTY, INCOMPLETE, Trajectory
from datapool.rewards.values import current_rewards
from datapool.steps.messages import engine_chat
from datapool.steps.store import PoolStore

ExportFormat = Literal["parquet", "jsonl"]
INTEGRITY_FLAGS = frozenset(curation_rules.INTEGRITY_FLAGS)
CHUNK_TRAJECTORIES = 256

SCHEMA = pa.schema(
    [
        ("trajectory_id", pa.string()),
        ("step_id", pa.string()),
        ("call_id", pa.string()),
        ("parent_step_id", pa.string()),
        ("lineage_id", pa.string()),
        ("lineage_parent_id", pa.string()),
        ("lineage_kind", pa.string()),
        ("step_index", pa.int32()),
        ("choice_index", pa.int32()),
        ("group_id", pa.string()),
        ("channel", pa.string()),
        ("trajectory_status", pa.string()),
        ("trajectory_flags", pa.list_(pa.string())),
        ("policy_version", pa.int32()),
        ("model", pa.string()),
        ("finish_reason", pa.string()),
        ("outcome", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("response_token_ids", pa.list_(pa.int32())),
        ("response_logprobs", pa.list_(pa.float64())),
        ("flags", pa.list_(pa.string())),
        ("extends_parent", pa.bool_()),
        ("trainable", pa.bool_()),
        ("step_rewards_json", pa.string()),
        ("trajectory_rewards_json", pa.string()),
        ("messages_json", pa.string()),
        ("response_message_json", pa.string()),
        ("created_at", pa.timestamp("us", tz="UTC")),
        ("sampling_json", pa.string()),
        ("policy_version_spans_json", pa.string()),
    ]
)


def select_trajectories(
    store: PoolStore,
    *,
    status: list[str] | None = None,
    channel: str | None = None,
    group_id: str | None = None,
) -> list[str]:
    """Ids of the trajectories matching the filters, oldest first."""
    query = select(Trajectory.id).order_by(Trajectory.created_at, Trajectory.id)
    if status:
        query = query.where(Trajectory.status.in_(status))
    if channel is not None:
        query = query.where(Trajectory.channel == channel)
    if group_id is not None:
        query = query.where(Trajectory.group_id == group_id)
    with store.sessions() as session:
        return list(session.scalars(query))


def _rows(store: PoolStore, trajectory_ids: list[str]) -> Iterator[dict[str, Any]]:
    with store.sessions() as session:
        trajectories = {
            t.id: t
            for t in session.scalars(select(Trajectory).where(Trajectory.id.in_(trajectory_ids)))
        }
        trajectory_rewards = current_rewards(session, "trajectory", trajectory_ids)
    for trajectory_id in trajectory_ids:
        trajectory = trajectories[trajectory_id]
        steps = store.steps_of(trajectory_id)
        with store.sessions() as session:
            step_rewards = current_rewards(session, "step", [s.id for s in steps])
        bad_trajectory = bool({EMPTY, INCOMPLETE} & set(trajectory.flags or []))
        for step in steps:
            trainable = (
                step.outcome == "ok"
                and step.prompt_token_ids is not None
                and step.response_token_ids is not None
                and not INTEGRITY_FLAGS & set(step.flags or [])
                and not bad_trajectory
            )
            yield {
                "trajectory_id": trajectory_id,
                "step_id": step.id,
                "call_id": step.call_id,
                "parent_step_id": step.parent_step_id,
                "lineage_id": step.lineage_id,
                "lineage_parent_id": step.lineage_parent_id,
                "lineage_kind": step.lineage_kind,
                "step_index": step.step_index,
                "choice_index": step.choice_index,
                "group_id": trajectory.group_id,
                "channel": trajectory.channel,
                "trajectory_status": trajectory.status,
                "trajectory_flags": list(trajectory.flags or []),
                "policy_version": step.policy_version,
                "model": step.model,
                "finish_reason": step.finish_reason,
                "outcome": step.outcome,
                "prompt_token_ids": step.prompt_token_ids,
                "response_token_ids": step.response_token_ids,
                "response_logprobs": step.response_logprobs,
                "flags": list(step.flags or []),
                "extends_parent": step.extends_parent,
                "trainable": trainable,
                "step_rewards_json": json.dumps(step_rewards.get(step.id, {})),
                "trajectory_rewards_json": json.dumps(trajectory_rewards.get(trajectory_id, {})),
                "messages_json": json.dumps(engine_chat(step.row)[0]),
                "response_message_json": json.dumps(step.response_message),
                "created_at": step.created_at,
                "sampling_json": json.dumps(step.sampling),
                "policy_version_spans_json": json.dumps(step.policy_version_spans),
            }


def export_trajectories(
    store: PoolStore,
    trajectory_ids: list[str],
    out: Path,
    fmt: ExportFormat,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Write the steps of ``trajectory_ids`` to ``out``; returns the rows written.

    ``progress(n)`` is called after every chunk with the trajectories done in it.
    """
    if fmt not in ("parquet", "jsonl"):
        raise ValueError(f"format must be 'parquet' or 'jsonl', got {fmt!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows_written = 0
    writer = pq.ParquetWriter(out, SCHEMA, compression="zstd") if fmt == "parquet" else None
    sink = out.open("w") if fmt == "jsonl" else None
    try:
        for start in range(0, len(trajectory_ids), CHUNK_TRAJECTORIES):
            chunk = trajectory_ids[start : start + CHUNK_TRAJECTORIES]
            rows = list(_rows(store, chunk))
            if writer is not None:
                writer.write_table(pa.Table.from_pylist(rows, schema=SCHEMA))
            elif sink is not None:
                for row in rows:
                    sink.write(json.dumps({**row, "created_at": row["created_at"].isoformat()}))
                    sink.write("\n")
            rows_written += len(rows)
            if progress is not None:
                progress(len(chunk))
    finally:
        if writer is not None:
            writer.close()
        if sink is not None:
            sink.close()
    return rows_written
