"""The gateway's HTTP application: an OpenAI-compatible proxy in front of vLLM that records
every call as steps of a trajectory.

Owns: routes, attribution of a call to a trajectory, the upstream HTTP client, and the order
"call upstream → commit steps → answer client" (so an answered call is always in the pool).
Never: changes what the client receives beyond removing fields the gateway itself asked for.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Annotated, Any

import httpx
from fastapi import Depends, FastAPI, Header, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from datapool.db import make_engine
from datapool.models import StepOutcome
from datapool.records import CallRecord, ChoiceRecord
from datapool.settings import PoolSettings
from datapool.store import PoolStore
from gateway.capture import prepare_chat_request, read_chat_choices, strip_for_client
from gateway.errors import (
    InvalidRequestError,
    PayloadTooLargeError,
    UpstreamError,
    UpstreamTimeoutError,
    install_error_handlers,
)
from gateway.settings import GatewaySettings

TRAJECTORY_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$")


@dataclass
class GatewayState:
    settings: GatewaySettings
    store: PoolStore
    client: httpx.AsyncClient


def _state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


StateDep = Annotated[GatewayState, Depends(_state)]


def check_trajectory_id(trajectory_id: str) -> str:
    """Raise ``InvalidRequestError`` unless the id is 1-200 of ``[A-Za-z0-9._:-]``."""
    if not TRAJECTORY_ID_PATTERN.match(trajectory_id):
        raise InvalidRequestError(
            "trajectory id must be 1-200 characters of letters, digits, '.', '_', ':' or '-' "
            f"starting with a letter or digit; got {trajectory_id[:80]!r}",
            param="trajectory_id",
        )
    return trajectory_id


async def read_json_object(request: Request, max_body_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object; 413 past ``max_body_bytes``, 400 when not an object."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise PayloadTooLargeError(
                f"request body exceeds {max_body_bytes} bytes", code="payload_too_large"
            )
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid UTF-8: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequestError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def check_chat_body(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(
            f"'messages' must be a non-empty list, got {type(messages).__name__}",
            param="messages",
        )
    if not all(isinstance(m, dict) for m in messages):
        raise InvalidRequestError("every item of 'messages' must be an object", param="messages")
    if body.get("stream") is True:
        raise InvalidRequestError(
            "stream=true is not supported by this gateway version yet", param="stream"
        )


def create_app(
    gateway_settings: GatewaySettings | None = None, pool_settings: PoolSettings | None = None
) -> FastAPI:
    """Build the gateway app; the pool must already be migrated (``trajgate db upgrade``)."""
    settings = gateway_settings or GatewaySettings()
    pool = pool_settings or PoolSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = make_engine(pool.resolved_database_url())
        timeout = httpx.Timeout(
            settings.upstream_total_timeout_s, connect=settings.upstream_connect_timeout_s
        )
        async with httpx.AsyncClient(base_url=settings.upstream_url, timeout=timeout) as client:
            app.state.gateway = GatewayState(settings, PoolStore(engine), client)
            yield
        engine.dispose()

    app = FastAPI(title="trajgate gateway", lifespan=lifespan)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/t/{trajectory_id}/v1/chat/completions")
    async def chat_completions_by_url(
        trajectory_id: str, request: Request, state: StateDep
    ) -> Response:
        return await proxy_chat_completion(state, request, check_trajectory_id(trajectory_id))

    @app.post("/v1/chat/completions")
    async def chat_completions_by_header(
        request: Request,
        state: StateDep,
        x_trajgate_trajectory: Annotated[str | None, Header()] = None,
    ) -> Response:
        trajectory_id = (
            check_trajectory_id(x_trajgate_trajectory)
            if x_trajgate_trajectory
            else f"anon-{uuid.uuid4()}"
        )
        return await proxy_chat_completion(state, request, trajectory_id)

    return app


async def proxy_chat_completion(
    state: GatewayState, request: Request, trajectory_id: str
) -> Response:
    """Forward one chat completion, commit its steps, then answer with vLLM's response."""
    started = time.perf_counter()
    body = await read_json_object(request, state.settings.max_body_bytes)
    check_chat_body(body)
    upstream_body, asked = prepare_chat_request(body)
    record = CallRecord(
        request=body,
        upstream_request=upstream_body,
        model=body.get("model") if isinstance(body.get("model"), str) else None,
        upstream=state.settings.upstream_url,
        policy_version=state.settings.policy_version,
        latency_ms=0.0,
        prompt_token_ids=None,
        prompt_tokens=None,
        choices=[],
    )

    def failed(outcome: StepOutcome, error: str) -> CallRecord:
        choice = ChoiceRecord(0, None, None, None, None, flags=[outcome.value])
        return replace(
            record,
            outcome=outcome.value,
            error=error,
            choices=[choice],
            latency_ms=_elapsed_ms(started),
        )

    try:
        upstream = await state.client.post("/v1/chat/completions", json=upstream_body)
    except httpx.TimeoutException as exc:
        await run_in_threadpool(
            state.store.record_call, trajectory_id, failed(StepOutcome.UPSTREAM_TIMEOUT, repr(exc))
        )
        raise UpstreamTimeoutError(f"upstream did not answer in time: {exc!r}") from exc
    except httpx.TransportError as exc:
        await run_in_threadpool(
            state.store.record_call,
            trajectory_id,
            failed(StepOutcome.UPSTREAM_UNREACHABLE, repr(exc)),
        )
        raise UpstreamError(f"upstream {state.settings.upstream_url} unreachable: {exc!r}") from exc

    if upstream.status_code != 200:
        # The client sees vLLM's own error (already OpenAI's envelope); the pool keeps it too.
        step_ids = await run_in_threadpool(
            state.store.record_call,
            trajectory_id,
            failed(StepOutcome.UPSTREAM_ERROR, upstream.text),
        )
        return Response(
            upstream.content,
            status_code=upstream.status_code,
            media_type=upstream.headers.get("content-type"),
            headers=_trajgate_headers(trajectory_id, step_ids),
        )

    response = upstream.json()
    prompt_ids, choices = read_chat_choices(response)
    usage = response.get("usage") or {}
    record = replace(
        record,
        latency_ms=_elapsed_ms(started),
        prompt_token_ids=prompt_ids,
        prompt_tokens=usage.get("prompt_tokens"),
        choices=choices,
        model=response.get("model", record.model),
    )
    step_ids = await run_in_threadpool(state.store.record_call, trajectory_id, record)
    return JSONResponse(
        strip_for_client(response, asked), headers=_trajgate_headers(trajectory_id, step_ids)
    )


def _elapsed_ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000.0


def _trajgate_headers(trajectory_id: str, step_ids: list[str]) -> dict[str, str]:
    return {"x-trajgate-trajectory-id": trajectory_id, "x-trajgate-step-id": ",".join(step_ids)}
