"""A gateway host installs the core alone: ``pip install <repo>`` with no extra, into a fresh
virtual environment (a real install of the core dependencies; pip's cache makes it quick). There
torch, transformers and peft are not importable, yet ``trajgate serve`` migrates a SQLite pool,
proxies a chat call to the real vLLM and records the step with its token IDs and logprobs.

The repository is copied first (without caches and build output), so a stale ``build/`` of an
earlier run can never put a removed module into the wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests_support import free_port

from trajgate.vllm_server import VLLMServer

ROOT = Path(__file__).resolve().parent.parent
NOT_SOURCES = shutil.ignore_patterns(
    ".git",
    ".venv",
    ".trajgate",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    "test-artifacts",
)
# Imports every module of the gateway and the pool: none may need what only extras bring.
IMPORT_GATEWAY_AND_POOL = """
import importlib, pkgutil
for package in ("gateway", "datapool"):
    for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        importlib.import_module(info.name)
"""
INSTALL_TIMEOUT_S = 900  # a cold pip cache downloads pyarrow, uvloop, psycopg's binary, ...
SERVE_READY_TIMEOUT_S = 60


def _clean_env(**variables: str) -> dict[str, str]:
    """This process's environment without trajgate settings or a Python path into the repo."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TRAJGATE_", "PYTHON", "VIRTUAL_ENV"))
    }
    return {**env, **variables}


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with ``pip install <copy of the repo>`` and no extra."""
    base = tmp_path_factory.mktemp("core-install")
    source = base / "trajgate"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCES)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(source)],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return venv


@pytest.fixture
def core_gateway(core_venv: Path, vllm: VLLMServer, tmp_path: Path) -> Iterator[str]:
    """``trajgate serve`` of the core environment on a SQLite pool, in front of the real vLLM."""
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [
            str(core_venv / "bin" / "trajgate"),
            "serve",
            "--upstream",
            vllm.url,
            "--port",
            str(port),
            "--data-dir",
            str(tmp_path / "data"),
        ],
        cwd=tmp_path,  # not the repo: only the installed copy is importable
        env=_clean_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVE_READY_TIMEOUT_S
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def test_the_core_install_has_no_torch_transformers_or_peft(core_venv: Path) -> None:
    for module in ("torch", "transformers", "peft"):
        done = subprocess.run(
            [str(core_venv / "bin" / "python"), "-c", f"import {module}"],
            env=_clean_env(),
            cwd=core_venv,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 1, f"{module} is importable in the core install"
        assert f"No module named '{module}'" in done.stderr


def test_every_gateway_and_pool_module_imports_in_the_core_install(core_venv: Path) -> None:
    done = subprocess.run(
        [str(core_venv / "bin" / "python"), "-c", IMPORT_GATEWAY_AND_POOL],
        env=_clean_env(),
        cwd=core_venv,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_core_install_serves_and_records_a_step_with_its_token_ids(
    core_gateway: str,
) -> None:
    answer = httpx.post(
        f"{core_gateway}/t/core-1/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "What is the temperature in Oslo?"}],
            "max_tokens": 5,
        },
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    step_id = answer.headers["x-trajgate-step-id"]

    detail = httpx.get(f"{core_gateway}/api/trajectories/core-1", timeout=30).json()
    assert [step["id"] for step in detail["steps"]] == [step_id]
    step = httpx.get(f"{core_gateway}/api/steps/{step_id}", timeout=30).json()
    assert step["outcome"] == "ok"
    # vLLM's own counts: the stored IDs are exactly the ones it used and sampled
    assert len(step["prompt_token_ids"]) == usage["prompt_tokens"]
    assert len(step["response_token_ids"]) == usage["completion_tokens"]
    assert len(step["response_logprobs"]) == usage["completion_tokens"]
    assert not {"ids_missing", "ids_incomplete", "prompt_ids_missing"} & set(step["flags"])

    # completion runs the reward functions and curation rules, in the same process
    completed = httpx.post(
        f"{core_gateway}/api/trajectories/core-1/complete", json={"reward": 1.0}, timeout=60
    )
    assert completed.status_code == 200, completed.text
    assert completed.json()["status"] == "complete"


def test_a_command_that_needs_an_extra_names_it_in_the_core_install(
    core_venv: Path, tmp_path: Path
) -> None:
    done = subprocess.run(
        [str(core_venv / "bin" / "trajgate"), "train", "--model-dir", str(tmp_path)],
        env=_clean_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "pip install 'trajgate[train]'" in done.stderr
