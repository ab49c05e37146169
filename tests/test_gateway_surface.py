"""The OpenAI surface as a client sees it: streaming transparency, completions, n > 1,
attribution, keys, policy versions, replicas, metrics and limits."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest
from gateway_helpers import gateway_with, sse_chunks, steps_of
from openai import AsyncOpenAI, OpenAI
from tests_support import free_port

from datapool.db import make_engine
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings
from trajgate.bench.emulator import EmulatorSettings, EmulatorThread
from trajgate.vllm_server import VLLMServer

CHAT: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Count to three."}],
    "max_tokens": 8,
    "temperature": 0,
    "seed": 11,
}
CAPTURE_FIELDS = {"return_token_ids": True, "logprobs": True}


def _post(url: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(url, json=body, timeout=120, **kwargs)


def _direct_ids(vllm: VLLMServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    extra = {"return_token_ids": True, "logprobs": True if "messages" in body else 1}
    response: dict[str, Any] = _post(f"{vllm.url}{path}", {**body, **extra}).json()
    return response


def _trajectory(pool_settings: PoolSettings, trajectory_id: str) -> Any:
    engine = make_engine(pool_settings.resolved_database_url())
    try:
        return PoolStore(engine, pool_settings).get_trajectory(trajectory_id)
    finally:
        engine.dispose()


# -- streaming transparency --------------------------------------------------------------


def test_stream_hides_what_the_client_did_not_ask_and_stores_the_exact_ids(
    vllm: VLLMServer, gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    body = {**CHAT, "stream": True}
    response = _post(f"{gateway.url}/t/st-1/v1/chat/completions", body)
    chunks = sse_chunks(response.text)
    assert response.text.endswith("data: [DONE]\n\n")
    for chunk in chunks:
        assert chunk.get("prompt_token_ids") is None
        assert "usage" not in chunk  # the gateway's own usage chunk is dropped
        for choice in chunk["choices"]:
            assert choice.get("token_ids") is None and choice["logprobs"] is None
    terminal = chunks[-1]
    assert terminal["choices"][0]["finish_reason"] == "length"
    assert terminal["system_fingerprint"].startswith("vllm-")  # stamped back, as vLLM would
    direct = _direct_ids(vllm, "/v1/chat/completions", CHAT)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == direct["choices"][0]["message"]["content"]
    (step,) = steps_of(pool_settings, "st-1")
    assert response.headers["x-trajgate-step-id"] == step.id  # named before the first token
    assert step.prompt_token_ids == direct["prompt_token_ids"]
    assert step.response_token_ids == direct["choices"][0]["token_ids"]
    assert step.response_logprobs == [
        e["logprob"] for e in direct["choices"][0]["logprobs"]["content"]
    ]
    assert step.ttft_ms is not None and 0 < step.ttft_ms <= step.latency_ms


def test_stream_with_usage_asked_ends_with_vllms_usage_chunk(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    chunks = sse_chunks(_post(f"{gateway.url}/t/st-2/v1/chat/completions", body).text)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert "system_fingerprint" not in chunks[-2]  # vLLM moves it to the usage chunk
    (step,) = steps_of(pool_settings, "st-2")
    assert len(step.response_token_ids) == chunks[-1]["usage"]["completion_tokens"]


def test_async_openai_client_streams_through_the_gateway(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    async def stream_text() -> str:
        client = AsyncOpenAI(base_url=f"{gateway.url}/t/st-3/v1", api_key="unused")
        stream = await client.chat.completions.create(**{**CHAT, "stream": True})
        return "".join([chunk.choices[0].delta.content or "" async for chunk in stream])

    text = asyncio.run(stream_text())
    (step,) = steps_of(pool_settings, "st-3")
    assert step.response_message["content"] == text
    assert len(step.response_token_ids) == 8


# -- completions, n > 1, thinking ----------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_completions_store_the_engines_ids(
    vllm: VLLMServer, gateway: BackgroundServer, pool_settings: PoolSettings, stream: bool
) -> None:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    client = OpenAI(base_url=f"{gateway.url}/t/cmp-{stream}/v1", api_key="unused")
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True))
    else:
        text = client.completions.create(**body).choices[0].text
    direct = _direct_ids(vllm, "/v1/completions", body)["choices"][0]
    (step,) = steps_of(pool_settings, f"cmp-{stream}")
    assert step.endpoint == "completions"
    assert step.prompt_token_ids == direct["prompt_token_ids"]
    assert step.response_token_ids == direct["token_ids"]
    assert step.response_logprobs == direct["logprobs"]["token_logprobs"]
    assert step.response_message == {"text": text}


def test_completions_hide_ids_and_logprobs_the_client_did_not_ask_for(
    gateway: BackgroundServer,
) -> None:
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 3}
    choice = _post(f"{gateway.url}/t/cmp-hide/v1/completions", body).json()["choices"][0]
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None
    assert choice["logprobs"] is None


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_become_sibling_steps_sharing_the_prompt(
    gateway: BackgroundServer, pool_settings: PoolSettings, stream: bool
) -> None:
    body = {**CHAT, "n": 2, "temperature": 1.0, "stream": stream}
    response = _post(f"{gateway.url}/t/n2-{stream}/v1/chat/completions", body)
    assert response.status_code == 200
    steps = steps_of(pool_settings, f"n2-{stream}")
    assert [(s.step_index, s.choice_index) for s in steps] == [(0, 0), (0, 1)]
    assert steps[0].prompt_token_ids == steps[1].prompt_token_ids
    assert response.headers["x-trajgate-step-id"].split(",") == [s.id for s in steps]
    for step in steps:
        assert len(step.response_token_ids) == len(step.response_logprobs) == 8


def test_thinking_off_is_recorded_and_its_prompt_is_the_templates(
    vllm: VLLMServer, gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    assert _post(f"{gateway.url}/t/think/v1/chat/completions", {**CHAT, **kwargs}).is_success
    rendered = _post(
        f"{vllm.url}/tokenize", {"model": "tiny", "messages": CHAT["messages"], **kwargs}
    ).json()["tokens"]
    with_thinking = _post(
        f"{vllm.url}/tokenize", {"model": "tiny", "messages": CHAT["messages"]}
    ).json()["tokens"]
    (step,) = steps_of(pool_settings, "think")
    assert step.prompt_token_ids == rendered != with_thinking
    assert "thinking_off" in step.flags


# -- attribution, keys, limits -------------------------------------------------------------


def test_header_attribution_sets_trajectory_group_and_channel(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    headers = {
        "X-Trajgate-Trajectory": "hdr-1",
        "X-Trajgate-Group": "task-7",
        "X-Trajgate-Channel": "val",
    }
    response = _post(f"{gateway.url}/v1/chat/completions", CHAT, headers=headers)
    assert response.headers["x-trajgate-trajectory-id"] == "hdr-1"
    trajectory = _trajectory(pool_settings, "hdr-1")
    assert (trajectory.group_id, trajectory.channel) == ("task-7", "val")
    anonymous = _post(f"{gateway.url}/v1/chat/completions", CHAT)
    assert anonymous.headers["x-trajgate-trajectory-id"].startswith("anon-")


def test_api_keys_are_required_bound_and_revocable(
    vllm: VLLMServer, pool_settings: PoolSettings
) -> None:
    with gateway_with(
        pool_settings,
        free_port(),
        upstream_url=vllm.url,
        admin_token="s3cret",
        require_api_key=True,
    ) as gw:
        admin = {"Authorization": "Bearer s3cret"}
        assert _post(f"{gw.url}/admin/api-keys", {"name": "a"}).status_code == 401
        issued = _post(
            f"{gw.url}/admin/api-keys", {"name": "agent-1", "trajectory_id": "keyed"}, headers=admin
        ).json()
        key = {"Authorization": f"Bearer {issued['key']}"}
        missing = _post(f"{gw.url}/v1/chat/completions", CHAT)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
        ok = _post(f"{gw.url}/v1/chat/completions", CHAT, headers=key)
        assert ok.headers["x-trajgate-trajectory-id"] == "keyed"
        other = _post(f"{gw.url}/t/someone-else/v1/chat/completions", CHAT, headers=key)
        assert other.status_code == 403
        listed = httpx.get(f"{gw.url}/admin/api-keys", headers=admin).json()
        assert [k["name"] for k in listed] == ["agent-1"] and "key" not in listed[0]
        revoked = httpx.delete(f"{gw.url}/admin/api-keys/{issued['id']}", headers=admin)
        assert revoked.status_code == 204
        assert _post(f"{gw.url}/v1/chat/completions", CHAT, headers=key).status_code == 401
    assert len(steps_of(pool_settings, "keyed")) == 1
    assert steps_of(pool_settings, "someone-else") == []


def test_binding_beyond_loopback_without_an_admin_token_is_refused() -> None:
    with pytest.raises(ValueError, match="requires TRAJGATE_ADMIN_TOKEN"):
        GatewaySettings(host="0.0.0.0")
    exposed = GatewaySettings(host="0.0.0.0", admin_token="Zq8-rT2vXw_LmN4pKc7yHb1sUe5o")
    assert exposed.api_key_required and not GatewaySettings().api_key_required


def test_oversize_body_is_413_and_writes_nothing(pool_settings: PoolSettings) -> None:
    with gateway_with(pool_settings, free_port(), max_body_bytes=1000) as gw:
        body = {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}
        response = _post(f"{gw.url}/t/big/v1/chat/completions", body)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "payload_too_large"
    assert steps_of(pool_settings, "big") == []


# -- policy versions -----------------------------------------------------------------------


def test_policy_alias_follows_the_active_version_and_steps_carry_it(
    vllm: VLLMServer, gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    url = f"{gateway.url}/t/pol/v1/chat/completions"
    unregistered = _post(url, {**CHAT, "model": "policy"})
    assert unregistered.status_code == 400 and "no policy version" in unregistered.text
    assert (
        _post(
            f"{gateway.url}/admin/policy-versions", {"version": 3, "model_name": "tiny"}
        ).status_code
        == 201
    )
    first = _post(url, {**CHAT, "model": "policy"})
    assert first.headers["x-trajgate-policy-version"] == "3"
    assert (
        _post(
            f"{gateway.url}/admin/policy-versions",
            {"version": 4, "model_name": "tiny", "activate": True},
        ).status_code
        == 201
    )
    second = _post(url, {**CHAT, "model": "policy"})
    assert second.headers["x-trajgate-policy-version"] == "4"
    steps = steps_of(pool_settings, "pol")
    assert [
        (s.policy_version, s.upstream_request["model"]) for s in steps if s.outcome == "ok"
    ] == [(3, "tiny"), (4, "tiny")]
    assert steps[1].request["model"] == "policy"  # what the agent sent is kept as sent
    versions = httpx.get(f"{gateway.url}/admin/policy-versions").json()
    assert [(v["version"], v["active"]) for v in versions] == [(3, False), (4, True)]


def test_registering_a_version_of_a_model_vllm_does_not_serve_is_400_naming_the_served_ones(
    vllm: VLLMServer, gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    """A version whose model_name no replica lists was registered, and every call for the
    alias then failed in vLLM; it is refused up front, naming what vLLM serves. A gateway
    whose replicas do not answer cannot tell, and registers (a trainer may register before
    the gateway's replica is up)."""
    refused = _post(
        f"{gateway.url}/admin/policy-versions", {"version": 5, "model_name": "not-served"}
    )
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "model_name",
        "model_not_served",
    )
    assert "'not-served' is not served" in error["message"]
    assert repr(vllm.served_model_name) in error["message"]  # e.g. "the replicas serve ['tiny']"
    assert httpx.get(f"{gateway.url}/admin/policy-versions").json() == []
    with gateway_with(
        pool_settings, free_port(), upstream_url=f"http://127.0.0.1:{free_port()}"
    ) as gw:
        unknown = _post(f"{gw.url}/admin/policy-versions", {"version": 5, "model_name": "any"})
        assert unknown.status_code == 201, unknown.text


