"""The trainer under ``torchrun``: data-parallel RL updates, each rank on its share of one batch.

Run it (CPU, gloo; on GPUs the same command picks NCCL and one GPU per rank)::

    torchrun --nproc-per-node 2 -m trainer_bridge.distributed

configured by ``TRAJGATE_TRAINER_*`` variables (``trainer_bridge.settings``: ``TrainerSettings``
and ``DistributedSettings``, docs/deployment.md) or a ``TRAJGATE_CONFIG`` file; ``--check-config``
prints the settings and exits.

Owns: the lease protocol across ranks, the gradient reduction of the replicated model, and
resuming after a crash. Rank 0 alone talks to the pool's lease API: it leases the next batch and
broadcasts the lease to every rank; each rank fetches the batch's rows, orders them longest
first and keeps rows ``rank, rank + W, ...`` (so the ranks' token counts differ by at most one
row); ``PolicyTrainer.update(shard, world)`` weighs each micro-batch by its share of the *whole*
batch and sums gradients over the ranks before clipping, so every rank applies exactly the
update one process would apply to the whole batch (tests/test_distributed.py checks it within
float tolerance). After the update every rank joins in saving the weights (a sharded model's
are gathered), rank 0 publishes them (vLLM, then the gateway's policy registry; up to
``publish_attempts`` tries, ``trainer_bridge.loop.publish_with_retries``), then acks and posts
the update's metrics to the pool's training metrics (run = the consumer id), as ``trajgate
train`` does: a batch is never consumed by an update that no policy version holds (acking first
lost the update when vLLM or the gateway was unreachable). A failed update or a publish that
failed every try on rank 0 nacks, and every rank raises (``PublishFailedError`` for the
publish); a crashed rank lets the lease expire, so the batch comes back either way. Rank 0's
``trainer_bridge.leases.LeaseKeeper`` renews every lease it holds (every ``lease_s / 3``) until
it is acked, checkpoints included, so ``lease_s`` bounds how long a crashed trainer keeps its
batches, not how long N updates take; a lease lost anyway is said in one line and counted once
(that module's rule; a skipped batch that comes back is acked without training because the
lineage holds it).

Two ways to hold the model (``TRAJGATE_TRAINER_SHARDING``): ``replicated``, every rank the whole
model, gradients all-reduced once per update after accumulation (what DDP does with ``no_sync``
on every micro-batch but the last, without DDP's bucketed overlap, which buys nothing for LoRA's
few megabytes); ``fsdp2``, parameters, gradients and optimizer state sharded over the ranks
(``trainer_bridge.sharding``), for full fine-tuning of models that do not fit one GPU. The same
command runs either, on CPU (gloo) or GPUs (NCCL).

Resuming (``checkpoint_dir``, ``trainer_bridge.checkpoint``): every ``checkpoint_every_updates``
updates the ranks save model and optimizer state with the lineage (policy version, the batches
trained), after the update is published, and only then does rank 0 ack those updates' leases, so an
acked batch is always in a checkpoint and published. A restarted trainer loads the newest checkpoint
and continues at the version after it. The leases it held are in ``<checkpoint_dir>/leases.json``:
it acks those the checkpoint holds (crash between checkpoint and ack) and nacks the rest (crash
before the checkpoint: the batch is trained again, from the checkpointed weights, so no batch is
trained twice into one lineage); a leased batch the lineage already holds is acked without training.
With N > 1 a crash loses up to N updates, and the versions published since the checkpoint were
served from weights that are gone: their numbers are published again, from the retrained weights
(the gateway keeps the first registration's row; vLLM's adapter or weights are replaced in place).

Shape legend: ``B`` rows of the whole batch, ``B_r`` rows of rank r's share, ``T`` tokens.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
import torch.distributed as dist

from trainer_bridge.checkpoint import Lineage, latest, load, save
from trainer_bridge.client import LeasedBatch, PoolClient, rows_from_table
from trainer_bridge.collate import Row, collate
from trainer_bridge.leases import LeaseKeeper
from trainer_bridge.loop import PublishFailedError, publish_with_retries
from trainer_bridge.settings import DistributedSettings, TrainerSettings
from trainer_bridge.sharding import local_numel
from trainer_bridge.sync import PublishedPolicy, WeightFormat, WeightSync
from trainer_bridge.trainer import PolicyTrainer, UpdateMetrics


class GlooWorld:
    """``trainer_bridge.trainer.World`` over the default process group (gloo or NCCL)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    def _reduce(self, value: float, op: Any) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=op)
        return float(tensor.item())

    def sum(self, value: float) -> float:
        return self._reduce(value, dist.ReduceOp.SUM)

    def max(self, value: float) -> float:
        return self._reduce(value, dist.ReduceOp.MAX)

    def sum_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        """Sum every gradient over the ranks (a rank without tokens contributes zeros)."""
        for parameter in parameters:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            dist.all_reduce(parameter.grad, op=dist.ReduceOp.SUM)

    def broadcast_parameters(self, parameters: list[torch.nn.Parameter]) -> None:
        """Start every rank from rank 0's trainable weights."""
        with torch.no_grad():
            for parameter in parameters:
                dist.broadcast(parameter.data, src=0)


