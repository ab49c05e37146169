"""SIGTERM to the demo stops the vLLM it started, as Ctrl-C does.

Found by a tryout: ``kill`` of ``trajgate demo`` left its vLLM running (3 GB, its port held),
since Python's default SIGTERM ends the process without running a ``finally``. The demo now runs
under ``trajgate.demo.sigterm_as_interrupt`` and ``vllm_server.start`` stops a server it is
still waiting for when interrupted.

A whole demo is not run: the seam is ``vllm_server.start`` under ``sigterm_as_interrupt`` in a
driver process, in the shape of ``run_demo`` (start, then a ``finally`` that stops). vLLM is
stood in for by a real short-lived child process in vLLM's place (its environment's python, a
script): one that never becomes healthy (SIGTERM while vLLM loads, minutes for the real one) and
one that answers /health (SIGTERM while the demo runs). The real vLLM is not started: it takes
minutes and gigabytes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from tests_support import free_port

from trajgate import vllm_server

# vLLM's stand-in: answers GET /health with 200 on the --port it is given, as vLLM does once
# loaded; everything else 404.
_HEALTHY_SERVER = textwrap.dedent(
    """
    import sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    port = int(sys.argv[sys.argv.index("--port") + 1])
    HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)

# The demo's shape: start vLLM under the SIGTERM handler, work, stop it in a finally.
_DRIVER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from trajgate import vllm_server
    from trajgate.demo import sigterm_as_interrupt

    model, venv, port, log = sys.argv[1:5]
    try:
        with sigterm_as_interrupt():
            server = vllm_server.start(
                Path(model), venv_dir=Path(venv), port=int(port), log_path=Path(log),
                ready_timeout_s=120,
            )
            try:
                print("serving", flush=True)
                time.sleep(120)
            finally:
                server.stop()
    except KeyboardInterrupt:
        print("stopped", flush=True)
        sys.exit(130)
    """
)


def _stand_in_venv(tmp_path: Path, healthy: bool) -> Path:
    """A directory ``vllm_server`` takes for vLLM's environment, whose python runs the stand-in:
    the health server above, or a sleep that never answers."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    if healthy:
        (venv / "server.py").write_text(_HEALTHY_SERVER)
        python.write_text(f'#!/bin/sh\nexec {sys.executable} {venv / "server.py"} "$@"\n')
    else:
        python.write_text("#!/bin/sh\nexec sleep 120\n")
    python.chmod(0o755)
    (venv / "trajgate-vllm.txt").write_text(vllm_server.VLLM_PACKAGE)
    return venv


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("healthy", [False, True], ids=["while-loading", "while-serving"])
def test_sigterm_to_the_demo_stops_the_vllm_it_started(tmp_path: Path, healthy: bool) -> None:
    venv = _stand_in_venv(tmp_path, healthy)
    home = tmp_path / "home"
    port = free_port()
    pid_file = home / "run" / f"vllm-{port}.pid"
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, str(tmp_path), str(venv), str(port), str(tmp_path / "log")],
        env={**os.environ, "TRAJGATE_HOME": str(home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert driver.stdout is not None
        if healthy:
            assert driver.stdout.readline() == "serving\n"  # start returned: vLLM is up
        else:
            while not pid_file.exists() and driver.poll() is None:
                time.sleep(0.05)  # vLLM is loading: start is waiting for /health
        vllm_pid = int(pid_file.read_text())
        assert _alive(vllm_pid)
        driver.send_signal(signal.SIGTERM)
        out, err = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 130, err  # the KeyboardInterrupt path, not an abrupt exit
    assert out.strip().endswith("stopped") and "Traceback" not in err, (out, err)
    # stop() waited for the stand-in (SIGTERM to its process group) before the driver exited;
    # an orphan zombie, if any, is reaped by init at once.
    deadline = time.monotonic() + 10
    while _alive(vllm_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(vllm_pid)
    assert vllm_server.port_is_free("127.0.0.1", port)
    if not healthy:
        assert not pid_file.exists()  # start removed what it wrote
