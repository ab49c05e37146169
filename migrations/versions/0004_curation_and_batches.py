"""Curation and batches: labels, curation rules and their marks, batches, consumptions, rows.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _created_at() -> sa.Column:  # type: ignore[type-arg]
    return sa.Column("created_at", sa.DateTime(timezone=True), nullable=False)


def upgrade() -> None:
    # Over 80 lines on purpose: a revision is one ordered schema script.
    op.create_table(
        "labels",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("target_kind", sa.String(20), nullable=False),
        sa.Column("target_id", sa.String(200), nullable=False),
        sa.Column("trajectory_id", sa.String(200), nullable=True),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("remove_tags", sa.JSON(), nullable=False),
        sa.Column("quality", sa.String(10), nullable=True),
        sa.Column("decision", sa.String(10), nullable=True),
        sa.Column("note", sa.Text(), nullable=True),
        sa.Column("author", sa.String(200), nullable=True),
        _created_at(),
    )
    op.create_index("ix_labels_target", "labels", ["target_kind", "target_id"])
    op.create_index("ix_labels_trajectory_id", "labels", ["trajectory_id"])
    op.create_table(
        "curation_rules",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(200), nullable=False, unique=True),
        sa.Column("kind", sa.String(50), nullable=False),
        sa.Column("action", sa.String(20), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("author", sa.String(200), nullable=True),
        _created_at(),
        sa.Column("applied_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_table(
        "curation_marks",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "rule_id",
            sa.Integer(),
            sa.ForeignKey("curation_rules.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("target_kind", sa.String(20), nullable=False),
        sa.Column("target_id", sa.String(200), nullable=False),
        sa.Column("trajectory_id", sa.String(200), nullable=True),
        sa.Column("action", sa.String(20), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        _created_at(),
        sa.UniqueConstraint("rule_id", "target_kind", "target_id"),
    )
    op.create_index("ix_curation_marks_rule_id", "curation_marks", ["rule_id"])
    op.create_index("ix_curation_marks_trajectory_id", "curation_marks", ["trajectory_id"])
    op.create_index("ix_curation_marks_target", "curation_marks", ["target_kind", "target_id"])
    op.create_table(
        "batches",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("name", sa.String(200), nullable=True),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("manifest", sa.JSON(), nullable=False),
        sa.Column("uri", sa.Text(), nullable=True),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("lease_owner", sa.String(200), nullable=True),
        sa.Column("lease_id", sa.String(36), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("leases", sa.Integer(), nullable=False),
        sa.Column("expired_leases", sa.Integer(), nullable=False),
        _created_at(),
    )
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_consumptions",
        sa.Column(
            "batch_id",
            sa.String(36),
            sa.ForeignKey("batches.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("consumer", sa.String(200), primary_key=True),
        sa.Column("lease_id", sa.String(36), nullable=False),
        sa.Column("policy_version_trained", sa.Integer(), nullable=True),
        sa.Column("acked_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "batch_rows",
        sa.Column(
            "batch_id",
            sa.String(36),
            sa.ForeignKey("batches.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("row_index", sa.Integer(), primary_key=True),
        sa.Column("step_id", sa.String(36), primary_key=True),
        sa.Column("trajectory_id", sa.String(200), nullable=False),
    )
    op.create_index("ix_batch_rows_step_id", "batch_rows", ["step_id"])
    op.create_index("ix_batch_rows_trajectory_id", "batch_rows", ["trajectory_id"])


def downgrade() -> None:
    op.drop_table("batch_rows")
    op.drop_table("batch_consumptions")
    op.drop_table("batches")
    op.drop_table("curation_marks")
    op.drop_table("curation_rules")
    op.drop_index("ix_labels_target", table_name="labels")
    op.drop_table("labels")