def shard_rows(rows: list[Row], rank: int, world_size: int) -> list[Row]:
    """Rank ``rank``'s rows: longest first, every ``world_size``-th (balanced token counts)."""
    ordered = sorted(rows, key=lambda row: len(row.input_ids), reverse=True)
    return ordered[rank::world_size]


def _broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class RankReport:
    """What one rank did: the metrics of each update (with its batch and policy version), the
    batches it acknowledged without training because its checkpoint already held them
    (``recovered``), and how many parameter elements it holds of how many."""

    rank: int
    updates: list[dict[str, Any]]
    recovered: list[dict[str, Any]] = field(default_factory=list)
    parameters_held: int = 0
    parameters_total: int = 0


class _Leases:
    """Rank 0's leases whose updates no checkpoint holds yet (acked once one does), mirrored in
    ``<checkpoint_dir>/leases.json`` so a restarted trainer can settle them at once: ack those its
    checkpoint holds, nack the others (instead of waiting for them to expire)."""

    def __init__(self, keeper: LeaseKeeper, checkpoint_dir: Path | None) -> None:
        self.keeper = keeper
        self.file = None if checkpoint_dir is None else checkpoint_dir / "leases.json"
        self.held: list[tuple[LeasedBatch, int | None]] = []  # (lease, version trained or None)

    def _write(self) -> None:
        if self.file is not None:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            staged = self.file.with_suffix(".tmp")
            staged.write_text(json.dumps([[asdict(lease), v] for lease, v in self.held]))
            staged.replace(self.file)

    def add(self, lease: LeasedBatch) -> None:
        self.held.append((lease, None))
        self._write()

    def trained(self, lease: LeasedBatch, version: int) -> None:
        self.held = [(h, version if h == lease else v) for h, v in self.held]
        self._write()

    def drop(self, lease: LeasedBatch) -> None:
        self.held = [(h, v) for h, v in self.held if h != lease]
        self._write()

    def ack_trained(self) -> None:
        """Ack every lease whose update is trained (and, with checkpoints, checkpointed)."""
        for lease, version in list(self.held):
            if version is not None:
                self.keeper.ack(lease, policy_version_trained=version)
                self.drop(lease)

    def settle_previous(self, lineage: Lineage) -> None:
        """After a restart: ack the leases the checkpoint holds (one that expired meanwhile is
        leased again and acked, or skipped: ``LeaseKeeper.ack``), nack the rest."""
        if self.file is None or not self.file.exists():
            return
        for data, _ in json.loads(self.file.read_text()):
            lease = LeasedBatch(**data)
            version = lineage.version_of(lease.batch_id)
            if version is None:
                self.keeper.nack(lease, reason="trainer restarted before checkpointing it")
            else:
                self.keeper.ack(lease, policy_version_trained=version)
        self._write()


def _say(line: str) -> None:
    """A line about a lease (only rank 0 holds any) on stderr: stdout carries the ranks' JSON
    reports, one line each."""
    print(line, file=sys.stderr, flush=True)


def _crash_point(stage: str, updates: int) -> None:
    """Fault injection for tests/test_distributed.py: ``TRAJGATE_TRAINER_CRASH_AT=<stage>:<n>``
    ends rank 0 at once (exit status 3) at ``stage`` (``trained``: after the update, before its
    checkpoint; ``checkpointed``: after the checkpoint, before the ack) of this process's
    ``n``-th update."""
    crash_at = os.environ.get("TRAJGATE_TRAINER_CRASH_AT")
    if crash_at == f"{stage}:{updates}" and dist.get_rank() == 0:
        os._exit(3)