def test_a_call_in_flight_finishes_on_the_version_it_started_with(
    pool_settings: PoolSettings,
) -> None:
    emulator = EmulatorThread(
        EmulatorSettings(
            port=free_port(),
            model="policy-a",
            also_serves=["policy-b"],
            prompt_tokens=4,
            response_tokens=10,
            inter_token_ms=100,
        )
    ).start()
    try:
        with gateway_with(pool_settings, free_port(), upstream_url=emulator.url) as gw:
            admin = f"{gw.url}/admin/policy-versions"
            _post(admin, {"version": 1, "model_name": "policy-a"})
            body = {
                "model": "policy",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
            }
            with httpx.stream(
                "POST", f"{gw.url}/t/inflight/v1/chat/completions", json=body, timeout=30
            ) as response:
                lines = response.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                _post(admin, {"version": 2, "model_name": "policy-b"})  # switch mid-stream
                assert response.headers["x-trajgate-policy-version"] == "1"
                for _ in lines:
                    pass
            after = _post(f"{gw.url}/t/inflight/v1/chat/completions", {**body, "stream": False})
            assert after.headers["x-trajgate-policy-version"] == "2"
    finally:
        emulator.stop()
    steps = steps_of(pool_settings, "inflight")
    assert [(s.policy_version, s.upstream_request["model"]) for s in steps] == [
        (1, "policy-a"),
        (2, "policy-b"),
    ]


