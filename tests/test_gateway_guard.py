"""What the gateway refuses before any route runs (``gateway.guard``) and who may write where:
cross-site browser writes, foreign Host names, non-JSON bodies, oversized or unauthenticated
bodies, channel-bound keys outside their channel, weak admin tokens, and the bounded key cache."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psycopg
import pytest
from gateway_helpers import gateway_with, steps_of
from sqlalchemy.engine import make_url
from tests_support import free_port

from datapool import db
from datapool.db import make_engine
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore
from gateway.auth import KeyRing
from gateway.errors import AuthenticationError
from gateway.settings import GatewaySettings
from trajgate.vllm_server import VLLMServer

CHAT: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Count to three."}],
    "max_tokens": 4,
    "temperature": 0,
}
MESSAGES: dict[str, Any] = {
    "model": "tiny",
    "max_tokens": 4,
    "messages": [{"role": "user", "content": "Count to three."}],
}
EVIL = {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}
FORM = {"Content-Type": "application/x-www-form-urlencoded"}
STRONG_TOKEN = "Zq8-rT2vXw_LmN4pKc7yHb1sUe5o"  # random-looking, fixed for stable test ids


def _raw_request(port: int, head: str, timeout_s: float = 5.0) -> bytes:
    """Send only a request's head (no body, whatever Content-Length says) and return what the
    server answers before ``timeout_s``; b"" when it waits for the body instead."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(head.encode())
        try:
            return sock.recv(65536)
        except TimeoutError:
            return b""


def _status_and_body(raw: bytes) -> tuple[int, dict[str, Any]]:
    assert raw, "no answer: the server waited for the body"
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


# -- item 10: cross-site writes, content types, host names ------------------------------------


@pytest.fixture
def loopback_gateway(vllm: VLLMServer, pool_settings: PoolSettings) -> Iterator[Any]:
    """The tokenless loopback default, in front of the real vLLM."""
    with gateway_with(pool_settings, free_port(), upstream_url=vllm.url) as gw:
        yield gw


def test_a_cross_site_page_cannot_record_a_step_switch_the_policy_or_close_a_trajectory(
    loopback_gateway: Any, pool_settings: PoolSettings
) -> None:
    url = loopback_gateway.url
    text_plain = httpx.post(
        f"{url}/t/xs-1/v1/chat/completions",
        content=json.dumps(CHAT),
        headers={"Content-Type": "text/plain;charset=UTF-8", **EVIL},
        timeout=60,
    )
    assert text_plain.status_code == 403
    assert text_plain.json()["error"]["code"] == "cross_site"
    # A JSON content type would need a preflight a browser never gets; refused all the same.
    as_json = httpx.post(f"{url}/t/xs-1/v1/chat/completions", json=CHAT, headers=EVIL)
    assert as_json.status_code == 403
    # Anthropic's dialect answers in Anthropic's envelope.
    messages = httpx.post(f"{url}/t/xs-1/v1/messages", json=MESSAGES, headers=EVIL)
    assert messages.status_code == 403
    assert messages.json()["type"] == "error"
    assert messages.json()["error"]["type"] == "permission_error"
    assert steps_of(pool_settings, "xs-1") == []

    registered = httpx.post(
        f"{url}/admin/policy-versions",
        json={"version": 1, "model_name": "tiny", "activate": False},
    )
    assert registered.status_code == 201
    switched = httpx.post(f"{url}/admin/policy-versions/1/activate", headers={**FORM, **EVIL})
    assert switched.status_code == 403
    versions = httpx.get(f"{url}/admin/policy-versions").json()
    assert [v["active"] for v in versions] == [False]

    assert httpx.post(f"{url}/api/trajectories", json={"id": "xs-2"}).status_code == 201
    closed = httpx.post(f"{url}/api/trajectories/xs-2/complete", headers={**FORM, **EVIL})
    assert closed.status_code == 403
    assert httpx.get(f"{url}/api/trajectories/xs-2").json()["status"] == "open"


def test_a_browser_request_from_another_origin_on_the_same_site_is_refused(
    loopback_gateway: Any,
) -> None:
    # Another port of localhost is the same site, not the same origin.
    refused = httpx.post(
        f"{loopback_gateway.url}/api/trajectories",
        json={"id": "xs-3"},
        headers={"Sec-Fetch-Site": "same-site"},
    )
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "cross_site"
    null_origin = httpx.post(
        f"{loopback_gateway.url}/api/trajectories", json={"id": "xs-3"}, headers={"Origin": "null"}
    )
    assert null_origin.status_code == 403