def run(settings: DistributedSettings, trainer_settings: TrainerSettings) -> RankReport:
    """The training loop of one rank; ``torch.distributed`` must be initialised.

    With ``checkpoint_dir``: resumes from the newest checkpoint (weights, optimizer, policy
    version, the batches trained), acks a leased batch the checkpoint already holds instead of
    training it again, and acks each update only after a checkpoint holds it (module doc).
    """
    trainer = PolicyTrainer(trainer_settings)
    world = GlooWorld(trainer.device if dist.get_backend() == "nccl" else torch.device("cpu"))
    if not trainer.sharded:  # sharded: PolicyTrainer broadcast them before sharding
        world.broadcast_parameters(trainer.parameters)
    lineage = Lineage(policy_version=settings.first_version - 1)
    checkpoint_dir = settings.checkpoint_dir
    if checkpoint_dir is not None and (path := latest(checkpoint_dir)) is not None:
        lineage = load(path, trainer.model, trainer.optimizer)
        trainer.steps = lineage.steps
    sync = (
        WeightSync(  # the gateway loads the weights into the replicas it routes to
            settings.gateway_url or settings.pool_url,
            admin_token=settings.admin_token,
            adapter_prefix=settings.adapter_prefix,
        )
        if world.rank == 0 and settings.vllm_urls.strip()
        else None
    )
    report = RankReport(
        world.rank,
        [],
        parameters_held=sum(local_numel(p) for p in trainer.model.parameters()),
        parameters_total=sum(p.numel() for p in trainer.model.parameters()),
    )
    idle_since = time.monotonic()
    headers = {"Authorization": f"Bearer {settings.admin_token}"} if settings.admin_token else None
    with (
        PoolClient(settings.pool_url, headers=headers) as pool,
        LeaseKeeper(pool, settings.consumer, settings.lease_s, say=_say) as keeper,
    ):
        leases = _Leases(keeper, checkpoint_dir if world.rank == 0 else None)
        leases.settle_previous(lineage)
        while settings.max_updates is None or len(report.updates) < settings.max_updates:
            lease: LeasedBatch | None = None
            if world.rank == 0:
                lease = keeper.lease()
            lease = _broadcast(lease)
            if lease is None:
                waited = time.monotonic() - idle_since
                if settings.idle_exit_s is not None and _broadcast(waited) > settings.idle_exit_s:
                    break
                time.sleep(settings.idle_wait_s)
                continue
            idle_since = time.monotonic()
            held = lineage.version_of(lease.batch_id)
            if held is not None:  # trained into the checkpoint, its ack lost in a crash
                if world.rank == 0:
                    keeper.ack(lease, policy_version_trained=held)
                report.recovered.append({"batch_id": lease.batch_id, "policy_version": held})
                continue
            version = lineage.policy_version + 1
            if world.rank == 0:
                leases.add(lease)
            metrics = _update_on_share(trainer, world, pool, lease, settings, leases)
            lineage.policy_version, lineage.steps = version, trainer.steps
            lineage.batches.append((lease.batch_id, version))
            report.updates.append(
                {"batch_id": lease.batch_id, "policy_version": version, **metrics.as_dict()}
            )
            if world.rank == 0:
                leases.trained(lease, version)
            _crash_point("trained", len(report.updates))
            published = _publish(trainer, world, settings, sync, version, lease, leases)
            since = len(lineage.batches) % settings.checkpoint_every_updates
            if checkpoint_dir is not None and since == 0:
                save(checkpoint_dir, trainer.model, trainer.optimizer, lineage)
            _crash_point("checkpointed", len(report.updates))
            if world.rank == 0:
                if checkpoint_dir is None or since == 0:
                    leases.ack_trained()
                pause = None if published is None else published.pause_ms
                extra = None if pause is None else {"weight_update_pause_ms": pause}
                pool.post_training_metrics(settings.consumer, version, metrics, extra)
            dist.barrier()  # no rank leases the next batch before rank 0 has published and acked
        unsaved = world.rank == 0 and any(v is not None for _, v in leases.held)
        if checkpoint_dir is not None and _broadcast(unsaved):  # stopping between checkpoints
            save(checkpoint_dir, trainer.model, trainer.optimizer, lineage)
            if world.rank == 0:
                leases.ack_trained()
    if sync is not None:
        sync.close()
    return report


