"""Migrations run on SQLite and PostgreSQL, both ways, and produce exactly the models' schema."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from datapool import db
from datapool.db import make_engine
from datapool.models import Base


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_creates_the_pool_tables_and_downgrade_removes_them(
    empty_database_url: str,
) -> None:
    db.upgrade(empty_database_url)
    assert {"trajectories", "steps", "alembic_version"} <= _tables(empty_database_url)
    db.downgrade(empty_database_url, "base")
    assert _tables(empty_database_url) <= {"alembic_version"}
    db.upgrade(empty_database_url)  # and back up again
    assert {"trajectories", "steps"} <= _tables(empty_database_url)


def test_upgrade_twice_is_a_no_op(empty_database_url: str) -> None:
    db.upgrade(empty_database_url)
    db.upgrade(empty_database_url)
    assert {"trajectories", "steps"} <= _tables(empty_database_url)


def test_migrated_schema_matches_the_models(empty_database_url: str) -> None:
    db.upgrade(empty_database_url)
    engine = make_engine(empty_database_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == []
