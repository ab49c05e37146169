"""The trainer's client of the pool: lease a batch, read its rows, renew, ack or nack.

Owns: the HTTP calls of ``/api/batches/lease``, ``/api/batches/{id}/rows`` (Arrow IPC),
``/renew``, ``/ack``, ``/nack`` and ``/api/training-metrics`` (each update's metrics, which the
inspector's training chart draws), and turning Arrow rows into ``trainer_bridge.collate.Row``s
or straight into a padded ``TrainBatch``. Never: builds or changes rows; they arrive exactly as
the pool materialised them (token IDs, loss mask, behaviour logprobs, advantage). Keeping leases
alive while an update runs, and the rule for one lost anyway, is ``trainer_bridge.leases``.

Typical loop::

    with PoolClient("http://127.0.0.1:8000") as pool, LeaseKeeper(pool, "trainer-0", 600) as keeper:
        while (lease := keeper.lease()) is not None:  # renewed every 200 s until ack/nack
            batch = train_batch(pool.rows(lease.batch_id), pad_token_id=0)
            ...  # one RL update, as long as it takes
            keeper.ack(lease, policy_version_trained=version)
            pool.post_training_metrics("trainer-0", version + 1, metrics)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx
import pyarrow as pa

from trainer_bridge.collate import Row, collate
from trainer_bridge.trainer import TrainBatch, UpdateMetrics


class PoolClientError(RuntimeError):
    """The pool answered with an error envelope (message, status code)."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(f"{status_code}: {message}")
        self.status_code = status_code


class LeaseLostError(PoolClientError):
    """The lease expired or was taken over before a renewal, ack or nack (the pool answered 409
    ``lease_lost``, its ``LeaseNotCurrentError``); do not count the update as done
    (``trainer_bridge.leases.LeaseKeeper.ack`` applies the rule for it)."""


@dataclass(frozen=True)
class LeasedBatch:
    """A batch held under a lease until ``expires_at`` (ISO 8601, UTC)."""

    batch_id: str
    consumer: str
    lease_id: str
    expires_at: str
    rows: int
    tokens: int


