"""``trajgate bench inspector``: the inspector's JSON endpoints on a large SQLite pool.

Owns: filling a fresh SQLite pool in bulk with SQL (``executemany`` of trajectories, steps,
token payloads and rewards, never through the gateway) and timing the endpoints the views call,
in-process (Starlette's test client around the real app; no network, so the times are server
time plus the ASGI hop). Never: measures rendering in a browser.

Shape of the synthetic pool: ``trajectories`` episodes of ``steps_per_trajectory`` steps, groups
of 4, channels ``train``/``val`` (9:1), 90% rewarded ``final`` 0/1, each step a 32-token prompt
delta (the first step) or an extension of its parent (``prompt_base_tokens``), 16 sampled tokens
with logprobs, a short chat request, 5% of steps flagged ``truncated``.

Reports (milliseconds): ``list_p50_ms``/``list_p99_ms`` over a mix of list queries (default
order, status, channel, group, tag, reward range, sort by reward / last step / call count, a deep
page), ``trajectory_view_p50_ms``, ``step_tokens_p50_ms``, plus ``count_p50_ms`` (the total
shown beside the list), ``search_ms`` (text search scans every request) and ``charts_ms``.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import text

from datapool import db
from datapool.db import make_engine
from datapool.settings import PoolSettings
from datapool.steps.payloads import encode_ids, encode_logprobs

GROUP_SIZE = 4
PROMPT_TOKENS = 32
RESPONSE_TOKENS = 16
ENV_TOKENS = 8
CHUNK_TRAJECTORIES = 2000
Rows = list[dict[str, Any]]
LIST_QUERIES: list[dict[str, Any]] = [
    {},
    {"status": "complete"},
    {"channel": "val"},
    {"group_id": "g-000123"},
    {"tag": "hard"},
    {"reward_min": 0.5},
    {"sort": "reward", "order": "desc"},
    {"sort": "last_step_at", "order": "asc"},
    {"sort": "call_count"},
    {"offset": 5000},
]


def _at(t: datetime) -> str:
    # SQLAlchemy's SQLite DateTime storage format (timezone-aware values are stored as UTC).
    return t.strftime("%Y-%m-%d %H:%M:%S.%f")


def _rows(
    start: int, stop: int, steps_per_trajectory: int, t0: datetime, rng: np.random.Generator
) -> Iterator[tuple[Rows, Rows, Rows, Rows]]:
    """Rows of trajectories ``start..stop`` for each table, ``CHUNK_TRAJECTORIES`` at a time."""
    # Over 80 lines on purpose: the bulk rows of every table in one place, in insert order, so
    # the synthetic pool's shape is visible at a glance.
    for chunk in range(start, stop, CHUNK_TRAJECTORIES):
        trajectories, steps, payloads, rewards = [], [], [], []
        for n in range(chunk, min(stop, chunk + CHUNK_TRAJECTORIES)):
            tid = f"t-{n:07d}"
            created = t0 + timedelta(seconds=n)
            last = created + timedelta(seconds=steps_per_trajectory)
            trajectories.append(
                {
                    "id": tid,
                    "group_id": f"g-{n // GROUP_SIZE:06d}",
                    "channel": "val" if n % 10 == 9 else "train",
                    "status": "complete",
                    "metadata_json": "{}",
                    "created_at": _at(created),
                    "completed_at": _at(last),
                    "call_count": steps_per_trajectory,
                    "tags": json.dumps(["hard"] if n % 7 == 0 else []),
                    "flags": "[]",
                    "last_step_at": _at(last),
                    "completion_reason": "explicit",
                    "rejected_calls": 0,
                }
            )
            if n % 10 != 3:
                rewards.append(
                    {
                        "target_kind": "trajectory",
                        "target_id": tid,
                        "trajectory_id": tid,
                        "name": "final",
                        "value": float(n % 2),
                        "source": "rule",
                        "created_at": _at(last),
                    }
                )
            parent = None
            prompt_len = 0
            for k in range(steps_per_trajectory):
                step_id = str(uuid.uuid4())
                delta = rng.integers(
                    0, 2048, PROMPT_TOKENS if k == 0 else ENV_TOKENS, dtype=np.int32
                )
                response = rng.integers(0, 2048, RESPONSE_TOKENS, dtype=np.int32)
                base = 0 if k == 0 else prompt_len + RESPONSE_TOKENS
                prompt_len = base + len(delta)
                steps.append(
                    {
                        "id": step_id,
                        "trajectory_id": tid,
                        "parent_step_id": parent,
                        "endpoint": "chat.completions",
                        "step_index": k,
                        "choice_index": 0,
                        "policy_version": n * 5 // stop,
                        "model": "tiny",
                        "outcome": "ok",
                        "request": json.dumps(
                            {
                                "model": "tiny",
                                "messages": [{"role": "user", "content": f"task {n} turn {k}"}],
                            }
                        ),
                        "upstream_request": "{}",
                        "response_message": json.dumps({"role": "assistant", "content": "ok"}),
                        "finish_reason": "stop",
                        "prompt_tokens": prompt_len,
                        "completion_tokens": RESPONSE_TOKENS,
                        "latency_ms": 20.0 + k,
                        "flags": json.dumps(["truncated"] if (n + k) % 20 == 0 else []),
                        "extends_parent": None if k == 0 else True,
                        "prompt_base_tokens": base,
                        "created_at": _at(created + timedelta(seconds=k)),
                    }
                )
                payloads.append(
                    {
                        "step_id": step_id,
                        "prompt_delta": encode_ids(delta),
                        "response_token_ids": encode_ids(response),
                        "response_logprobs": encode_logprobs(
                            (-rng.random(RESPONSE_TOKENS) * 3).astype(np.float32).tolist()
                        ),
                        "created_at": _at(created + timedelta(seconds=k)),
                    }
                )
                parent = step_id
        yield trajectories, steps, payloads, rewards


def _insert_sql(table: str, row: dict[str, Any]) -> Any:
    columns = ", ".join(row)
    values = ", ".join(f":{c}" for c in row)
    return text(f"INSERT INTO {table} ({columns}) VALUES ({values})")


def fill(database_url: str, trajectories: int, steps_per_trajectory: int, seed: int = 0) -> None:
    """Write the synthetic pool into a migrated, empty SQLite database in bulk."""
    rng = np.random.default_rng(seed)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    engine = make_engine(database_url)
    try:
        for tables in _rows(0, trajectories, steps_per_trajectory, t0, rng):
            with engine.begin() as conn:
                for name, rows in zip(
                    ("trajectories", "steps", "step_payloads", "rewards"), tables, strict=True
                ):
                    if rows:
                        conn.execute(_insert_sql(name, rows[0]), rows)
        with engine.begin() as conn:
            conn.execute(text("ANALYZE"))
    finally:
        engine.dispose()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _time_ms(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000


def run_inspector_benchmark(
    trajectories: int = 100_000,
    steps_per_trajectory: int = 10,
    repeats: int = 20,
    data_dir: Path | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Fill a fresh SQLite pool (reused when ``data_dir`` already holds a filled one) and time
    the inspector's endpoints; returns the report described in the module docstring."""
    from fastapi.testclient import TestClient

    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    with tempfile.TemporaryDirectory(prefix="trajgate-bench-inspector-") as tmp:
        root = data_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{(root / 'pool.sqlite3').resolve()}"
        marker = root / f"filled-{trajectories}x{steps_per_trajectory}"
        fill_s = None
        if not marker.exists():
            db.upgrade(url)
            progress(f"filling {trajectories} trajectories x {steps_per_trajectory} steps")
            start = time.perf_counter()
            fill(url, trajectories, steps_per_trajectory)
            fill_s = time.perf_counter() - start
            marker.touch()
        # Compaction off: the timing must not share the CPU with a background Parquet write.
        pool = PoolSettings(data_dir=root, database_url=url, compaction_interval_s=0)
        rng = random.Random(1)
        # TestClient sends Host "testserver", not one of the gateway's default names.
        settings = GatewaySettings(allowed_hosts=["testserver"])
        with TestClient(create_app(settings, pool)) as client:

            def get(path: str, **params: Any) -> Any:
                response = client.get(path, params=params)
                assert response.status_code == 200, response.text[:300]
                return response.json()

            progress("timing")
            get("/api/inspector/trajectories")  # warm-up: caches, first query plans
            list_ms = [
                _time_ms(lambda q=query: get("/api/inspector/trajectories", **q))  # type: ignore[misc]
                for _ in range(repeats)
                for query in LIST_QUERIES
            ]
            count_ms = [
                _time_ms(lambda: get("/api/inspector/trajectories", with_total="true", limit=1))
                for _ in range(repeats)
            ]
            picks = [f"t-{rng.randrange(trajectories):07d}" for _ in range(repeats * 5)]
            view_ms, step_ids = [], []
            for tid in picks:
                start = time.perf_counter()
                view = get(f"/api/inspector/trajectories/{tid}")
                view_ms.append((time.perf_counter() - start) * 1000)
                step_ids.append(rng.choice(view["steps"])["id"])
            tokens_ms = [_time_ms(lambda s=s: get(f"/api/steps/{s}/tokens")) for s in step_ids]  # type: ignore[misc]
            search_ms = _time_ms(lambda: get("/api/inspector/trajectories", q="task 99999 "))
            charts_ms = _time_ms(lambda: get("/api/charts", bucket_s=86400))
    return {
        "trajectories": trajectories,
        "steps": trajectories * steps_per_trajectory,
        "fill_s": None if fill_s is None else round(fill_s, 1),
        "list_p50_ms": round(statistics.median(list_ms), 1),
        "list_p99_ms": round(_percentile(list_ms, 0.99), 1),
        "list_max_ms": round(max(list_ms), 1),
        "count_p50_ms": round(statistics.median(count_ms), 1),
        "trajectory_view_p50_ms": round(statistics.median(view_ms), 1),
        "step_tokens_p50_ms": round(statistics.median(tokens_ms), 1),
        "search_ms": round(search_ms, 1),
        "charts_ms": round(charts_ms, 1),
        "list_goal_met": _percentile(list_ms, 0.99) < 300,
    }
