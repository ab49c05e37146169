"""Gateway: logical calls and attempts, lineage detail, timings, policy versions, API keys.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("call_id", sa.String(36), nullable=True))
        batch.add_column(
            sa.Column("endpoint", sa.String(30), nullable=False, server_default="chat.completions")
        )
        batch.add_column(sa.Column("request_hash", sa.String(64), nullable=True))
        batch.add_column(sa.Column("idempotency_key", sa.String(200), nullable=True))
        batch.add_column(sa.Column("ttft_ms", sa.Float(), nullable=True))
        batch.add_column(sa.Column("stop_reason", sa.String(200), nullable=True))
        batch.add_column(sa.Column("divergence_kind", sa.String(50), nullable=True))
        batch.add_column(sa.Column("divergence_detail", sa.JSON(), nullable=True))
        batch.create_index("ix_steps_call_id", ["call_id"])
        batch.create_index("ix_steps_request_hash", ["request_hash"])

    op.create_table(
        "call_attempts",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("call_id", sa.String(36), nullable=False),
        sa.Column("trajectory_id", sa.String(200), nullable=False),
        sa.Column("attempt_index", sa.Integer(), nullable=False),
        sa.Column("upstream", sa.String(500), nullable=True),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("outcome", sa.String(30), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("latency_ms", sa.Float(), nullable=False),
        sa.Column("idempotency_key", sa.String(200), nullable=True),
        sa.Column("response_body", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_call_attempts_call_id", "call_attempts", ["call_id"])
    op.create_index("ix_call_attempts_trajectory_id", "call_attempts", ["trajectory_id"])

    op.create_table(
        "policy_versions",
        sa.Column("version", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("model_name", sa.String(200), nullable=False),
        sa.Column("weights_location", sa.Text(), nullable=True),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("activated_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_policy_versions_active", "policy_versions", ["active"])

    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("key_hash", sa.String(200), nullable=False, unique=True),
        sa.Column("trajectory_id", sa.String(200), nullable=True),
        sa.Column("channel", sa.String(100), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("api_keys")
    op.drop_index("ix_policy_versions_active", table_name="policy_versions")
    op.drop_table("policy_versions")
    op.drop_index("ix_call_attempts_trajectory_id", table_name="call_attempts")
    op.drop_index("ix_call_attempts_call_id", table_name="call_attempts")
    op.drop_table("call_attempts")
    with op.batch_alter_table("steps") as batch:
        batch.drop_index("ix_steps_request_hash")
        batch.drop_index("ix_steps_call_id")
        for column in (
            "divergence_detail",
            "divergence_kind",
            "stop_reason",
            "ttft_ms",
            "idempotency_key",
            "request_hash",
            "endpoint",
            "call_id",
        ):
            batch.drop_column(column)
