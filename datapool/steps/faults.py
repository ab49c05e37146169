"""What kind of storage fault the pool hit, named for logs, metrics and the client's 503.

Owns: ``fault_reason``, which reads the database driver's own error codes (SQLite's result code,
PostgreSQL's SQLSTATE, SQLAlchemy's "connection invalidated") and the OS errno of a failed file
write, and ``is_storage_fault``, which tells a fault of the storage (retrying the same call later
may work) from an error in one call's data. Never: retries, or decides what the gateway answers
(see ``datapool.steps.writer``).

Reasons (a fixed, low-cardinality set, safe as a metric label):

- ``disk_full``: SQLITE_FULL, SQLSTATE 53100, ``ENOSPC``/``EDQUOT``/``EFBIG`` on a file write.
- ``locked``: SQLITE_BUSY/SQLITE_LOCKED past the busy timeout; SQLSTATE 55P03 (lock not
  available), 40P01 (deadlock), 57014 (statement timeout).
- ``unreachable``: the connection could not be made or was lost (SQLSTATE class 08, 57P01-03
  server shutting down, any other psycopg ``OperationalError`` such as a database that does not
  accept connections, an invalidated connection, SQLite's SQLITE_CANTOPEN).
- ``read_only``: SQLITE_READONLY, SQLSTATE 25006.
- ``io_error``: SQLITE_IOERR and other OS errors of a file write.
- ``other``: anything else (a bug or one call's bad data, not the storage).
"""

from __future__ import annotations

import errno
import sqlite3
from typing import Literal, get_args

import psycopg
from sqlalchemy import exc as sa_exc

FaultReason = Literal["disk_full", "locked", "unreachable", "read_only", "io_error", "other"]
FAULT_REASONS: tuple[FaultReason, ...] = get_args(FaultReason)

_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_SQLSTATE_REASONS: dict[str, FaultReason] = {
    "53100": "disk_full",
    "55P03": "locked",
    "40P01": "locked",
    "57014": "locked",
    "57P01": "unreachable",
    "57P02": "unreachable",
    "57P03": "unreachable",
    "3D000": "unreachable",  # the database does not exist (dropped, or a wrong URL)
    "25006": "read_only",
}


def fault_reason(exc: BaseException) -> FaultReason:
    """The kind of storage fault ``exc`` is, or ``other`` when it is not one."""
    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated:
            return "unreachable"
        return _driver_reason(exc.orig)
    if isinstance(exc, sa_exc.TimeoutError):  # no connection free in the pool in time
        return "unreachable"
    if isinstance(exc, OSError):
        return "disk_full" if exc.errno in _DISK_FULL_ERRNOS else "io_error"
    return _driver_reason(exc)


def is_storage_fault(exc: BaseException) -> bool:
    """True when ``exc`` is a fault of the storage rather than of the data written."""
    return fault_reason(exc) != "other"


def _driver_reason(exc: BaseException | None) -> FaultReason:
    if isinstance(exc, sqlite3.Error):
        name = getattr(exc, "sqlite_errorname", "") or ""
        if name.startswith("SQLITE_FULL"):
            return "disk_full"
        if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
            return "locked"
        if name.startswith("SQLITE_READONLY"):
            return "read_only"
        if name.startswith("SQLITE_CANTOPEN"):
            return "unreachable"
        if name.startswith("SQLITE_IOERR"):
            return "io_error"
        return "other"
    sqlstate = getattr(exc, "sqlstate", None)
    if isinstance(sqlstate, str):
        if sqlstate in _SQLSTATE_REASONS:
            return _SQLSTATE_REASONS[sqlstate]
        if sqlstate.startswith("08"):
            return "unreachable"
    # psycopg's OperationalError is the server's or the connection's state, never one call's
    # data (that is DataError/IntegrityError/ProgrammingError): e.g. a refused connection (no
    # SQLSTATE) or "database is not currently accepting connections" (55000).
    if isinstance(exc, psycopg.OperationalError):
        return "unreachable"
    return "other"
