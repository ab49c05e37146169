"""The gateway's HTTP application: an OpenAI-compatible proxy in front of vLLM that records
every call as steps of a trajectory, plus health, metrics and admin endpoints.

Owns: wiring (settings, the pool, the upstream pool, the policy registry, keys, metrics, error
envelope) and background tasks (health checks, policy refresh, completion hooks). Never:
proxies by itself; the OpenAI surface is ``gateway.proxy.routes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from pathlib import Path

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from datapool.batches.settings import BatchSettings
from datapool.db import make_engine
from datapool.errors import InvalidPoolRequestError
from datapool.lifecycle.hooks import CompletionHooks
from datapool.lifecycle.transitions import close_idle
from datapool.rewards.step_rewards import STEP_ENTRY_POINT_GROUP
from datapool.rewards.values import resolve_reward_function
from datapool.settings import PoolSettings
from datapool.steps.faults import fault_reason, is_storage_fault
from datapool.steps.store import PoolStore
from datapool.steps.writer import PoolWriter
from datapool.tokenizer_copies import TokenizerCopies
from gateway.api import admin, lora
from gateway.api import batches as batches_api
from gateway.api import pool as pool_api
from gateway.auth import KeyRing, check_admin_token
from gateway.body_budget import BodyBudget
from gateway.dialects import DIALECTS, Dialect
from gateway.errors import install_error_handlers
from gateway.guard import EdgeGuard
from gateway.inspector import page as inspector
from gateway.liveness import Heartbeat, LivenessServer
from gateway.metrics import GatewayMetrics
from gateway.proxy import routes as proxy
from gateway.proxy.continuation.history import TurnMemory
from gateway.proxy.continuation.walk import WalkMemory
from gateway.proxy.sampling import check_defaults_against_policy
from gateway.settings import UPSTREAM_TRANSPORTS, GatewaySettings
from gateway.state import GatewayState, StateDep
from gateway.tokenizer_dirs import TokenizerDirs
from gateway.upstream.answer_limit import AnswerLimit
from gateway.upstream.policy import PolicyRegistry
from gateway.upstream.replicas import UpstreamPool
from gateway.upstream.transport import UpstreamTransport
from gateway.workers import WORKER_DIR_ENV, PeerServer, gather_metrics

log = logging.getLogger("trajgate.gateway")


def check_settings(
    settings: GatewaySettings, pool: PoolSettings, batch: BatchSettings | None = None
) -> None:
    """Every check of the settings that needs more than their own validation, run before the
    gateway starts: by ``create_app`` and by ``trajgate serve --check-config``, so a
    configuration the check accepts is one that starts (``--check-config`` skipped the sampling
    check and passed a configuration ``serve`` then refused).

    Raises:
        InvalidPoolRequestError: a configured reward function or step reward function cannot be
            resolved (a typo would otherwise surface only as a failed reward on every
            trajectory, or every step).
        InvalidPoolRequestError: also (``param`` 'lease_default_s') a default lease longer
            than the longest one allowed (``batch``, read from the environment when None):
            every lease asked without ``lease_s`` would be refused, blaming a field the client
            never sent.
        SamplingSettingsError: a channel's sampling policy refuses its own defaults.
    """
    batch = batch or BatchSettings()
    if batch.lease_default_s > batch.lease_max_s:
        raise InvalidPoolRequestError(
            f"lease_default_s ({batch.lease_default_s:g} s) exceeds lease_max_s "
            f"({batch.lease_max_s:g} s), so every lease asked without lease_s would be refused; "
            "lower TRAJGATE_LEASE_DEFAULT_S or raise TRAJGATE_LEASE_MAX_S",
            param="lease_default_s",
        )
    for name in pool.reward_functions:
        resolve_reward_function(name)
    for name in pool.step_reward_functions:
        resolve_reward_function(name, STEP_ENTRY_POINT_GROUP)
    check_defaults_against_policy(settings)


def create_app(
    gateway_settings: GatewaySettings | None = None,
    pool_settings: PoolSettings | None = None,
    *,
    upstream_transport: httpx.AsyncBaseTransport | None = None,
    worker_dir: Path | None = None,
    dialects: Sequence[Dialect] = DIALECTS,
) -> FastAPI:
    """Build the gateway app; the pool must already be migrated (``trajgate db upgrade``).

    Raises ``InvalidPoolRequestError`` when a configured (step) reward function cannot be
    resolved, ``SamplingSettingsError`` when a channel's sampling policy refuses its own
    defaults.

    ``upstream_transport`` replaces the network for upstream calls (tests that need an upstream
    shape the real vLLM cannot produce pass an ``httpx.MockTransport``). ``worker_dir``: this app
    is one of several worker processes (``gateway.workers``): it answers its siblings there,
    ``/metrics`` merges all of them, and the liveness port is the parent's, not its own.
    ``dialects``: the client APIs served (``gateway.dialects.DIALECTS`` by default; a user's
    own ``Dialect`` is served, captured, rewarded and exported by passing it here with them,
    e.g. ``create_app(settings, pool, dialects=(*DIALECTS, MyDialect()))``).
    """
    settings = gateway_settings or GatewaySettings()
    pool = pool_settings or PoolSettings()
    check_settings(settings, pool)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with _running_state(settings, pool, upstream_transport, worker_dir) as state:
            app.state.gateway = state
            with _tuned_collector(settings.gc_young_threshold):
                yield

    app = FastAPI(title="trajgate gateway", lifespan=lifespan)
    app.state.settings = settings  # read before the lifespan too (gateway.server's deadlines)
    install_error_handlers(app)
    # Host names, cross-site writes, content types, the admin token and the body limit, before
    # any route reads a body (gateway.guard).
    # The budget of body bytes in flight (gateway.body_budget), on app.state for its counters.
    app.state.body_budget = BodyBudget(settings.max_body_bytes_in_flight)
    app.add_middleware(
        EdgeGuard, settings=settings, dialects=dialects, body_budget=app.state.body_budget
    )
    app.include_router(proxy.dialect_router(dialects))
    app.include_router(proxy.router)
    app.include_router(admin.router)
    app.include_router(lora.router)
    # The pool API manages data: behind the admin token whenever one is set (always beyond
    # loopback, where the settings refuse to start without one).
    app.include_router(pool_api.router, prefix="/api", dependencies=[Depends(_require_admin)])
    app.include_router(batches_api.router, prefix="/api", dependencies=[Depends(_require_admin)])
    app.include_router(inspector.router)
    app.include_router(probes)
    return app


@contextmanager
def _tuned_collector(young_threshold: int) -> Iterator[None]:
    """While the app serves: the objects made by its start frozen out of every collection
    (``gc.freeze``) and the youngest generation's threshold at ``young_threshold`` (the
    setting ``gc_young_threshold``: why, there); the interpreter's thresholds restored and the
    frozen objects handed back to the oldest generation on exit. 0 changes nothing."""
    if young_threshold == 0:
        yield
        return
    before = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(young_threshold, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


def create_worker_app() -> FastAPI:
    """The app of one ``trajgate serve --workers N`` worker (uvicorn's factory): settings from
    the environment the parent prepared, siblings in ``TRAJGATE_WORKER_DIR``."""
    return create_app(worker_dir=Path(os.environ[WORKER_DIR_ENV]))


@asynccontextmanager
async def _running_state(
    settings: GatewaySettings,
    pool: PoolSettings,
    upstream_transport: httpx.AsyncBaseTransport | None,
    worker_dir: Path | None = None,
) -> AsyncIterator[GatewayState]:
    """The app's state with its pool writer, upstream client and background tasks running;
    everything is stopped, in reverse order, on exit."""
    engine = make_engine(
        pool.resolved_database_url(), lock_timeout_ms=pool.database_lock_timeout_ms
    )
    store = PoolStore(engine, pool)
    idle_closer = partial(close_idle, store.sessions)
    writer = await run_in_threadpool(PoolWriter(store, close_idle=idle_closer).start)
    upstreams = UpstreamPool(settings.upstream_urls)
    policy = PolicyRegistry(
        store.sessions, alias=settings.policy_alias, default_version=settings.policy_version
    )
    await run_in_threadpool(policy.refresh)
    async with _upstream_client(settings, upstream_transport) as client:
        hooks = CompletionHooks(store)
        state = GatewayState(
            settings,
            store,
            client,
            upstreams,
            policy,
            KeyRing(store.sessions),
            GatewayMetrics(upstreams, lambda: float(state.pending_writes), writer, hooks),
        )
        state.writer = writer
        state.hooks = hooks
        state.turns = TurnMemory(settings.continuation_memory_trajectories, TURNS_PER_TRAJECTORY)
        state.walks = WalkMemory(settings.continuation_history_memory_mb * 2**20)
        state.worker_dir = worker_dir
        copies = TokenizerCopies(pool.data_dir.resolve() / "tokenizers")
        state.tokenizer_dirs = TokenizerDirs(copies=copies)
        # Liveness off the event loop (gateway.liveness); binds first, so a taken port stops
        # the start before any task runs. With several workers the parent holds the port and
        # asks each worker's peer thread for its heartbeat.
        heartbeat = Heartbeat()
        liveness: LivenessServer | PeerServer | None = None
        if worker_dir is not None:
            liveness = PeerServer(worker_dir, state.metrics.render, heartbeat.lag_s).start()
        elif settings.liveness_port:
            liveness = LivenessServer(settings.host, settings.liveness_port, heartbeat).start()
        tasks = [
            asyncio.create_task(
                upstreams.health_loop(
                    client, settings.health_check_interval_s, settings.upstream_connect_timeout_s
                )
            ),
            asyncio.create_task(_refresh_loop(policy, settings.policy_refresh_s)),
            asyncio.create_task(_tokenizer_loop(state, settings.upstream_connect_timeout_s)),
            asyncio.create_task(hooks.run_forever()),
            asyncio.create_task(heartbeat.beat()),
        ]
        try:
            yield state
        finally:
            if liveness is not None:
                liveness.stop()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await run_in_threadpool(writer.close)
    engine.dispose()


# Answers unencoded: the answer limit counts framed bytes (gateway.upstream.answer_limit).
IDENTITY = {"accept-encoding": "identity"}


def _upstream_client(
    settings: GatewaySettings, transport: httpx.AsyncBaseTransport | None
) -> httpx.AsyncClient:
    """An HTTP client for upstream calls: the read timeout is the silence allowed between
    stream chunks; no cap on connections (the replicas' queues are the limit)."""
    timeout = httpx.Timeout(
        settings.upstream_total_timeout_s,
        connect=settings.upstream_connect_timeout_s,
        read=settings.upstream_between_chunks_timeout_s,
    )
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    most_bytes = settings.upstream_max_answer_bytes
    if transport is not None:  # a test's transport for shapes the real vLLM cannot produce
        return httpx.AsyncClient(
            timeout=timeout,
            limits=limits,
            transport=AnswerLimit(transport, most_bytes),
            headers=IDENTITY,
        )
    # Plain-HTTP replicas through our own transport (gateway.upstream.transport: the capture
    # hot path) unless the settings fall back to httpx's; https:// ones always through httpx's.
    # Every answer is limited in bytes (gateway.upstream.answer_limit), whichever carries it.
    plain: httpx.AsyncBaseTransport
    match settings.upstream_transport:
        case "own":
            plain = UpstreamTransport()
        case "httpx":
            plain = httpx.AsyncHTTPTransport(limits=limits)
        case other:
            raise ValueError(
                f"upstream_transport must be one of {', '.join(UPSTREAM_TRANSPORTS)}, got {other!r}"
            )
    return httpx.AsyncClient(
        timeout=timeout,
        headers=IDENTITY,
        mounts={
            "http://": AnswerLimit(plain, most_bytes),
            "https://": AnswerLimit(httpx.AsyncHTTPTransport(limits=limits), most_bytes),
        },
    )


# Turns kept per trajectory for exact continuation: an agent extends its latest turn, a retry or
# a fork one of the few before it.
TURNS_PER_TRAJECTORY = 8

probes = APIRouter()


@probes.get("/health")
async def health() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@probes.get("/ready")
async def ready(state: StateDep) -> Response:
    """Ready when at least one upstream replica passes its health check.

    ``pool_writable`` is false from a failed commit until the next good one. It is reported,
    not made a condition: a balancer that stopped sending calls would never let a call
    find the pool writable again.
    """
    healthy = [r.url for r in state.upstreams.replicas if r.healthy]
    writable = state.writer is not None and state.writer.writable
    return JSONResponse(
        {"ready": bool(healthy), "healthy_upstreams": len(healthy), "pool_writable": writable},
        status_code=200 if healthy else 503,
    )


@probes.get("/metrics")
async def metrics(state: StateDep) -> Response:
    """Prometheus metrics (text exposition format); with several workers, all of them merged
    (``gateway.workers``)."""
    if state.worker_dir is not None:
        body = await run_in_threadpool(gather_metrics, state.worker_dir)
    else:
        body = state.metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4")


def _require_admin(request: Request, state: StateDep) -> None:
    check_admin_token(request, state.settings.admin_token)


async def _tokenizer_loop(state: GatewayState, timeout_s: float) -> None:
    """Learn the served models' tokenizers now and every ``refresh_s`` (the pool keeps a copy
    of each: a pool reopened without vLLM still decodes), unless an override is set."""
    dirs = state.tokenizer_dirs
    while state.store.settings.tokenizer_dir is None:
        try:
            await dirs.learn(state.client, [r.url for r in state.upstreams.replicas], timeout_s)
        except Exception:  # the token view learns again when asked; this loop must not end
            log.exception("learning the served models' tokenizers failed")
        await asyncio.sleep(dirs.refresh_s)


async def _refresh_loop(policy: PolicyRegistry, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await run_in_threadpool(policy.refresh)
        except Exception as exc:  # a transient database error must not end the loop
            if is_storage_fault(exc):  # expected during an outage: one line, no traceback
                log.warning(
                    "policy refresh failed (%s); keeping version %s",
                    fault_reason(exc),
                    policy.active.version,
                )
            else:
                log.exception("policy refresh failed; keeping version %s", policy.active.version)
