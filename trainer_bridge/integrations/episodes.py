"""Episodes through the gateway, read back as the pool's rows: what TRL's ``rollout_func`` and
verl's agent loop both do before they hand tokens to their trainer.

Owns: for each episode, creating its trajectory (id, group, channel), running the user's agent
against ``{gateway}/t/<trajectory_id>/v1``, completing the trajectory (with the reward the agent
returned, or leaving it to the gateway's reward functions), waiting until the pool finds every
trajectory ready (rewarded, curated), then materialising one batch of exactly those
trajectories (``layout: merged``), leasing it, reading its rows and acknowledging it; and the one
call that tells the gateway a new policy version serves (``POST /admin/policy-versions``).
Never: talks to vLLM, tokenizes, or changes a row (``rows.pool_rows`` cuts them).

An agent is any callable ``agent(base_url, prompt) -> float | None``: it runs one episode with
its own SDK pointed at ``base_url`` (OpenAI's ``base_url``, Anthropic's without ``/v1``) and
returns the episode's reward, or None when the gateway's reward functions score it
(``TRAJGATE_REWARD_FUNCTIONS``). Missing is never 0: a trajectory that stays unrewarded past
``ready_timeout_s`` raises ``EpisodeError`` with the pool's readiness reasons.

Exactly-once: the batch is leased by ``consumer`` (renewed while its rows are read:
``trainer_bridge.leases.LeaseKeeper``, whose rule also covers a lease lost anyway) and
acknowledged once its rows are read and handed to the caller (the trainer trains on them in the
same process right after); a crash in between leaves the lease to expire and the rows come back
to the pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from trainer_bridge.client import PoolClient, PoolClientError
from trainer_bridge.integrations.rows import PoolRow, pool_rows
from trainer_bridge.leases import LeaseKeeper

Agent = Callable[[str, Any], float | None]
"""``agent(base_url, prompt)``: run one episode through ``base_url``; its reward or None."""


def _transient(reason: str) -> bool:
    """A readiness reason that passes by itself: a reward function still running, or another
    process's episodes of the same group still playing (TRL's groups may span processes)."""
    return reason.startswith("unrewarded") or reason.endswith("open member(s)")


class EpisodeError(RuntimeError):
    """An episode failed (the agent raised), or its trajectory never became ready."""


@dataclass(frozen=True)
class Episode:
    """One agent run: its trajectory, its group (the GRPO baseline's rollouts of one task), the
    prompt handed to the agent as is."""

    trajectory_id: str
    group_id: str
    prompt: Any


class PoolEpisodes:
    """Runs episodes through the gateway at ``gateway_url`` and reads their rows from its pool.

    ``reward_names``: the trajectory rewards a row needs (the batch spec's, default
    ``["final"]``). ``batch_spec``: more fields of the batch spec (docs/batches.md); the
    algorithm defaults to ``grpo`` (the rows' ``advantage``; TRL and verl compute their own)
    with every group kept, degenerate ones included. ``admin_token``: the gateway's, for
    ``register_policy_version``.
    """

    def __init__(
        self,
        gateway_url: str,
        agent: Agent,
        *,
        channel: str = "train",
        consumer: str = "trajgate-integration",
        reward_names: Sequence[str] = ("final",),
        batch_spec: dict[str, Any] | None = None,
        max_concurrency: int = 8,
        ready_timeout_s: float = 300.0,
        lease_s: float = 600.0,
        admin_token: str | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        self.gateway_url = gateway_url.rstrip("/")
        self.agent = agent
        self.channel = channel
        self.consumer = consumer
        self.reward_names = list(reward_names)
        self.batch_spec = dict(batch_spec or {})
        self.max_concurrency = max_concurrency
        self.ready_timeout_s = ready_timeout_s
        self.lease_s = lease_s
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else None
        self._api = httpx.Client(base_url=self.gateway_url, timeout=timeout_s, headers=headers)
        self.pool = PoolClient(self.gateway_url, timeout_s=timeout_s, headers=headers)

    def close(self) -> None:
        self._api.close()
        self.pool.close()

    def _check(self, response: httpx.Response) -> httpx.Response:
        if response.status_code >= 400:
            raise PoolClientError(response.status_code, response.text[:500])
        return response

    def base_url(self, trajectory_id: str) -> str:
        """The OpenAI-style base URL of one trajectory: ``{gateway}/t/<id>/v1``."""
        return f"{self.gateway_url}/t/{trajectory_id}/v1"

    def _play(self, episode: Episode) -> None:
        try:
            reward = self.agent(self.base_url(episode.trajectory_id), episode.prompt)
        except Exception:
            self._api.post(f"/api/trajectories/{episode.trajectory_id}/fail")
            raise
        body = {} if reward is None else {"reward": float(reward)}
        self._check(
            self._api.post(f"/api/trajectories/{episode.trajectory_id}/complete", json=body)
        )

    def play(self, episodes: Sequence[Episode]) -> None:
        """Create the trajectories, run the agents (``max_concurrency`` at once), complete them.

        Raises:
            EpisodeError: an agent raised (its trajectory is marked failed; the others finish).
        """
        for episode in episodes:
            self._check(
                self._api.post(
                    "/api/trajectories",
                    json={
                        "id": episode.trajectory_id,
                        "group_id": episode.group_id,
                        "channel": self.channel,
                    },
                )
            )
        with ThreadPoolExecutor(max_workers=self.max_concurrency) as executor:
            futures = [(e, executor.submit(self._play, e)) for e in episodes]
        failed = [(e.trajectory_id, f.exception()) for e, f in futures if f.exception()]
        if failed:
            raise EpisodeError(f"{len(failed)} of {len(episodes)} episodes failed: {failed[:3]}")

    def wait_ready(self, trajectory_ids: Sequence[str]) -> None:
        """Wait until the pool finds every trajectory ready for a batch.

        Raises:
            EpisodeError: one is not ready within ``ready_timeout_s`` (its reasons quoted), or is
                not ready for a reason that stays (a flag, an exclusion), not a reward still to
                come or a group member still playing.
        """
        params = {"reward_name": self.reward_names}
        deadline = time.monotonic() + self.ready_timeout_s
        pending = list(trajectory_ids)
        reasons: dict[str, list[str]] = {}
        while pending:
            for trajectory_id in list(pending):
                answer = self._check(
                    self._api.get(f"/api/trajectories/{trajectory_id}/readiness", params=params)
                ).json()
                if answer["ready"]:
                    pending.remove(trajectory_id)
                    continue
                reasons[trajectory_id] = answer["reasons"]
                if not all(_transient(r) for r in answer["reasons"]):
                    raise EpisodeError(
                        f"trajectory {trajectory_id!r} is not ready: {answer['reasons']}"
                    )
            if pending and time.monotonic() > deadline:
                raise EpisodeError(
                    f"{len(pending)} trajectories not ready after {self.ready_timeout_s} s: "
                    f"{ {t: reasons.get(t) for t in pending[:3]} }"
                )
            if pending:
                time.sleep(0.2)

    def rows(self, trajectory_ids: Sequence[str]) -> list[PoolRow]:
        """Materialise, lease, read and acknowledge one batch of exactly ``trajectory_ids``;
        its rows in the batch's order (a trajectory split by a prefix break or a tree has
        several)."""
        spec: dict[str, Any] = {
            "channel": self.channel,
            "algorithm": "grpo",
            "layout": "merged",
            "drop_degenerate_groups": False,
            "short_groups": "keep",
            "apply_rules": False,
            "reward_names": self.reward_names,
            **self.batch_spec,
            "filters": {
                **self.batch_spec.get("filters", {}),
                "trajectory_ids": list(trajectory_ids),
            },
        }
        batch_id = self._check(self._api.post("/api/batches", json=spec)).json()["id"]
        with LeaseKeeper(self.pool, self.consumer, self.lease_s) as leases:
            lease = leases.lease(batch_id=batch_id)
            if lease is None:
                raise EpisodeError(f"batch {batch_id} was just materialised but is not leasable")
            try:
                rows = pool_rows(self.pool.rows(lease.batch_id))
            except Exception as error:
                leases.nack(lease, reason=str(error)[:500])
                raise
            leases.ack(lease)
        return rows

    def run(self, episodes: Sequence[Episode]) -> list[PoolRow]:
        """``play``, ``wait_ready`` and ``rows`` of these episodes."""
        self.play(episodes)
        trajectory_ids = [e.trajectory_id for e in episodes]
        self.wait_ready(trajectory_ids)
        return self.rows(trajectory_ids)

    def register_policy_version(
        self, version: int, model_name: str, weights_location: str | None = None
    ) -> None:
        """The one call after new weights reached vLLM: register ``version`` (served as
        ``model_name``) and make it active, so the gateway stamps every later step with it and
        routes the model alias ``policy`` to ``model_name``.

        ``POST /admin/policy-versions {"version", "model_name", "weights_location", "activate":
        true}``; an identical re-send is a no-op. Raises ``PoolClientError`` on 409 (the version
        is registered with another model name or location).
        """
        body: dict[str, Any] = {"version": version, "model_name": model_name, "activate": True}
        if weights_location is not None:
            body["weights_location"] = weights_location
        self._check(self._api.post("/admin/policy-versions", json=body))
