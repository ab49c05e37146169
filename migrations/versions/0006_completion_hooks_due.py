"""Completion hooks as durable work: ``trajectories.hooks_due_at``.

Set when a trajectory becomes complete (explicitly or by the idle timeout), moved forward by the
runner that claims it (a lease), NULL once its reward functions and curation rules ran (see
``datapool.lifecycle.hooks``). Trajectories completed before this revision stay NULL: their hooks
are not
re-run on upgrade (reward functions may be costly or already replaced by imported rewards);
docs/datapool.md shows the one UPDATE that queues them.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-12
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("trajectories") as batch:
        batch.add_column(sa.Column("hooks_due_at", sa.DateTime(timezone=True), nullable=True))
        batch.create_index("ix_trajectories_hooks_due_at", ["hooks_due_at"])


def downgrade() -> None:
    with op.batch_alter_table("trajectories") as batch:
        batch.drop_index("ix_trajectories_hooks_due_at")
        batch.drop_column("hooks_due_at")
