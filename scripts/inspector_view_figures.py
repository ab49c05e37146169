"""The inspector's views of one long coding-agent session: bytes and server milliseconds.

Records a session of ``--turns`` calls (and one of a tenth as many, for the ratio) in chat
completions or the Messages API (``--dialect``) into a fresh
SQLite pool through ``PoolStore`` (``trajgate.bench.long_session``: 28 KB tool list, ~450-character
tool results; with ``--cch``, Claude Code's system message whose attribution line changes on every
call), then reads ``GET /api/inspector/trajectories/<id>`` and the last step's first token
page, whole and its first window of 2,000 positions, in-process (Starlette's test client: server
time plus the ASGI hop, no network), each ``--repeats`` times; prints JSON with the median wall
and process-CPU milliseconds and the bytes.

    PYTHONPATH=. .venv/bin/python scripts/inspector_view_figures.py --turns 200
    PYTHONPATH=. .venv/bin/python scripts/inspector_view_figures.py --dialect messages --cch
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from datapool.db import make_engine, upgrade
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore
from gateway.app import create_app
from gateway.settings import GatewaySettings
from trajgate.bench.long_session import DIALECTS, record_session


def _timed(client: TestClient, path: str, repeats: int) -> tuple[float, float, int]:
    """``(median wall ms, median process CPU ms, bytes)`` of ``repeats`` GETs of ``path``
    (CPU time counts every thread of this process: the server's work, steadier than wall time
    on a shared machine)."""
    walls, cpus, size = [], [], 0
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        response = client.get(path)
        walls.append((time.perf_counter() - wall) * 1000)
        cpus.append((time.process_time() - cpu) * 1000)
        response.raise_for_status()
        size = len(response.content)
    return round(statistics.median(walls), 1), round(statistics.median(cpus), 1), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dialect", choices=DIALECTS, default="chat")
    parser.add_argument(
        "--cch",
        action="store_true",
        help="Claude Code's system message with a cch that changes on every call",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pool = PoolSettings(data_dir=Path(tmp))
        upgrade(pool.resolved_database_url())
        store = PoolStore(make_engine(pool.resolved_database_url()), pool)
        short_turns = max(1, args.turns // 10)
        sessions = {
            "long": record_session(store, "long", args.turns, args.dialect, args.cch),
            "short": record_session(store, "short", short_turns, args.dialect, args.cch),
        }
        store.engine.dispose()
        app = create_app(GatewaySettings(allowed_hosts=["testserver"]), pool)
        result: dict[str, Any] = {
            "dialect": args.dialect,
            "cch": args.cch,
            "turns": args.turns,
            "short_turns": short_turns,
        }
        with TestClient(app) as client:
            for name in sessions:
                view = f"/api/inspector/trajectories/{name}"
                client.get(view)  # warm-up
                figures = _timed(client, view, args.repeats)
                for unit, value in zip(("ms", "cpu_ms", "bytes"), figures, strict=True):
                    result[f"{name}_view_{unit}"] = value
            last = sessions["long"].step_ids[-1]
            for label, query in (("tokens", ""), ("token_page", "?limit=2000")):
                figures = _timed(client, f"/api/steps/{last}/tokens{query}", args.repeats)
                for unit, value in zip(("ms", "cpu_ms", "bytes"), figures, strict=True):
                    result[f"last_step_{label}_{unit}"] = value
        result["view_bytes_per_step_ratio"] = round(
            (result["long_view_bytes"] / args.turns) / (result["short_view_bytes"] / short_turns),
            2,
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
