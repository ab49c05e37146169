"""Exclusive batches claim their trajectories: ``batch_claims``.

One row per trajectory taken by a batch built with ``exclude_batched`` (the default): the
trajectory id is the primary key, so two batch builds that chose the same trajectory at the same
time cannot both commit (the second's INSERT fails on the key, on SQLite and PostgreSQL alike,
from any number of gateway processes) and the loser builds again without it. ``batch_id`` cascades:
deleting a batch frees its trajectories.

Upgrade adds the empty table: batches built before it are still excluded by ``batch_rows``, which
the build reads first; the claim only settles builds that race each other. Downgrade drops it.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "batch_claims",
        sa.Column("trajectory_id", sa.String(200), primary_key=True),
        sa.Column(
            "batch_id",
            sa.String(36),
            sa.ForeignKey("batches.id", ondelete="CASCADE"),
            nullable=False,
        ),
    )
    op.create_index("ix_batch_claims_batch_id", "batch_claims", ["batch_id"])


def downgrade() -> None:
    op.drop_table("batch_claims")
