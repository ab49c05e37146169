"""``trajgate bench pool``: a tiny run reports its figures with exact reconstruction, and the
benchmark refuses a database that already holds a pool (it would take the pool's payloads)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from sqlalchemy import func, select
from tests_support import TRAJGATE

from datapool.db import make_engine
from datapool.models import Step
from datapool.settings import PoolSettings
from datapool.steps.records import CallRecord, ChoiceRecord
from datapool.steps.store import PoolStore
from trajgate.bench.pool import BenchDatabaseNotEmptyError, bench_pool


def test_tiny_pool_bench_reads_every_prompt_back_exactly(
    empty_database_url: str, tmp_path: Path
) -> None:
    figures = bench_pool(
        empty_database_url, tmp_path / "bench", trajectories=3, turns=4, concurrency=2
    )
    assert figures["exact"] is True
    assert figures["steps"] == 3 * 4
    # Each turn's prompt extends the last, so deltas store about the final sequences once.
    assert figures["amplification"] <= 1.0


def test_pool_bench_refuses_a_database_that_holds_a_pool(pool_settings: PoolSettings) -> None:
    engine = make_engine(pool_settings.resolved_database_url())
    try:
        PoolStore(engine, pool_settings).record_call(
            "live-1",
            CallRecord(
                request={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                upstream_request={"model": "tiny"},
                model="tiny",
                upstream="test://",
                policy_version=0,
                latency_ms=1.0,
                prompt_token_ids=[1, 2, 3],
                prompt_tokens=3,
                choices=[ChoiceRecord(0, [4, 5], [-0.1, -0.2], {"role": "assistant"}, "stop")],
            ),
        )
        with pytest.raises(BenchDatabaseNotEmptyError, match="expected an empty database"):
            bench_pool(pool_settings.resolved_database_url(), pool_settings.data_dir / "bench")
        done = subprocess.run(
            [
                TRAJGATE,
                "bench",
                "pool",
                "--trajectories",
                "1",
                "--turns",
                "1",
                "--postgres-url",
                pool_settings.resolved_database_url(),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 2
        assert "expected an empty database" in done.stderr
        with engine.connect() as connection:  # the live pool is untouched
            assert connection.scalar(select(func.count()).select_from(Step)) == 1
        [step] = PoolStore(engine, pool_settings).steps_of("live-1")
        assert step.prompt_token_ids == [1, 2, 3]
    finally:
        engine.dispose()
