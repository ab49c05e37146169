"""Engines and sessions for the pool's SQL database (SQLite by default, PostgreSQL at scale).

Owns: connection set-up (SQLite in WAL mode with foreign keys on), running the Alembic
migrations programmatically, and the size of ``IN (...)`` lists (``chunks``). Never: creates
tables with ``metadata.create_all``; the schema comes only from ``migrations/``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeAlias

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

import migrations

SQL_IN_CHUNK = 2000  # ids per IN (...) list, well under SQLite's bound-parameter limit


def chunks(items: Sequence[str], size: int = SQL_IN_CHUNK) -> Iterable[Sequence[str]]:
    """``items`` in consecutive slices of at most ``size``, one ``IN (...)`` list each."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


def make_engine(database_url: str, *, lock_timeout_ms: int | None = None) -> Engine:
    """Create an engine; for SQLite, make the parent directory and turn on WAL and foreign keys.

    ``lock_timeout_ms``: how long a statement waits for another connection's lock before it
    fails (SQLite: the busy timeout, ``database is locked``, 30 s when None; PostgreSQL:
    ``lock_timeout``, SQLSTATE 55P03, the server's setting when None).
    """
    if database_url.startswith("sqlite"):
        path = database_url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        busy_timeout_ms = 30_000 if lock_timeout_ms is None else lock_timeout_ms
        engine = create_engine(database_url, connect_args={"timeout": busy_timeout_ms / 1000})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    connect_args: dict[str, Any] = {}
    if lock_timeout_ms is not None and database_url.startswith("postgresql"):
        connect_args["options"] = f"-c lock_timeout={lock_timeout_ms}"
    return create_engine(database_url, pool_pre_ping=True, connect_args=connect_args)


def insert_ignoring(model: Any, dialect: str) -> Any:
    """The statement ``INSERT INTO model ... ON CONFLICT DO NOTHING`` of ``dialect``.

    Raises ValueError on a database other than SQLite or PostgreSQL.
    """
    if dialect == "postgresql":
        return postgresql.insert(model).on_conflict_do_nothing()
    if dialect == "sqlite":
        return sqlite.insert(model).on_conflict_do_nothing()
    raise ValueError(f"unsupported database dialect {dialect!r}; expected sqlite or postgresql")


def insert_ignore(executor: Session | Connection, model: Any, rows: list[dict[str, Any]]) -> int:
    """``INSERT ... ON CONFLICT DO NOTHING`` of ``rows`` in ``executor``'s transaction; for one
    row, returns 1 if it was inserted and 0 if it existed (for several rows, -1: drivers cannot
    tell).

    The race-free way to create a row that concurrent requests may create too.
    Raises ValueError on a database other than SQLite or PostgreSQL.
    """
    bind = executor.get_bind() if isinstance(executor, Session) else executor
    stmt = insert_ignoring(model, bind.dialect.name)
    if len(rows) != 1:
        executor.execute(stmt, rows)
        return -1
    # RETURNING lists only the rows actually inserted (rowcount is -1 on psycopg here).
    keys = list(model.__table__.primary_key.columns)
    return len(executor.execute(stmt.returning(*keys), rows[0]).all())


# What functions of the pool take to open their own sessions (``with sessions() as session``),
# so callers outside the data layer can hand it on without importing SQLAlchemy.
Sessions: TypeAlias = sessionmaker[Session]


def make_sessionmaker(engine: Engine) -> Sessions:
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(database_url: str) -> Config:
    """An Alembic config pointing at the packaged ``migrations/`` and at ``database_url``."""
    script_location = Path(migrations.__file__).parent
    config = Config()
    config.set_main_option("script_location", str(script_location))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


# Key of the PostgreSQL advisory lock held while migrating (any constant bigint; "trajgate").
MIGRATION_LOCK_KEY = 0x7472616A67617465


@contextmanager
def _migration_lock(database_url: str) -> Iterator[None]:
    """Serialise migrations of one database across processes.

    Several gateway replicas starting at once each run ``upgrade``; without the lock their
    ``CREATE TABLE alembic_version`` race and all but one fail. On PostgreSQL the lock is a
    session advisory lock held on its own connection; SQLite serialises writers itself.
    """
    if not database_url.startswith("postgresql"):
        yield
        return
    engine = create_engine(database_url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            try:
                yield
            finally:
                connection.execute(
                    text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY}
                )
    finally:
        engine.dispose()


def upgrade(database_url: str, revision: str = "head") -> None:
    """Migrate the database at ``database_url`` up to ``revision`` (idempotent, and safe when
    several processes do it at once)."""
    if database_url.startswith("sqlite"):
        make_engine(database_url).dispose()  # creates the data directory
    with _migration_lock(database_url):
        command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str) -> None:
    """Migrate the database at ``database_url`` down to ``revision`` (``base`` drops everything)."""
    with _migration_lock(database_url):
        command.downgrade(alembic_config(database_url), revision)
