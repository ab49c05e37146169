"""Storage faults with real faults, not mocks: a full disk (a 16 MiB tmpfs filled to the last
byte), a SQLite database or a PostgreSQL table locked by another session past the lock
timeout, a PostgreSQL database that stops accepting connections and loses the ones it had.
In each, the gateway in front of the real vLLM either refuses clearly ('refuse': 503 with the
fault's reason and Retry-After; a stream ends in an error event the OpenAI SDK raises) or keeps
serving ('serve': 200 with ``x-trajgate-recorded: false``), says so in its log and its metrics,
never corrupts the pool, and records again once the fault is gone.

The invariant checked after every fault: each call answered 200 with ``x-trajgate-recorded:
true`` has its steps in the pool exactly once with a payload that reads back, and nothing else
is there (no step, no half-written call, of a call that was refused or served unrecorded).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import sqlite3
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import psycopg
import pytest
from gateway_helpers import gateway_with
from sqlalchemy import func, select
from sqlalchemy.engine import make_url
from tests_support import free_port

from datapool import db
from datapool.db import make_engine
from datapool.errors import PoolUnavailableError
from datapool.models import PayloadFile, Step, StepPayload
from datapool.settings import PoolSettings
from datapool.steps import payloads as payload
from datapool.steps.faults import fault_reason
from datapool.steps.records import CallRecord, ChoiceRecord
from datapool.steps.store import PoolStore
from datapool.steps.writer import PoolWriter
from gateway.server import BackgroundServer
from trajgate import vllm_server

CHAT: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Name three colours."}],
    "max_tokens": 8,
    "temperature": 0,
    "logprobs": True,
}
BACKOFF_S = 1.0


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs of its own, so filling it fills nothing else (needs CAP_SYS_ADMIN)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(directory: Path) -> Path:
    """Write a filler file until the filesystem says ENOSPC; returns it (delete it to free)."""
    filler = directory / "filler"
    chunk = b"\0" * 65536
    # Unbuffered: a buffered file kept what the failed flush could not write and raised
    # ENOSPC again when closed (seen on this machine's tmpfs).
    with filler.open("wb", buffering=0) as handle:
        try:
            while True:
                handle.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    # Byte-sized writes take the last partial block too.
    with filler.open("ab", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0")
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def checkpoint_wal(database_url: str) -> None:
    """Fold SQLite's WAL into the database and truncate it, so the next commit needs new disk
    space (a WAL keeps its size after a checkpoint and would absorb a few commits)."""
    path = database_url.split("///", 1)[1]
    with sqlite3.connect(path) as connection:
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def metric(gateway: BackgroundServer, name: str, labels: str = "") -> float:
    text = httpx.get(f"{gateway.url}/metrics").text
    pattern = rf"^{re.escape(name)}{re.escape(labels)} (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    assert found, f"{name}{labels} not in /metrics"
    return float(found.group(1))


class Agent:
    """One trajectory's calls through the gateway, remembering what the pool must hold."""

    def __init__(self, gateway: BackgroundServer) -> None:
        self.trajectory_id = f"faults-{uuid.uuid4().hex[:10]}"
        self.base_url = f"{gateway.url}/t/{self.trajectory_id}/v1"
        self.recorded: dict[str, int] = {}  # step id -> completion tokens the client was told
        self.refused = 0
        self.unrecorded = 0

    def call(self) -> httpx.Response:
        response = httpx.post(f"{self.base_url}/chat/completions", json=CHAT, timeout=60)
        if response.status_code == 200:
            if response.headers["x-trajgate-recorded"] == "true":
                step_id = response.headers["x-trajgate-step-id"]
                self.recorded[step_id] = response.json()["usage"]["completion_tokens"]
            else:
                assert response.headers["x-trajgate-step-id"] == ""
                self.unrecorded += 1
        else:
            self.refused += 1
        return response


def assert_refused_or_served(response: httpx.Response, mode: str, reason: str) -> None:
    """'refuse': 503 naming the fault; 'serve': 200 that says it was not recorded."""
    if mode == "refuse":
        assert response.status_code == 503
        assert response.json()["error"]["code"] == f"pool_{reason}"
    else:
        assert response.status_code == 200
        assert response.headers["x-trajgate-recorded"] == "false"