class PoolClient:
    """A synchronous client of one pool (gateway) at ``base_url``."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 120.0,
        transport: httpx.BaseTransport | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), timeout=timeout_s, transport=transport, headers=headers
        )

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _check(self, response: httpx.Response) -> httpx.Response:
        if response.status_code < 400:
            return response
        try:
            message = str(response.json()["error"]["message"])
            code = response.json()["error"].get("code")
        except (ValueError, KeyError, TypeError, AttributeError):
            message, code = response.text[:500], None
        # By code, not by wording: an ack_conflict's message names its lease too.
        if response.status_code == 409 and code == "lease_lost":
            raise LeaseLostError(response.status_code, message)
        raise PoolClientError(response.status_code, message)

    def lease(
        self, consumer: str, lease_s: float | None = None, batch_id: str | None = None
    ) -> LeasedBatch | None:
        """The next batch ``consumer`` has not consumed (only ``batch_id`` when given), under a
        lease; None when none is ready."""
        body: dict[str, Any] = {"consumer": consumer}
        if lease_s is not None:
            body["lease_s"] = lease_s
        if batch_id is not None:
            body["batch_id"] = batch_id
        response = self._check(self._http.post("/api/batches/lease", json=body))
        if response.status_code == 204:
            return None
        return _leased(response.json())

    def renew(self, lease: LeasedBatch, lease_s: float | None = None) -> LeasedBatch:
        """Extend a held lease to ``lease_s`` seconds from now (the pool's default when None; at
        most its ``TRAJGATE_LEASE_MAX_S``); the same lease with its new ``expires_at``.

        Raises:
            LeaseLostError: the lease expired, was released or was taken over.
            PoolClientError: any other refusal (400: ``lease_s`` above the pool's maximum).
        """
        body: dict[str, Any] = {"consumer": lease.consumer, "lease_id": lease.lease_id}
        if lease_s is not None:
            body["lease_s"] = lease_s
        return _leased(
            self._check(self._http.post(f"/api/batches/{lease.batch_id}/renew", json=body)).json()
        )

    def rows(self, batch_id: str) -> pa.Table:
        """The batch's rows (Arrow IPC stream → table)."""
        response = self._check(self._http.get(f"/api/batches/{batch_id}/rows"))
        return pa.ipc.open_stream(pa.py_buffer(response.content)).read_all()

    def ack(self, lease: LeasedBatch, policy_version_trained: int | None = None) -> None:
        """The update on this batch succeeded; raises ``LeaseLostError`` if the lease is gone."""
        self._check(
            self._http.post(
                f"/api/batches/{lease.batch_id}/ack",
                json={
                    "consumer": lease.consumer,
                    "lease_id": lease.lease_id,
                    "policy_version_trained": policy_version_trained,
                },
            )
        )

    def post_training_metrics(
        self,
        run: str,
        policy_version: int,
        metrics: UpdateMetrics,
        extra: dict[str, float] | None = None,
    ) -> None:
        """Append one update's metrics to the pool's training metrics (``run``, ``step`` =
        ``metrics.step``, ``policy_version``: the version the update produced), with ``extra``
        values measured around the update (``weight_update_pause_ms``: how long publishing it
        held the agents' calls); every value is finite (the pool refuses others with a 400,
        raised as ``PoolClientError``)."""
        values = {name: v for name, v in metrics.as_dict().items() if name != "step"}
        values.update(extra or {})
        # the version again among the values, so the inspector's training chart draws it
        values["policy_version"] = float(policy_version)
        row = {
            "run": run,
            "policy_version": policy_version,
            "step": metrics.step,
            "metrics": values,
        }
        self._check(self._http.post("/api/training-metrics", json={"rows": [row]}))

    def nack(self, lease: LeasedBatch, reason: str | None = None) -> None:
        """The update failed; the batch goes back to the pool now."""
        self._check(
            self._http.post(
                f"/api/batches/{lease.batch_id}/nack",
                json={"consumer": lease.consumer, "lease_id": lease.lease_id, "reason": reason},
            )
        )


def _leased(data: dict[str, Any]) -> LeasedBatch:
    return LeasedBatch(
        data["batch_id"],
        data["consumer"],
        data["lease_id"],
        data["expires_at"],
        data["rows"],
        data["tokens"],
    )


def rows_from_table(table: pa.Table, *, skip_unscored: bool = False) -> list[Row]:
    """``Row``s of a batch table (columns ``input_ids``, ``loss_mask``, ``behaviour_logprobs``,
    ``advantage``, and ``temperature`` where the batch has it, else 1.0).

    A NaN advantage (a row without a baseline, e.g. ``rloo`` with one rewarded member) raises
    ``ValueError`` unless ``skip_unscored``, which drops such rows: NaN never becomes 0.
    """
    columns = table.select(["input_ids", "loss_mask", "behaviour_logprobs", "advantage"])
    temperatures = (
        table["temperature"].to_pylist()
        if "temperature" in table.column_names
        else [1.0] * table.num_rows  # a batch built before rows carried it
    )
    rows: list[Row] = []
    for ids, mask, logprobs, advantage, temperature in zip(
        *(columns[name].to_pylist() for name in columns.column_names), temperatures, strict=True
    ):
        if advantage is None or math.isnan(advantage):
            if skip_unscored:
                continue
            raise ValueError(
                "a row has no advantage (NaN: unrewarded, or no baseline in its group); "
                "pass skip_unscored=True to drop such rows"
            )
        rows.append(Row(ids, mask, logprobs, float(advantage), float(temperature or 1.0)))
    return rows


def train_batch(table: pa.Table, pad_token_id: int, *, skip_unscored: bool = False) -> TrainBatch:
    """A padded ``TrainBatch`` (``[B, T]`` tensors) of a batch table (see ``rows_from_table``)."""
    return collate(rows_from_table(table, skip_unscored=skip_unscored), pad_token_id)
