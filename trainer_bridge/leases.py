"""A consumer's leases while it works: renewed until acknowledged, and the rule for one lost anyway.

Owns: ``LeaseKeeper``, the one way every trainer path (``loop``, ``distributed``, the demo, the
TRL and verl integrations) takes, keeps and ends leases. Each lease it hands out is renewed by a
background thread every ``renew_every_s`` (default a third of ``lease_s``: two renewals may fail,
the pool unreachable for a while, before the lease runs out) with ``POST
/api/batches/{id}/renew``, the way a queue consumer extends a message's visibility, until
``ack`` or ``nack`` ends it. So ``lease_s`` is how long a *crashed* consumer keeps its batch from
the others, not a guess at the slowest update.

The rule for a lease lost anyway (the process stalled, or the pool was unreachable, for longer
than the lease): the update stands (its weights are already changed) and is counted once.
``ack`` leases the same batch again and acknowledges it; when another consumer holds it by
then, the batch is skipped: not acknowledged now, remembered, and acknowledged without training
when this keeper leases it again (a batch is trained once per consumer; the distributed
trainer's checkpoint lineage does the same across restarts). Either way one line says so
(``say``), never a traceback. A ``nack`` of a lost lease is quiet: the batch is back in the pool
(or another consumer's) either way.

Never: trains, retries an update, or renews a lease it did not hand out.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from types import TracebackType

import httpx

from trainer_bridge.client import LeasedBatch, LeaseLostError, PoolClient, PoolClientError

_log = logging.getLogger(__name__)


class LeaseKeeper:
    """Leases of ``consumer`` of ``lease_s`` seconds each, renewed every ``renew_every_s`` while
    held (module doc); a context manager that starts and stops the renewing thread.

    ``say``: where the one line about a lost lease goes (default: a warning on this module's
    logger). Raises ``ValueError`` for ``lease_s`` <= 0 or ``renew_every_s`` not below it.
    """

    def __init__(
        self,
        pool: PoolClient,
        consumer: str,
        lease_s: float,
        *,
        renew_every_s: float | None = None,
        say: Callable[[str], None] = _log.warning,
    ) -> None:
        renew_every_s = lease_s / 3 if renew_every_s is None else renew_every_s
        if lease_s <= 0 or not 0 < renew_every_s < lease_s:
            raise ValueError(
                f"need 0 < renew_every_s < lease_s; got renew_every_s {renew_every_s}, "
                f"lease_s {lease_s}"
            )
        self.pool = pool
        self.consumer = consumer
        self.lease_s = lease_s
        self.renew_every_s = renew_every_s
        self.say = say
        self.renewals = 0  # renewals the pool accepted (what a test or a report can read)
        self._held: dict[str, LeasedBatch] = {}
        self._lost: dict[str, str] = {}  # batch id -> why its renewal failed
        self._trained: dict[str, int | None] = {}  # skipped batch id -> version it trained
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the renewing thread -------------------------------------------------------------------

    def __enter__(self) -> LeaseKeeper:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._renew_until_stopped, name=f"lease-keeper-{self.consumer}", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        """Stop renewing (the leases still held run out at their expiry unless acked)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _renew_until_stopped(self) -> None:
        while not self._stop.wait(self.renew_every_s):
            with self._lock:
                held = list(self._held.values())
            for lease in held:
                self._renew(lease)

    def _renew(self, lease: LeasedBatch) -> None:
        try:
            renewed = self.pool.renew(lease, self.lease_s)
        except LeaseLostError:
            with self._lock:
                if self._held.pop(lease.batch_id, None) is not None:
                    self._lost[lease.batch_id] = "a renewal found it expired or taken over"
            return
        except (PoolClientError, httpx.HTTPError) as error:
            # the pool may answer again before the lease runs out: the next beat tries again
            with self._lock:
                if lease.batch_id in self._held:
                    self._lost[lease.batch_id] = f"renewals failed: {str(error)[:200]}"
            return
        with self._lock:
            self._lost.pop(lease.batch_id, None)
            if lease.batch_id in self._held:
                self._held[lease.batch_id] = renewed
                self.renewals += 1

    # -- taking and ending leases --------------------------------------------------------------

    def lease(self, batch_id: str | None = None) -> LeasedBatch | None:
        """The next batch (only ``batch_id`` when given) under a lease renewed until ack/nack;
        None when none is ready. A batch this keeper trained whose lease was lost (skipped by
        ``ack``) is acknowledged here without training, and the next one is looked for."""
        while True:
            lease = self.pool.lease(self.consumer, lease_s=self.lease_s, batch_id=batch_id)
            if lease is None:
                return None
            with self._lock:
                skipped = lease.batch_id in self._trained
                version = self._trained.pop(lease.batch_id, None)
                if not skipped:
                    self._held[lease.batch_id] = lease
                    return lease
            self.pool.ack(lease, policy_version_trained=version)
            self.say(f"batch {lease.batch_id} came back; acknowledged without training it again")
            if batch_id is not None:
                return None

    def release(self, lease: LeasedBatch) -> str | None:
        """Stop renewing ``lease`` without ending it; why it was lost, if a renewal found so."""
        with self._lock:
            self._held.pop(lease.batch_id, None)
            return self._lost.pop(lease.batch_id, None)

    def ack(self, lease: LeasedBatch, policy_version_trained: int | None = None) -> bool:
        """The update on ``lease``'s batch is done: acknowledge it (the lost-lease rule of the
        module doc when the pool refuses). True when acknowledged, False when skipped.

        Raises:
            PoolClientError: the pool refused for another reason, or was unreachable
                (``httpx.HTTPError``).
        """
        why = self.release(lease)
        try:
            self.pool.ack(lease, policy_version_trained=policy_version_trained)
            return True
        except LeaseLostError:
            pass
        reason = why or f"it expired before the ack, lease_s {self.lease_s:g}"
        again = self.pool.lease(self.consumer, lease_s=self.lease_s, batch_id=lease.batch_id)
        if again is not None:
            self.pool.ack(again, policy_version_trained=policy_version_trained)
            self.say(
                f"lease on batch {lease.batch_id} was lost while its update ran ({reason}); "
                "the batch was still free, so it was leased again and acknowledged"
            )
            return True
        with self._lock:
            self._trained[lease.batch_id] = policy_version_trained
        self.say(
            f"lease on batch {lease.batch_id} was lost while its update ran ({reason}) and "
            f"another consumer holds the batch now: the update stands, {self.consumer} skips "
            "the batch and acknowledges it without training if it comes back"
        )
        return False

    def nack(self, lease: LeasedBatch, reason: str | None = None) -> None:
        """The update failed: give the batch back now (a lost lease has given it back already)."""
        self.release(lease)
        with contextlib.suppress(LeaseLostError):
            self.pool.nack(lease, reason=reason)