def test_a_non_json_body_is_refused_with_415_even_without_an_origin(
    loopback_gateway: Any, pool_settings: PoolSettings
) -> None:
    url = loopback_gateway.url
    plain = httpx.post(
        f"{url}/t/ct-1/v1/chat/completions",
        content=json.dumps(CHAT),
        headers={"Content-Type": "text/plain"},
        timeout=60,
    )
    assert plain.status_code == 415
    assert plain.json()["error"]["code"] == "unsupported_media_type"
    assert steps_of(pool_settings, "ct-1") == []
    assert httpx.post(f"{url}/api/trajectories", json={"id": "ct-2"}).status_code == 201
    form = httpx.post(f"{url}/api/trajectories/ct-2/complete", headers=FORM)
    assert form.status_code == 415
    assert httpx.get(f"{url}/api/trajectories/ct-2").json()["status"] == "open"


def test_same_origin_writes_and_bodiless_writes_still_work(
    loopback_gateway: Any, pool_settings: PoolSettings
) -> None:
    """The inspector's own requests (same origin, JSON) and clients that send no body."""
    url = loopback_gateway.url
    same_origin = {"Origin": url, "Sec-Fetch-Site": "same-origin"}
    created = httpx.post(f"{url}/api/trajectories", json={"id": "so-1"}, headers=same_origin)
    assert created.status_code == 201
    call = httpx.post(
        f"{url}/t/so-1/v1/chat/completions",
        json=CHAT,
        headers={"Content-Type": "application/json; charset=utf-8", **same_origin},
        timeout=60,
    )
    assert call.status_code == 200
    assert len(steps_of(pool_settings, "so-1")) == 1
    # A user typing the URL is not a cross-site request.
    typed = httpx.post(f"{url}/api/trajectories/so-1/complete", headers={"Sec-Fetch-Site": "none"})
    assert typed.status_code == 200 and typed.json()["status"] == "complete"


def test_only_configured_host_names_are_answered(loopback_gateway: Any) -> None:
    url = loopback_gateway.url
    port = url.rsplit(":", 1)[1]
    rebound = httpx.get(f"{url}/api/trajectories", headers={"Host": f"attacker.example:{port}"})
    assert rebound.status_code == 400
    assert rebound.json()["error"]["code"] == "host_not_allowed"
    for name in ("127.0.0.1", "localhost", "LOCALHOST."):
        assert (
            httpx.get(f"{url}/api/trajectories", headers={"Host": f"{name}:{port}"}).status_code
            == 200
        )


def test_allowed_hosts_setting_names_the_host_names(pool_settings: PoolSettings) -> None:
    with gateway_with(pool_settings, free_port(), allowed_hosts="gw.internal") as gw:
        assert httpx.get(f"{gw.url}/health", headers={"Host": "gw.internal"}).status_code == 200
        assert httpx.get(f"{gw.url}/health", headers={"Host": "other.internal"}).status_code == 400
        assert httpx.get(f"{gw.url}/health").status_code == 200  # loopback names stay
    assert GatewaySettings(allowed_hosts="a.example, b.example").allowed_hosts == [
        "a.example",
        "b.example",
    ]


# -- item 7: the body limit on every route, the admin token before the body -------------------


def test_an_unauthenticated_body_is_refused_before_it_is_read(pool_settings: PoolSettings) -> None:
    port = free_port()
    with gateway_with(pool_settings, port, admin_token=STRONG_TOKEN, max_body_bytes=1000):
        # Content-Length promises 1 GB that never comes: the answer must not wait for it.
        for path in ("/api/rewards", "/admin/api-keys"):
            raw = _raw_request(
                port,
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                "Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n",
            )
            status, body = _status_and_body(raw)
            assert (status, body["error"]["code"]) == (401, "invalid_admin_token"), path
        # With the token, the declared size alone is refused.
        raw = _raw_request(
            port,
            f"POST /api/rewards HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {STRONG_TOKEN}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n",
        )
        status, body = _status_and_body(raw)
        assert (status, body["error"]["code"]) == (413, "payload_too_large")


