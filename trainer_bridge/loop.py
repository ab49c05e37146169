"""The trainer's side of the loop, against running services: lease → train → publish → ack.

Owns: ``trajgate train``. It needs only URLs and a model path, so the same loop runs against the
CPU demo's services and against a GPU host (vLLM on GPUs, the trainer on a GPU: ``--device cuda``
or the default ``auto``). Each update's metrics go to the pool's training metrics (run = the
consumer id), which the inspector's training chart draws. A lease is renewed while its update
runs (``trainer_bridge.leases.LeaseKeeper``), so ``lease_s`` only bounds how long a crashed
trainer keeps its batch; one lost anyway is said in one line and counted once (that module's
rule). A batch is acknowledged only once the update it made is published: a publish that
fails after ``publish_attempts`` tries gives the batch back (nack) and raises, so no batch is
ever consumed by an update that no policy version holds (acknowledging first lost the update
when vLLM or the gateway was unreachable: the batch was consumed, the weights died with the
process). Never: runs agents or computes rewards; it trains on what the pool hands out, one
batch per update, exactly once per consumer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from trainer_bridge.client import PoolClient, train_batch
from trainer_bridge.leases import LeaseKeeper
from trainer_bridge.settings import TrainerSettings
from trainer_bridge.sync import PublishedPolicy, WeightFormat, WeightSync, WeightSyncError
from trainer_bridge.trainer import PolicyTrainer


@dataclass
class LoopSettings:
    """Where the services are and how long to run."""

    gateway_url: str  # publishes each update into its vLLM replicas (POST /admin/weight-updates)
    consumer: str = "trainer-0"
    lease_s: float = 600.0  # renewed every lease_s / 3 while an update runs
    spec: dict[str, Any] | None = None  # materialised whenever no batch is waiting
    first_version: int | None = None  # default: the gateway's active version
    max_updates: int | None = None
    idle_exit_s: float | None = None  # stop after this long without a batch
    poll_s: float = 2.0
    admin_token: str | None = None
    adapter_dir: Path = Path(".trajgate/adapters")
    adapter_prefix: str = "policy"
    pad_token_id: int = 0
    publish_attempts: int = 3  # tries of one publish before its batch is given back
    publish_retry_s: float = 5.0  # wait before the second try, doubled before each later one
    metrics: list[dict[str, float]] = field(default_factory=list)


def active_version(gateway_url: str, admin_token: str | None) -> int:
    """The gateway's active policy version, or 0 when none is registered."""
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    versions = httpx.get(f"{gateway_url}/admin/policy-versions", headers=headers, timeout=30)
    versions.raise_for_status()
    active = [v["version"] for v in versions.json() if v["active"]]
    return int(active[0]) if active else 0


class PublishFailedError(RuntimeError):
    """An update could not be published; its batch was given back to the pool (nacked)."""


def publish_with_retries(
    sync: WeightSync,
    version: int,
    weights_dir: Path,
    fmt: WeightFormat,
    attempts: int,
    retry_s: float,
    say: Callable[[str], None],
) -> PublishedPolicy:
    """``sync.publish`` tried up to ``attempts`` times, waiting ``retry_s`` then twice as long
    before each later try (publishing a version again is the documented way to recover from a
    failed one: a LoRA load is in place, a full reload re-sent whole).

    Raises:
        PublishFailedError: every try failed (the last failure is its cause).
        ValueError: ``attempts`` below 1.
    """
    if attempts < 1:
        raise ValueError(f"publish_attempts must be at least 1, got {attempts}")
    wait = retry_s
    for attempt in range(1, attempts + 1):
        try:
            return sync.publish(version, weights_dir, fmt)
        except (WeightSyncError, httpx.HTTPError) as failure:
            if attempt == attempts:
                raise PublishFailedError(
                    f"publishing policy version {version} failed {attempts} times (its batch "
                    f"goes back to the pool), last: {failure}"
                ) from failure
            say(
                f"publishing policy version {version} failed ({failure}); "
                f"try {attempt + 1} of {attempts} in {wait:g} s"
            )
            time.sleep(wait)
            wait *= 2
    raise AssertionError("unreachable")


def run_loop(
    loop: LoopSettings,
    trainer_settings: TrainerSettings,
    say: Callable[[str], None] = print,
) -> list[dict[str, float]]:
    """Train until ``max_updates`` or ``idle_exit_s``; returns each update's metrics.

    A failed update, or one whose publish failed every try, is nacked (the batch returns to
    the pool) and re-raised; a lease lost during an update is said through ``say`` in one line
    (``trainer_bridge.leases``' rule).

    Raises:
        PublishFailedError: the update could not be published (its batch was given back).
    """
    trainer = PolicyTrainer(trainer_settings)
    version = (
        loop.first_version
        if loop.first_version is not None
        else active_version(loop.gateway_url, loop.admin_token)
    )
    sync = WeightSync(  # a training run leaves its last adapters served
        loop.gateway_url,
        admin_token=loop.admin_token,
        adapter_prefix=loop.adapter_prefix,
    )
    idle_since = time.monotonic()
    headers = {"Authorization": f"Bearer {loop.admin_token}"} if loop.admin_token else None
    with (
        PoolClient(loop.gateway_url, headers=headers) as pool,
        LeaseKeeper(pool, loop.consumer, loop.lease_s, say=say) as leases,
    ):
        while loop.max_updates is None or len(loop.metrics) < loop.max_updates:
            lease = leases.lease()
            if lease is None and loop.spec is not None:
                created = httpx.post(
                    f"{loop.gateway_url}/api/batches", json=loop.spec, headers=headers, timeout=300
                )
                if created.status_code not in (201, 409):  # 409: nothing ready yet
                    created.raise_for_status()
                if created.status_code == 201:
                    lease = leases.lease(batch_id=created.json()["id"])
            if lease is None:
                if (
                    loop.idle_exit_s is not None
                    and time.monotonic() - idle_since > loop.idle_exit_s
                ):
                    break
                time.sleep(loop.poll_s)
                continue
            try:
                metrics = trainer.update(train_batch(pool.rows(lease.batch_id), loop.pad_token_id))
                adapter = trainer.save_for_vllm(
                    loop.adapter_dir / f"{loop.adapter_prefix}-v{version + 1}"
                )
            except BaseException:
                leases.nack(lease, reason="update failed")
                raise
            try:  # the lease is kept (renewed) while publishing is retried
                published = publish_with_retries(
                    sync,
                    version + 1,
                    adapter,
                    "lora" if trainer_settings.lora_rank else "full",
                    loop.publish_attempts,
                    loop.publish_retry_s,
                    say,
                )
            except BaseException:
                leases.nack(lease, reason="publish failed")
                raise
            version += 1
            leases.ack(lease, policy_version_trained=version)  # the version it produced
            pause = published.pause_ms
            pool.post_training_metrics(
                loop.consumer,
                version,
                metrics,
                None if pause is None else {"weight_update_pause_ms": pause},
            )
            loop.metrics.append({"policy_version": float(version), **metrics.as_dict()})
            say(
                f"batch {lease.batch_id}: loss {metrics.loss:+.4f}, "
                f"clip {metrics.clip_fraction:.3f}, gap {metrics.logprob_gap_mean_abs:.1e}, "
                f"{metrics.tokens_per_s:.0f} tokens/s "
                f"-> policy v{version}"
            )
            idle_since = time.monotonic()
    sync.close()
    return loop.metrics
