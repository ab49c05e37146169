"""An index that lets the inspector's list sort by reward without scoring every trajectory.

Sorting the trajectory list by its current reward used to evaluate the current-reward subquery
for every matching trajectory and sort them all (about 350 to 420 ms at 100k trajectories, the
list's p99). ``ix_rewards_sort`` (target_kind, name, value, target_id) holds each reward record in
value order, so a page sorted by reward walks the index from either end and stops after one page
(``datapool.queries.listing``, docs/inspector.md "Benchmark").

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_rewards_sort", "rewards", ["target_kind", "name", "value", "target_id"])


def downgrade() -> None:
    op.drop_index("ix_rewards_sort", table_name="rewards")
