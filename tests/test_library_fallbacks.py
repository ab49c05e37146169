"""The speed layers' switches back to the libraries they replace, against the real vLLM.

Each behaviour runs three ways: the gateway's own layers (``upstream_transport`` ``own``,
``http_protocol`` ``own``), and httpx's default transport under uvicorn's own ``httptools`` or
``h11`` protocol. On every way a unary and a streamed call store exactly the ids and logprobs
vLLM reports, an answer past ``upstream_max_answer_bytes`` ends as ``upstream_error``, one
slower than ``upstream_total_timeout_s`` as ``upstream_timeout``, a body
dripped past ``request_body_timeout_s`` gets 408 and nothing recorded, and a client that leaves
a stream keeps its partial step. The head deadline holds on the own protocol only (documented
in ``gateway.http_protocol``); it is tested in ``tests/test_request_deadlines.py``.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from gateway_helpers import gateway_with, sse_chunks, steps_of
from tests_support import free_port

from datapool.settings import PoolSettings
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings
from trajgate.vllm_server import VLLMServer

# (upstream_transport, http_protocol)
LAYERS = [("own", "own"), ("httpx", "httptools"), ("httpx", "h11")]
LAYER_IDS = ["own", "httpx-httptools", "httpx-h11"]

REQUEST: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Count from one to ten."}],
    "max_tokens": 16,
    "temperature": 0,
    "seed": 7,
}


@pytest.fixture(params=LAYERS, ids=LAYER_IDS)
def layers(request: pytest.FixtureRequest) -> dict[str, str]:
    transport, protocol = request.param
    return {"upstream_transport": transport, "http_protocol": protocol}


@contextmanager
def layered_gateway(
    vllm: VLLMServer, pool: PoolSettings, layers: dict[str, str], **settings: Any
) -> Iterator[BackgroundServer]:
    with gateway_with(
        pool, free_port(), upstream_url=vllm.url, upstream_max_attempts=1, **layers, **settings
    ) as server:
        yield server


def direct_ids_and_logprobs(vllm: VLLMServer) -> tuple[list[int], list[int], list[float]]:
    """vLLM's own prompt ids, sampled ids and logprobs for ``REQUEST`` (greedy: reproducible)."""
    direct = httpx.post(
        f"{vllm.url}/v1/chat/completions",
        json={**REQUEST, "return_token_ids": True, "logprobs": True},
        timeout=120,
    ).json()
    choice = direct["choices"][0]
    logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    return direct["prompt_token_ids"], choice["token_ids"], logprobs


def test_a_unary_call_stores_vllms_exact_ids_and_logprobs_either_way(
    vllm: VLLMServer, sqlite_pool: PoolSettings, layers: dict[str, str]
) -> None:
    with layered_gateway(vllm, sqlite_pool, layers) as gateway:
        answer = httpx.post(f"{gateway.url}/t/unary/v1/chat/completions", json=REQUEST, timeout=120)
    assert answer.status_code == 200
    prompt_ids, ids, logprobs = direct_ids_and_logprobs(vllm)
    (step,) = steps_of(sqlite_pool, "unary")
    assert step.prompt_token_ids == prompt_ids
    assert step.response_token_ids == ids
    assert step.response_logprobs == logprobs
    assert len(ids) == 16  # max_tokens, "length"
    assert step.response_message is not None
    assert step.response_message["content"] == answer.json()["choices"][0]["message"]["content"]


def test_a_streamed_call_stores_vllms_exact_ids_and_logprobs_either_way(
    vllm: VLLMServer, sqlite_pool: PoolSettings, layers: dict[str, str]
) -> None:
    with layered_gateway(vllm, sqlite_pool, layers) as gateway:
        answer = httpx.post(
            f"{gateway.url}/t/streamed/v1/chat/completions",
            json={**REQUEST, "stream": True},
            timeout=120,
        )
    assert answer.status_code == 200
    text = "".join(
        chunk["choices"][0]["delta"].get("content") or ""
        for chunk in sse_chunks(answer.text)
        if chunk.get("choices")
    )
    prompt_ids, ids, logprobs = direct_ids_and_logprobs(vllm)
    (step,) = steps_of(sqlite_pool, "streamed")
    assert step.prompt_token_ids == prompt_ids
    assert step.response_token_ids == ids
    assert step.response_logprobs == logprobs
    assert step.response_message is not None
    assert step.response_message["content"] == text


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
def test_an_answer_past_the_answer_limit_is_upstream_error_either_way(
    vllm: VLLMServer, sqlite_pool: PoolSettings, layers: dict[str, str], stream: bool
) -> None:
    # 16 tokens with their logprobs (about 60 bytes each in the unary body, more streamed) and
    # the prompt's ids come to well over 1 KiB: checked on vLLM's own answer first.
    limit_bytes = 1024
    direct = httpx.post(
        f"{vllm.url}/v1/chat/completions",
        json={**REQUEST, "return_token_ids": True, "logprobs": True},
        timeout=120,
    )
    assert len(direct.content) > limit_bytes
    trajectory_id = f"too-long-{stream}".lower()
    with layered_gateway(
        vllm, sqlite_pool, layers, upstream_max_answer_bytes=limit_bytes
    ) as gateway:
        answer = httpx.post(
            f"{gateway.url}/t/{trajectory_id}/v1/chat/completions",
            json={**REQUEST, "stream": stream},
            timeout=120,
        )
    # A stream whose first event went out before the limit was passed ends in its error event;
    # one cut while the gateway still held its first events (how the reads fall) is a 502.
    if stream and answer.status_code == 200:
        last = sse_chunks(answer.text)[-1]
        assert last["error"]["code"] == "upstream_error"
    else:
        assert answer.status_code == 502
        assert answer.json()["error"]["code"] == "upstream_error"
    (step,) = steps_of(sqlite_pool, trajectory_id)
    assert step.outcome == "upstream_error"
    assert "upstream_max_answer_bytes" in (step.error or "")