# -- replicas --------------------------------------------------------------------------------


def test_replicas_are_sticky_per_trajectory_and_a_killed_one_is_routed_around(
    pool_settings: PoolSettings,
) -> None:
    # The victim is its own process so that kill -9 drops its connections, as a dead vLLM does.
    victim_port = free_port()
    victim = subprocess.Popen(
        [sys.executable, "-m", "trajgate.bench.emulator"],
        env={
            **os.environ,
            "TRAJGATE_EMULATOR_PORT": str(victim_port),
            "TRAJGATE_EMULATOR_PROMPT_TOKENS": "4",
            "TRAJGATE_EMULATOR_RESPONSE_TOKENS": "3",
        },
    )
    survivor = EmulatorThread(
        EmulatorSettings(port=free_port(), prompt_tokens=4, response_tokens=3)
    ).start()
    victim_url = f"http://127.0.0.1:{victim_port}"
    body = {"model": "emulated", "messages": [{"role": "user", "content": "hi"}]}
    # Rendezvous hashing over URLs with random ports: each trajectory lands on either replica
    # with chance 1/2, so 6 trajectories all landed on one replica 1 run in 32 (seen in CI);
    # with 20 it is 2 * 2**-20, about 1 in 500,000.
    trajectories = [f"r-{i}" for i in range(20)]
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{victim_url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        with gateway_with(
            pool_settings,
            free_port(),
            upstream_url=f"{victim_url},{survivor.url}",
            upstream_retry_backoff_ms=1,
        ) as gw:
            for trajectory in trajectories:
                for _ in range(3):
                    assert _post(f"{gw.url}/t/{trajectory}/v1/chat/completions", body).is_success
            used = {t: {s.upstream for s in steps_of(pool_settings, t)} for t in trajectories}
            assert all(len(urls) == 1 for urls in used.values())  # sticky
            assert {url for urls in used.values() for url in urls} == {victim_url, survivor.url}
            victim.kill()
            victim.wait()
            for trajectory in trajectories:
                response = _post(f"{gw.url}/t/{trajectory}/v1/chat/completions", body)
                assert response.status_code == 200  # retried on the live replica
            assert httpx.get(f"{gw.url}/ready").json()["ready"] is True
    finally:
        victim.kill()
        survivor.stop()
    last = [steps_of(pool_settings, t)[-1] for t in trajectories]
    assert {step.upstream for step in last} == {survivor.url}


def test_ready_is_503_when_no_replica_is_healthy(pool_settings: PoolSettings) -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(500))
    with gateway_with(
        pool_settings, free_port(), transport=transport, health_check_interval_s=0.05
    ) as gw:
        deadline = time.monotonic() + 10
        status = 200
        while status == 200 and time.monotonic() < deadline:
            status = httpx.get(f"{gw.url}/ready").status_code
            time.sleep(0.05)
    assert status == 503


