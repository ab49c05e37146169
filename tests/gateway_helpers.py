"""Helpers shared by the gateway tests: reading steps back, SSE parsing, mock upstreams."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from datapool.db import make_engine
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore, StoredStep
from gateway.app import create_app
from gateway.engine.exact import RenderAhead
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings

# The tool the tests force the model to call. "strict": without it, this vLLM leaves a named
# tool_choice unconstrained and the random tiny model writes "<tool_call>{...digits" as content
# until max_tokens: no tool call at all.
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def steps_of(pool_settings: PoolSettings, trajectory_id: str) -> list[StoredStep]:
    engine = make_engine(pool_settings.resolved_database_url())
    try:
        return PoolStore(engine, pool_settings).steps_of(trajectory_id)
    finally:
        engine.dispose()


def sse_payloads(text: str) -> list[str]:
    """The ``data`` payloads of an SSE body, in order (``[DONE]`` included)."""
    payloads = []
    for event in text.split("\n\n"):
        for line in event.splitlines():
            if line.startswith("data: "):
                payloads.append(line[len("data: ") :])
    return payloads


def sse_chunks(text: str) -> list[dict[str, Any]]:
    return [json.loads(p) for p in sse_payloads(text) if p != "[DONE]"]


@contextmanager
def gateway_with(
    pool_settings: PoolSettings,
    port: int,
    *,
    upstream_url: str = "http://upstream.test",
    transport: httpx.AsyncBaseTransport | None = None,
    **settings: Any,
) -> Iterator[BackgroundServer]:
    """A real gateway on ``port`` whose upstream calls go to ``transport`` (or the network)."""
    settings.setdefault("health_check_interval_s", 3600)
    gateway_settings = GatewaySettings(upstream_url=upstream_url, port=port, **settings)
    app = create_app(gateway_settings, pool_settings, upstream_transport=transport)
    server = BackgroundServer(app, port=port).start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def emulated_gateway(
    pool_settings: PoolSettings, *, gateway: dict[str, Any] | None = None, **emulator: Any
) -> Iterator[BackgroundServer]:
    """A gateway in front of a fresh vLLM-shaped emulator (``trajgate.bench.emulator``) with the
    given
    pace and lengths; both stop on exit."""
    from tests_support import free_port

    from trajgate.bench.emulator import EmulatorSettings, EmulatorThread

    upstream = EmulatorThread(EmulatorSettings(port=free_port(), **emulator)).start()
    try:
        with gateway_with(
            pool_settings, free_port(), upstream_url=upstream.url, **(gateway or {})
        ) as server:
            yield server
    finally:
        upstream.stop()


def chat_response(
    ids: list[int] | None,
    logprobs: list[float] | None,
    *,
    completion_tokens: int,
    prompt_ids: list[int] | None = None,
    content: str = "ok",
    finish_reason: str = "stop",
) -> dict[str, Any]:
    """A non-streaming chat completion in vLLM 0.32's shape (as the real server sends it)."""
    prompt_ids = [1, 2, 3] if prompt_ids is None else prompt_ids
    return {
        "id": "chatcmpl-mock",
        "object": "chat.completion",
        "created": 1,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "tool_calls": []},
                "logprobs": None
                if logprobs is None
                else {"content": [{"token": "x", "logprob": lp} for lp in logprobs]},
                "finish_reason": finish_reason,
                "stop_reason": None,
                "token_ids": ids,
            }
        ],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) + completion_tokens,
        },
        "system_fingerprint": "fp-mock",
        "prompt_token_ids": prompt_ids,
    }


def sse_body(chunks: list[dict[str, Any]]) -> bytes:
    return (
        b"".join(f"data: {json.dumps(c, separators=(',', ':'))}\n\n".encode() for c in chunks)
        + b"data: [DONE]\n\n"
    )


Handler = Callable[[httpx.Request], httpx.Response]


def wait_for_exact_probes(server: BackgroundServer, timeout_s: float = 300.0) -> None:
    """Wait until every replica's exact-continuation probe has ended (the gateway's
    ``trajgate_upstream_exact_continuation`` gauge is no longer -1): a test that asserts how a
    call extending a turn is sent must not race the probe a fresh gateway starts.

    Raises AssertionError when a probe is still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        values = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("trajgate_upstream_exact_continuation{")
        ]
        if values and -1.0 not in values:
            return
        assert time.monotonic() < deadline, f"exact probes still running: {values}"
        time.sleep(0.1)


def assert_renders_ended(sent: list[RenderAhead], within_s: float) -> None:
    """Every render the gateway sent ahead (``RenderAhead``) has ended, taken and answered or
    cancelled, within ``within_s`` seconds: the call's lifetime ends before its answer goes out
    (a stream's, once the server has sent it), and a cancel needs one more turn of the
    gateway's event loop to land.

    Raises AssertionError naming how many are still pending."""
    deadline = time.monotonic() + within_s
    while not all(ahead.task.done() for ahead in sent):
        pending = sum(not ahead.task.done() for ahead in sent)
        assert time.monotonic() < deadline, f"{pending} render(s) sent ahead still pending"
        time.sleep(0.01)