def test_an_answer_slower_than_the_total_limit_is_upstream_timeout_either_way(
    vllm: VLLMServer, sqlite_pool: PoolSettings, layers: dict[str, str]
) -> None:
    # A unary answer of 2,000 tokens comes in one piece after all are sampled: seconds on the
    # tiny model, far past the 0.3 s of upstream_total_timeout_s (which is also the read limit
    # each read of a unary answer is given, in either transport).
    long_request = {**REQUEST, "max_tokens": 2000, "ignore_eos": True}
    with layered_gateway(vllm, sqlite_pool, layers, upstream_total_timeout_s=0.3) as gateway:
        started = time.monotonic()
        answer = httpx.post(
            f"{gateway.url}/t/slow/v1/chat/completions", json=long_request, timeout=120
        )
        answered_after_s = time.monotonic() - started
        direct_started = time.monotonic()
        httpx.post(f"{vllm.url}/v1/chat/completions", json=long_request, timeout=120)
        direct_s = time.monotonic() - direct_started
    assert direct_s > 1.0  # the premise: vLLM itself takes longer than the limit
    assert answer.status_code == 504
    assert answer.json()["error"]["code"] == "upstream_timeout"
    assert answered_after_s < direct_s  # cut at the limit, not after the whole answer
    (step,) = steps_of(sqlite_pool, "slow")
    assert step.outcome == "upstream_timeout"


def test_a_body_dripped_past_its_deadline_gets_408_and_nothing_recorded_either_way(
    vllm: VLLMServer, sqlite_pool: PoolSettings, layers: dict[str, str]
) -> None:
    body = json.dumps(REQUEST).encode()
    head = (
        b"POST /t/dripped/v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        b"content-type: application/json\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
    )
    with layered_gateway(vllm, sqlite_pool, layers, request_body_timeout_s=1.0) as gateway:
        host, port = gateway.url.removeprefix("http://").split(":")
        started = time.monotonic()
        # The socket's own timeout only bounds the test: a gateway that never cuts fails it.
        with socket.create_connection((host, int(port)), timeout=15) as client:
            client.sendall(head)
            for byte in body:  # 4 bytes a second: the whole body would take len(body) / 4 s
                try:
                    client.sendall(bytes([byte]))
                except OSError:  # closed by the gateway
                    break
                time.sleep(0.25)
            received = b""
            while piece := client.recv(65536):
                received += piece
        closed_after_s = time.monotonic() - started
    answer_head, _, answer_body = received.partition(b"\r\n\r\n")
    assert answer_head.startswith(b"HTTP/1.1 408 "), received[:200]
    assert b"connection: close" in answer_head.lower()
    assert json.loads(answer_body)["error"]["code"] == "request_timeout"
    assert closed_after_s < len(body) * 0.25 / 2  # cut near the 1 s deadline, not at the end
    assert steps_of(sqlite_pool, "dripped") == []


def test_a_client_that_leaves_a_stream_keeps_its_partial_step_either_way(
    vllm: VLLMServer, sqlite_pool: PoolSettings, layers: dict[str, str]
) -> None:
    body = {**REQUEST, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with layered_gateway(vllm, sqlite_pool, layers) as gateway:
        with httpx.stream(
            "POST", f"{gateway.url}/t/left/v1/chat/completions", json=body, timeout=60
        ) as response:
            seen = 0
            for line in response.iter_lines():
                seen += line.startswith("data: {")
                if seen >= 4:
                    break  # leaving the block closes the connection mid-stream
        deadline = time.monotonic() + 30
        steps = steps_of(sqlite_pool, "left")
        while not steps and time.monotonic() < deadline:
            time.sleep(0.2)
            steps = steps_of(sqlite_pool, "left")
    (step,) = steps
    assert step.outcome == "client_disconnect"
    assert "aborted" in step.flags
    assert step.response_token_ids is not None and 0 < len(step.response_token_ids) < 1500


@pytest.mark.parametrize(
    ("name", "value"), [("upstream_transport", "h2"), ("http_protocol", "asyncio")]
)
def test_an_unknown_layer_is_refused_naming_the_valid_values(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=name) as refused:
        GatewaySettings(**{name: value})
    valid = {"upstream_transport": ("own", "httpx"), "http_protocol": ("own", "httptools", "h11")}
    assert all(f"'{option}'" in str(refused.value) for option in valid[name])
