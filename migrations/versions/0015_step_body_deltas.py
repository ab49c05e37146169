"""Step bodies linear in turns: large values stored once, translated upstream bodies as deltas.

New table ``json_blobs`` (a JSON value by the sha256 of its JSON text, ``json.dumps`` with its
default separators) and column ``steps.body_deltas``: per body of a step (``request``,
``upstream``, ``canonical``), the fields stored as a delta on the parent step's same field (an
int: the parent's first n items or characters, then the stored value) or as a blob (its sha;
the stored value is null, the key kept for its place). NULL: every field as stored.

Upgrade rewrites the rows already stored the same way, one trajectory at a time: every value of
512 bytes or more of JSON text (a tool list, a system prompt) becomes a blob, except a step's
history list (``history_field`` of the request, ``messages`` of the canonical record: already
deltas); an upstream request stored whole whose list extends its parent's (also stored whole)
keeps only the items appended. Downgrade writes every row back whole (the form 0014 reads),
then drops the column and the table.

Frozen here (no import of the pool's code, which may change): the rules above are the subset
of ``datapool.steps.bodies`` (revision 0015) that old rows need, and its reader.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-05
"""

import hashlib
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BLOB_MIN_BYTES = 512

_STEPS = sa.table(
    "steps",
    sa.column("id", sa.String()),
    sa.column("trajectory_id", sa.String()),
    sa.column("parent_step_id", sa.String()),
    sa.column("step_index", sa.Integer()),
    sa.column("choice_index", sa.Integer()),
    sa.column("history_field", sa.String()),
    sa.column("request", sa.JSON()),
    sa.column("upstream_request", sa.JSON(none_as_null=True)),
    sa.column("upstream_request_patch", sa.JSON(none_as_null=True)),
    sa.column("canonical", sa.JSON(none_as_null=True)),
    sa.column("body_deltas", sa.JSON(none_as_null=True)),
)
_BLOBS = sa.table(
    "json_blobs",
    sa.column("sha256", sa.String()),
    sa.column("body", sa.Text()),
    sa.column("created_at", sa.DateTime(timezone=True)),
)


def upgrade() -> None:
    op.create_table(
        "json_blobs",
        sa.Column("sha256", sa.String(64), primary_key=True),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("body_deltas", sa.JSON(), nullable=True))
    _compact()


def downgrade() -> None:
    _expand()
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("body_deltas")
    op.drop_table("json_blobs")


def _rows(connection: sa.Connection, trajectory_id: str) -> list[Any]:
    return connection.execute(
        sa.select(
            _STEPS.c.id,
            _STEPS.c.parent_step_id,
            _STEPS.c.history_field,
            _STEPS.c.request,
            _STEPS.c.upstream_request,
            _STEPS.c.canonical,
            _STEPS.c.body_deltas,
        )
        .where(_STEPS.c.trajectory_id == trajectory_id)
        .order_by(_STEPS.c.step_index, _STEPS.c.choice_index)
    ).all()


def _trajectories(connection: sa.Connection) -> Sequence[str]:
    return connection.scalars(sa.select(_STEPS.c.trajectory_id).distinct()).all()


def _compact() -> None:
    connection = op.get_bind()
    now = datetime.now(UTC)
    written: set[str] = set()  # blobs inserted so far (the table was empty)
    for trajectory_id in _trajectories(connection):
        whole_upstream: dict[str, dict[str, Any]] = {}  # step id -> its upstream, whole
        for step_id, parent_id, field, request, upstream, canonical, _ in _rows(
            connection, trajectory_id
        ):
            deltas: dict[str, dict[str, Any]] = {}
            blobs: dict[str, str] = {}
            values: dict[str, Any] = {}
            history = field if isinstance(request.get(field or ""), list) else None
            values["request"] = _blobbed(request, history, "request", deltas, blobs)
            if upstream is not None:
                whole_upstream[step_id] = upstream
                parent = whole_upstream.get(parent_id or "")
                values["upstream_request"] = _blobbed(
                    _extending(upstream, parent, deltas), None, "upstream", deltas, blobs
                )
            if canonical is not None:
                skip = "messages" if isinstance(canonical.get("messages"), list) else None
                values["canonical"] = _blobbed(canonical, skip, "canonical", deltas, blobs)
            if not deltas:
                continue
            for sha, text in blobs.items():
                if sha not in written:
                    written.add(sha)
                    connection.execute(
                        sa.insert(_BLOBS).values(sha256=sha, body=text, created_at=now)
                    )
            connection.execute(
                sa.update(_STEPS).where(_STEPS.c.id == step_id).values(body_deltas=deltas, **values)
            )


def _extending(
    body: dict[str, Any], parent: dict[str, Any] | None, deltas: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """``body`` with each list that extends ``parent``'s same list cut to what it appends."""
    if parent is None:
        return body
    stored: dict[str, Any] = {}
    for name, value in body.items():
        theirs = parent.get(name)
        n = 0
        if isinstance(value, list) and isinstance(theirs, list):
            for mine, other in zip(value, theirs, strict=False):
                if json.dumps(mine) != json.dumps(other):
                    break
                n += 1
        if n and not n == len(value) == len(theirs):
            stored[name] = value[n:]
            deltas.setdefault("upstream", {})[name] = n
        else:
            stored[name] = value
    return stored


def _blobbed(
    body: dict[str, Any],
    skip: str | None,
    doc: str,
    deltas: dict[str, dict[str, Any]],
    blobs: dict[str, str],
) -> dict[str, Any]:
    """``body`` with each value of ``BLOB_MIN_BYTES`` or more of JSON (not ``skip``, not a
    delta already) replaced by null and named in ``deltas[doc]`` by its blob's sha."""
    stored: dict[str, Any] = {}
    spec = deltas.get(doc, {})
    for name, value in body.items():
        text = json.dumps(value)
        if name == skip or name in spec or len(text) < BLOB_MIN_BYTES:
            stored[name] = value
            continue
        sha = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
        blobs[sha] = text
        deltas.setdefault(doc, {})[name] = sha
        stored[name] = None
    return stored


def _expand() -> None:
    connection = op.get_bind()
    for trajectory_id in _trajectories(connection):
        full: dict[str, dict[str, Any]] = {}  # step id -> {"request"|..: body, whole}
        for step_id, parent_id, _field, request, upstream, canonical, deltas in _rows(
            connection, trajectory_id
        ):
            bodies = {"request": request, "upstream": upstream, "canonical": canonical}
            parent = full.get(parent_id or "", {})
            for doc, spec in (deltas or {}).items():
                body = bodies[doc]
                whole = {}
                for name, value in body.items():
                    how = spec.get(name)
                    if how is None:
                        whole[name] = value
                    elif isinstance(how, str):
                        text = connection.scalar(
                            sa.select(_BLOBS.c.body).where(_BLOBS.c.sha256 == how)
                        )
                        if text is None:
                            raise RuntimeError(f"step {step_id}: blob {how} is not stored")
                        whole[name] = json.loads(text)
                    else:
                        whole[name] = parent[doc][name][:how] + value
                bodies[doc] = whole
            full[step_id] = bodies
            if deltas:
                connection.execute(
                    sa.update(_STEPS)
                    .where(_STEPS.c.id == step_id)
                    .values(
                        request=bodies["request"],
                        upstream_request=bodies["upstream"],
                        canonical=bodies["canonical"],
                    )
                )
