"""Training metrics from the trainer, and indexes the inspector's sorted lists and charts use.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-09
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (index name, table, columns): sort keys of the trajectory list, the time axis of the step
# charts, and the current-reward subquery (kind, name -> latest id per target).
INDEXES = [
    ("ix_trajectories_created_at", "trajectories", ["created_at"]),
    ("ix_trajectories_last_step_at", "trajectories", ["last_step_at"]),
    ("ix_steps_created_at", "steps", ["created_at"]),
    ("ix_rewards_kind_name_target", "rewards", ["target_kind", "name", "target_id", "id"]),
]


def upgrade() -> None:
    op.create_table(
        "training_metrics",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run", sa.String(200), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=True),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_training_metrics_run_step", "training_metrics", ["run", "step"])
    for name, table, columns in INDEXES:
        op.create_index(name, table, columns)


def downgrade() -> None:
    for name, table, _ in reversed(INDEXES):
        op.drop_index(name, table_name=table)
    op.drop_index("ix_training_metrics_run_step", table_name="training_metrics")
    op.drop_table("training_metrics")
