"""Slow and heavy clients against a real ``trajgate serve`` (read deadlines, body budget).

Starts the emulator (``trajgate.bench.emulator``) in this process and ``trajgate serve`` as a
child process (tokenless loopback default, SQLite in a temporary directory) in front of it, so
the RSS read from ``/proc/<pid>/status`` is the gateway's alone. Prints one JSON line.

- ``slow``: ``--connections`` connections drip a request head at 1 byte per 2 s, as many drip
  a body at 1 byte/s after a whole head; reports how long the gateway held them (seconds,
  capped at ``--cap-s``) and its RSS before and after (MB).
- ``bodies``: ``--connections`` concurrent chat calls with one user message of
  ``--body-mib`` MiB each; reports the gateway's RSS before and at its peak (sampled every
  20 ms) and the latency of ``GET /health`` polled meanwhile (ms).
- ``stall``: ``--connections`` connections send a POST's head and one byte of its body, then
  stop (half declare ``--body-mib`` MiB, half send a chunked body), so their bodies hang until
  the body deadline (30 s); one second later an ordinary chat call is sent: reports how long
  it took (s). The body limit is the default 16 MiB here, so the default four connections
  declare the whole default budget (64 MiB).
- ``answers``: ``--connections`` concurrent unary chat calls whose answers are ``--answer-mib``
  MiB each (the emulator's tokens with their logprobs); reports the answer's bytes, the
  gateway's RSS before and at its peak (sampled every 20 ms) and the calls' statuses.

Run it from two trees in turns to compare them (the machine's load changes the figures):

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_hostile_clients.py slow
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_hostile_clients.py bodies
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_hostile_clients.py stall --connections 4 \
        --body-mib 16
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_hostile_clients.py answers --connections 4 \
        --answer-mib 20
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from trajgate.bench.emulator import EmulatorSettings, EmulatorThread


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def held_s(port: int, whole: bytes, dripped: bytes, every_s: float, cap_s: float) -> float:
    """Seconds until the gateway closed a connection that sent ``whole`` then dripped."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=cap_s) as client:
        client.sendall(whole)
        for byte in dripped:
            if time.monotonic() - started > cap_s:
                return cap_s
            try:
                client.sendall(bytes([byte]))
                client.settimeout(every_s)
                if client.recv(65536) == b"":
                    break
            except TimeoutError:
                continue
            except OSError:
                break
    return min(time.monotonic() - started, cap_s)


