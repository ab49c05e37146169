"""TRL's experimental ``AsyncGRPOTrainer`` (1.16) fed from leased pool batches: a rollout worker.

TRL's contract (``trl/experimental/async_grpo/async_grpo_trainer.py``, ``RolloutWorkerProtocol``):
the trainer drains ``rollout_buffer`` (a ``queue.Queue`` of ``RolloutSample``: ``input_ids``
``[T]`` the whole row, ``completion_mask`` ``[T]`` 1 on trained tokens, ``old_log_probs`` ``[T]``
0 on context, one ``advantage``, the ``model_version`` that sampled it, an int ``group_id``,
``metrics``), drops samples older than ``max_staleness`` versions, calls ``start`` once at train
begin, ``update_model_version(v)`` after each weight sync, ``check_health`` while it waits and
``stop`` at the end. TRL's own worker generates and re-renders prompts with the chat template; a
token-exact pool has the rows already, so this one only leases them.

Owns: ``PoolRolloutWorker``: a thread that leases ready batches (``consumer``), turns each row
into a ``RolloutSample`` (the pool's advantage, its oldest step's policy version minus
``version_offset``, its group numbered in order of first sight) and queues them; acknowledges a
batch at the second weight sync after the trainer took its last sample (TRL's planner and
accelerate's dispatcher may each hold one micro-batch across a sync, so a sample taken before
sync ``v`` is trained by sync ``v + 1`` at the latest: exactly once), and nacks the batches still
held at ``stop`` (their rows come back; the last batch may then be trained again, at least once
rather than lost). A sample TRL drops as too stale counts as taken: the trainer's decision. Its
``trainer_bridge.leases.LeaseKeeper`` renews every held lease (each ``lease_s / 3``) until that
ack, however many updates it waits, and applies its rule to a lease lost anyway.
Optionally it tells the gateway each new version (``policy_model_name``; the one call
``POST /admin/policy-versions``). Never: re-tokenizes, recomputes an advantage, or changes a
value.

Shape legend: ``T`` tokens of a merged row (prompt, then model and tool tokens).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from trainer_bridge.client import LeasedBatch, PoolClient
from trainer_bridge.integrations.episodes import PoolEpisodes
from trainer_bridge.leases import LeaseKeeper


@dataclass
class _Held:
    """A leased batch whose samples are queued or taken, not yet acknowledged."""

    lease: LeasedBatch
    queued: int
    taken: int = 0
    taken_at_version: int | None = None  # the model version when its last sample was taken


class _TakenQueue(queue.Queue[RolloutSample]):
    """The rollout buffer: counts each sample the trainer takes against its batch."""

    def __init__(self, maxsize: int, on_taken: Any) -> None:
        super().__init__(maxsize)
        self._on_taken = on_taken

    def get(self, block: bool = True, timeout: float | None = None) -> RolloutSample:
        sample = super().get(block, timeout)
        self._on_taken(sample)
        return sample


@dataclass
class _State:
    held: dict[str, _Held] = field(default_factory=dict)
    batch_of: dict[int, str] = field(default_factory=dict)  # id(sample) -> batch id
    acked: list[str] = field(default_factory=list)


class PoolRolloutWorker:
    """A ``RolloutWorkerProtocol`` whose samples are the rows of leased pool batches.

    ``temperature``: the trainer's (``AsyncGRPOConfig.temperature``); a batch whose rows'
    logprobs are at another is nacked and the worker fails (``check_health`` raises).
    ``max_held_batches``: leased and not yet acknowledged at once (back-pressure on the lease).
    ``episodes``/``policy_model_name``: when both are given, ``update_model_version(v)``
    registers and activates version ``version_offset + v`` with the gateway.

    Raises (from ``check_health``): ``RuntimeError`` when the leasing thread failed (the cause
    chained) or took no step within ``stale_after_s``.
    """

    def __init__(
        self,
        pool: PoolClient,
        consumer: str,
        *,
        temperature: float = 1.0,
        lease_s: float = 600.0,
        poll_interval_s: float = 1.0,
        max_held_batches: int = 2,
        queue_maxsize: int = 0,
        version_offset: int = 0,
        episodes: PoolEpisodes | None = None,
        policy_model_name: str | None = None,
    ) -> None:
        self.pool = pool
        self.consumer = consumer
        self.temperature = temperature
        self.lease_s = lease_s
        self.leases = LeaseKeeper(pool, consumer, lease_s)
        self.poll_interval_s = poll_interval_s
        self.max_held_batches = max_held_batches
        self.version_offset = version_offset
        self.episodes = episodes
        self.policy_model_name = policy_model_name
        self.rollout_buffer: _TakenQueue = _TakenQueue(queue_maxsize, self._taken)
        self.metrics_queue: queue.Queue[dict[str, Any]] = queue.Queue()
        self.model_version = 0
        self._state = _State()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._heartbeat = time.monotonic()
        self._group_numbers: dict[str, int] = {}

    # -- RolloutWorkerProtocol ---------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._heartbeat = time.monotonic()
        self.leases.start()
        self._thread = threading.Thread(target=self._run, name="pool-rollout-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop leasing; nack every batch not acknowledged yet (its rows come back)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        with self._lock:
            held = list(self._state.held.values())
            self._state.held.clear()
        for batch in held:
            self.leases.nack(batch.lease, reason="rollout worker stopped before training on it")
        self.leases.stop()

    def update_model_version(self, model_version: int) -> None:
        """A weight sync finished: acknowledge every batch whose last sample was taken two or
        more syncs ago (the updates that trained on it are done), then tell the gateway."""
        with self._lock:
            self.model_version = model_version
            done = [
                b
                for b in self._state.held.values()
                if b.taken == b.queued
                and b.taken_at_version is not None
                and b.taken_at_version + 2 <= model_version
            ]
            for batch in done:
                del self._state.held[batch.lease.batch_id]
        for batch in done:
            trained = model_version + self.version_offset
            if self.leases.ack(batch.lease, policy_version_trained=trained):
                self._state.acked.append(batch.lease.batch_id)
        if self.episodes is not None and self.policy_model_name is not None:
            version = self.version_offset + model_version
            location = f"trl-async:{self.consumer}:v{model_version}"
            self.episodes.register_policy_version(version, self.policy_model_name, location)

    def check_health(self, stale_after_s: float) -> None:
        if self._error is not None:
            raise RuntimeError("the pool rollout worker failed") from self._error
        age_s = time.monotonic() - self._heartbeat
        if self._thread is not None and age_s > stale_after_s:
            raise RuntimeError(f"the pool rollout worker took no step for {age_s:.0f} s")

    # -- what it reports ---------------------------------------------------------------------

    @property
    def acked_batches(self) -> list[str]:
        """Batch ids acknowledged so far, in order."""
        return list(self._state.acked)

    # -- the leasing thread ------------------------------------------------------------------

    def _taken(self, sample: RolloutSample) -> None:
        with self._lock:
            batch_id = self._state.batch_of.pop(id(sample), None)
            held = self._state.held.get(batch_id) if batch_id is not None else None
            if held is not None:
                held.taken += 1
                if held.taken == held.queued:
                    held.taken_at_version = self.model_version

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._heartbeat = time.monotonic()
                with self._lock:
                    full = len(self._state.held) >= self.max_held_batches
                lease = None if full else self.leases.lease()
                if lease is None:
                    self._stop.wait(self.poll_interval_s)
                    continue
                self._queue_batch(lease)
        except BaseException as error:
            self._error = error

    def _group_number(self, group_id: str | None, batch_id: str, row: int) -> int:
        key = group_id if group_id is not None else f"{batch_id}:{row}"
        return self._group_numbers.setdefault(key, len(self._group_numbers))

    def _queue_batch(self, lease: LeasedBatch) -> None:
        table = self.pool.rows(lease.batch_id)
        try:
            samples = self.samples(table, lease.batch_id)
        except Exception as error:
            self.leases.nack(lease, reason=str(error)[:500])
            raise
        with self._lock:
            self._state.held[lease.batch_id] = _Held(lease, queued=len(samples))
            for sample in samples:
                self._state.batch_of[id(sample)] = lease.batch_id
        for sample in samples:
            self.rollout_buffer.put(sample)
        self.metrics_queue.put({"pool/batches_leased": 1.0})

    def samples(self, table: Any, batch_id: str) -> list[RolloutSample]:
        """One ``RolloutSample`` per row of a batch table (docs/batches.md's columns).

        Raises:
            ValueError: a row has no advantage (an ``sft`` batch, or unrewarded), or its
                logprobs are at another temperature than the trainer's.
        """
        columns = table.to_pydict()
        temperatures = columns.get("temperature", [1.0] * table.num_rows)
        samples = []
        now = time.time()
        for i in range(table.num_rows):
            advantage = columns["advantage"][i]
            if advantage is None or advantage != advantage:
                raise ValueError(f"row {i} of batch {batch_id} has no advantage")
            if float(temperatures[i]) != self.temperature:
                raise ValueError(
                    f"row {i} of batch {batch_id}: logprobs at temperature {temperatures[i]}, "
                    f"the trainer divides its logits by {self.temperature}"
                )
            version = columns["policy_version"][i]
            reward = columns["reward"][i]
            samples.append(
                RolloutSample(
                    prompt=[],
                    completion=[],
                    input_ids=np.asarray(columns["input_ids"][i], dtype=np.int64),
                    completion_mask=np.asarray(columns["loss_mask"][i], dtype=np.int64),
                    old_log_probs=np.asarray(columns["behaviour_logprobs"][i], dtype=np.float32),
                    advantage=float(advantage),
                    model_version=(version or 0) - self.version_offset,
                    group_id=self._group_number(columns["group_id"][i], batch_id, i),
                    metrics={"reward": float("nan") if reward is None else float(reward)},
                    enqueued_at=now,
                )
            )
        return samples