def _update_on_share(
    trainer: PolicyTrainer,
    world: GlooWorld,
    pool: PoolClient,
    lease: LeasedBatch,
    settings: DistributedSettings,
    leases: _Leases,
) -> UpdateMetrics:
    """One update of every rank on its share of ``lease``'s batch; a failure nacks it."""
    try:
        table: pa.Table = pool.rows(lease.batch_id)
        share = shard_rows(rows_from_table(table), world.rank, world.size)
        if not share:
            raise ValueError(
                f"batch {lease.batch_id} has {table.num_rows} rows for {world.size} ranks; "
                "every rank needs at least one (make batches larger or use fewer ranks)"
            )
        return trainer.update(collate(share, settings.pad_token_id), world)
    except BaseException:
        if world.rank == 0:
            leases.keeper.nack(lease, reason="distributed update failed")
            leases.drop(lease)
        raise


def _publish(
    trainer: PolicyTrainer,
    world: GlooWorld,
    settings: DistributedSettings,
    sync: WeightSync | None,
    version: int,
    lease: LeasedBatch,
    leases: _Leases,
) -> PublishedPolicy | None:
    """Save ``version``'s weights (every rank joins a sharded model's gathers; rank 0 writes) and
    load them into vLLM and the gateway (rank 0, ``settings.publish_attempts`` tries); returns
    what rank 0 published (None on the other ranks, or without ``vllm_urls``).

    Raises:
        PublishFailedError: on every rank when rank 0 could not publish; rank 0 gave ``lease``
            back first (nack), so the batch is trained again rather than consumed unpublished.
    """
    weights = trainer.save_for_vllm(settings.weights_dir / f"policy-v{version}")
    published: PublishedPolicy | None = None
    failure: BaseException | None = None
    if world.rank == 0 and sync is not None:
        fmt: WeightFormat = "lora" if trainer.settings.lora_rank else "full"
        try:
            published = publish_with_retries(
                sync,
                version,
                weights,
                fmt,
                settings.publish_attempts,
                settings.publish_retry_s,
                _say,
            )
        except BaseException as exc:  # every rank must hear of it, or they wait forever
            leases.keeper.nack(lease, reason="publish failed")
            leases.drop(lease)
            failure = exc
    failed = _broadcast(None if failure is None else str(failure))
    if failure is not None:
        raise failure
    if failed is not None:
        raise PublishFailedError(f"rank 0: {failed}")
    return published


def join_ranks(trainer_settings: TrainerSettings) -> TrainerSettings:
    """Join torchrun's process group: on CUDA (``device`` cuda, or auto with a GPU) NCCL with GPU
    ``LOCAL_RANK``, else gloo on CPU. Returns the settings with this rank's device."""
    if trainer_settings.device == "cuda" or (
        trainer_settings.device == "auto" and torch.cuda.is_available()
    ):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        trainer_settings = trainer_settings.model_copy(
            update={"device": f"cuda:{torch.cuda.current_device()}"}
        )
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return trainer_settings


def main(argv: list[str] | None = None) -> None:
    """``torchrun -m trainer_bridge.distributed [--check-config]``: one process per rank.

    ``--check-config`` loads the settings (the ``TRAJGATE_CONFIG`` file's keys all checked),
    prints them as one JSON object, secrets hidden, and exits before joining the process group.
    """
    import argparse

    from trajgate.config import describe

    parser = argparse.ArgumentParser(prog="torchrun -m trainer_bridge.distributed")
    parser.add_argument(
        "--check-config", action="store_true", help="Print the settings and exit (no training)."
    )
    arguments = parser.parse_args(argv)
    trainer_settings = TrainerSettings()  # type: ignore[call-arg]  # model_dir from env/config
    settings = DistributedSettings()
    if arguments.check_config:
        print(json.dumps(describe(trainer_settings, settings)), flush=True)
        return
    trainer_settings = join_ranks(trainer_settings)
    try:
        report = run(settings, trainer_settings)
        # One line per rank on the stdout every rank shares (torchrun), written by one call:
        # print may write the text and its newline apart (unbuffered), and another rank's line
        # then lands between them (seen in CI). A pipe keeps a write of up to PIPE_BUF (4 KiB)
        # whole; a longer report can still interleave.
        line = (json.dumps(asdict(report)) + "\n").encode()
        sys.stdout.flush()
        while line:
            line = line[os.write(sys.stdout.fileno(), line) :]
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
