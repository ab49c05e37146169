"""Trajectories and steps: the first tables of the pool.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "trajectories",
        sa.Column("id", sa.String(200), primary_key=True),
        sa.Column("group_id", sa.String(200), nullable=True),
        sa.Column("channel", sa.String(100), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("metadata_json", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("call_count", sa.Integer(), nullable=False),
    )
    op.create_index("ix_trajectories_group_id", "trajectories", ["group_id"])
    op.create_index("ix_trajectories_channel", "trajectories", ["channel"])
    op.create_index("ix_trajectories_status", "trajectories", ["status"])

    op.create_table(
        "steps",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column(
            "trajectory_id",
            sa.String(200),
            sa.ForeignKey("trajectories.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("parent_step_id", sa.String(36), nullable=True),
        sa.Column("step_index", sa.Integer(), nullable=False),
        sa.Column("choice_index", sa.Integer(), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=True),
        sa.Column("model", sa.String(200), nullable=True),
        sa.Column("upstream", sa.String(500), nullable=True),
        sa.Column("outcome", sa.String(30), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("upstream_request", sa.JSON(), nullable=False),
        sa.Column("response_message", sa.JSON(), nullable=True),
        sa.Column("finish_reason", sa.String(50), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("latency_ms", sa.Float(), nullable=False),
        sa.Column("flags", sa.JSON(), nullable=False),
        sa.Column("extends_parent", sa.Boolean(), nullable=True),
        sa.Column("divergence_offset", sa.Integer(), nullable=True),
        sa.Column("prompt_token_ids", sa.JSON(), nullable=True),
        sa.Column("response_token_ids", sa.JSON(), nullable=True),
        sa.Column("response_logprobs", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("trajectory_id", "step_index", "choice_index"),
    )
    op.create_index("ix_steps_trajectory_id", "steps", ["trajectory_id"])
    op.create_index("ix_steps_policy_version", "steps", ["policy_version"])


def downgrade() -> None:
    op.drop_index("ix_steps_policy_version", table_name="steps")
    op.drop_index("ix_steps_trajectory_id", table_name="steps")
    op.drop_table("steps")
    op.drop_index("ix_trajectories_status", table_name="trajectories")
    op.drop_index("ix_trajectories_channel", table_name="trajectories")
    op.drop_index("ix_trajectories_group_id", table_name="trajectories")
    op.drop_table("trajectories")
