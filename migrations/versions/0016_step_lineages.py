"""Each step's lineage: the conversation of its trajectory it belongs to (sub-agents, side calls).

New columns ``steps.lineage_id`` (a client's session or agent id, or the id of the lineage's
first step), ``lineage_parent_id`` (the lineage it came from), ``lineage_kind`` (``main``,
``subagent``, ``side_call``, ``compaction``) and ``lineage_source`` (``headers``: a client header
named it; ``inferred``: the message structure did), indexed with the trajectory.

Upgrade fills them for the rows already stored, one trajectory at a time, from what those rows
know (no header was kept, so every backfilled lineage is ``inferred``), walking the steps in
step then choice order:

- a choice after the first of its call is in the first's lineage;
- a step whose parent is known is in its parent's lineage (an exact continuation, a prefix
  break, a failed call hung on the latest step);
- a root stored as a side call (``divergence_kind = 'side_call'``) starts a lineage of kind
  ``side_call`` named after it, whose parent is the trajectory's main lineage;
- any other root is in the latest step's lineage, or starts the ``main`` lineage when it is
  the trajectory's first step.

These are the writer's rules (``datapool.steps.lineage``) for calls without a header, with one
difference the stored rows cannot settle: a re-send of a side call (a root at the same prompt)
is its own lineage here, where the writer puts it in its twin's. Downgrade drops the columns.

Downgrade refuses (``RuntimeError``, nothing changed) while a step's ``body_deltas`` holds a
list delta ``[k, m, items]``: the code of this revision writes it for a list whose leading
items changed (Claude Code's billing line, with a ``cch`` new on every request), and the
readers of revision 0015 and before cannot read it (0015's own downgrade would fail half way).
Export such a pool (``trajgate export``) before going back.

Frozen here: no import of the pool's code, which may change.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06
"""

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_STEPS = sa.table(
    "steps",
    sa.column("id", sa.String()),
    sa.column("trajectory_id", sa.String()),
    sa.column("parent_step_id", sa.String()),
    sa.column("step_index", sa.Integer()),
    sa.column("choice_index", sa.Integer()),
    sa.column("divergence_kind", sa.String()),
    sa.column("lineage_id", sa.String()),
    sa.column("lineage_parent_id", sa.String()),
    sa.column("lineage_kind", sa.String()),
    sa.column("lineage_source", sa.String()),
    sa.column("body_deltas", sa.JSON(none_as_null=True)),
)

# (lineage_id, lineage_parent_id, lineage_kind)
Lineage = tuple[str, str | None, str]


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("lineage_id", sa.String(200), nullable=True))
        batch.add_column(sa.Column("lineage_parent_id", sa.String(200), nullable=True))
        batch.add_column(sa.Column("lineage_kind", sa.String(20), nullable=True))
        batch.add_column(sa.Column("lineage_source", sa.String(10), nullable=True))
    op.create_index("ix_steps_trajectory_lineage", "steps", ["trajectory_id", "lineage_id"])
    _backfill()


def downgrade() -> None:
    _refuse_list_deltas()
    op.drop_index("ix_steps_trajectory_lineage", table_name="steps")
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("lineage_source")
        batch.drop_column("lineage_kind")
        batch.drop_column("lineage_parent_id")
        batch.drop_column("lineage_id")


def _refuse_list_deltas() -> None:
    """Raise ``RuntimeError`` naming a step whose ``body_deltas`` holds a list delta."""
    connection = op.get_bind()
    rows = connection.execute(
        sa.select(_STEPS.c.id, _STEPS.c.body_deltas).where(_STEPS.c.body_deltas.is_not(None))
    )
    for step_id, deltas in rows:
        if isinstance(deltas, str):  # SQLite's JSON as text, where the driver did not decode it
            deltas = json.loads(deltas)
        for doc, specs in (deltas or {}).items():
            for name, spec in (specs or {}).items():
                if isinstance(spec, list):
                    raise RuntimeError(
                        f"cannot downgrade below 0016: step {step_id} stores {doc}.{name} as a "
                        "list delta with replaced leading items, which revision 0015 and before "
                        "cannot read; export the pool (trajgate export) before downgrading"
                    )


def _backfill() -> None:
    connection = op.get_bind()
    update = (
        _STEPS.update()
        .where(_STEPS.c.id == sa.bindparam("step_id"))
        .values(
            lineage_id=sa.bindparam("l_id"),
            lineage_parent_id=sa.bindparam("l_parent"),
            lineage_kind=sa.bindparam("l_kind"),
            lineage_source="inferred",
        )
    )
    trajectory_ids = connection.scalars(sa.select(_STEPS.c.trajectory_id).distinct()).all()
    for trajectory_id in trajectory_ids:
        rows = connection.execute(
            sa.select(
                _STEPS.c.id,
                _STEPS.c.parent_step_id,
                _STEPS.c.step_index,
                _STEPS.c.choice_index,
                _STEPS.c.divergence_kind,
            )
            .where(_STEPS.c.trajectory_id == trajectory_id)
            .order_by(_STEPS.c.step_index, _STEPS.c.choice_index)
        ).all()
        values = [
            {"step_id": step_id, "l_id": lineage[0], "l_parent": lineage[1], "l_kind": lineage[2]}
            for step_id, lineage in lineages(rows).items()
        ]
        if values:
            connection.execute(update, values)


def lineages(rows: Sequence[Any]) -> dict[str, Lineage]:
    """Each step's lineage by the rules above; ``rows`` are ``(id, parent_step_id, step_index,
    choice_index, divergence_kind)`` of one trajectory in step then choice order."""
    of: dict[str, Lineage] = {}
    first_of_call: dict[int, str] = {}
    main: str | None = None
    latest: Lineage | None = None
    for step_id, parent, step_index, choice_index, kind in rows:
        first = first_of_call.setdefault(step_index, step_id)
        if choice_index > 0 and first in of:
            lineage = of[first]
        elif parent is not None and parent in of:
            lineage = of[parent]
        elif kind == "side_call":
            lineage = (step_id, main, "side_call")
        elif latest is not None:
            lineage = latest
        else:
            lineage = (step_id, None, "main")
        if main is None and lineage[2] == "main":
            main = lineage[0]
        of[step_id] = lineage
        if first == step_id:
            latest = lineage
    return of
