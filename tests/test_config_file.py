"""``TRAJGATE_CONFIG=path.toml`` configures every component: top-level keys for ``TRAJGATE_*``
settings, ``[trainer]`` and ``[emulator]`` tables for theirs; the environment wins over the file,
code (CLI flags) over both; a key no setting knows is refused with its name. The known keys come
from one explicit list of settings classes (``trajgate.config.SETTINGS_CLASSES``), which names
every settings class and none that imports torch; the example file of docs/deployment.md is
loaded by every entry point, each in its own process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from datapool.batches.settings import BatchSettings
from datapool.settings import PoolSettings
from gateway.settings import GatewaySettings
from trainer_bridge.settings import DistributedSettings, TrainerSettings
from trajgate.bench.emulator import EmulatorSettings
from trajgate.config import SETTINGS_CLASSES, ConfigFileError, describe

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# Imports every module of the four packages, then names every ConfigFileSettings subclass.
FIND_SETTINGS_CLASSES = """
import importlib, json, pkgutil
from trajgate.config import ConfigFileSettings
for package in ("trajgate", "gateway", "datapool", "trainer_bridge"):
    for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        importlib.import_module(info.name)
def subclasses(cls):
    return [found for sub in cls.__subclasses__() for found in (sub, *subclasses(sub))]
