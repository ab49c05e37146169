"""Each step's canonical call record, and the request field that holds its history.

New columns ``steps.canonical`` (the call's conversation, tools and sampling parameters in the
one form every reader uses: ``datapool.steps.canonical``), ``steps.canonical_base`` (its
messages a delta on the parent's, as ``messages_base`` is for the request) and
``steps.history_field`` (the request's field that holds the resent history, named by the
call's dialect instead of a list of dialect fields inside the pool).

Upgrade gives every existing step both: ``history_field`` by the rule the pool used until now,
``canonical`` from its stored upstream request by the rule of the dialect that recorded it
(``steps.endpoint``; the dialects' ``canonical`` as it was at this revision, frozen in
``migrations.legacy``, so later changes of the live code leave this migration as it is), one
trajectory at a time, as a delta on the parent's where the parent is a step of the same
trajectory with a canonical record. A step of an endpoint no dialect served keeps NULL (no
record). Downgrade drops the columns (the record is derived data).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02
"""

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("history_field", sa.String(32), nullable=True))
        batch.add_column(sa.Column("canonical", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("canonical_base", sa.Integer(), nullable=True))
    _backfill()


def _backfill() -> None:
    from migrations.legacy import (
        ENDPOINTS_0013,
        StoredRequest,
        canonical_0013,
        canonical_response_0013,
        full_requests,
        message_key,
        messages_base,
        messages_before_0013,
    )

    steps = sa.table(
        "steps",
        sa.column("id", sa.String()),
        sa.column("trajectory_id", sa.String()),
        sa.column("parent_step_id", sa.String()),
        sa.column("messages_base", sa.Integer()),
        sa.column("request", sa.JSON()),
        sa.column("upstream_request", sa.JSON()),
        sa.column("upstream_request_patch", sa.JSON()),
        sa.column("response_message", sa.JSON(none_as_null=True)),
        sa.column("endpoint", sa.String()),
        sa.column("step_index", sa.Integer()),
        sa.column("choice_index", sa.Integer()),
        sa.column("history_field", sa.String()),
        sa.column("canonical", sa.JSON(none_as_null=True)),
        sa.column("canonical_base", sa.Integer()),
    )
    connection = op.get_bind()
    trajectory_ids = connection.scalars(sa.select(steps.c.trajectory_id).distinct()).all()
    for trajectory_id in trajectory_ids:  # a trajectory's rows are one delta chain
        rows = connection.execute(
            sa.select(
                steps.c.id,
                steps.c.parent_step_id,
                steps.c.messages_base,
                steps.c.request,
                steps.c.upstream_request,
                steps.c.upstream_request_patch,
                steps.c.response_message,
                steps.c.endpoint,
            )
            .where(steps.c.trajectory_id == trajectory_id)
            .order_by(steps.c.step_index, steps.c.choice_index)
        ).all()
        stored = {row[0]: StoredRequest(*row[:7]) for row in rows}
        messages = messages_before_0013(stored)
        keys: dict[str, list[str]] = {}  # C + [R] as message keys, per step with a record
        for row in rows:
            step_id, parent_id, endpoint = row[0], row[1], row[7]
            entry = stored[step_id]
            values: dict[str, Any] = {"history_field": entry.history_field}
            if endpoint in ENDPOINTS_0013:
                upstream = full_requests(entry, messages[step_id])[1]
                record = canonical_0013(endpoint, upstream)
                own = record["messages"]
                base = None
                if isinstance(own, list):
                    base = messages_base(keys.get(parent_id or ""), own)
                    own_keys = [message_key(m) for m in own]
                    if entry.response_message is not None:
                        own_keys.append(
                            message_key(canonical_response_0013(entry.response_message))
                        )
                    keys[step_id] = own_keys
                    if base:
                        record["messages"] = own[base:]
                values.update(canonical=record, canonical_base=base)
            connection.execute(steps.update().where(steps.c.id == step_id).values(**values))


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("canonical_base")
        batch.drop_column("canonical")
        batch.drop_column("history_field")
