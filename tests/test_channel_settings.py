"""Per-channel settings follow the trajectory's channel, not the call's header, through a real
gateway in front of the real vLLM: a trajectory registered in a channel through the pool API
(or created in one by a call's ``X-Trajgate-Channel``) gets that channel's continuation,
sampling policy and sampling defaults on calls that name no channel; a header naming another
channel for an existing trajectory is refused with 403, as a channel-bound key is, and nothing
is recorded."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from gateway_helpers import gateway_with, steps_of
from tests_support import free_port

from datapool.settings import PoolSettings
from gateway.server import BackgroundServer
from trajgate.vllm_server import VLLMServer

USER = {"role": "user", "content": "What is the weather in Paris?"}
LATER = {"role": "user", "content": "And tomorrow?"}


@pytest.fixture
def server(vllm: VLLMServer, sqlite_pool: PoolSettings) -> Iterator[BackgroundServer]:
    with gateway_with(
        sqlite_pool,
        free_port(),
        upstream_url=vllm.url,
        continuation_channels={"eval": "template"},  # every other channel: exact (the default)
        sampling_policy={"eval": "refuse"},  # every other channel: flag
        sampling_defaults={"greedy": {"temperature": 0}},
    ) as gateway:
        yield gateway


def _call(
    server: BackgroundServer, trajectory: str, channel: str | None = None, **body: Any
) -> httpx.Response:
    headers = {"X-Trajgate-Channel": channel} if channel else {}
    return httpx.post(
        f"{server.url}/t/{trajectory}/v1/chat/completions",
        json={"model": "tiny", "messages": [USER], "max_tokens": 4, **body},
        headers=headers,
        timeout=120,
    )


def _two_turns(server: BackgroundServer, trajectory: str) -> None:
    first = _call(server, trajectory)
    assert first.status_code == 200, first.text
    answer = first.json()["choices"][0]["message"]["content"]
    messages = [USER, {"role": "assistant", "content": answer}, LATER]
    second = _call(server, trajectory, messages=messages)
    assert second.status_code == 200, second.text


def _register(server: BackgroundServer, trajectory: str, channel: str) -> None:
    created = httpx.post(
        f"{server.url}/api/trajectories", json={"id": trajectory, "channel": channel}, timeout=30
    )
    assert created.status_code == 201, created.text


def test_a_registered_trajectory_gets_its_channels_continuation_and_policy_without_a_header(
    server: BackgroundServer, sqlite_pool: PoolSettings
) -> None:
    _register(server, "evr", "eval")
    _two_turns(server, "evr")
    _two_turns(server, "trr")  # control: a new trajectory in train continues exactly
    assert [s.continuation for s in steps_of(sqlite_pool, "trr")] == ["template", "exact"]
    assert [s.continuation for s in steps_of(sqlite_pool, "evr")] == ["template", "template"]
    refused = _call(server, "evr", top_p=0.5)  # eval refuses what narrows the distribution
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "sampling_refused"
    assert _call(server, "trr", top_p=0.5).status_code == 200  # train flags it


def test_a_trajectory_gets_its_channels_sampling_defaults_on_calls_without_a_header(
    server: BackgroundServer, sqlite_pool: PoolSettings
) -> None:
    _register(server, "greedy-api", "greedy")
    assert _call(server, "greedy-api").status_code == 200
    # created in greedy by its first call's header, then called without it
    assert _call(server, "greedy-header", "greedy").status_code == 200
    assert _call(server, "greedy-header").status_code == 200
    for trajectory, calls in (("greedy-api", 1), ("greedy-header", 2)):
        steps = steps_of(sqlite_pool, trajectory)
        assert [s.upstream_request.get("temperature") for s in steps] == [0] * calls
    assert _call(server, "train-plain").status_code == 200
    [plain] = steps_of(sqlite_pool, "train-plain")
    assert "temperature" not in plain.upstream_request  # train has no defaults: vLLM's own


def test_a_header_naming_another_channel_for_an_existing_trajectory_is_refused(
    server: BackgroundServer, sqlite_pool: PoolSettings
) -> None:
    _register(server, "evr-2", "eval")
    refused = _call(server, "evr-2", "train")
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert error["code"] == "channel_mismatch"
    assert "'train'" in error["message"] and "is in channel 'eval'" in error["message"]
    assert steps_of(sqlite_pool, "evr-2") == []
    assert _call(server, "evr-2", "eval").status_code == 200  # its own channel named: served


def test_concurrent_first_calls_of_a_new_trajectory_settle_on_one_channel(
    server: BackgroundServer, sqlite_pool: PoolSettings
) -> None:
    """Eight first calls at once, half naming channel greedy and half none (train): the
    trajectory is created by the first to reach the pool, every call served gets that channel's
    settings, and a call naming the other channel is refused 403 (each used to be served under
    the channel it named, both kinds recorded in one trajectory)."""
    start = threading.Barrier(8)

    def first_call(i: int) -> httpx.Response:
        start.wait()
        return _call(server, "race", "greedy" if i % 2 else None)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(first_call, range(8)))
    channel = httpx.get(f"{server.url}/api/trajectories/race", timeout=30).json()["channel"]
    assert channel in ("greedy", "train")
    for i, answer in enumerate(answers):
        named = "greedy" if i % 2 else None
        if named is not None and named != channel:
            assert answer.status_code == 403, answer.text
            assert answer.json()["error"]["code"] == "channel_mismatch"
        else:
            assert answer.status_code == 200, answer.text
    steps = steps_of(sqlite_pool, "race")
    assert len(steps) == sum(a.status_code == 200 for a in answers) >= 4
    # every recorded call got the stored channel's defaults: greedy's temperature 0, else none
    expected = 0 if channel == "greedy" else None
    assert [s.upstream_request.get("temperature") for s in steps] == [expected] * len(steps)