print(json.dumps([f"{c.__module__}:{c.__qualname__}" for c in subclasses(ConfigFileSettings)]))
"""
# Resolves the list, then names the heavy modules that came with it.
RESOLVE_SETTINGS_CLASSES = """
import json, sys
from trajgate.config import settings_classes
settings_classes()
heavy = {"torch", "transformers", "peft"}
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & heavy)))
"""
# Each entry point with the flag that loads its settings, prints them and exits.
ENTRY_POINTS = {
    "trajgate serve": [str(BIN / "trajgate"), "serve", "--check-config"],
    "trajgate train": [str(BIN / "trajgate"), "train", "--check-config"],
    "torchrun": [
        str(BIN / "torchrun"),
        "--standalone",
        "--nproc-per-node=1",
        "-m",
        "trainer_bridge.distributed",
        "--check-config",
    ],
}

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


def test_describe_hides_tokens_and_url_passwords() -> None:
    report = describe(
        PoolSettings(database_url="postgresql+psycopg://trajgate:secret@db/trajgate"),
        GatewaySettings(admin_token="tg-admin"),
    )
    assert report["PoolSettings"]["database_url"] == "postgresql+psycopg://trajgate:***@db/trajgate"
    assert report["GatewaySettings"]["admin_token"] == "***"
    assert report["GatewaySettings"]["upstream_url"] == "http://127.0.0.1:8100"  # not a secret


def test_settings_classes_name_every_config_file_settings_class() -> None:
    done = subprocess.run(
        [sys.executable, "-c", FIND_SETTINGS_CLASSES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(json.loads(done.stdout)) == sorted(SETTINGS_CLASSES)


def test_settings_classes_resolve_without_torch_transformers_or_peft() -> None:
    done = subprocess.run(
        [sys.executable, "-c", RESOLVE_SETTINGS_CLASSES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == []


def _deployment_doc_config() -> str:
    """The TOML block under "## The configuration file" in docs/deployment.md."""
    doc = (ROOT / "docs" / "deployment.md").read_text()
    section = doc.split("## The configuration file", 1)[1]
    found = re.search(r"```toml\n(.*?)```", section, re.DOTALL)
    assert found is not None, "docs/deployment.md lost its example configuration"
    return found.group(1)


def _run_with_config(
    entry_point: str, config: str, tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "trajgate.toml"
    path.write_text(config)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJGATE_")}
    return subprocess.run(
        ENTRY_POINTS[entry_point],
        cwd=tmp_path,
        env={**env, "TRAJGATE_CONFIG": str(path), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("entry_point", sorted(ENTRY_POINTS))
def test_every_entry_point_loads_the_deployment_doc_config(
    entry_point: str, tmp_path: Path
) -> None:
    done = _run_with_config(entry_point, _deployment_doc_config(), tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)  # one JSON object: {settings class: {field: value}}
    if entry_point == "trajgate serve":  # the top-level keys
        assert report["PoolSettings"]["database_url"] == (
            "postgresql+psycopg://trajgate:***@db/trajgate"  # the doc's password, hidden
        )
        assert report["PoolSettings"]["payload_uri"] == "s3://trajgate/payloads"
        assert report["BatchSettings"]["batch_uri"] == "s3://trajgate/batches"
        assert report["GatewaySettings"]["upstream_url"] == "http://vllm-0:8000,http://vllm-1:8000"
    else:  # [trainer]
        assert report["TrainerSettings"]["model_dir"] == "/models/base"
        assert report["TrainerSettings"]["lora_rank"] == 16
    if entry_point == "torchrun":
        assert report["DistributedSettings"]["pool_url"] == "http://lb:8000"


@pytest.mark.parametrize("entry_point", sorted(ENTRY_POINTS))
def test_every_entry_point_refuses_an_unknown_key_with_its_name(
    entry_point: str, tmp_path: Path
) -> None:
    config = _deployment_doc_config().replace("lora_rank = 16", "lora_rnak = 16")
    assert "lora_rnak" in config  # the doc's example still sets lora_rank
    done = _run_with_config(entry_point, config, tmp_path)
    assert done.returncode != 0
    assert "unknown keys ['trainer.lora_rnak']" in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("command", "env", "field"),
    [
        (["serve", "--check-config"], {"TRAJGATE_ON_WRITE_FAILURE": "bogus"}, "on_write_failure"),
        (
            ["serve", "--check-config"],
            {"TRAJGATE_DATABASE_LOCK_TIMEOUT_MS": "-1"},
            "database_lock_timeout_ms",
        ),
        # An unsafe start (beyond loopback without an admin token) is refused the same way.
        (
            ["serve", "--host", "0.0.0.0", "--check-config"],
            {"TRAJGATE_ADMIN_TOKEN": ""},
            "GatewaySettings",
        ),
    ],
)
def test_a_bad_setting_value_is_a_short_error_naming_the_field_not_a_traceback(
    command: list[str], env: dict[str, str], field: str
) -> None:
    from tests_support import TRAJGATE

    done = subprocess.run(
        [TRAJGATE, *command],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"error: setting '{field}") and "TRAJGATE_CONFIG" in line


@pytest.mark.parametrize(
    ("env", "named"),
    [
        # A refusing channel whose own defaults narrow: every call leaving temperature out
        # would be refused (c33e4f1 refused it at start, but --check-config passed it).
        (
            {
                "TRAJGATE_SAMPLING_POLICY": '{"eval": "refuse"}',
                "TRAJGATE_SAMPLING_DEFAULTS": '{"eval": {"temperature": 0}}',
            },
            "channel 'eval'",
        ),
        ({"TRAJGATE_REWARD_FUNCTIONS": '["no_such_reward_fn"]'}, "no_such_reward_fn"),
    ],
)
def test_serve_check_config_refuses_what_serve_refuses_at_start(
    env: dict[str, str], named: str
) -> None:
    from tests_support import TRAJGATE

    done = subprocess.run(
        [TRAJGATE, "serve", "--check-config"],
        env={**os.environ, **env, "COLUMNS": "200"},  # the usage box on one line
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout
    assert "Traceback" not in done.stderr
    assert named in done.stderr
    assert done.stdout == ""  # no settings printed as if they were fine


def test_a_refused_admin_token_is_never_echoed() -> None:
    """A weak token beyond loopback is refused in one line that does not print the token."""
    from tests_support import TRAJGATE

    done = subprocess.run(
        [TRAJGATE, "serve", "--host", "0.0.0.0", "--check-config"],
        env={**os.environ, "TRAJGATE_ADMIN_TOKEN": "weak-tok"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: setting ") and "admin" in line.lower()
    assert "weak-tok" not in done.stderr + done.stdout


def test_trajgate_train_finds_the_gateway_in_the_config_file(tmp_path: Path) -> None:
    """``trajgate train`` without flags uses the [trainer] table's pool and consumer (it used its
    own localhost defaults); a flag still wins. It reaches vLLM through the gateway only."""
    path = tmp_path / "trajgate.toml"
    path.write_text(
        '[trainer]\nmodel_dir = "/models/base"\npool_url = "http://lb:8000"\n'
        'vllm_urls = "http://vllm-0:8000, http://vllm-1:8000"\nconsumer = "run-7"\n'
    )
    env = {**os.environ, "TRAJGATE_CONFIG": str(path)}

    def services(*flags: str) -> dict[str, Any]:
        done = subprocess.run(
            [str(BIN / "trajgate"), "train", "--check-config", *flags],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return dict(json.loads(done.stdout)["services"])

    found = services()
    assert found["gateway_url"] == "http://lb:8000"
    assert "vllm_urls" not in found
    assert found["consumer"] == "run-7"
    assert services("--gateway-url", "http://gw:9000")["gateway_url"] == "http://gw:9000"
