"""deploy/nginx.conf's sticky routing, run by a real nginx: a trajectory's calls, by path or by
header, reach one backend; the same API key in ``Authorization`` or ``x-api-key`` reaches one
backend; a dead backend's keys move and the others' stay.

The file is the compose file's own, with what only Docker provides replaced: the replica
addresses (``server gateway:8000 resolve`` needs Docker's DNS and nginx >= 1.27.3; Debian's may be
older) and the listening port. The backends only say which one answered: what is under test is
nginx's choice, not the gateway (tests/test_fleet_routing.py runs real gateways).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from tests_support import free_port

ROOT = Path(__file__).resolve().parent.parent
NGINX = shutil.which("nginx") or shutil.which("/usr/sbin/nginx")

pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (scripts/setup.sh)")


class _Identity(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = str(self.server.server_address[1]).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.do_GET()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def backends() -> Iterator[list[ThreadingHTTPServer]]:
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Identity) for _ in range(3)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield servers
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def nginx_url(backends: list[ThreadingHTTPServer], tmp_path: Path) -> Iterator[str]:
    assert NGINX is not None
    port = free_port()
    servers = " ".join(f"server 127.0.0.1:{s.server_address[1]};" for s in backends)
    conf = (ROOT / "deploy" / "nginx.conf").read_text()
    for docker_only, here in (
        ("server gateway:8000 resolve;", servers),
        ("resolver 127.0.0.11 valid=10s ipv6=off;", ""),
        ("listen 8000;", f"listen 127.0.0.1:{port};"),
    ):
        assert docker_only in conf
        conf = conf.replace(docker_only, here)
    (tmp_path / "nginx.conf").write_text(conf)
    process = subprocess.Popen(
        [
            NGINX,
            "-p",
            str(tmp_path),
            "-c",
            str(tmp_path / "nginx.conf"),
            "-e",
            str(tmp_path / "error.log"),
            "-g",
            f"daemon off; pid {tmp_path / 'nginx.pid'};",
        ],
        stderr=subprocess.STDOUT,
        stdout=(tmp_path / "nginx.out").open("wb"),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while True:
        try:
            httpx.get(f"{url}/health", timeout=1)
            break
        except httpx.HTTPError:
            assert process.poll() is None, (tmp_path / "nginx.out").read_text()
            assert time.monotonic() < deadline, "nginx did not answer"
            time.sleep(0.05)
    yield url
    process.send_signal(signal.SIGQUIT)
    process.wait(timeout=10)


def test_nginx_routes_each_trajectory_and_each_key_to_one_backend(nginx_url: str) -> None:
    with httpx.Client(base_url=nginx_url, timeout=5) as client:
        for i in range(12):
            by_path = {
                client.post(f"/t/traj-{i}/v1/chat/completions", json={}).text for _ in range(3)
            }
            by_header = client.post(
                "/v1/chat/completions", json={}, headers={"X-Trajgate-Trajectory": f"traj-{i}"}
            ).text
            assert by_path == {by_header}, (i, by_path, by_header)
            key = f"tg-key-{i}"
            bearer = client.get("/v1/models", headers={"Authorization": key}).text
            assert client.get("/v1/models", headers={"x-api-key": key}).text == bearer
        owners = {client.post(f"/t/traj-{i}/v1/x", json={}).text for i in range(30)}
        assert len(owners) == 3  # 30 trajectories over 3 backends: each owns some


def test_nginx_moves_only_a_dead_backends_trajectories(
    nginx_url: str, backends: list[ThreadingHTTPServer]
) -> None:
    ids = [f"traj-{i}" for i in range(30)]
    with httpx.Client(base_url=nginx_url, timeout=5) as client:
        before = {i: client.post(f"/t/{i}/v1/x", json={}).text for i in ids}
        dead = backends[0]
        dead.shutdown()
        dead.server_close()
        after = {i: client.post(f"/t/{i}/v1/x", json={}).text for i in ids}
    dead_port = str(dead.server_address[1])
    for i in ids:
        if before[i] == dead_port:
            assert after[i] != dead_port
        else:
            assert after[i] == before[i], i
