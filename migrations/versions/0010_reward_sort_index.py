"""Indexes that let the inspector's list sort by reward, call count or completion time without
sorting every trajectory.

Sorting the trajectory list by its current reward used to evaluate the current-reward subquery
for every matching trajectory and sort them all (about 350 to 420 ms at 100k trajectories, the
list's p99). ``ix_rewards_sort`` (target_kind, name, value, target_id) holds each reward record in
value order, so a page sorted by reward walks the index from either end and stops after one page
(``datapool.queries.listing``, docs/inspector.md "Benchmark").

``ix_trajectories_call_count`` and ``ix_trajectories_completed_at`` (key, id) give the list's
other sort keys their order with the id tie-break, where a one-column index still sorted every
tie (sorting 100k trajectories by call count took 120 to 370 ms when all had 10 calls).

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
    op.create_index("ix_trajectories_call_count", "trajectories", ["call_count", "id"])
    op.create_index("ix_trajectories_completed_at", "trajectories", ["completed_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_trajectories_completed_at", table_name="trajectories")
    op.drop_index("ix_trajectories_call_count", table_name="trajectories")
    op.drop_index("ix_rewards_sort", table_name="rewards")
