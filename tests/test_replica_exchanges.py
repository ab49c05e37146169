"""Exchanges with a replica that never end: each has one overall deadline and a stated outcome
(DESIGN.md invariant 11), not only a per-read timeout that a peer trickling a byte every 0.1 s
beats forever.

- A full-weight update's ``/pause`` that trickles: the publish fails within its exchange
  deadline (502), the gate opens, calls go on under the active version.
- A ``/resume`` that fails: the version is active (201, the replica named in
  ``unresumed_replicas``), the replica is unhealthy (``/ready`` 503) and routed no call until
  a resume, retried at each health check, succeeds.
- An exact-continuation probe that trickles: it runs outside the health round, which goes on,
  and a call extending a turn waits for it only briefly, then uses the template.

Fakes at the edge we do not own: the real vLLM cannot be made to trickle or to fail its
``/resume``, so the replica is the project's emulator (``EmulatorThread.fail``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
from gateway_helpers import gateway_with, steps_of
from tests_support import free_port

from datapool.settings import PoolSettings
from trajgate.bench.emulator import EmulatorSettings, EmulatorThread
from trajgate.bench.scale_out import RENDER_PATH
from trajgate.bench.weight_endpoints import (
    LABEL_PATH,
    PAUSE_PATH,
    RELOAD_PATH,
    RESET_PATH,
    RESUME_PATH,
)

MODEL = "emulated"
PROMPT = [{"role": "user", "content": "hi"}]


@contextmanager
def replica_behind_gateway(
    pool: PoolSettings, faults: dict[str, Any], **gateway: Any
) -> Iterator[tuple[EmulatorThread, httpx.Client]]:
    """One emulated replica failing as ``faults`` say (path -> fault, set before the gateway
    starts) behind a gateway with ``gateway`` settings, version 1 active."""
    with ExitStack() as stack:
        settings = EmulatorSettings(port=free_port(), prompt_ids="messages", response_tokens=3)
        engine = EmulatorThread(settings).start()
        stack.callback(engine.stop)
        for path, fault in faults.items():
            engine.fail(path, fault)
        server = stack.enter_context(
            gateway_with(pool, free_port(), upstream_url=engine.url, **gateway)
        )
        # Bounded: the old code hung here for ever on the trickling replica.
        api = stack.enter_context(httpx.Client(base_url=server.url, timeout=30))
        registered = api.post("/admin/policy-versions", json={"version": 1, "model_name": MODEL})
        assert registered.status_code == 201, registered.text
        yield engine, api


def _publish(api: httpx.Client, version: int) -> httpx.Response:
    body = {"version": version, "model_name": MODEL, "weights_location": f"/ckpt/v{version}"}
    return api.post("/admin/weight-updates", json={**body, "mode": "keep"})


def _chat(api: httpx.Client, trajectory: str, messages: list[Any] = PROMPT) -> httpx.Response:
    body = {"model": "policy", "messages": messages, "max_tokens": 3}
    return api.post(f"/t/{trajectory}/v1/chat/completions", json=body)


def _wait_until_ready_is(api: httpx.Client, status: int) -> None:
    """Poll ``/ready`` until it answers ``status`` (a wait for the health loop, no timing
    asserted: 30 s is only there to end a broken run)."""
    deadline = time.monotonic() + 30
    while api.get("/ready").status_code != status:
        assert time.monotonic() < deadline, f"/ready never answered {status}"
        time.sleep(0.05)


def test_a_pause_that_trickles_fails_the_publish_at_its_deadline_and_calls_go_on(
    sqlite_pool: PoolSettings,
) -> None:
    faults = {PAUSE_PATH: "trickle"}
    with replica_behind_gateway(sqlite_pool, faults, weight_update_exchange_timeout_s=0.5) as (
        engine,
        api,
    ):
        failed = _publish(api, 2)
        assert failed.status_code == 502, failed.text
        error = failed.json()["error"]
        assert error["code"] == "weight_update_failed"
        assert "no whole answer to /pause?mode=keep within 0.5 s" in error["message"]
        assert "replicas that accepted the reload: none" in error["message"]
        assert engine.book.weights.asked == [PAUSE_PATH, RESUME_PATH]  # nothing reloaded
        served = _chat(api, "after-pause")
        assert served.status_code == 200, served.text
        assert served.headers["x-trajgate-policy-version"] == "1"


def test_a_replica_whose_resume_fails_is_routed_nothing_until_a_retried_resume_succeeds(
    sqlite_pool: PoolSettings,
) -> None:
    faults = {RESUME_PATH: 500}
    with replica_behind_gateway(sqlite_pool, faults, health_check_interval_s=0.1) as (
        engine,
        api,
    ):
        _wait_until_ready_is(api, 200)
        published = _publish(api, 2)
        # Reloaded, labelled and registered: the version is active, and the answer says so.
        assert published.status_code == 201, published.text
        assert published.json()["unresumed_replicas"] == [engine.url]
        asked = engine.book.weights.asked
        assert asked[:4] == [PAUSE_PATH, RELOAD_PATH, RESET_PATH, LABEL_PATH]
        assert asked[4:7] == [RESUME_PATH] * 3  # tried three times
        assert api.get("/ready").status_code == 503
        refused = _chat(api, "while-paused")
        assert refused.status_code == 503, refused.text
        assert "paused" in refused.json()["error"]["message"]
        assert steps_of(sqlite_pool, "while-paused") == []

        engine.fail(RESUME_PATH, None)  # the health checks' retry now succeeds
        _wait_until_ready_is(api, 200)
        served = _chat(api, "resumed")
        assert served.status_code == 200, served.text
        assert served.headers["x-trajgate-policy-version"] == "2"


def test_a_trickling_exact_probe_holds_neither_the_health_checks_nor_a_call_extending_a_turn(
    sqlite_pool: PoolSettings,
) -> None:
    faults = {RENDER_PATH: "trickle"}  # the probe's first exchange
    settings = {"health_check_interval_s": 0.1, "upstream_connect_timeout_s": 1.0}
    with replica_behind_gateway(sqlite_pool, faults, **settings) as (engine, api):
        first = _chat(api, "probe")
        assert first.status_code == 200, first.text
        said = first.json()["choices"][0]["message"]["content"]
        history = [
            *PROMPT,
            {"role": "assistant", "content": said},
            {"role": "user", "content": "?"},
        ]
        second = _chat(api, "probe", history)
        assert second.status_code == 200, second.text
        _, step = steps_of(sqlite_pool, "probe")
        assert step.continuation == "template"  # the probe is unknown yet
        # The health round goes on while the probe trickles: a failing /health is seen.
        engine.fail("/health", 500)
        _wait_until_ready_is(api, 503)
