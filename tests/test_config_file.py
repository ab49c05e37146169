"""``TRAJGATE_CONFIG=path.toml`` configures every component: top-level keys for ``TRAJGATE_*``
settings, ``[trainer]`` and ``[emulator]`` tables for theirs; the environment wins over the file,
code (CLI flags) over both; a key no setting knows is refused with its name."""

from __future__ import annotations

from pathlib import Path

import pytest

from datapool.batches.settings import BatchSettings
from datapool.settings import PoolSettings
from gateway.settings import GatewaySettings
from trainer_bridge.distributed import DistributedSettings
from trainer_bridge.trainer import TrainerSettings
from trajgate.bench.emulator import EmulatorSettings
from trajgate.config import ConfigFileError

CONFIG = """
database_url = "postgresql+psycopg://trajgate@db/trajgate"
payload_uri = "s3://bucket/payloads"
batch_uri = "s3://bucket/batches"
upstream_url = "http://vllm-0:8000,http://vllm-1:8000"
port = 9001

[trainer]
model_dir = "/models/base"
lora_rank = 16
pool_url = "http://lb:8000"

[emulator]
port = 8300
"""


def test_every_settings_class_reads_its_part_of_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "trajgate.toml"
    path.write_text(CONFIG)
    monkeypatch.setenv("TRAJGATE_CONFIG", str(path))
    monkeypatch.setenv("TRAJGATE_PORT", "9002")  # the environment wins over the file

    pool = PoolSettings()
    assert pool.database_url == "postgresql+psycopg://trajgate@db/trajgate"
    assert pool.payload_uri == "s3://bucket/payloads"
    assert BatchSettings().batch_uri == "s3://bucket/batches"
    gateway = GatewaySettings()
    assert gateway.upstream_urls == ["http://vllm-0:8000", "http://vllm-1:8000"]
    assert gateway.port == 9002
    assert GatewaySettings(port=9003).port == 9003  # code (a CLI flag) wins over both
    trainer = TrainerSettings()  # type: ignore[call-arg]  # model_dir comes from the file
    assert (trainer.model_dir, trainer.lora_rank) == (Path("/models/base"), 16)
    assert DistributedSettings().pool_url == "http://lb:8000"
    assert EmulatorSettings().port == 8300  # [emulator], not the gateway's top-level port


def test_an_unknown_key_in_the_config_file_is_refused_with_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "trajgate.toml"
    path.write_text('databse_url = "sqlite://"\n[trainer]\nlora_rnak = 4\n')
    monkeypatch.setenv("TRAJGATE_CONFIG", str(path))
    with pytest.raises(ConfigFileError, match=r"\['databse_url', 'trainer.lora_rnak'\]"):
        PoolSettings()


def test_without_trajgate_config_the_defaults_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAJGATE_CONFIG", raising=False)
    assert PoolSettings().database_url is None
    assert GatewaySettings().port == 8000
