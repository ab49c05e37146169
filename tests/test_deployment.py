"""docker-compose.yml, the Dockerfile and .env.example, checked without a Docker engine.

What cannot run here (no engine, no GPU) is pinned to what does: the file validates against the
Compose specification (the ``compose-spec`` parser, strict about unknown keys, and
``docker compose config`` / ``docker-compose config`` when installed); every ``TRAJGATE_*``
variable it sets is a setting the code reads; and the gateway, migrate and trainer commands and
environments are the ones tests/test_replicas.py and tests/test_distributed.py run.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from compose_spec import PyCompose
from deployment_helpers import COMPOSE_FILE, ENV_EXAMPLE, ROOT, compose, compose_service_env
from pydantic_settings import BaseSettings
from tests_support import TRAJGATE

from datapool.batches.settings import BatchSettings
from datapool.settings import PoolSettings
from gateway.settings import GatewaySettings
from trainer_bridge.settings import DistributedSettings, TrainerSettings

SETTINGS: list[type[BaseSettings]] = [
    GatewaySettings,
    PoolSettings,
    BatchSettings,
    TrainerSettings,
    DistributedSettings,
]


def _env_names() -> set[str]:
    return {
        f"{cls.model_config.get('env_prefix', '')}{name}".upper()
        for cls in SETTINGS
        for name in cls.model_fields
    }


def test_compose_file_is_valid_against_the_compose_specification() -> None:
    PyCompose.from_yaml(yaml.safe_dump(compose()))  # raises ValueError, naming the key


def test_compose_config_accepts_the_file_when_a_compose_cli_is_installed(tmp_path: Path) -> None:
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    ):
        command = ["docker", "compose"]
    elif shutil.which("docker-compose"):
        command = ["docker-compose"]
    else:
        pytest.skip("no compose CLI here; the compose-spec check above still ran")
    done = subprocess.run(
        [*command, "-f", str(COMPOSE_FILE), "--env-file", str(ENV_EXAMPLE), "config", "-q"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr


def test_compose_runs_the_images_and_health_checks_a_gpu_host_needs() -> None:
    services = compose()["services"]
    assert {name: service.get("image") for name, service in services.items()} == {
        "postgres": "postgres:17",
        "vllm": "vllm/vllm-openai:v0.32.0",
        "migrate": "trajgate:latest",
        "gateway": "trajgate:latest",
        "lb": "nginx:1.28-alpine",
        "trainer": "trajgate:latest",
    }
    for name in ("postgres", "vllm", "gateway", "lb"):
        assert services[name]["healthcheck"]["test"], name
    assert services["gateway"]["deploy"]["replicas"] == 2
    for name in ("vllm", "trainer"):
        [device] = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"], name
    nginx = (ROOT / "deploy" / "nginx.conf").read_text()
    assert "server gateway:8000 resolve;" in nginx and "proxy_buffering off;" in nginx


def test_every_trajgate_variable_in_compose_is_a_setting_the_code_reads() -> None:
    used = {
        key
        for service in compose()["services"].values()
        for key in (service.get("environment") or {})
        if key.startswith("TRAJGATE_")
    }
    assert used - _env_names() == set()


def test_compose_commands_are_the_ones_the_tests_run(tmp_path: Path) -> None:
    services = compose()["services"]
    # tests/test_replicas.py: trajgate.bench.fleet.start_gateway runs `trajgate serve` with this env
    assert services["gateway"]["command"] == ["trajgate", "serve"]
    # tests/test_distributed.py: torchrun ... -m trainer_bridge.distributed with this env
    assert services["trainer"]["command"][0] == "torchrun"
    assert services["trainer"]["command"][-2:] == ["-m", "trainer_bridge.distributed"]
    # the migrate service, run here on a fresh SQLite pool with its own environment
    assert services["migrate"]["command"] == ["trajgate", "db", "upgrade"]
    env = compose_service_env(
        "migrate",
        {
            "TRAJGATE_DATABASE_URL": f"sqlite:///{tmp_path / 'pool.sqlite3'}",
            "TRAJGATE_DATA_DIR": str(tmp_path),
        },
    )
    done = subprocess.run(
        [TRAJGATE, *services["migrate"]["command"][1:]],
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "is at revision head" in done.stdout


def test_dockerfile_copies_every_package_and_serves_by_default() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    for package in ("gateway", "datapool", "trainer_bridge", "trajgate", "migrations"):
        assert f"COPY {package} ./{package}" in dockerfile
        assert (ROOT / package).is_dir()
    assert 'CMD ["trajgate", "serve"]' in dockerfile


def test_env_example_sets_every_required_variable() -> None:
    text = COMPOSE_FILE.read_text()
    required = {part.split(":?")[0] for part in text.split("${")[1:] if ":?" in part.split("}")[0]}
    example = ENV_EXAMPLE.read_text()
    assert {name for name in required if f"\n{name}=" not in f"\n{example}"} == set()
