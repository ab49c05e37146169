"""What every request handler of one gateway app shares, and the dependency that hands it over.

Owns: ``GatewayState`` (settings, the pool and its writer, the upstream pool, the policy
registry, keys, metrics, completion hooks, the served models' tokenizers) and ``StateDep``, the
dependency alias routes declare to receive it. Never: builds the state (the app's lifespan does,
in ``gateway.app``) or serves a route; modules that need the state import it from here, never
from ``gateway.app``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import httpx
from fastapi import Depends, Request

from datapool.errors import PoolError
from datapool.lifecycle.hooks import CompletionHooks
from datapool.steps.records import CallRecord
from datapool.steps.store import PoolStore
from datapool.steps.writer import PoolWriter
from gateway.auth import KeyRing
from gateway.errors import from_pool_error
from gateway.metrics import GatewayMetrics
from gateway.proxy.continuation.history import TurnMemory
from gateway.proxy.continuation.walk import WalkMemory
from gateway.settings import GatewaySettings
from gateway.tokenizer_dirs import TokenizerDirs
from gateway.upstream.policy import PolicyRegistry
from gateway.upstream.replicas import UpstreamPool


@dataclass
class GatewayState:
    """Everything a request handler needs, built once per app in its lifespan."""

    settings: GatewaySettings
    store: PoolStore
    client: httpx.AsyncClient
    upstreams: UpstreamPool
    policy: PolicyRegistry
    keys: KeyRing
    metrics: GatewayMetrics
    pending_writes: int = 0
    writer: PoolWriter | None = None
    hooks: CompletionHooks | None = None
    # The clients of model calls (``client`` serves health checks, models and admin calls).
    # each served model's tokenizer, learnt from vLLM for the inspector's token view
    tokenizer_dirs: TokenizerDirs = field(default_factory=TokenizerDirs)
    # one of several worker processes (gateway.workers): where its siblings answer
    worker_dir: Path | None = None
    # the recent turns of each trajectory, for exact continuation (gateway.proxy.continuation)
    turns: TurnMemory = field(default_factory=lambda: TurnMemory(4096, 8))
    # the last walk over each trajectory's history (gateway.proxy.continuation.walk)
    walks: WalkMemory = field(default_factory=lambda: WalkMemory(256 * 2**20))

    async def record(self, trajectory_id: str, call: CallRecord) -> list[str]:
        """Make one call durable (its steps and its attempts, one group-commit transaction);
        returns the step ids."""
        self.pending_writes += 1
        try:
            assert self.writer is not None, "the lifespan starts the pool writer"
            try:
                step_ids = await self.writer.record(trajectory_id, call)
            except PoolError as exc:
                raise from_pool_error(exc) from exc
        finally:
            self.pending_writes -= 1
        return step_ids


def gateway_state(request: Request) -> GatewayState:
    """The state of the app serving ``request`` (set by the lifespan as ``app.state.gateway``)."""
    state: GatewayState = request.app.state.gateway
    return state


StateDep = Annotated[GatewayState, Depends(gateway_state)]
