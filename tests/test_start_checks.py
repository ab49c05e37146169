"""Settings that cannot run are refused at start, in one line, by `trajgate serve` and by
`serve --check-config` alike; pool commands say an unknown id in one line.

Found by a new user's tryout: a default lease above the longest allowed passed the start and
then made every lease a 400; a garbage database URL passed ``--check-config`` and made ``serve``
die with a traceback; a reward list that is not JSON printed pydantic-settings' traceback; an
upstream URL without a scheme passed; ``demo --max-staleness -1`` was taken. The CLI runs as a
subprocess, as a user runs it (with this checkout on PYTHONPATH when the tests have it).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from datapool.batches.settings import BatchSettings
from datapool.errors import InvalidPoolRequestError
from datapool.settings import PoolSettings
from gateway.app import check_settings
from gateway.settings import GatewaySettings
from trajgate.demo import DemoConfig


def _cli(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trajgate.cli", *args],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _one_line_error(result: subprocess.CompletedProcess[str], rc: int) -> str:
    assert result.returncode == rc, (result.returncode, result.stdout[-2000:], result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        (
            "TRAJGATE_DATABASE_URL",
            "garbage://x",
            "setting 'database_url': Value error, SQLAlchemy has no dialect 'garbage'",
        ),
        ("TRAJGATE_DATABASE_URL", "not a url", "setting 'database_url': Value error, not a"),
        (
            "TRAJGATE_REWARD_FUNCTIONS",
            "not json",
            'error parsing value for field "reward_functions"',
        ),
        (
            "TRAJGATE_UPSTREAM_URL",
            "notaurl",
            "setting 'upstream_url': Value error, expected an http:// or https:// URL with a host",
        ),
        ("TRAJGATE_UPSTREAM_URL", "http://127.0.0.1:8100,ftp://x", "(got 'http://127.0.0.1"),
    ],
)
@pytest.mark.parametrize("check_only", [True, False])
def test_serve_refuses_a_setting_that_cannot_run_in_one_line(
    tmp_path: Path, variable: str, value: str, says: str, check_only: bool
) -> None:
    args = ("serve", "--port", "1", "--check-config") if check_only else ("serve", "--port", "1")
    line = _one_line_error(_cli(*args, cwd=tmp_path, **{variable: value}), rc=2)
    assert says in line, line
    assert not (tmp_path / ".trajgate").exists()  # nothing was created or migrated


def test_serve_refuses_a_default_lease_longer_than_the_longest(tmp_path: Path) -> None:
    for args in (("serve", "--check-config"), ("serve", "--port", "1")):
        result = _cli(*args, cwd=tmp_path, TRAJGATE_LEASE_DEFAULT_S="100000")
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        said = " ".join(result.stderr.replace("│", " ").split())
        assert "Invalid value for TRAJGATE_LEASE_DEFAULT_S" in said
        assert "lease_default_s (100000 s) exceeds lease_max_s (86400 s)" in said
    assert not (tmp_path / ".trajgate").exists()


def test_check_settings_takes_a_default_lease_up_to_the_longest(tmp_path: Path) -> None:
    pool = PoolSettings(data_dir=tmp_path)
    check_settings(GatewaySettings(), pool, BatchSettings(lease_default_s=60, lease_max_s=60))
    with pytest.raises(InvalidPoolRequestError, match=r"\(60.5 s\) exceeds lease_max_s \(60 s\)"):
        check_settings(GatewaySettings(), pool, BatchSettings(lease_default_s=60.5, lease_max_s=60))


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:////tmp/pool.sqlite3",
        "postgresql+psycopg://user:pw@db.example:5432/pool",
        "postgres://user@db.example/pool",  # read as psycopg's: the driver installed
        "postgresql://user@db.example/pool",
    ],
)
def test_pool_settings_take_a_database_url_sqlalchemy_can_use(url: str) -> None:
    assert PoolSettings(database_url=url).database_url == url


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("garbage://x", "SQLAlchemy has no dialect 'garbage'"),
        ("pool.sqlite3", "not a SQLAlchemy URL"),
        ("mysql+nosuchdriver://u@h/d", "SQLAlchemy has no dialect 'mysql+nosuchdriver'"),
    ],
)
def test_pool_settings_refuse_a_database_url_sqlalchemy_cannot_use(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        PoolSettings(database_url=url)


def test_pool_settings_refuse_a_database_url_whose_driver_is_not_installed() -> None:
    if importlib.util.find_spec("pymysql") is not None:
        pytest.skip("pymysql is installed here: no missing driver to name")
    with pytest.raises(ValueError, match=r"the driver of 'mysql\+pymysql' is not installed"):
        PoolSettings(database_url="mysql+pymysql://u@h/d")


def test_a_refused_database_url_shows_no_password(tmp_path: Path) -> None:
    line = _one_line_error(
        _cli(
            "serve",
            "--check-config",
            cwd=tmp_path,
            TRAJGATE_DATABASE_URL="garbage://user:s3cret-pw@host/db",
        ),
        rc=2,
    )
    assert "s3cret-pw" not in line and "(got 'garbage://user:***@host/db')" in line


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:8100", "https://vllm.example", "http://a:1, http://[::1]:8100/"],
)
def test_gateway_settings_take_http_upstream_urls(url: str) -> None:
    assert GatewaySettings(upstream_url=url).upstream_url == url


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("notaurl", "expected an http:// or https:// URL with a host"),
        ("127.0.0.1:8100", "expected an http:// or https:// URL with a host"),
        ("unix:///tmp/vllm.sock", "expected an http:// or https:// URL with a host"),
        ("http://", "expected an http:// or https:// URL with a host"),
        ("http://vllm:99999", "not a URL"),
        (" , ", "names no replica"),
    ],
)
def test_gateway_settings_refuse_an_upstream_url_without_http_scheme_or_host(
    url: str, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        GatewaySettings(upstream_url=url)


def test_demo_refuses_a_negative_staleness_before_starting_anything(tmp_path: Path) -> None:
    result = _cli("demo", "--exit", "--max-staleness", "-1", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    said = " ".join(result.stderr.replace("│", " ").split())  # rich wraps the panel's lines
    assert "Invalid value for '--max-staleness': Input should be greater than or equal to 0" in said
    assert not (tmp_path / ".trajgate").exists()
    with pytest.raises(ValueError, match="max_staleness_versions must be >= 0, got -1"):
        DemoConfig(max_staleness_versions=-1)


def test_batches_export_of_an_unknown_batch_is_one_line(tmp_path: Path) -> None:
    assert _cli("db", "upgrade", "--data-dir", "pool", cwd=tmp_path).returncode == 0
    line = _one_line_error(
        _cli("batches", "export", "nope", "--out", "x", "--data-dir", "pool", cwd=tmp_path), rc=1
    )
    assert line == "error: no batch 'nope'"
    assert not (tmp_path / "x").exists()
    # and the other batch commands that read the pool: nothing to batch, a spec that is not JSON
    line = _one_line_error(_cli("batches", "create", "--data-dir", "pool", cwd=tmp_path), rc=1)
    assert line.startswith("error: no ready data for this spec: ")
    (tmp_path / "spec.json").write_text('{"name":')
    line = _one_line_error(
        _cli("batches", "create", "--spec", "spec.json", "--data-dir", "pool", cwd=tmp_path), rc=2
    )
    assert line.startswith("error: --spec spec.json: not valid JSON: "), line