def slow(port: int, pid: int, args: argparse.Namespace) -> dict[str, object]:
    body = json.dumps({"model": "emulated", "messages": [{"role": "user", "content": "hi"}]})
    head = (
        "POST /t/slow/v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    before = rss_mb(pid)
    jobs = [(b"", head + body.encode(), 2.0)] * args.connections
    jobs += [(head, body.encode(), 1.0)] * args.connections
    with ThreadPoolExecutor(len(jobs)) as pool:
        held = list(pool.map(lambda job: held_s(port, *job, args.cap_s), jobs))
    heads, bodies = held[: args.connections], held[args.connections :]
    return {
        "mode": "slow",
        "connections_each": args.connections,
        "cap_s": args.cap_s,
        "head_held_s_max": round(max(heads), 1),
        "head_held_s_median": round(statistics.median(heads), 1),
        "body_held_s_max": round(max(bodies), 1),
        "body_held_s_median": round(statistics.median(bodies), 1),
        "rss_mb_before": round(before, 1),
        "rss_mb_after": round(rss_mb(pid), 1),
    }


# Bytes of one emulated answer per token with its logprob (measured: 20,000 tokens, 1.78 MB).
ANSWER_BYTES_PER_TOKEN = 89


def peak_rss(pid: int, work: Callable[[], list[int]]) -> tuple[float, float, list[int]]:
    """The RSS of ``pid`` before ``work`` and its peak while ``work`` runs (MB, sampled every
    20 ms), and what ``work`` returned."""
    before = rss_mb(pid)
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb(pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        result = work()
    finally:
        done.set()
        sampler.join()
    return before, peak[0], result


def bodies(url: str, pid: int, args: argparse.Namespace) -> dict[str, object]:
    content = "x" * int(args.body_mib * 1024 * 1024)
    body = {"model": "emulated", "messages": [{"role": "user", "content": content}]}
    payload = json.dumps(body).encode()
    health_ms: list[float] = []
    polled = threading.Event()
    elapsed = [0.0]

    def poll_health() -> None:
        with httpx.Client(timeout=60) as client:
            while not polled.is_set():
                started = time.perf_counter()
                client.get(f"{url}/health")
                health_ms.append((time.perf_counter() - started) * 1000)
                time.sleep(0.05)

    def call(index: int) -> int:
        with httpx.Client(timeout=300) as client:
            answer = client.post(
                f"{url}/t/big-{index}/v1/chat/completions",
                content=payload,
                headers={"content-type": "application/json"},
            )
            return answer.status_code

    def work() -> list[int]:
        poller = threading.Thread(target=poll_health)
        poller.start()
        try:
            time.sleep(0.5)
            started = time.monotonic()
            with ThreadPoolExecutor(args.connections) as pool:
                statuses = list(pool.map(call, range(args.connections)))
            elapsed[0] = time.monotonic() - started
            return statuses
        finally:
            polled.set()
            poller.join()

    before, peak, statuses = peak_rss(pid, work)
    return {
        "mode": "bodies",
        "connections": args.connections,
        "body_mib": args.body_mib,
        "statuses": sorted(set(statuses)),
        "seconds": round(elapsed[0], 2),
        "rss_mb_before": round(before, 1),
        "rss_mb_peak": round(peak, 1),
        "health_ms_median": round(statistics.median(health_ms), 1),
        "health_ms_max": round(max(health_ms), 1),
    }


def answers(url: str, pid: int, args: argparse.Namespace) -> dict[str, object]:
    body = {
        "model": "emulated",
        "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True,
    }
    sizes: list[int] = []

    def call(index: int) -> int:
        with httpx.Client(timeout=600) as client:
            answer = client.post(f"{url}/t/answer-{index}/v1/chat/completions", json=body)
            sizes.append(len(answer.content))
            return answer.status_code

    def work() -> list[int]:
        with ThreadPoolExecutor(args.connections) as pool:
            return list(pool.map(call, range(args.connections)))

    started = time.monotonic()
    before, peak, statuses = peak_rss(pid, work)
    return {
        "mode": "answers",
        "connections": args.connections,
        "answer_mb": round(max(sizes) / 1e6, 1),
        "statuses": sorted(set(statuses)),
        "seconds": round(time.monotonic() - started, 2),
        "rss_mb_before": round(before, 1),
        "rss_mb_peak": round(peak, 1),
    }


def stall(url: str, port: int, args: argparse.Namespace) -> dict[str, object]:
    declared = int(args.body_mib * 1024 * 1024)
    stallers: list[socket.socket] = []
    for index in range(args.connections):
        length = f"content-length: {declared}" if index % 2 == 0 else "transfer-encoding: chunked"
        first = b"{" if index % 2 == 0 else b"1\r\n{\r\n"
        client = socket.create_connection(("127.0.0.1", port), timeout=60)
        client.sendall(
            f"POST /t/stall-{index}/v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            f"content-type: application/json\r\n{length}\r\n\r\n".encode()
            + first
        )
        stallers.append(client)
    try:
        time.sleep(1.0)
        body = {"model": "emulated", "messages": [{"role": "user", "content": "hi"}]}
        started = time.monotonic()
        answer = httpx.post(f"{url}/t/honest/v1/chat/completions", json=body, timeout=120)
        waited = time.monotonic() - started
    finally:
        for client in stallers:
            client.close()
    return {
        "mode": "stall",
        "connections": args.connections,
        "declared_mib": args.body_mib,
        "status": answer.status_code,
        "honest_call_s": round(waited, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("slow", "bodies", "stall", "answers"))
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--cap-s", type=float, default=40.0)
    parser.add_argument("--body-mib", type=float, default=10.7)
    parser.add_argument("--answer-mib", type=float, default=20.0)
    args = parser.parse_args()
    tokens = 4
    if args.mode == "answers":
        tokens = int(args.answer_mib * 1024 * 1024 / ANSWER_BYTES_PER_TOKEN)
    upstream = EmulatorThread(
        EmulatorSettings(port=free_port(), response_tokens=tokens, inter_token_ms=0)
    ).start()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            # Bodies up to 64 MiB unless the caller's environment says otherwise (set
            # TRAJGATE_MAX_BODY_BYTES_IN_FLIGHT too to try another budget).
            "TRAJGATE_MAX_BODY_BYTES": str((16 if args.mode == "stall" else 64) * 1024 * 1024),
            **os.environ,
            "TRAJGATE_UPSTREAM_URL": upstream.url,
            "TRAJGATE_PORT": str(port),
            "TRAJGATE_DATA_DIR": str(Path(tmp) / "data"),
            "TRAJGATE_DATABASE_URL": f"sqlite:///{tmp}/pool.sqlite3",
        }
        trajgate = Path(sys.executable).parent / "trajgate"
        gateway = subprocess.Popen(
            [str(trajgate), "serve", "--no-access-log"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(300):
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            warm = {"model": "emulated", "messages": [{"role": "user", "content": "hi"}]}
            httpx.post(f"{url}/t/warm/v1/chat/completions", json=warm, timeout=60)
            if args.mode == "slow":
                result = slow(port, gateway.pid, args)
            elif args.mode == "stall":
                result = stall(url, port, args)
            elif args.mode == "answers":
                result = answers(url, gateway.pid, args)
            else:
                result = bodies(url, gateway.pid, args)
        finally:
            gateway.terminate()
            gateway.wait(timeout=30)
            upstream.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