def test_a_model_call_without_its_api_key_is_refused_before_its_body_is_read(
    pool_settings: PoolSettings,
) -> None:
    port = free_port()
    with gateway_with(pool_settings, port, require_api_key=True):
        for path in ("/v1/chat/completions", "/t/nokey/v1/messages"):
            raw = _raw_request(
                port,
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                "Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n",
            )
            status, body = _status_and_body(raw)
            assert status == 401, path
            assert "API key" in body["error"]["message"]


def test_a_body_without_a_length_is_cut_at_the_limit_on_pool_and_admin_routes(
    pool_settings: PoolSettings,
) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: sent chunked
        yield b'{"name": "'
        yield b"x" * 2000
        yield b'"}'

    with gateway_with(pool_settings, free_port(), max_body_bytes=1000) as gw:
        for path in ("/admin/api-keys", "/api/trajectories"):
            response = httpx.post(
                f"{gw.url}{path}",
                content=chunks(),
                headers={"Content-Type": "application/json"},
            )
            assert response.status_code == 413, path
            assert response.json()["error"]["code"] == "payload_too_large"
        assert httpx.get(f"{gw.url}/admin/api-keys").json() == []


# -- item 9: a channel-bound key stays in its channel -----------------------------------------


def test_a_channel_bound_key_cannot_write_into_another_channels_trajectory(
    loopback_gateway: Any, pool_settings: PoolSettings
) -> None:
    url = loopback_gateway.url
    issued = httpx.post(f"{url}/admin/api-keys", json={"name": "evaluator", "channel": "eval"})
    key = issued.json()["key"]
    created = httpx.post(f"{url}/api/trajectories", json={"id": "ch-train", "channel": "train"})
    assert created.status_code == 201
    bearer = {"Authorization": f"Bearer {key}"}
    refused = httpx.post(
        f"{url}/t/ch-train/v1/chat/completions", json=CHAT, headers=bearer, timeout=60
    )
    assert refused.status_code == 403
    assert refused.json()["error"]["type"] == "permission_error"
    assert "eval" in refused.json()["error"]["message"]
    anthropic = httpx.post(
        f"{url}/t/ch-train/v1/messages", json=MESSAGES, headers={"x-api-key": key}, timeout=60
    )
    assert anthropic.status_code == 403 and anthropic.json()["type"] == "error"
    by_header = httpx.post(
        f"{url}/v1/chat/completions",
        json=CHAT,
        headers={**bearer, "X-Trajgate-Trajectory": "ch-train"},
        timeout=60,
    )
    assert by_header.status_code == 403
    assert steps_of(pool_settings, "ch-train") == []
    # Its own channel: a new trajectory (created in 'eval'), then the same one again.
    for _ in range(2):
        own = httpx.post(
            f"{url}/t/ch-eval/v1/chat/completions", json=CHAT, headers=bearer, timeout=60
        )
        assert own.status_code == 200
    assert len(steps_of(pool_settings, "ch-eval")) == 2
    assert httpx.get(f"{url}/api/trajectories/ch-eval").json()["channel"] == "eval"


def test_count_tokens_checks_a_keys_binding_as_a_call_does(loopback_gateway: Any) -> None:
    """A channel-bound key counting tokens of another channel's trajectory got
    200 on the tokenless loopback default (the route checked keys only when keys were
    required); now the call's checks: 403 in Anthropic's envelope, by URL and by header, for
    a channel-bound and a trajectory-bound key, and 200 in the key's own channel."""
    url = loopback_gateway.url
    channel_key = httpx.post(
        f"{url}/admin/api-keys", json={"name": "evaluator", "channel": "eval"}
    ).json()["key"]
    trajectory_key = httpx.post(
        f"{url}/admin/api-keys", json={"name": "one", "trajectory_id": "ct-own"}
    ).json()["key"]
    for trajectory_id, channel in (("ct-train", "train"), ("ct-eval", "eval")):
        created = httpx.post(
            f"{url}/api/trajectories", json={"id": trajectory_id, "channel": channel}
        )
        assert created.status_code == 201
    count = {"model": "tiny", "messages": MESSAGES["messages"]}
    refused = [
        httpx.post(f"{url}/t/ct-train/v1/messages/count_tokens", json=count, headers=headers)
        for headers in (
            {"x-api-key": channel_key},
            {"Authorization": f"Bearer {channel_key}"},
            {"x-api-key": trajectory_key},
        )
    ]
    refused.append(
        httpx.post(
            f"{url}/v1/messages/count_tokens",
            json=count,
            headers={"x-api-key": channel_key, "X-Trajgate-Trajectory": "ct-train"},
        )
    )
    for answer in refused:
        assert answer.status_code == 403, answer.text
        assert answer.json()["type"] == "error"
        assert answer.json()["error"]["type"] == "permission_error"
    assert "bound to channel 'eval'" in refused[0].json()["error"]["message"]
    own = httpx.post(
        f"{url}/t/ct-eval/v1/messages/count_tokens", json=count, headers={"x-api-key": channel_key}
    )
    assert own.status_code == 200, own.text
    assert own.json()["input_tokens"] > 0


