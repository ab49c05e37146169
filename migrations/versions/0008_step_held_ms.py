"""How long a full-weight reload held a call: ``steps.held_ms``.

The gateway holds new calls while a full-weight reload drains, reloads and resumes
(docs/gateway.md, "Full-weight updates"); the wait is part of ``latency_ms`` and is recorded on
the step so that slow calls can be told apart from held ones. NULL: not held (and every row
written before this revision).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("held_ms", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("held_ms")
