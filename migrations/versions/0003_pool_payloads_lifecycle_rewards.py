"""Pool: token payloads off the step rows, lifecycle, groups, rewards.

Moves ``steps.prompt_token_ids / response_token_ids / response_logprobs`` (JSON) into
``step_payloads`` (binary blobs, the durable path until compaction into Parquet files listed in
``payload_files``); adds trajectory lifecycle columns, ``trajectory_groups`` and the append-only
``rewards``. Existing payloads are copied as whole prompts (no delta); downgrade copies back what
is still in ``step_payloads`` (payloads already compacted into Parquet stay there, their JSON
columns come back NULL).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

import json
import struct
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _ints(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def _floats(values: list[float]) -> bytes:
    # Width 8: the migration keeps the stored float64 exactly; new writes pick 4 when exact.
    return b"8" + struct.pack(f"<{len(values)}d", *values)


def _loads(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def upgrade() -> None:
    # Over 80 lines on purpose: a revision is one ordered schema script.
    op.create_table(
        "trajectory_groups",
        sa.Column("id", sa.String(200), primary_key=True),
        sa.Column("expected_size", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_table(
        "payload_files",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "step_payloads",
        sa.Column(
            "step_id",
            sa.String(36),
            sa.ForeignKey("steps.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("prompt_delta", sa.LargeBinary(), nullable=True),
        sa.Column("response_token_ids", sa.LargeBinary(), nullable=True),
        sa.Column("response_logprobs", sa.LargeBinary(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "rewards",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("target_kind", sa.String(20), nullable=False),
        sa.Column("target_id", sa.String(200), nullable=False),
        sa.Column("trajectory_id", sa.String(200), nullable=False),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("source", sa.String(20), nullable=False),
        sa.Column("author", sa.String(200), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_rewards_target_name", "rewards", ["target_kind", "target_id", "name"])
    op.create_index("ix_rewards_trajectory_id", "rewards", ["trajectory_id"])

    with op.batch_alter_table("trajectories") as batch:
        batch.add_column(sa.Column("tags", sa.JSON(), nullable=False, server_default="[]"))
        batch.add_column(sa.Column("flags", sa.JSON(), nullable=False, server_default="[]"))
        batch.add_column(sa.Column("last_step_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("completion_reason", sa.String(50), nullable=True))
        batch.add_column(
            sa.Column("rejected_calls", sa.Integer(), nullable=False, server_default="0")
        )
        batch.add_column(sa.Column("writer_id", sa.String(200), nullable=True))
        batch.create_index("ix_trajectories_writer_id", ["writer_id"])

    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("prompt_base_tokens", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("payload_file_id", sa.String(36), nullable=True))
        batch.create_index("ix_steps_payload_file_id", ["payload_file_id"])

    conn = op.get_bind()
    rows = conn.execute(
        sa.text(
            "SELECT id, prompt_token_ids, response_token_ids, response_logprobs, created_at "
            "FROM steps"
        )
    ).all()
    payloads = sa.table(
        "step_payloads",
        sa.column("step_id", sa.String()),
        sa.column("prompt_delta", sa.LargeBinary()),
        sa.column("response_token_ids", sa.LargeBinary()),
        sa.column("response_logprobs", sa.LargeBinary()),
        sa.column("created_at", sa.DateTime(timezone=True)),
    )
    records = []
    for step_id, prompt, response, logprobs, created_at in rows:
        prompt, response, logprobs = _loads(prompt), _loads(response), _loads(logprobs)
        records.append(
            {
                "step_id": step_id,
                "prompt_delta": None if prompt is None else _ints(prompt),
                "response_token_ids": None if response is None else _ints(response),
                "response_logprobs": None if logprobs is None else _floats(logprobs),
                "created_at": created_at,
            }
        )
    if records:
        op.bulk_insert(payloads, records)

    with op.batch_alter_table("steps") as batch:
        batch.drop_column("prompt_token_ids")
        batch.drop_column("response_token_ids")
        batch.drop_column("response_logprobs")


def _unpack_ints(blob: bytes | None) -> list[int] | None:
    return None if blob is None else list(struct.unpack(f"<{len(blob) // 4}i", blob))


def _unpack_floats(blob: bytes | None) -> list[float] | None:
    if blob is None:
        return None
    width, body = blob[:1], blob[1:]
    code = "f" if width == b"4" else "d"
    return list(struct.unpack(f"<{len(body) // int(width)}{code}", body))


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("prompt_token_ids", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("response_token_ids", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("response_logprobs", sa.JSON(), nullable=True))

    conn = op.get_bind()
    rows = conn.execute(
        sa.text(
            "SELECT s.id, s.parent_step_id, s.prompt_base_tokens, p.prompt_delta, "
            "p.response_token_ids, p.response_logprobs FROM steps s "
            "JOIN step_payloads p ON p.step_id = s.id ORDER BY s.trajectory_id, s.step_index"
        )
    ).all()
    sequences: dict[str, list[int]] = {}
    for step_id, parent_id, base_tokens, delta, response, logprobs in rows:
        delta_ids = _unpack_ints(delta)
        response_ids = _unpack_ints(response)
        prompt: list[int] | None = None
        if delta_ids is not None:
            base = sequences.get(parent_id, []) if base_tokens else []
            prompt = base[: base_tokens or 0] + delta_ids
            sequences[step_id] = prompt + (response_ids or [])
        conn.execute(
            sa.text(
                "UPDATE steps SET prompt_token_ids = :p, response_token_ids = :r, "
                "response_logprobs = :l WHERE id = :id"
            ),
            {
                "p": None if prompt is None else json.dumps(prompt),
                "r": None if response_ids is None else json.dumps(response_ids),
                "l": None if logprobs is None else json.dumps(_unpack_floats(logprobs)),
                "id": step_id,
            },
        )

    with op.batch_alter_table("steps") as batch:
        batch.drop_index("ix_steps_payload_file_id")
        batch.drop_column("payload_file_id")
        batch.drop_column("prompt_base_tokens")
    with op.batch_alter_table("trajectories") as batch:
        batch.drop_index("ix_trajectories_writer_id")
        for column in (
            "writer_id",
            "rejected_calls",
            "completion_reason",
            "last_step_at",
            "flags",
            "tags",
        ):
            batch.drop_column(column)
    op.drop_index("ix_rewards_trajectory_id", table_name="rewards")
    op.drop_index("ix_rewards_target_name", table_name="rewards")
    op.drop_table("rewards")
    op.drop_table("step_payloads")
    op.drop_table("payload_files")
    op.drop_table("trajectory_groups")
