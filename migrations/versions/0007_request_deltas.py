"""Request messages as deltas on the parent step, the upstream request as a merge patch.

New columns ``steps.messages_base`` (the first b messages are the parent's messages + response;
``request.messages`` holds the rest) and ``steps.upstream_request_patch`` (RFC 7396 merge patch
against the full client request); ``steps.upstream_request`` becomes nullable (NULL when the
patch is set). Rows written before this revision are not rewritten: NULL ``messages_base`` and a
whole ``upstream_request`` read as they always did (``datapool.steps.messages``).

Downgrade restores every row to the old form (whole request, whole upstream request), one
trajectory at a time, then drops the columns: nothing is lost, but it rewrites every row
written since the upgrade, and its database grows back to the quadratic size.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("messages_base", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("upstream_request_patch", sa.JSON(), nullable=True))
        batch.alter_column("upstream_request", existing_type=sa.JSON(), nullable=True)


def downgrade() -> None:
    from migrations.legacy import StoredRequest, full_requests, messages_before_0013

    steps = sa.table(
        "steps",
        sa.column("id", sa.String()),
        sa.column("trajectory_id", sa.String()),
        sa.column("parent_step_id", sa.String()),
        sa.column("messages_base", sa.Integer()),
        sa.column("request", sa.JSON()),
        sa.column("upstream_request", sa.JSON()),
        sa.column("upstream_request_patch", sa.JSON()),
        sa.column("response_message", sa.JSON(none_as_null=True)),
    )
    connection = op.get_bind()
    trajectory_ids = connection.scalars(
        sa.select(steps.c.trajectory_id)
        .where(sa.or_(steps.c.messages_base.is_not(None), steps.c.upstream_request.is_(None)))
        .distinct()
    ).all()
    for trajectory_id in trajectory_ids:  # a trajectory's rows are one delta chain
        rows = connection.execute(
            sa.select(
                steps.c.id,
                steps.c.parent_step_id,
                steps.c.messages_base,
                steps.c.request,
                steps.c.upstream_request,
                steps.c.upstream_request_patch,
                steps.c.response_message,
            ).where(steps.c.trajectory_id == trajectory_id)
        ).all()
        stored = {row[0]: StoredRequest(*row) for row in rows}
        messages = messages_before_0013(stored)
        for step_id, entry in stored.items():
            if entry.messages_base is None and entry.upstream_request is not None:
                continue
            request, upstream_request = full_requests(entry, messages[step_id])
            connection.execute(
                steps.update()
                .where(steps.c.id == step_id)
                .values(request=request, upstream_request=upstream_request)
            )
    with op.batch_alter_table("steps") as batch:
        batch.alter_column("upstream_request", existing_type=sa.JSON(), nullable=False)
        batch.drop_column("upstream_request_patch")
        batch.drop_column("messages_base")
