"""The key of the turn each step answered, so exact continuation finds it in any process.

``steps.turn_key`` is ``gateway.proxy.continuation.history.turn_key`` of an ok step of an exact
channel (a hash of its canonical history, the echo form of its response and the fields that
change the rendering); a later call that extends the turn finds its step by this key when the
gateway's memory does not hold it (another worker or replica, a restart). NULL on rows written
before and on template channels. Indexed with the trajectory: one read per call that misses.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("turn_key", sa.String(64), nullable=True))
    op.create_index("ix_steps_trajectory_turn_key", "steps", ["trajectory_id", "turn_key"])


def downgrade() -> None:
    op.drop_index("ix_steps_trajectory_turn_key", table_name="steps")
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("turn_key")
