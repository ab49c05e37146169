"""The trajectories this process knows are closed, so a late call is refused before sampling.

Owns: ``KnownClosed``, a bounded LRU of trajectory id → the status it closed as (``complete``,
``abandoned``, ``failed``), held by the writer (``PoolWriter.known_closed``) and asked by
``PoolWriter.check_open`` before a call goes upstream. Never: reads or writes the database; a
miss means "not known closed", never "open".

Why a cache of closed ids needs no invalidation: closing is terminal (no transition leads back
to ``open``, and a trajectory is never deleted), so an entry can only go stale by eviction, and
an evicted or never-seen closed trajectory is still refused, later, by the commit's own check
(``PoolStore.record_calls`` reads the status under the write lock), which then adds it here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["KnownClosed"]


class KnownClosed:
    """At most ``max_ids`` closed trajectories, least recently added or asked for dropped first.

    ``status_of`` is one dict lookup for a trajectory not known closed (the gateway asks it on
    every call); ``add`` is called by the writer thread, the upkeep thread and the event loop
    alike, under a lock (it reorders and evicts).
    """

    def __init__(self, max_ids: int) -> None:
        if max_ids < 1:
            raise ValueError(f"KnownClosed holds at least 1 trajectory, got max_ids={max_ids}")
        self.max_ids = max_ids
        self._status: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, trajectory_id: str, status: str) -> None:
        """Remember ``trajectory_id`` as closed with ``status``; drops the least recently used
        entry past ``max_ids``."""
        with self._lock:
            self._status[trajectory_id] = status
            self._status.move_to_end(trajectory_id)
            if len(self._status) > self.max_ids:
                self._status.popitem(last=False)

    def status_of(self, trajectory_id: str) -> str | None:
        """The status ``trajectory_id`` closed as, or None when it is not known closed (open,
        unknown, closed by another process, or evicted)."""
        # The miss (every call of an open trajectory) takes no lock: one dict lookup, atomic
        # against the other threads' ``add`` as every single operation on a dict is.
        if trajectory_id not in self._status:
            return None
        with self._lock:
            status = self._status.get(trajectory_id)
            if status is not None:
                self._status.move_to_end(trajectory_id)  # a client still calling: keep it
            return status

    def __len__(self) -> int:
        return len(self._status)
