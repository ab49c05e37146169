"""Curation rules record why their last run failed, and SQLite never reuses a rule's id.

New columns ``curation_rules.error`` (the message of the rule's last failed run: stored params
that no longer validate, a predicate that raises; NULL after a good run) and ``failed_at``.
On SQLite the table is rebuilt with ``AUTOINCREMENT``, so the id of a deleted rule is never
given to a new one (without it SQLite hands out max(id) + 1 again); the rows keep their ids.
PostgreSQL's sequence never reused ids, so there only the columns are added. Downgrade drops
the columns (the SQLite table keeps ``AUTOINCREMENT``, which the older code does not mind).

Frozen here: no import of the pool's code, which may change.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    # recreate="always" on SQLite rebuilds the table, the only way to add AUTOINCREMENT there
    # (foreign keys are off while migrating: migrations/env.py).
    with op.batch_alter_table(
        "curation_rules",
        recreate="always" if sqlite else "auto",
        table_kwargs={"sqlite_autoincrement": True} if sqlite else {},
    ) as batch:
        batch.add_column(sa.Column("error", sa.Text(), nullable=True))
        batch.add_column(sa.Column("failed_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("curation_rules") as batch:
        batch.drop_column("failed_at")
        batch.drop_column("error")