# -- metrics ---------------------------------------------------------------------------------


def test_metrics_count_requests_steps_tokens_and_flags(gateway: BackgroundServer) -> None:
    _post(f"{gateway.url}/t/met/v1/chat/completions", CHAT)
    text = httpx.get(f"{gateway.url}/metrics").text
    assert 'trajgate_requests_total{endpoint="chat.completions",status="200"} 1.0' in text
    assert "trajgate_steps_written_total 1.0" in text
    assert 'trajgate_tokens_total{direction="completion"} 8.0' in text
    assert 'trajgate_step_flags_total{flag="truncated"} 1.0' in text
    assert "trajgate_upstream_healthy{" in text
    assert "trajgate_write_queue_depth" in text


def test_an_upstream_that_returns_no_token_ids_is_refused_at_start(
    pool_settings: PoolSettings,
) -> None:
    # Mock upstream: an old server (or a rebuilding proxy) that ignores return_token_ids (C06).
    def old_server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
        if request.url.path == "/v1/completions":
            return httpx.Response(200, json={"choices": [{"index": 0, "text": "a"}]})
        return httpx.Response(200, json={})

    with gateway_with(
        pool_settings,
        free_port(),
        transport=httpx.MockTransport(old_server),
        health_check_interval_s=0.05,
    ) as gw:
        deadline = time.monotonic() + 10
        response = _post(f"{gw.url}/t/old/v1/chat/completions", CHAT)
        while response.status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
            response = _post(f"{gw.url}/t/old/v1/chat/completions", CHAT)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_capturing_upstream"
    assert "token ids" in response.json()["error"]["message"]