# -- item 11: admin token strength beyond loopback, the bounded key cache ---------------------


@pytest.mark.parametrize(
    "token",
    [
        "a",
        "   ",
        "s3cret",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        " " + STRONG_TOKEN,
        "abc def ghi jkl mno",
    ],
)
def test_a_weak_admin_token_is_refused_beyond_loopback(token: str) -> None:
    with pytest.raises(ValueError, match="TRAJGATE_ADMIN_TOKEN is too weak"):
        GatewaySettings(host="0.0.0.0", admin_token=token)
    GatewaySettings(admin_token=token)  # loopback: the user's own machine, any token


@pytest.mark.parametrize(
    "token",
    [STRONG_TOKEN, secrets.token_hex(16), "tg-admin-" + secrets.token_urlsafe(12)],
)
def test_a_random_admin_token_is_accepted_beyond_loopback(token: str) -> None:
    assert GatewaySettings(host="0.0.0.0", admin_token=token).admin_token == token


def test_failed_key_lookups_are_cached_within_a_bound(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path / 'pool.sqlite3'}"
    db.upgrade(url)
    engine = make_engine(url)
    try:
        ring = KeyRing(
            PoolStore(engine, PoolSettings(data_dir=tmp_path / "d", database_url=url)).sessions,
            cache_max_entries=8,
        )
        _key_id, key = ring.issue("agent", None, None)
        asyncio.run(ring.verify(key))
        for _ in range(100):
            with pytest.raises(AuthenticationError):
                asyncio.run(ring.verify("tg-" + secrets.token_urlsafe(32)))
        assert ring.cached_entries == 8  # 101 distinct keys tried, 8 kept
        assert asyncio.run(ring.verify(key)).name == "agent"  # evicted, looked up again
    finally:
        engine.dispose()


@pytest.mark.parametrize("empty_database_url", ["postgresql"], indirect=True)
def test_a_key_lookup_waiting_on_the_database_leaves_the_event_loop_serving(
    pool_settings: PoolSettings,
) -> None:
    """A key the cache does not hold is looked up in a thread: while PostgreSQL holds the key
    table locked (a migration, a long admin transaction), the lookup waits and ``/health`` is
    still answered by the same event loop. On the loop, the lookup would hold ``/health`` until
    the lock went."""
    port = free_port()
    url = make_url(pool_settings.resolved_database_url())
    with (
        gateway_with(pool_settings, port, require_api_key=True),
        psycopg.connect(
            host=url.host, port=url.port, user=url.username, dbname=url.database
        ) as locker,
        ThreadPoolExecutor(1) as calls,
    ):
        locker.execute("LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE")  # in a transaction
        call = calls.submit(
            httpx.post,
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json=CHAT,
            headers={"Authorization": "Bearer tg-" + secrets.token_urlsafe(32)},
            timeout=60,
        )
        waiting = 0
        for _ in range(100):  # until the lookup waits on the lock (about a second at most)
            locker.execute("SELECT pg_stat_clear_snapshot()")  # else one snapshot per transaction
            waiting = locker.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query ILIKE '%api_keys%'"
            ).fetchone()[0]  # type: ignore[index]
            if waiting:
                break
            time.sleep(0.1)
        assert waiting == 1, "the key lookup never reached the database"
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        assert health.status_code == 200
        assert not call.done()  # still waiting on the lock
        locker.rollback()
        refused = call.result(timeout=60)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
