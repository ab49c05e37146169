"""What a crashed writer leaves: the trajectories whose calls it cut, flagged ``incomplete`` (C14).

Owns: the ``trajectories.writer_id`` claim (set by ``datapool.steps.store`` on each write as
``host:pid:start_ns``); the call journal (``CallJournal``), which says which trajectories had a
call in flight in a writer process; at start, flagging the open trajectories that a dead writer
on this host cut (a call in flight at the crash) and releasing its claims; releasing the claims
of a writer that stops cleanly; and lifting the flag when the agent comes back (``came_back``).
Never: closes a trajectory (the agent may come back) or deletes anything; the flag only keeps the
trajectory out of training until the agent carries on, or a human or rule decides.

The journal is a file per writer, ``<data_dir>/calls/<writer>.calls``: the line ``writer <id>``,
then ``+ <trajectory id>`` when a call starts (before it goes upstream) and ``- <trajectory id>``
when its commit ended, each one unbuffered ``write`` in append mode, so it survives ``kill -9``
(the kernel holds it) without an ``fsync`` per call; a machine crash may lose its last lines, and
then a cut trajectory goes unflagged. Upkeep rewrites it to the calls in flight when it grows past
``JOURNAL_REWRITE_BYTES``. A dead writer without a journal (written by an older version) has all
its open trajectories flagged, as before: nothing says which were cut.

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

import os
import socket
import threading
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from sqlalchemy import Connection, select, update
from sqlalchemy.orm import Session, sessionmaker

from datapool.models import INCOMPLETE, Trajectory, TrajectoryStatus

JOURNAL_SUFFIX = ".calls"
JOURNAL_REWRITE_BYTES = 1 << 20  # 1 MiB: about 12k calls of 40-character trajectory ids


def _writer_is_dead(writer_id: str, own_writer_id: str) -> bool:
    """A writer id is ``host:pid:start_ns``; only this host's writers can be judged."""
    host, _, rest = writer_id.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit() or writer_id == own_writer_id:
        return False
    pid = int(pid_text)
    if pid == os.getpid():  # an earlier writer of this very process (restarted in place)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class CallJournal:
    """This writer's calls in flight, per trajectory, in a file that outlives the process."""

    def __init__(self, directory: Path, writer_id: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / (writer_id.replace(":", "_").replace("/", "_") + JOURNAL_SUFFIX)
        self.writer_id = writer_id
        self._lock = threading.Lock()
        self._fd = self._open(self.path, Counter())

    def _open(self, path: Path, in_flight: Mapping[str, int]) -> int:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        lines = [f"writer {self.writer_id}\n"]
        lines += [f"+ {tid}\n" for tid, n in in_flight.items() for _ in range(n)]
        os.write(fd, "".join(lines).encode())
        return fd

    def started(self, trajectory_id: str) -> None:
        """A call of ``trajectory_id`` is in flight (before it goes upstream)."""
        with self._lock:
            os.write(self._fd, f"+ {trajectory_id}\n".encode())

    def ended(self, trajectory_id: str) -> None:
        """Once per ``started``, after the call's commit ended (committed or not)."""
        with self._lock:
            os.write(self._fd, f"- {trajectory_id}\n".encode())

    def rewrite_if_large(self, in_flight: Mapping[str, int]) -> None:
        """Replace the file by the calls ``in_flight`` now once it outgrew
        ``JOURNAL_REWRITE_BYTES``; ``in_flight`` must be read under the caller's lock that also
        orders ``started``/``ended`` (``PoolWriter`` holds it)."""
        with self._lock:
            if os.fstat(self._fd).st_size < JOURNAL_REWRITE_BYTES:
                return
            fresh = self.path.with_suffix(".rewrite")
            fd = self._open(fresh, in_flight)
            os.replace(fresh, self.path)
            os.close(self._fd)
            self._fd = fd

    def close(self) -> None:
        """A clean stop: nothing of this writer is in flight any more."""
        with self._lock:
            os.close(self._fd)
            self.path.unlink(missing_ok=True)


def read_journal(path: Path) -> tuple[str | None, set[str]]:
    """``(writer id, trajectories with a call in flight)`` from a journal file; a torn or
    unknown line is skipped."""
    writer_id: str | None = None
    counts: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        kind, _, value = line.partition(" ")
        if kind == "writer" and writer_id is None:
            writer_id = value
        elif kind == "+" and value:
            counts[value] += 1
        elif kind == "-" and value:
            counts[value] -= 1
    return writer_id, {tid for tid, n in counts.items() if n > 0}


def mark_interrupted(
    sessions: sessionmaker[Session], own_writer_id: str, journal_dir: Path | None = None
) -> int:
    """Flag ``incomplete`` the open trajectories a dead writer on this host cut, and release
    the claims of every dead writer; returns how many were flagged.

    Cut: a call in flight in the dead writer's journal (in ``journal_dir``), whoever last wrote
    the trajectory; without a journal, every open trajectory the dead writer last wrote. They
    stay open (the agent may come back). Journals of dead writers are deleted afterwards.
    """
    journals: dict[str, tuple[Path, set[str]]] = {}
    if journal_dir is not None and journal_dir.is_dir():
        for path in journal_dir.glob(f"*{JOURNAL_SUFFIX}"):
            writer_id, cut = read_journal(path)
            if writer_id is not None and _writer_is_dead(writer_id, own_writer_id):
                journals[writer_id] = (path, cut)
    open_ = Trajectory.status == TrajectoryStatus.OPEN.value
    with sessions.begin() as session:
        writers = session.scalars(
            select(Trajectory.writer_id).where(open_, Trajectory.writer_id.is_not(None)).distinct()
        ).all()
        dead = {w for w in writers if w is not None and _writer_is_dead(w, own_writer_id)}
        unjournaled = dead - set(journals)
        cut = set().union(*(ids for _path, ids in journals.values()))
        flagged = 0
        if dead or cut:
            chosen = Trajectory.writer_id.in_(dead) | Trajectory.id.in_(cut)
            for trajectory in session.scalars(select(Trajectory).where(open_, chosen)):
                if trajectory.id in cut or trajectory.writer_id in unjournaled:
                    if INCOMPLETE not in trajectory.flags:
                        trajectory.flags = [*trajectory.flags, INCOMPLETE]
                    flagged += 1
                if trajectory.writer_id in dead:
                    trajectory.writer_id = None
    for path, _cut in journals.values():
        path.unlink(missing_ok=True)
    return flagged


def came_back(connection: Connection, flags_by_id: Mapping[str, list[str]]) -> None:
    """The agents of these trajectories carried on (a step of theirs is being committed in
    ``connection``'s transaction): lift their ``incomplete`` flag, so each is judged on its own
    steps. ``flags_by_id``: each one's flags as read under the transaction's write lock (the
    writer reads them with the trajectories' state); an update only for a flagged one."""
    for trajectory_id, flags in flags_by_id.items():
        if INCOMPLETE in flags:
            connection.execute(
                update(Trajectory)
                .where(Trajectory.id == trajectory_id)
                .values(flags=[f for f in flags if f != INCOMPLETE])
            )


def release_writer(sessions: sessionmaker[Session], writer_id: str) -> None:
    """On a clean stop: this writer's open trajectories are not in flight in a dead process."""
    with sessions.begin() as session:
        session.execute(
            update(Trajectory).where(Trajectory.writer_id == writer_id).values(writer_id=None)
        )