def assert_pool_holds_exactly(pool: PoolSettings, agent: Agent) -> None:
    """The delivered-and-recorded steps, once each, with payloads that read back; nothing else."""
    engine = make_engine(pool.resolved_database_url())
    try:
        store = PoolStore(engine, pool)
        steps = store.steps_of(agent.trajectory_id)
        assert sorted(s.id for s in steps) == sorted(agent.recorded)
        for step in steps:
            assert step.response_token_ids is not None
            assert len(step.response_token_ids) == agent.recorded[step.id]
            assert step.response_logprobs is not None
            assert len(step.response_logprobs) == len(step.response_token_ids)
            assert step.prompt_token_ids
        with store.sessions() as session:
            orphans = session.scalar(
                select(func.count())
                .select_from(StepPayload)
                .outerjoin(Step, Step.id == StepPayload.step_id)
                .where(Step.id.is_(None))
            )
            assert orphans == 0
        if pool.resolved_database_url().startswith("sqlite"):
            with engine.connect() as connection:
                assert connection.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
    finally:
        engine.dispose()


def pool_on(
    directory: Path, mode: str, database_url: str | None = None, **extra: Any
) -> PoolSettings:
    settings = PoolSettings(
        data_dir=directory / "data",
        database_url=database_url,
        on_write_failure=mode,
        write_failure_backoff_s=BACKOFF_S,
        compaction_interval_s=0,
        **extra,
    )
    db.upgrade(settings.resolved_database_url())
    return settings


# ---- disk full --------------------------------------------------------------------------------


@dataclass
class FullDisk:
    pool: PoolSettings
    gateway: BackgroundServer
    agent: Agent
    filler: Path  # delete it to free the disk


@contextmanager
def gateway_on_a_disk_filled_after_one_call(
    vllm: vllm_server.VLLMServer, small_disk: Path, mode: str
) -> Iterator[FullDisk]:
    """A gateway whose pool lives on ``small_disk``: one call recorded, then the disk full."""
    pool = pool_on(small_disk, mode)
    with gateway_with(pool, free_port(), upstream_url=vllm.url) as gateway:
        agent = Agent(gateway)
        assert agent.call().status_code == 200
        checkpoint_wal(pool.resolved_database_url())
        yield FullDisk(pool, gateway, agent, fill(small_disk))


