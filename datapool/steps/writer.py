"""The write path off the request's hot path, but durable: group commit on one writer thread.

Owns: ``PoolWriter.record`` (await it; it returns the step ids once their transaction has
committed, so a delivered response's step survives ``kill -9``), batching of concurrent calls into
one transaction, the refuse/serve policy when the database fails, the counters that say so, the
trajectories known closed (``check_open``: a call to one is refused before it is sampled), and
the writer's background upkeep (compaction of payloads into Parquet, idle-timeout completion,
marking trajectories that were in flight in a crashed writer ``incomplete``).
Never: answers before the commit; holds an acknowledged step only in memory.

Why group commit rather than a write-ahead spool (figures in docs/datapool.md): both make the
step durable before the answer, but the spool needs a second copy of every payload, a replay that
must be idempotent, and answers step ids and 409s that the database has not confirmed yet; group
commit costs one transaction per batch and keeps the database the only source of truth.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

from sqlalchemy.exc import SQLAlchemyError

from datapool.errors import PoolUnavailableError, TrajectoryClosedError
from datapool.models import TrajectoryStatus
from datapool.settings import PoolSettings
from datapool.steps.closed import KnownClosed
from datapool.steps.crashes import CallJournal, mark_interrupted, release_writer
from datapool.steps.faults import fault_reason, is_storage_fault
from datapool.steps.payloads import CompactionRaceError
from datapool.steps.records import CallRecord
from datapool.steps.store import CallResult, PendingCall, PoolStore


class IdleCloser(Protocol):
    """Completes the open trajectories idle for ``idle_s`` seconds, except those ``in_flight``;
    returns the ids completed (``datapool.lifecycle.transitions.close_idle`` with its sessions)."""

    def __call__(self, idle_s: float, *, in_flight: Collection[str] = ()) -> list[str]: ...


log = logging.getLogger("trajgate.pool.writer")


@dataclass
class WriterStats:
    """Counters of the write path (exported as gateway metrics by ``gateway.metrics``)."""

    committed_calls: int = 0
    committed_batches: int = 0
    rejected_calls: int = 0  # trajectory closed (409), refused up front or at commit
    failed_calls: int = 0  # commit failed: refused (503) or served unrecorded
    # Database operations (batch commits, lookups) that met a storage fault, by
    # ``datapool.steps.faults.FaultReason``.
    faults_by_reason: dict[str, int] = field(default_factory=dict)
    refused_calls: int = 0  # answered 503: commit failed, queue full, or refused up front
    unrecorded_calls: int = 0  # served without a step because on_write_failure='serve'
    compacted_steps: int = 0
    compaction_failures: int = 0
    orphan_files_deleted: int = 0
    upkeep_failures: int = 0
    # Monotonic time of the first failed commit since the last good one; None while writable.
    failing_since: float | None = None
    last_error: str | None = None
    batch_sizes: list[int] = field(default_factory=list)


@dataclass
class _Item:
    pending: PendingCall
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[str]]


_STOP = object()


class PoolWriter:
    """Commits calls for the whole process through one thread, many calls per transaction."""

    def __init__(
        self,
        store: PoolStore,
        settings: PoolSettings | None = None,
        *,
        close_idle: IdleCloser | None = None,
    ) -> None:
        """``close_idle`` runs the idle timeout in each upkeep round (the gateway passes
        ``datapool.lifecycle.transitions.close_idle`` bound to its sessions); without it this
        writer never completes idle trajectories, whatever ``trajectory_idle_timeout_s`` says.
        It is passed in because lifecycle sits above the write path (completing a trajectory
        checks its final reward), so the write path cannot import it."""
        self.store = store
        self.close_idle = close_idle
        self.settings = settings or store.settings
        self.stats = WriterStats()
        self.writer_id = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
        self._queue: queue.Queue[_Item | object] = queue.Queue(self.settings.write_queue_max_calls)
        self._thread = threading.Thread(target=self._run, name="pool-writer", daemon=True)
        self._upkeep_stop = threading.Event()
        self._upkeep = threading.Thread(target=self._run_upkeep, name="pool-upkeep", daemon=True)
        self._started = False
        # With on_write_failure='refuse', calls are refused up front until this monotonic time.
        self._refuse_until = 0.0
        self._last_reason = "other"
        # Calls of this process between their start and the end of their commit, per
        # trajectory: the idle timeout skips these (a call may outlast it; its step lands only
        # at commit). Other gateways' calls are not visible here.
        self._calls_in_flight: Counter[str] = Counter()
        self._calls_lock = threading.Lock()
        # The same calls in a file, so a restart after a crash knows which trajectories it cut
        # (``datapool.steps.crashes``); opened by ``start``.
        self._journal: CallJournal | None = None
        # Closed through this process, refused at commit as closed, or read closed by a call
        # (``check_open``).
        self.known_closed = KnownClosed(self.settings.known_closed_trajectories)

    def start(self) -> PoolWriter:
        """Flag the trajectories whose calls dead writers on this host cut, open this writer's
        call journal, then start the threads."""
        journal_dir = self.settings.data_dir / "calls"
        interrupted = mark_interrupted(self.store.sessions, self.writer_id, journal_dir)
        if interrupted:
            log.warning("marked %d trajectories cut by crashed writers incomplete", interrupted)
        self._journal = CallJournal(journal_dir, self.writer_id)
        self._thread.start()
        self._upkeep.start()
        self._started = True
        return self

    def close(self) -> None:
        """Commit what is queued, stop the threads, and release this writer's open trajectories
        (a clean stop leaves them open and unflagged)."""
        if not self._started:
            return
        self._queue.put(_STOP)
        self._thread.join(timeout=60)
        self._upkeep_stop.set()
        self._upkeep.join(timeout=60)
        release_writer(self.store.sessions, self.writer_id)
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        self._started = False

    async def record(self, trajectory_id: str, call: CallRecord) -> list[str]:
        """Commit ``call`` and return its step ids (choice order) once durable.

        Raises ``TrajectoryClosedError`` (409) when the trajectory is closed, and
        ``PoolUnavailableError`` (503) when the database fails and ``on_write_failure`` is
        'refuse'; with 'serve' it returns ``[]`` (logged and counted as unrecorded).
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[str]] = loop.create_future()
        item = _Item(PendingCall(trajectory_id, call), loop, future)
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            return self._on_failure(
                PoolUnavailableError(
                    f"the pool's write queue is full ({self.settings.write_queue_max_calls} calls)",
                    reason="overloaded",
                )
            )
        try:
            return await future
        except PoolUnavailableError as exc:
            return self._on_failure(exc)

    def call_started(self, trajectory_id: str) -> None:
        """Count a call of ``trajectory_id`` in flight (the gateway, before going upstream)."""
        with self._calls_lock:
            self._calls_in_flight[trajectory_id] += 1
            if self._journal is not None:
                self._journal.started(trajectory_id)

    def call_ended(self, trajectory_id: str) -> None:
        """Once per ``call_started``, after the call's commit ended (committed or not)."""
        with self._calls_lock:
            self._calls_in_flight[trajectory_id] -= 1
            if self._calls_in_flight[trajectory_id] <= 0:
                del self._calls_in_flight[trajectory_id]
            if self._journal is not None:
                self._journal.ended(trajectory_id)

    def trajectories_in_flight(self) -> frozenset[str]:
        """Trajectories with a call of this process between its start and its commit."""
        with self._calls_lock:
            return frozenset(self._calls_in_flight)

    def check_accepting(self) -> None:
        """Raise ``PoolUnavailableError`` when a call should be refused before it reaches the
        engine: 'refuse' mode, and a commit failed less than ``write_failure_backoff_s`` ago.

        Sampling tokens the pool cannot keep wastes the engine and hides the fault; after the
        backoff one call goes through and tests the database again.
        """
        if self.settings.on_write_failure != "refuse":
            return
        wait_s = self._refuse_until - time.monotonic()
        if wait_s > 0:
            self.stats.refused_calls += 1
            raise PoolUnavailableError(
                f"the pool cannot take writes ({self._last_reason}): {self.stats.last_error}; "
                f"calls are refused for {wait_s:.1f} s more",
                reason=self._last_reason,
                retry_after_s=wait_s,
            )

    async def check_open(self, trajectory_id: str) -> None:
        """Raise ``TrajectoryClosedError`` (409) when ``trajectory_id`` is known closed
        (``known_closed``), after counting the refusal in its ``rejected_calls`` (one UPDATE, on
        the event loop's executor, not on the loop) and in ``stats.rejected_calls``.

        For a trajectory not known closed this is one dict lookup and no SQL: the cache is
        exact for what this process closed or saw refused, and a trajectory closed elsewhere
        (another gateway, ``lifecycle.close_trajectory`` called directly) is refused at commit
        (``PoolStore.record_calls``), which adds it here for the calls after. A failed count
        leaves the refusal as it is (logged; a storage fault is reported like any lookup's).
        """
        status = self.known_closed.status_of(trajectory_id)
        if status is None:
            return
        self.stats.rejected_calls += 1
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self.store.count_rejected, trajectory_id)
        except SQLAlchemyError as exc:
            if is_storage_fault(exc):
                self.report_fault(exc, "count of a refused call")
            else:
                log.error("could not count a refused call of %s: %r", trajectory_id, exc)
        raise TrajectoryClosedError(trajectory_id, status)

    def trajectory_closed(self, trajectory_id: str, status: str) -> None:
        """``trajectory_id`` was closed as ``status`` through this process (the pool API, the
        idle timeout): later calls to it are refused up front, and its token sequences are
        dropped from the writer's memory."""
        self.known_closed.add(trajectory_id, status)
        self.store.forget_lineage(trajectory_id)

    @property
    def writable(self) -> bool:
        """False from a failed commit until the next good one."""
        return self.stats.failing_since is None

    def _on_failure(self, exc: PoolUnavailableError) -> list[str]:
        if self.settings.on_write_failure == "serve":
            self.stats.unrecorded_calls += 1
            log.error("call served without being recorded (%s): %s", exc.reason, exc.message)
            return []
        self.stats.refused_calls += 1
        raise exc

    # ---- the writer thread -----------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is _STOP:
                break
            batch: list[_Item] = [first]  # type: ignore[list-item]
            while len(batch) < self.settings.write_batch_max_calls:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stopping = True
                    break
                batch.append(nxt)  # type: ignore[arg-type]
            self._commit(batch)

    def _commit(self, batch: list[_Item]) -> None:
        try:
            results: list[CallResult] = self.store.record_calls(
                [item.pending for item in batch], writer_id=self.writer_id
            )
        except Exception as exc:
            reason = fault_reason(exc)
            if reason == "other" and len(batch) > 1:
                # Not the storage: perhaps one call's data. Commit each alone to find it.
                for item in batch:
                    self._commit([item])
                return
            self.stats.failed_calls += len(batch)
            if reason == "other":
                # This one call cannot be recorded (e.g. its trajectory's payload file is gone):
                # it fails alone, and the other calls go on without a backoff.
                results = [self._call_failed(batch[0], exc)]
            else:
                # The storage failed (disk full, locked, unreachable): every call of the batch
                # would fail the same way, and retrying each alone would hold the queue for a
                # busy timeout per call.
                error = self.report_fault(exc, f"commit of {len(batch)} calls")
                results = [error for _ in batch]
        else:
            self._record_success()
            self.stats.committed_batches += 1
            self.stats.batch_sizes.append(len(batch))
            del self.stats.batch_sizes[:-1000]
        for item, result in zip(batch, results, strict=True):
            if isinstance(result, TrajectoryClosedError):
                self.stats.rejected_calls += 1
                self.known_closed.add(result.trajectory_id, result.status)
            elif not isinstance(result, Exception):
                self.stats.committed_calls += 1
            item.loop.call_soon_threadsafe(_resolve, item.future, result)

    def _call_failed(self, item: _Item, exc: Exception) -> PoolUnavailableError:
        stats = self.stats
        stats.faults_by_reason["other"] = stats.faults_by_reason.get("other", 0) + 1
        stats.last_error = repr(exc)
        trajectory_id = item.pending.trajectory_id
        log.error("pool could not record a call of trajectory %s: %r", trajectory_id, exc)
        return PoolUnavailableError(
            f"the pool could not record this call of trajectory {trajectory_id!r} (not a "
            f"storage fault; other calls are recorded): {exc!r}",
            reason="other",
        )

    def report_fault(self, exc: BaseException, operation: str) -> PoolUnavailableError:
        """Count and log a storage fault met by ``operation`` (a commit, or a lookup a call
        needed), start refusing up front in 'refuse' mode, and return the error for the caller.

        Used by the writer thread and by the gateway's lookups, so every fault the gateway meets
        moves the same counters and the same backoff.
        """
        reason = fault_reason(exc)
        stats = self.stats
        stats.faults_by_reason[reason] = stats.faults_by_reason.get(reason, 0) + 1
        stats.last_error = repr(exc)
        self._last_reason = reason
        if stats.failing_since is None:
            stats.failing_since = time.monotonic()
        refuse = self.settings.on_write_failure == "refuse"
        action = (
            f"refusing calls (503) for {self.settings.write_failure_backoff_s:.1f} s"
            if refuse
            else "serving calls without recording them"
        )
        log.error("pool %s failed (%s), %s: %r", operation, reason, action, exc)
        if refuse:
            self._refuse_until = time.monotonic() + self.settings.write_failure_backoff_s
        return PoolUnavailableError(
            f"the pool's database failed ({reason}) during {operation}: {exc!r}",
            reason=reason,
            retry_after_s=max(self.settings.write_failure_backoff_s, 1.0),
        )

    def _record_success(self) -> None:
        stats = self.stats
        if stats.failing_since is not None:
            log.warning(
                "pool writable again after %.1f s (%d calls refused, %d served unrecorded so far)",
                time.monotonic() - stats.failing_since,
                stats.refused_calls,
                stats.unrecorded_calls,
            )
            stats.failing_since = None
        self._refuse_until = 0.0

    # ---- upkeep ----------------------------------------------------------------------------

    def _run_upkeep(self) -> None:
        interval_s = self.settings.compaction_interval_s
        if interval_s <= 0:
            return
        while not self._upkeep_stop.wait(interval_s):
            try:
                self.upkeep()
            except Exception as exc:  # upkeep never stops the writer; it says why and retries
                self.stats.upkeep_failures += 1
                self.stats.last_error = repr(exc)
                log.error("pool upkeep failed (%s): %r", fault_reason(exc), exc)

    def upkeep(self) -> None:
        """One round: complete idle trajectories, compact payloads past the threshold, delete
        orphaned payload files.

        Raises what the database or filesystem raised; a failed compaction leaves its payloads
        in SQL and no file behind (``PayloadFiles.compact``), and is counted.
        """
        if self.close_idle is not None and self.settings.trajectory_idle_timeout_s > 0:
            for trajectory_id in self.close_idle(
                self.settings.trajectory_idle_timeout_s,
                in_flight=self.trajectories_in_flight(),
            ):
                self.trajectory_closed(trajectory_id, TrajectoryStatus.COMPLETE.value)
        while self.store.payloads.pending_steps() >= self.settings.compaction_min_steps:
            try:
                file = self.store.payloads.compact(
                    self.settings.compaction_max_steps, self.settings.parquet_row_group_steps
                )
            except CompactionRaceError as exc:  # another gateway took them: not a failure
                log.info("compaction skipped this round: %s", exc)
                break
            except Exception:
                self.stats.compaction_failures += 1
                raise
            if file is None:
                break
            self.stats.compacted_steps += file.steps
        with self._calls_lock:
            if self._journal is not None:
                self._journal.rewrite_if_large(self._calls_in_flight)
        deleted = self.store.payloads.delete_orphans(self.settings.orphan_payload_min_age_s)
        if deleted:
            self.stats.orphan_files_deleted += len(deleted)
            log.warning("deleted %d orphaned payload files: %s", len(deleted), deleted[:5])


def _resolve(future: asyncio.Future[list[str]], result: CallResult) -> None:
    if future.done():  # the awaiting request was cancelled; the step is committed anyway
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)
