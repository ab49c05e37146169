"""What a step sampled with and which weights sampled which tokens: ``steps.sampling`` and
``steps.policy_version_spans``.

``sampling`` (JSON) holds the effective sampling fields after the channel's defaults and policy,
what narrowed the distribution, vLLM's logprobs mode and the temperature the stored behaviour
logprobs are at (the trainer divides its logits by it; docs/batches.md). ``policy_version_spans``
(JSON, ``[[version, start, end], ...]``) says which policy version sampled which response tokens
when a full-weight update kept the call running across the reload (docs/gateway.md, "Full-weight
updates"). NULL in both for every row written before this revision: temperature unknown, one
version.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("sampling", sa.JSON(none_as_null=True), nullable=True))
        batch.add_column(
            sa.Column("policy_version_spans", sa.JSON(none_as_null=True), nullable=True)
        )


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("policy_version_spans")
        batch.drop_column("sampling")
