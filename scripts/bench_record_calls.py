"""CPU of the pool's write transaction for batches of ONE call (a gateway at concurrency 1).

Calls ``PoolStore.record_calls`` directly, one call per batch, on SQLite in a temporary
directory (or an EMPTY PostgreSQL database), with the ``trajgate bench pool`` traffic: turn after
turn, each batch on another trajectory, as agents interleave. Prints one JSON line: the calling
thread's CPU per batch (``cpu_us_mean``, ``cpu_us_p50``) and the wall time (``wall_us_p50``),
in microseconds. Run it from two trees in turns to compare them:

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_record_calls.py [--postgres-url URL] [--group]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from datapool import db
from datapool.db import make_engine
from datapool.settings import PoolSettings
from datapool.steps.records import PendingCall
from datapool.steps.store import PoolStore
from trajgate.bench.pool import synthetic_call, synthetic_trajectory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--postgres-url", help="an EMPTY PostgreSQL database instead of SQLite")
    parser.add_argument("--trajectories", type=int, default=20)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--group", action="store_true", help="calls name a group, 4 per group")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = args.postgres_url or f"sqlite:///{tmp}/pool.sqlite3"
        db.upgrade(url)
        settings = PoolSettings(data_dir=Path(tmp) / "data", database_url=url)
        rng = np.random.default_rng(0)
        shapes = [
            synthetic_trajectory(rng, args.turns, system_tokens=args.system_tokens)
            for _ in range(args.trajectories)
        ]
        calls = [
            [
                replace(
                    synthetic_call(f"t{i}", prompt, response, logprobs, k),
                    group_id=f"g{i // 4}" if args.group else None,
                )
                for k, (prompt, response, logprobs) in enumerate(shape)
            ]
            for i, shape in enumerate(shapes)
        ]
        store = PoolStore(make_engine(url), settings)
        prompt, response, logprobs = shapes[0][0]
        # Connects and compiles before the clock starts.
        store.record_calls(
            [PendingCall("warm", synthetic_call("warm", prompt, response, logprobs, 0))]
        )
        gc.freeze()  # the prepared traffic is not the writer's garbage
        cpu_us: list[float] = []
        wall_us: list[float] = []
        for k in range(args.turns):
            for i in range(args.trajectories):
                cpu_started, wall_started = time.thread_time(), time.perf_counter()
                [result] = store.record_calls([PendingCall(f"t{i}", calls[i][k])])
                cpu_us.append((time.thread_time() - cpu_started) * 1e6)
                wall_us.append((time.perf_counter() - wall_started) * 1e6)
                if isinstance(result, Exception):
                    raise result
        gc.unfreeze()
        store.engine.dispose()
    print(
        json.dumps(
            {
                "backend": "postgresql" if args.postgres_url else "sqlite",
                "batches": len(cpu_us),
                "cpu_us_mean": round(statistics.fmean(cpu_us)),
                "cpu_us_p50": round(statistics.median(cpu_us)),
                "wall_us_p50": round(statistics.median(wall_us)),
            }
        )
    )


if __name__ == "__main__":
    main()
