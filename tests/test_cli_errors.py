"""A user's situation reads as one line on stderr, never a traceback.

`trajgate vllm start` and `trajgate demo` reuse a healthy server on the vLLM port; they must
first check that it is vLLM serving the expected model (another gateway or any web server
answers /health too) and otherwise refuse, naming the port and the fix. The CLI runs as a
subprocess, as a user runs it.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from gateway_helpers import gateway_with
from tests_support import free_port

from datapool.settings import PoolSettings
from trajgate import vllm_server
from trajgate.vllm_server import VLLMServer


class _AnswersEverything(BaseHTTPRequestHandler):
    """A web server that is not vLLM: ``health_status`` on /health, 404 elsewhere."""

    health_status = 200

    def do_GET(self) -> None:
        self.send_response(self.health_status if self.path == "/health" else 404)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def _not_vllm(health_status: int = 200) -> Iterator[int]:
    handler = type("Handler", (_AnswersEverything,), {"health_status": health_status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trajgate.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, (result.returncode, result.stdout[-2000:], result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def test_vllm_start_refuses_a_port_where_another_server_answers(tmp_path: Path) -> None:
    with _not_vllm() as port:
        line = _one_line_error(_cli("vllm", "start", "--port", str(port), cwd=tmp_path))
    assert f"port {port} answers /health but is not vLLM (GET /version answered 404)" in line
    assert "--port" in line  # the fix


def test_vllm_start_refuses_a_port_where_a_server_answers_but_not_health(
    tmp_path: Path,
) -> None:
    # python -m http.server answers 404 on /health: not healthy, but the port is taken
    with _not_vllm(health_status=404) as port:
        line = _one_line_error(_cli("vllm", "start", "--port", str(port), cwd=tmp_path))
    assert f"port {port} is in use by something that is not vLLM" in line
    assert "--port" in line


def test_vllm_start_refuses_a_vllm_serving_another_model(vllm: VLLMServer, tmp_path: Path) -> None:
    port = vllm.url.rsplit(":", 1)[1]
    other = tmp_path / "other-model"
    line = _one_line_error(
        _cli("vllm", "start", "--port", port, "--model", str(other), cwd=tmp_path)
    )
    assert f"port {port} answers /health but vLLM" in line
    assert "not 'other-model'" in line  # served under its directory's name, which vLLM lacks


def test_demo_refuses_a_vllm_port_taken_by_something_else(tmp_path: Path) -> None:
    with _not_vllm() as port:
        line = _one_line_error(
            _cli(
                "demo",
                "--model",
                "tiny",
                "--exit",
                "--port",
                str(free_port()),
                "--vllm-port",
                str(port),
                cwd=tmp_path,
            )
        )
    assert f"port {port} answers /health but is not vLLM" in line
    assert "--vllm-port" in line
    assert not (tmp_path / ".trajgate").exists()  # refused before any pool was made


def test_demo_refuses_a_gateway_port_in_use_before_starting_anything(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _one_line_error(
            _cli("demo", "--model", "tiny", "--exit", "--port", str(port), cwd=tmp_path)
        )
    assert f"port {port} is in use" in line and "--port" in line


def test_demo_refuses_one_port_for_the_gateway_and_vllm_before_starting_anything(
    tmp_path: Path,
) -> None:
    """Found by a review: the same port for both started vLLM there, then the gateway's start
    failed with a traceback and left vLLM running. Now refused before anything starts."""
    port = str(free_port())
    result = _cli("demo", "--exit", "--port", port, "--vllm-port", port, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"error: the gateway and vLLM cannot share port {port}"
    assert not (tmp_path / ".trajgate").exists()


def test_demo_refuses_sizes_it_could_not_train_on(tmp_path: Path) -> None:
    """No agents, no rounds, or groups of one rollout (no reward spread, so GRPO never
    trains): usage errors naming the flag, no traceback (``--agents 0`` was a ValueError of the
    thread pool after vLLM's start)."""
    for flag, value, least in (
        ("--agents", "0", 1),
        ("--rounds", "0", 1),
        ("--groups", "0", 1),
        ("--group-size", "1", 2),
    ):
        result = _cli("demo", "--exit", flag, value, cwd=tmp_path)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert f"Invalid value for '{flag}'" in result.stderr
        assert f"greater than or equal to {least}" in result.stderr
    assert not (tmp_path / ".trajgate").exists()


def test_vllm_that_exits_while_starting_leaves_no_pid_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stand-in for vLLM's environment whose python exits at once, as vLLM does when the model
    # cannot be served (a context longer than the weights', say).
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\nexit 3\n")
    python.chmod(0o755)
    (venv / "trajgate-vllm.txt").write_text(vllm_server.VLLM_PACKAGE)
    monkeypatch.setenv("TRAJGATE_HOME", str(tmp_path / "home"))
    port = free_port()
    with pytest.raises(vllm_server.VLLMStartError, match="exited with 3"):
        vllm_server.start(tmp_path, venv_dir=venv, port=port, log_path=tmp_path / "vllm.log")
    assert not (tmp_path / "home" / "run" / f"vllm-{port}.pid").exists()
    assert vllm_server.stop_on_port(port) is False  # nothing left to stop


def test_vllm_start_serves_a_model_under_its_own_name_and_context(tmp_path: Path) -> None:
    model = tmp_path / "SmolLM2-135M-Instruct"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 8192}')
    assert vllm_server.served_defaults(model) == ("SmolLM2-135M-Instruct", 8192)
    assert vllm_server.served_defaults(vllm_server.default_model_dir()) == ("tiny", 131072)
    bare = tmp_path / "bare"
    bare.mkdir()  # no config.json: the default context
    assert vllm_server.served_defaults(bare) == ("bare", vllm_server.MAX_MODEL_LEN)


