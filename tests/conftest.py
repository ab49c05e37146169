"""Shared fixtures: the real vLLM (once per run), real SQLite and PostgreSQL pools, a gateway.

The vLLM fixture never skips: a missing environment fails the run with the command to fix it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url
from tests_support import free_port

from datapool import db
from datapool.settings import PoolSettings
from gateway.app import create_app
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings
from trajgate import tinymodel, vllm_server

POSTGRES_ADMIN_URL = os.environ.get(
    "TRAJGATE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return tinymodel.generate(vllm_server.default_model_dir())


@pytest.fixture(scope="session")
def vllm(tiny_model_dir: Path) -> Iterator[vllm_server.VLLMServer]:
    """A real vLLM server (CPU build) serving the tiny model, owned by this test run."""
    if not vllm_server.is_installed(vllm_server.default_venv_dir()):
        pytest.fail(
            f"no vLLM environment at {vllm_server.default_venv_dir()}: run "
            "`.venv/bin/trajgate vllm install` (or `bash scripts/setup.sh`) first",
            pytrace=False,
        )
    port = int(os.environ.get("TRAJGATE_TEST_VLLM_PORT", free_port()))
    server = vllm_server.start(tiny_model_dir, port=port)
    yield server
    server.stop()


def _create_postgres_database() -> str:
    """A fresh, uniquely named database on the local PostgreSQL; returns its URL."""
    admin = make_url(POSTGRES_ADMIN_URL)
    name = f"trajgate_test_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(
            host=admin.host,
            port=admin.port,
            user=admin.username,
            dbname=admin.database,
            autocommit=True,
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL at {POSTGRES_ADMIN_URL} is not reachable: {exc}", pytrace=False)
    return admin.set(database=name).render_as_string(hide_password=False)


def _drop_postgres_database(url: str) -> None:
    admin = make_url(POSTGRES_ADMIN_URL)
    name = make_url(url).database
    with psycopg.connect(
        host=admin.host,
        port=admin.port,
        user=admin.username,
        dbname=admin.database,
        autocommit=True,
    ) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database of each backend: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'pool.sqlite3'}"
        return
    url = _create_postgres_database()
    yield url
    _drop_postgres_database(url)


@pytest.fixture
def pool_settings(empty_database_url: str, tmp_path: Path) -> PoolSettings:
    db.upgrade(empty_database_url)
    return PoolSettings(data_dir=tmp_path / "data", database_url=empty_database_url)


@pytest.fixture
def sqlite_pool(tmp_path: Path) -> PoolSettings:
    """A SQLite pool only, for tests whose storage paths are tested on both backends elsewhere."""
    url = f"sqlite:///{tmp_path / 'pool.sqlite3'}"
    db.upgrade(url)
    return PoolSettings(data_dir=tmp_path / "data", database_url=url)


@pytest.fixture
def gateway(
    vllm: vllm_server.VLLMServer, pool_settings: PoolSettings
) -> Iterator[BackgroundServer]:
    """The gateway on a free port, in front of the real vLLM, writing to each backend's pool."""
    settings = GatewaySettings(upstream_url=vllm.url, port=free_port())
    server = BackgroundServer(create_app(settings, pool_settings), port=settings.port).start()
    yield server
    server.stop()
