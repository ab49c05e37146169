"""Bad input gets OpenAI's error envelope and leaves nothing in the pool."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import func, select

from datapool.db import make_engine
from datapool.models import Step, Trajectory
from datapool.settings import PoolSettings
from gateway.server import BackgroundServer


def _row_counts(pool_settings: PoolSettings) -> tuple[int, int]:
    engine = make_engine(pool_settings.resolved_database_url())
    with engine.connect() as conn:
        steps = conn.execute(select(func.count()).select_from(Step)).scalar_one()
        trajectories = conn.execute(select(func.count()).select_from(Trajectory)).scalar_one()
    engine.dispose()
    return steps, trajectories


@pytest.mark.parametrize(
    ("path", "content", "status", "needle"),
    [
        ("/t/ok-1/v1/chat/completions", b"{not json", 400, "not valid JSON"),
        ("/t/ok-1/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
        ("/t/ok-1/v1/chat/completions", b'{"model": "tiny"}', 400, "'messages'"),
        ("/t/ok-1/v1/chat/completions", b'{"messages": "hi"}', 400, "'messages'"),
        (
            "/t/ok-1/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\xff"}]}',
            400,
            "UTF-8",
        ),
        (
            "/t/bad%20id/v1/chat/completions",
            b'{"messages": [{"role": "user"}]}',
            400,
            "trajectory id",
        ),
        ("/no/such/route", b"{}", 404, "Not Found"),
        (
            "/t/ok-1/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
            400,
            "NaN is not a JSON number",
        ),
    ],
)
def test_bad_request_gets_the_error_envelope_and_writes_nothing(
    gateway: BackgroundServer,
    pool_settings: PoolSettings,
    path: str,
    content: bytes,
    status: int,
    needle: str,
) -> None:
    response = httpx.post(f"{gateway.url}{path}", content=content, timeout=30)
    assert response.status_code == status
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["code"], str)
    assert needle in body["error"]["message"]
    assert _row_counts(pool_settings) == (0, 0)


@pytest.mark.parametrize(
    ("header", "value", "needle"),
    [
        ("X-Trajgate-Group", "g" * 201, "group id must be 1-200 characters"),
        ("X-Trajgate-Group", "a b/../c", "group id must be"),
        ("X-Trajgate-Channel", "c" * 101, "channel must be 1-100 characters"),
        ("X-Trajgate-Channel", "-leading-dash", "channel must be"),
    ],
)
def test_bad_group_or_channel_header_is_refused_before_sampling_and_writes_nothing(
    gateway: BackgroundServer, pool_settings: PoolSettings, header: str, value: str, needle: str
) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = httpx.post(
        f"{gateway.url}/t/ok-2/v1/chat/completions", json=body, headers={header: value}, timeout=30
    )
    assert response.status_code == 400
    assert needle in response.json()["error"]["message"]
    assert _row_counts(pool_settings) == (0, 0)