def test_train_says_in_one_line_that_the_gateway_does_not_answer(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()  # nobody listens there
    result = _cli(
        "train",
        "--model-dir",
        str(tiny_model_dir),
        "--gateway-url",
        f"http://127.0.0.1:{port}",
        "--device",
        "cpu",
        cwd=tmp_path,
    )
    # the model loads first (transformers draws its progress bar on stderr), then one line
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: http://127.0.0.1:{port} did not answer (ConnectError"), line


def test_train_says_in_one_line_that_the_pool_refused_its_batch_spec(
    tiny_model_dir: Path, tmp_path: Path, sqlite_pool: PoolSettings
) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text('{"name": "x", "algorithm": "nope"}')
    with gateway_with(sqlite_pool, free_port()) as gateway:
        result = _cli(
            "train",
            "--model-dir",
            str(tiny_model_dir),
            "--gateway-url",
            gateway.url,
            "--device",
            "cpu",
            "--spec",
            str(spec),
            "--idle-exit-s",
            "1",
            cwd=tmp_path,
        )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: POST {gateway.url}/api/batches answered 400: "), line


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--device", "tpu", "setting 'device'"),
        (
            "--spec",
            "/nonexistent/spec.json",
            "error: --spec /nonexistent/spec.json: cannot read it",
        ),
    ],
)
def test_train_refuses_a_bad_flag_in_one_line_before_loading_anything(
    tmp_path: Path, flag: str, value: str, says: str
) -> None:
    result = _cli(
        "train", "--model-dir", str(tmp_path), flag, value, "--check-config", cwd=tmp_path
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert says in " ".join(result.stderr.split()), result.stderr


def test_batches_create_names_each_problem_of_a_bad_spec_on_its_own_line(
    tmp_path: Path, sqlite_pool: PoolSettings
) -> None:
    """Not pydantic's dump (type=, input_type=, a link per error) wrapped in a usage box: one
    line per problem (in the spec's field order), its field's path first, nothing materialised."""
    spec = tmp_path / "spec.json"
    spec.write_text(
        '{"reward_names": "final", "gamma": 2, "filters": {"statuss": ["complete"]}, "bogus": 1}'
    )
    url = sqlite_pool.resolved_database_url()
    result = _cli("batches", "create", "--spec", str(spec), "--database-url", url, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines() == [
        f"error: --spec {spec}: filters.statuss: Extra inputs are not permitted (got ['complete'])",
        f"error: --spec {spec}: reward_names: Input should be a valid list (got 'final')",
        f"error: --spec {spec}: gamma: Input should be less than or equal to 1 (got 2)",
        f"error: --spec {spec}: bogus: Extra inputs are not permitted (got 1)",
    ]
    listed = _cli("batches", "list", "--database-url", url, cwd=tmp_path)
    assert listed.returncode == 0 and listed.stdout == "", listed.stderr


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ('{"gamma": NaN}', "not valid JSON: NaN is not a JSON number"),  # the API refuses these
        ('{"gamma": Infinity}', "not valid JSON: Infinity is not a JSON number"),
        ('{"gamma": -Infinity}', "not valid JSON: -Infinity is not a JSON number"),
        ('{"gamma": 1e999}', "not valid JSON: the number 1e999 is beyond a 64-bit float"),
        ('{"gamma": ', "not valid JSON: Expecting value: line 1 column 11 (char 10)"),
        ("", "not valid JSON: Expecting value: line 1 column 1 (char 0)"),
        ("[]", "expected a JSON object, got list"),
        (None, "cannot read it: No such file or directory"),
        ("DIR", "cannot read it: Is a directory"),
    ],
)
def test_batches_create_refuses_an_unreadable_spec_in_one_line(
    tmp_path: Path, sqlite_pool: PoolSettings, content: str | None, problem: str
) -> None:
    """docs/batches.md: ``error: --spec FILE: <problem>``, exit 2, not Typer's usage box."""
    spec = tmp_path / "spec.json"
    if content == "DIR":
        spec.mkdir()
    elif content is not None:
        spec.write_text(content)
    url = sqlite_pool.resolved_database_url()
    result = _cli("batches", "create", "--spec", str(spec), "--database-url", url, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines() == [f"error: --spec {spec}: {problem}"]


def test_batches_create_blames_a_bad_flag_on_the_flag_not_the_spec_file(
    tmp_path: Path, sqlite_pool: PoolSettings
) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text('{"gamma": 2}')
    url = sqlite_pool.resolved_database_url()
    result = _cli(
        "batches", "create", "--spec", str(spec), "--algorithm", "ppo", "--database-url", url,
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("error: --algorithm: Input should be 'grpo'"), lines
    assert lines[0].endswith("(got 'ppo')"), lines
    assert lines[1:] == [
        f"error: --spec {spec}: gamma: Input should be less than or equal to 1 (got 2)"
    ]


@pytest.mark.parametrize("command", [["export", "trajectories"], ["batches", "export", "b-1"]])
def test_an_export_to_a_folder_that_does_not_exist_is_refused_before_reading_the_pool(
    tmp_path: Path, sqlite_pool: PoolSettings, command: list[str]
) -> None:
    """An empty pool writes no row, so without the check nothing would open the file and the
    export would report success for a file that was never created."""
    out = tmp_path / "missing" / "rows.parquet"
    url = sqlite_pool.resolved_database_url()
    result = _cli(*command, "--out", str(out), "--database-url", url, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    said = " ".join(result.stderr.split())  # rich wraps the message in a box
    assert "Invalid value for --out: no directory" in said and "rows.parquet in" in said, said
    assert not out.parent.exists()
