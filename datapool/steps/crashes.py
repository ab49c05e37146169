"""What a crashed writer leaves: open trajectories it was writing, flagged ``incomplete`` (C14).

Owns: the ``trajectories.writer_id`` claim (set by ``datapool.steps.store`` on each write as
``host:pid:start_ns``), flagging the open trajectories of writers that died on this host, and
releasing the claims of a writer that stops cleanly. Never: closes a trajectory (the agent may
come back) or deletes anything; the flag only keeps the trajectory out of training until a human
or rule decides.

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

import os
import socket

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from datapool.models import INCOMPLETE, Trajectory, TrajectoryStatus


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


def mark_interrupted(sessions: sessionmaker[Session], own_writer_id: str) -> int:
    """Flag ``incomplete`` the open trajectories last written by a dead writer on this host.

    They stay open (the agent may come back); the flag keeps them out of training until a human
    or rule decides. Returns how many were flagged.
    """
    with sessions.begin() as session:
        writers = session.scalars(
            select(Trajectory.writer_id)
            .where(
                Trajectory.status == TrajectoryStatus.OPEN.value,
                Trajectory.writer_id.is_not(None),
            )
            .distinct()
        ).all()
        dead = [w for w in writers if w is not None and _writer_is_dead(w, own_writer_id)]
        if not dead:
            return 0
        trajectories = list(
            session.scalars(
                select(Trajectory).where(
                    Trajectory.status == TrajectoryStatus.OPEN.value,
                    Trajectory.writer_id.in_(dead),
                )
            )
        )
        for trajectory in trajectories:
            if INCOMPLETE not in trajectory.flags:
                trajectory.flags = [*trajectory.flags, INCOMPLETE]
            trajectory.writer_id = None
        return len(trajectories)


def release_writer(sessions: sessionmaker[Session], writer_id: str) -> None:
    """On a clean stop: this writer's open trajectories are not in flight in a dead process."""
    with sessions.begin() as session:
        session.execute(
            update(Trajectory).where(Trajectory.writer_id == writer_id).values(writer_id=None)
        )
