"""Parquet on an S3-compatible object store, through the same pyarrow-filesystem code path as
local directories: ``TRAJGATE_PAYLOAD_URI`` and ``TRAJGATE_BATCH_URI`` set to ``s3://`` URIs.

The server is moto's S3 HTTP server (``moto[server]``, a real HTTP endpoint speaking the S3 API)
run locally; credentials and endpoint come from the standard ``AWS_*`` variables, as in
docker-compose.yml, never from the URI (which the pool stores in its database)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from batch_helpers import agent_turns, make_store, write_trajectory
from moto.server import ThreadedMotoServer
from tests_support import free_port

from datapool.batches.build import BatchSpec, get_batch, materialise, read_rows
from datapool.batches.settings import BatchSettings
from datapool.models import PayloadFile
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore
from datapool.steps.writer import PoolWriter

BUCKET = "trajgate-test"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    pafs.S3FileSystem(
        endpoint_override=endpoint, region="us-east-1", allow_bucket_creation=True
    ).create_dir(BUCKET)
    yield endpoint
    server.stop()


def test_compaction_writes_payloads_to_s3_and_reads_them_back_exactly(
    s3: str, pool_settings: PoolSettings
) -> None:
    settings = pool_settings.model_copy(update={"payload_uri": f"s3://{BUCKET}/payloads"})
    store = PoolStore(make_store(pool_settings).engine, settings)
    turns = {f"t{seed}": agent_turns(seed, 4) for seed in (1, 2, 3)}
    for trajectory_id, calls in turns.items():
        write_trajectory(store, trajectory_id, calls, complete=False)
    PoolWriter(store, settings.model_copy(update={"compaction_min_steps": 1})).upkeep()

    assert store.payloads.pending_steps() == 0
    with store.sessions() as session:
        [file] = session.query(PayloadFile).all()
    assert file.uri.startswith(f"s3://{BUCKET}/payloads/payloads-") and file.steps == 12
    stored = pafs.S3FileSystem(endpoint_override=s3).get_file_info(file.uri.removeprefix("s3://"))
    assert stored.size == file.size_bytes > 0
    fresh = PoolStore(make_store(pool_settings).engine, settings)  # nothing cached
    for trajectory_id, calls in turns.items():
        steps = fresh.steps_of(trajectory_id)
        assert [(s.prompt_token_ids, s.response_token_ids) for s in steps] == calls
        assert all(s.payload_file_id == file.id for s in steps)


def test_batches_write_to_s3_and_read_back(s3: str, pool_settings: PoolSettings) -> None:
    store = make_store(pool_settings)
    for seed in (1, 2):
        write_trajectory(store, f"t{seed}", agent_turns(seed, 2), reward=float(seed))
    batch_settings = BatchSettings(batch_uri=f"s3://{BUCKET}/batches")
    batch = materialise(store, BatchSpec(algorithm="sft"), batch_settings)

    assert batch.uri == f"s3://{BUCKET}/batches/{batch.id}/rows.parquet"
    rows = read_rows(get_batch(store, batch.id))
    assert rows.num_rows == batch.rows == 4
    local = materialise(
        store,
        BatchSpec(algorithm="sft", exclude_batched=False),
        BatchSettings(batch_uri=str(Path(pool_settings.data_dir) / "batches")),
    )
    assert (
        read_rows(get_batch(store, local.id))
        .select(["input_ids", "loss_mask"])
        .equals(rows.select(["input_ids", "loss_mask"]))
    )  # the same rows as through a local directory