def test_the_real_vllm_passes_the_token_id_probe(gateway: BackgroundServer) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        replicas = gateway.app.state.gateway.upstreams.replicas
        if replicas[0].returns_token_ids is not None:
            break
        time.sleep(0.1)
    assert replicas[0].returns_token_ids is True


def test_the_pool_api_needs_the_admin_token_when_one_is_set(pool_settings: PoolSettings) -> None:
    with gateway_with(pool_settings, free_port(), admin_token="s3cret") as gw:
        assert httpx.get(f"{gw.url}/api/trajectories").status_code == 401
        assert httpx.post(f"{gw.url}/api/batches/lease", json={"consumer": "x"}).status_code == 401
        ok = httpx.get(f"{gw.url}/api/trajectories", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


def test_the_exact_probe_gauge_reads_unknown_then_what_the_probe_learnt() -> None:
    from gateway.metrics import GatewayMetrics
    from gateway.upstream.replicas import UpstreamPool

    upstreams = UpstreamPool(["http://a:1", "http://b:2"])
    metrics = GatewayMetrics(upstreams, lambda: 0.0)

    def gauge() -> dict[str, str]:
        lines = metrics.render().decode().splitlines()
        prefix = "trajgate_upstream_exact_continuation{"
        return {
            line.split('"')[1]: line.rsplit(" ", 1)[1] for line in lines if line.startswith(prefix)
        }

    assert gauge() == {"http://a:1": "-1.0", "http://b:2": "-1.0"}  # probes not ended
    upstreams.replicas[0].serves_exact, upstreams.replicas[1].serves_exact = True, False
    assert gauge() == {"http://a:1": "1.0", "http://b:2": "0.0"}