def test_full_disk_refuses_calls_with_503_and_records_again_once_space_is_freed(
    vllm: vllm_server.VLLMServer, small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with gateway_on_a_disk_filled_after_one_call(vllm, small_disk, "refuse") as full:
        pool, gateway, agent = full.pool, full.gateway, full.agent
        caplog.set_level(logging.ERROR, logger="trajgate.pool.writer")

        refused = agent.call()  # sampled by vLLM, then its commit fails
        assert refused.status_code == 503
        error = refused.json()["error"]
        assert error["type"] == "service_unavailable"
        assert error["code"] == "pool_disk_full"
        assert int(refused.headers["Retry-After"]) >= 1
        up_front = agent.call()  # inside the backoff: refused before reaching vLLM
        assert up_front.status_code == 503
        assert "refused for" in up_front.json()["error"]["message"]
        assert metric(gateway, "trajgate_pool_faults_total", '{reason="disk_full"}') == 1
        assert metric(gateway, "trajgate_pool_calls_failed_total") == 1
        assert metric(gateway, "trajgate_pool_calls_refused_total") == 2
        assert metric(gateway, "trajgate_pool_writable") == 0
        assert httpx.get(f"{gateway.url}/ready").json()["pool_writable"] is False
        assert any("disk_full" in r.getMessage() for r in caplog.records)

        full.filler.unlink()
        time.sleep(BACKOFF_S)
        assert agent.call().status_code == 200
        assert metric(gateway, "trajgate_pool_writable") == 1
        assert httpx.get(f"{gateway.url}/ready").json()["pool_writable"] is True
    assert (len(agent.recorded), agent.refused) == (2, 2)
    assert_pool_holds_exactly(pool, agent)


def test_full_disk_ends_a_stream_in_an_error_the_openai_sdk_raises(
    vllm: vllm_server.VLLMServer, small_disk: Path
) -> None:
    with gateway_on_a_disk_filled_after_one_call(vllm, small_disk, "refuse") as full:
        pool, agent = full.pool, full.agent
        with openai.OpenAI(base_url=agent.base_url, api_key="unused", max_retries=0) as client:
            stream = client.chat.completions.create(**CHAT, stream=True)
            with pytest.raises(openai.APIError, match="disk_full"):
                for _chunk in stream:
                    pass
    assert_pool_holds_exactly(pool, agent)


def test_full_disk_in_serve_mode_answers_unrecorded_and_counts_them(
    vllm: vllm_server.VLLMServer, small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with gateway_on_a_disk_filled_after_one_call(vllm, small_disk, "serve") as full:
        pool, gateway, agent = full.pool, full.gateway, full.agent
        caplog.set_level(logging.ERROR, logger="trajgate.pool.writer")
        for _ in range(2):
            served = agent.call()
            assert served.status_code == 200
            assert served.json()["choices"][0]["message"]["content"] is not None
        assert metric(gateway, "trajgate_pool_calls_unrecorded_total") == 2
        assert metric(gateway, "trajgate_pool_faults_total", '{reason="disk_full"}') == 2
        assert metric(gateway, "trajgate_pool_calls_refused_total") == 0
        assert any("served without being recorded" in r.getMessage() for r in caplog.records)
        full.filler.unlink()
        assert agent.call().status_code == 200
    assert (len(agent.recorded), agent.unrecorded, agent.refused) == (2, 2, 0)
    assert_pool_holds_exactly(pool, agent)


def test_compaction_onto_a_full_disk_leaves_no_file_and_keeps_payloads_in_sql(
    pool_settings: PoolSettings, small_disk: Path
) -> None:
    settings = pool_settings.model_copy(
        update={"payload_uri": str(small_disk / "payloads"), "compaction_min_steps": 1}
    )
    engine = make_engine(settings.resolved_database_url())
    try:
        store = PoolStore(engine, settings)
        step_ids = [
            store.record_call("compaction-full", synthetic_call(turn, 4000)) for turn in range(3)
        ]
        before = {s.id: s.prompt_token_ids for s in store.steps_of("compaction-full")}
        fill(small_disk)
        writer = PoolWriter(store, settings)
        with pytest.raises(OSError) as raised:
            writer.upkeep()
        assert raised.value.errno == errno.ENOSPC
        assert writer.stats.compaction_failures == 1
        assert [p.name for p in (small_disk / "payloads").iterdir()] == []
        assert store.payloads.pending_steps() == 3
        after = {s.id: s.prompt_token_ids for s in store.steps_of("compaction-full")}
        assert after == before
        assert sorted(after) == sorted(i for ids in step_ids for i in ids)
    finally:
        engine.dispose()


def synthetic_call(turn: int, prompt_tokens: int) -> CallRecord:
    """A call whose payload is ``prompt_tokens`` + 16 int32s: big enough to need disk."""
    prompt = [(turn * 7919 + i) % 2000 for i in range(prompt_tokens)]
    return CallRecord(
        request={"model": "tiny", "messages": [{"role": "user", "content": f"turn {turn}"}]},
        upstream_request={"model": "tiny"},
        model="tiny",
        upstream="test://",
        policy_version=0,
        latency_ms=1.0,
        prompt_token_ids=prompt,
        prompt_tokens=len(prompt),
        choices=[ChoiceRecord(0, list(range(16)), [-0.5] * 16, {"role": "assistant"}, "stop")],
    )


# ---- locked ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["refuse", "serve"])
def test_sqlite_locked_by_another_process_past_the_busy_timeout_refuses_or_serves(
    vllm: vllm_server.VLLMServer, tmp_path: Path, mode: str
) -> None:
    pool = pool_on(tmp_path, mode, database_lock_timeout_ms=300)
    with gateway_with(pool, free_port(), upstream_url=vllm.url) as gateway:
        agent = Agent(gateway)
        assert agent.call().status_code == 200
        # Another process's writer (the same thing as a second connection: SQLite's locks are
        # file locks) holds the write lock longer than the gateway waits for it.
        holder = sqlite3.connect(pool.resolved_database_url().split("///", 1)[1])
        holder.execute("BEGIN EXCLUSIVE")
        try:
            during = agent.call()
        finally:
            holder.rollback()
            holder.close()
        assert_refused_or_served(during, mode, "locked")
        assert metric(gateway, "trajgate_pool_faults_total", '{reason="locked"}') == 1
        time.sleep(BACKOFF_S)
        assert agent.call().headers["x-trajgate-recorded"] == "true"
    assert len(agent.recorded) == 2
    assert_pool_holds_exactly(pool, agent)


@pytest.mark.parametrize("empty_database_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("mode", ["refuse", "serve"])
def test_postgres_table_locked_by_another_session_past_the_lock_timeout_refuses_or_serves(
    vllm: vllm_server.VLLMServer, empty_database_url: str, tmp_path: Path, mode: str
) -> None:
    pool = pool_on(tmp_path, mode, database_url=empty_database_url, database_lock_timeout_ms=300)
    admin = make_url(empty_database_url)
    with gateway_with(pool, free_port(), upstream_url=vllm.url) as gateway:
        agent = Agent(gateway)
        assert agent.call().status_code == 200
        # A maintenance session (a migration, a VACUUM FULL) holding the trajectories table.
        with psycopg.connect(
            host=admin.host, port=admin.port, user=admin.username, dbname=admin.database
        ) as holder:
            holder.execute("LOCK TABLE trajectories IN ACCESS EXCLUSIVE MODE")
            during = agent.call()
            holder.rollback()
        assert_refused_or_served(during, mode, "locked")
        assert metric(gateway, "trajgate_pool_faults_total", '{reason="locked"}') >= 1
        time.sleep(BACKOFF_S)
        assert agent.call().headers["x-trajgate-recorded"] == "true"
    assert len(agent.recorded) == 2
    assert_pool_holds_exactly(pool, agent)


# ---- unreachable -----------------------------------------------------------------------------


def _admin(url: str, *statements: str) -> None:
    admin = make_url(url).set(database="postgres")
    with psycopg.connect(
        host=admin.host, port=admin.port, user=admin.username, dbname="postgres", autocommit=True
    ) as connection:
        for statement in statements:
            connection.execute(statement)


def cut_off(url: str) -> None:
    """The database stops accepting connections and drops the ones it had."""
    name = make_url(url).database
    _admin(
        url,
        f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false',
        f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'",
    )


def reconnect(url: str) -> None:
    name = make_url(url).database
    _admin(url, f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')


@pytest.mark.parametrize("empty_database_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("mode", ["refuse", "serve"])
def test_postgres_that_drops_its_connections_is_refused_or_served_then_reconnected(
    vllm: vllm_server.VLLMServer, empty_database_url: str, tmp_path: Path, mode: str
) -> None:
    pool = pool_on(tmp_path, mode, database_url=empty_database_url)
    with gateway_with(pool, free_port(), upstream_url=vllm.url) as gateway:
        agent = Agent(gateway)
        assert agent.call().status_code == 200
        cut_off(empty_database_url)
        try:
            during = agent.call()
            pool_api = httpx.get(f"{gateway.url}/api/trajectories/{agent.trajectory_id}")
        finally:
            reconnect(empty_database_url)
        assert_refused_or_served(during, mode, "unreachable")
        # The pool API says what happened too, in the one envelope.
        assert pool_api.status_code == 503
        assert pool_api.json()["error"]["code"] == "pool_unreachable"
        # The call's lookup and the pool API request each met the fault.
        assert metric(gateway, "trajgate_pool_faults_total", '{reason="unreachable"}') >= 2
        time.sleep(BACKOFF_S)
        assert agent.call().headers["x-trajgate-recorded"] == "true"
        assert metric(gateway, "trajgate_pool_writable") == 1
    assert len(agent.recorded) == 2
    assert_pool_holds_exactly(pool, agent)


# ---- orphaned payload files ------------------------------------------------------------------


def test_upkeep_deletes_only_old_unregistered_payload_files(pool_settings: PoolSettings) -> None:
    settings = pool_settings.model_copy(update={"compaction_min_steps": 1})
    engine = make_engine(settings.resolved_database_url())
    try:
        store = PoolStore(engine, settings)
        store.record_call("orphans", synthetic_call(0, 64))
        writer = PoolWriter(store, settings)
        writer.upkeep()  # compacts the one step into a registered file
        root = Path(settings.resolved_payload_uri())
        [registered] = list(root.iterdir())
        old = time.time() - 2 * settings.orphan_payload_min_age_s
        crashed = root / f"payloads-{uuid.uuid4()}.parquet"  # a compaction died before commit
        young = root / f"payloads-{uuid.uuid4()}.parquet"  # a compaction still committing
        foreign = root / "notes.parquet"  # not ours
        for path in (crashed, young, foreign):
            path.write_bytes(b"PAR1")
        for path in (registered, crashed, foreign):
            os.utime(path, (old, old))

        writer.upkeep()

        assert sorted(p.name for p in root.iterdir()) == sorted(
            [registered.name, young.name, foreign.name]
        )
        assert writer.stats.orphan_files_deleted == 1
        [step] = store.steps_of("orphans")
        assert step.prompt_token_ids == synthetic_call(0, 64).prompt_token_ids
    finally:
        engine.dispose()


# ---- naming the fault ------------------------------------------------------------------------


def test_fault_reason_reads_sqlite_result_codes_from_real_sqlite_errors(tmp_path: Path) -> None:
    path = tmp_path / "codes.sqlite3"
    sqlite3.connect(path).execute("CREATE TABLE t (x)").connection.commit()
    holder = sqlite3.connect(path)
    holder.execute("BEGIN EXCLUSIVE")
    waiter = sqlite3.connect(path, timeout=0.05)
    with pytest.raises(sqlite3.OperationalError) as locked:
        waiter.execute("INSERT INTO t VALUES (1)")
    holder.rollback()
    read_only = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    with pytest.raises(sqlite3.OperationalError) as refused:
        read_only.execute("INSERT INTO t VALUES (1)")
    with pytest.raises(sqlite3.OperationalError) as cannot_open:
        sqlite3.connect(tmp_path / "missing" / "dir" / "x.sqlite3")
    with pytest.raises(sqlite3.IntegrityError) as bad_data:
        sqlite3.connect(":memory:").executescript(
            "CREATE TABLE u (x UNIQUE); INSERT INTO u VALUES (1); INSERT INTO u VALUES (1);"
        )
    assert [fault_reason(e.value) for e in (locked, refused, cannot_open, bad_data)] == [
        "locked",
        "read_only",
        "unreachable",
        "other",
    ]


def test_fault_reason_reads_postgres_sqlstates_and_os_errnos() -> None:
    # PostgreSQL's disk-full and admin-shutdown cannot be caused safely on a shared server, so
    # these are psycopg's own exception classes, which carry the SQLSTATE the server would send.
    cases = {
        psycopg.errors.DiskFull("x"): "disk_full",  # 53100
        psycopg.errors.LockNotAvailable("x"): "locked",  # 55P03
        psycopg.errors.DeadlockDetected("x"): "locked",  # 40P01
        psycopg.errors.QueryCanceled("x"): "locked",  # 57014, statement_timeout
        psycopg.errors.AdminShutdown("x"): "unreachable",  # 57P01
        psycopg.errors.CannotConnectNow("x"): "unreachable",  # 57P03
        psycopg.errors.ReadOnlySqlTransaction("x"): "read_only",  # 25006
        psycopg.errors.UniqueViolation("x"): "other",  # 23505: the data, not the storage
        psycopg.OperationalError("connection refused"): "unreachable",  # no SQLSTATE at all
        OSError(errno.ENOSPC, "No space left on device"): "disk_full",
        OSError(errno.EIO, "Input/output error"): "io_error",
        ValueError("not a storage fault"): "other",
    }
    assert {repr(exc): fault_reason(exc) for exc in cases} == {
        repr(exc): reason for exc, reason in cases.items()
    }


def test_a_trajectory_whose_payload_file_is_gone_fails_alone_without_a_backoff(
    pool_settings: PoolSettings,
) -> None:
    settings = pool_settings.model_copy(
        update={"compaction_min_steps": 1, "compaction_interval_s": 0}
    )
    engine = make_engine(settings.resolved_database_url())
    try:
        first = PoolStore(engine, settings)
        first.record_call("lost", synthetic_call(0, 64))
        PoolWriter(first, settings).upkeep()  # its payload is now only in a Parquet file
        [payload_file] = Path(settings.resolved_payload_uri()).iterdir()
        payload_file.unlink()  # lost behind the pool's back

        # A new process: its lineage memory must read the lost file to place the next step.
        writer = PoolWriter(PoolStore(engine, settings), settings).start()

        async def both() -> list[list[str] | BaseException]:
            return await asyncio.gather(
                writer.record("lost", synthetic_call(1, 64)),
                writer.record("healthy", synthetic_call(2, 64)),
                return_exceptions=True,
            )

        try:
            lost, healthy = asyncio.run(both())
            writer.check_accepting()  # no backoff: the storage itself is fine
        finally:
            writer.close()
        assert isinstance(lost, PoolUnavailableError)
        assert lost.reason == "other"
        assert "is missing" in lost.message
        assert isinstance(healthy, list) and len(healthy) == 1
        assert writer.stats.faults_by_reason == {"other": 1}
        assert writer.writable
        [stored] = PoolStore(engine, settings).steps_of("healthy")
        assert stored.prompt_token_ids == synthetic_call(2, 64).prompt_token_ids
    finally:
        engine.dispose()


def test_reading_a_step_whose_payload_file_is_gone_names_the_file_in_the_envelope(
    vllm: vllm_server.VLLMServer, pool_settings: PoolSettings
) -> None:
    settings = pool_settings.model_copy(update={"compaction_min_steps": 1})
    engine = make_engine(settings.resolved_database_url())
    try:
        store = PoolStore(engine, settings)
        [step_id] = store.record_call("lost-read", synthetic_call(0, 64))
        PoolWriter(store, settings).upkeep()
        [payload_file] = Path(settings.resolved_payload_uri()).iterdir()
        payload_file.unlink()
    finally:
        engine.dispose()
    with gateway_with(settings, free_port(), upstream_url=vllm.url) as gateway:
        response = httpx.get(f"{gateway.url}/api/steps/{step_id}")
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "payload_missing"
    assert payload_file.name in error["message"]


def test_a_compaction_that_loses_the_race_to_another_gateway_is_not_a_failure(
    pool_settings: PoolSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = pool_settings.model_copy(update={"compaction_min_steps": 1})
    engine_a = make_engine(settings.resolved_database_url())
    engine_b = make_engine(settings.resolved_database_url())
    try:
        store_a, store_b = PoolStore(engine_a, settings), PoolStore(engine_b, settings)
        store_a.record_call("raced", synthetic_call(0, 64))
        write_table = payload.pq.write_table

        def write_then_let_b_compact_first(*args: Any, **kwargs: Any) -> None:
            write_table(*args, **kwargs)  # A's file is written, not yet registered...
            monkeypatch.setattr(payload.pq, "write_table", write_table)
            store_b.payloads.compact(100)  # ...when gateway B compacts the same payloads

        monkeypatch.setattr(payload.pq, "write_table", write_then_let_b_compact_first)
        writer_a = PoolWriter(store_a, settings)
        writer_a.upkeep()  # does not raise

        assert writer_a.stats.compaction_failures == 0
        assert writer_a.stats.compacted_steps == 0
        [kept] = list(Path(settings.resolved_payload_uri()).iterdir())  # B's; A deleted its own
        with store_a.sessions() as session:
            assert session.scalars(select(PayloadFile.uri)).all() == [str(kept)]
        [step] = store_a.steps_of("raced")
        assert step.prompt_token_ids == synthetic_call(0, 64).prompt_token_ids
    finally:
        engine_a.dispose()
        engine_b.dispose()
