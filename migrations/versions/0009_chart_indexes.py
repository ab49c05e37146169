"""Indexes that let the inspector's charts read narrow indexes instead of every step row.

A step row carries its request JSON, so a chart aggregate that scans ``steps`` reads the whole
table (about 1 GB at 1 M steps). With these, each chart reads only an index (docs/inspector.md,
"Benchmark"):

- ``ix_steps_trajectory_version`` (trajectory_id, policy_version): each trajectory's newest
  policy version (reward by version), one covering scan.
- ``ix_steps_charts`` (created_at, policy_version, prompt_tokens, completion_tokens): steps and
  tokens per time bucket, the length histograms, steps per version; covering.
- ``ix_steps_flagged`` (policy_version), partial, only the steps whose ``flags`` list is not
  empty: flag rates read the few flagged steps, not all of them.
- ``ix_steps_prompt_tokens``, ``ix_steps_completion_tokens`` (length, created_at): the length
  histograms count each distinct length in index order, without sorting the steps.

``ix_steps_created_at`` (0005) goes: ``ix_steps_charts`` starts with the same column.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The same predicate as datapool.models.FLAGGED_STEP (a query must repeat it to use the index).
FLAGGED = "flags IS NOT NULL AND CAST(flags AS TEXT) != '[]'"


def upgrade() -> None:
    op.create_index("ix_steps_trajectory_version", "steps", ["trajectory_id", "policy_version"])
    op.create_index(
        "ix_steps_charts",
        "steps",
        ["created_at", "policy_version", "prompt_tokens", "completion_tokens"],
    )
    for column in ("prompt_tokens", "completion_tokens"):
        op.create_index(f"ix_steps_{column}", "steps", [column, "created_at"])
    op.drop_index("ix_steps_created_at", table_name="steps")
    op.create_index(
        "ix_steps_flagged",
        "steps",
        ["policy_version"],
        sqlite_where=sa.text(FLAGGED),
        postgresql_where=sa.text(FLAGGED),
    )


def downgrade() -> None:
    op.create_index("ix_steps_created_at", "steps", ["created_at"])
    for name in (
        "ix_steps_flagged",
        "ix_steps_completion_tokens",
        "ix_steps_prompt_tokens",
        "ix_steps_charts",
        "ix_steps_trajectory_version",
    ):
        op.drop_index(name, table_name="steps")
