"""Exports of a materialised batch for trainers other than trajgate's own.

Owns: ``parquet`` (the batch's rows plus the prompt/response split columns that verl, OpenRLHF
and TRL users load; mapping in docs/batches.md) and ``messages`` (JSONL chat messages of each
row's last step, for SFT trainers such as TRL's ``SFTTrainer``). Never: re-tokenizes; the split
columns are slices of the stored IDs, and ``messages`` are the requests and replies as captured,
in the canonical record's form (``datapool.steps.canonical``: the reply without the null fields
vLLM sends, ``refusal``, ``annotations``, ``audio``, ...).

Split columns (per row, ``p`` = ``prompt_tokens``, the tokens before the first sampled token):
``prompt_ids = input_ids[:p]``, ``response_ids = input_ids[p:]``, ``response_mask =
loss_mask[p:]`` (0 on environment tokens inside a merged row), ``response_logprobs =
behaviour_logprobs[p:]``, and ``response_token_rewards``: the row's step reward
(``process_reward``) on its last sampled token and 0.0 on the others, the token-level reward
layout of verl's ``token_level_rewards``; null for a row without a step reward (never zeros).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal, get_args

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import select

from datapool.db import chunks
from datapool.models import Batch, Step
from datapool.steps.canonical import response_of
from datapool.steps.messages import engine_chat, expand_requests
from datapool.steps.store import PoolStore

ExportFormat = Literal["parquet", "messages"]
EXPORT_FORMATS: tuple[str, ...] = get_args(ExportFormat)


def _split(column: pa.ListArray, head: np.ndarray) -> tuple[pa.ListArray, pa.ListArray]:
    """``(column[:head], column[head:])`` per row, vectorised over the flat values."""
    lengths = np.diff(column.offsets.to_numpy())  # [B]
    starts = column.offsets.to_numpy()[:-1]  # [B]
    flat = column.values.to_numpy(zero_copy_only=False)  # [N]
    positions = np.arange(len(flat)) - np.repeat(starts - column.offsets.to_numpy()[0], lengths)
    in_head = positions < np.repeat(head, lengths)  # [N]
    head_offsets = np.concatenate([[0], np.cumsum(head)]).astype(np.int32)
    tail_offsets = np.concatenate([[0], np.cumsum(lengths - head)]).astype(np.int32)
    return (
        pa.ListArray.from_arrays(pa.array(head_offsets), pa.array(flat[in_head])),
        pa.ListArray.from_arrays(pa.array(tail_offsets), pa.array(flat[~in_head])),
    )


def with_split_columns(table: pa.Table) -> pa.Table:
    """``table`` plus ``prompt_ids``, ``response_ids``, ``response_mask``, ``response_logprobs``."""
    table = table.combine_chunks()
    head = table["prompt_tokens"].to_numpy()
    prompt_ids, response_ids = _split(table["input_ids"].chunk(0), head)
    _m, response_mask = _split(table["loss_mask"].chunk(0), head)
    _l, response_logprobs = _split(table["behaviour_logprobs"].chunk(0), head)
    for name, column in (
        ("prompt_ids", prompt_ids),
        ("response_ids", response_ids),
        ("response_mask", response_mask),
        ("response_logprobs", response_logprobs),
        ("response_token_rewards", _token_rewards(response_mask, table["process_reward"])),
    ):
        table = table.append_column(name, column)
    return table


def _token_rewards(response_mask: pa.ListArray, process_reward: pa.ChunkedArray) -> pa.Array:
    """Per row ``[R]`` float64: ``process_reward`` on the last token whose mask is 1, else 0;
    null where the row has no step reward (NaN)."""
    rewards = process_reward.to_numpy()  # [B]
    result: list[list[float] | None] = []
    for mask, reward in zip(response_mask.to_pylist(), rewards.tolist(), strict=True):
        if math.isnan(reward):
            result.append(None)
            continue
        row = [0.0] * len(mask)
        sampled = [i for i, m in enumerate(mask) if m]
        if sampled:
            row[sampled[-1]] = reward
        result.append(row)
    return pa.array(result, pa.list_(pa.float64()))


def export_batch(
    store: PoolStore, batch: Batch, table: pa.Table, out: Path, fmt: ExportFormat
) -> int:
    """Write ``batch``'s rows ``table`` to ``out`` as ``fmt``; returns the rows written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        pq.write_table(with_split_columns(table), out, compression="zstd")
        return int(table.num_rows)
    if fmt == "messages":
        last_steps = [ids[-1] for ids in table["step_ids"].to_pylist()]
        with store.sessions() as session:
            steps = {
                s.id: s
                for chunk in chunks(sorted(set(last_steps)))
                for s in session.scalars(select(Step).where(Step.id.in_(chunk)))
            }
            expand_requests(session, steps.values())  # full messages, not stored deltas
        with out.open("w") as sink:
            for i, step_id in enumerate(last_steps):
                step = steps[step_id]
                history, tools = engine_chat(step)
                messages = history or []
                if step.response_message is not None:
                    # canonical, as the history is: vLLM's null fields (refusal, audio, ...)
                    # are no part of the message
                    messages.append(response_of(step.response_message).to_json())
                record = {
                    "messages": messages,
                    "tools": tools,
                    "batch_id": batch.id,
                    "trajectory_id": table["trajectory_id"][i].as_py(),
                    "lineage_id": table["lineage_id"][i].as_py(),
                    "step_ids": table["step_ids"][i].as_py(),
                    "reward": _finite(table["reward"][i].as_py()),
                    "advantage": _finite(table["advantage"][i].as_py()),
                    "step_rewards": json.loads(table["step_rewards_json"][i].as_py() or "null"),
                    "process_reward": _finite(table["process_reward"][i].as_py()),
                    "episode_advantage": _finite(table["episode_advantage"][i].as_py()),
                    "step_advantage": _finite(table["step_advantage"][i].as_py()),
                    "anchor_key": table["anchor_key"][i].as_py(),
                }
                sink.write(json.dumps(record) + "\n")
        return len(last_steps)
    raise ValueError(f"format must be one of {EXPORT_FORMATS}, got {fmt!r}")


def _finite(value: float | None) -> float | None:
    """JSON has no NaN: an unrewarded/unscored value is null (never 0)."""
    return None if value is None or value != value else value
