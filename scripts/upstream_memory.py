"""Gateway RSS against hostile upstreams and slow readers (answer size limits, bounded buffers).

Starts ``trajgate serve`` as its own process (its RSS is what is measured, sampled every 20 ms
from /proc) in front of an upstream run here, then one scenario:

- ``unary_body``: a unary 200 of ``--size-mb`` MiB (content-length declared);
- ``sse_line``: a stream whose second event is one line of ``--size-mb`` MiB;
- ``endless``: a chunked stream of valid events that never ends (stopped after ``--seconds``);
- ``slow_readers``: ``--readers`` streams of ``--tokens`` tokens each from the vLLM-shaped
  emulator (logprobs on), read by clients that take 1 KiB every 100 ms for ``--seconds`` and
  then leave; the steps recorded are counted afterwards.

Prints one line: the scenario, RSS before, peak and the difference in MiB, what the client got.
Usage: ``.venv/bin/python scripts/upstream_memory.py unary_body --size-mb 300``. Extra gateway
settings go in the environment (``TRAJGATE_UPSTREAM_MAX_ANSWER_BYTES=...``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx

from trajgate.bench.raw_upstream import RawUpstream

MIB = 1024 * 1024
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def piece(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(ids: list[int], content: str, prompt: bool = False) -> bytes:
    chunk: dict[str, object] = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"content": content},
                "finish_reason": None,
                "logprobs": {"content": [{"token": "t", "logprob": -0.5} for _ in ids]},
                "token_ids": ids,
            }
        ],
    }
    if prompt:
        chunk["prompt_token_ids"] = [1, 2]
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def unary_body(size: int) -> Iterator[bytes]:
    yield b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % size
    yield b'{"id": "'
    block = b"x" * MIB
    for _ in range(size // MIB - 1):
        yield block
    yield b"x" * (size % MIB + MIB - 10) + b'"}'


def sse_line(size: int) -> Iterator[bytes]:
    yield HEAD + piece(event([], "", prompt=True))
    yield piece(b'data: {"id": "')
    block = piece(b"x" * MIB)
    for _ in range(size // MIB):
        yield block
    yield piece(b'"}\n\n') + b"0\r\n\r\n"


def endless(_size: int) -> Iterator[bytes]:
    yield HEAD + piece(event([], "", prompt=True))
    one = event([7], "a")
    block = piece(one * (65536 // len(one)))
    while True:
        yield block


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Peak:
    """The highest RSS of ``pid`` while running."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0.0, False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            self.peak = max(self.peak, rss_mib(self.pid))
            time.sleep(0.02)

    def stop(self) -> float:
        self._stop = True
        self._thread.join()
        return self.peak


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def slow_reader(
    url: str, body: bytes, seconds: float, got: list[int], pause_s: float = 0.1
) -> None:
    """A client that reads 1 KiB every ``pause_s`` for ``seconds``, then leaves (0: a fast
    reader, reading 64 KiB at a time, for comparison)."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    if pause_s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    request = (
        f"POST /t/slow-{threading.get_ident()}/v1/chat/completions HTTP/1.1\r\n"
        f"host: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    s.sendall(request + body)
    read = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        data = s.recv(1024 if pause_s else 65536)
        if not data:
            break
        read += len(data)
        if pause_s:
            time.sleep(pause_s)
    got.append(read)
    s.close()


def steps_of(data_dir: str) -> int:
    try:
        with sqlite3.connect(f"{data_dir}/pool.sqlite3") as db:
            return int(db.execute("select count(*) from steps").fetchone()[0])
    except sqlite3.Error:
        return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["unary_body", "sse_line", "endless", "slow_readers"])
    parser.add_argument("--size-mb", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--readers", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--pause-ms", type=float, default=100.0, help="0: fast readers")
    args = parser.parse_args()
    emulator = None
    if args.scenario == "slow_readers":
        from trajgate.bench.emulator import EmulatorSettings, EmulatorThread

        emulator = EmulatorThread(
            EmulatorSettings(
                port=free_port(), response_tokens=args.tokens, inter_token_ms=0, ttft_ms=0
            )
        ).start()
        upstream_url = emulator.url
    else:
        answers = {"unary_body": unary_body, "sse_line": sse_line, "endless": endless}
        upstream_url = RawUpstream(partial(answers[args.scenario], args.size_mb * MIB)).url
    data_dir = tempfile.mkdtemp(prefix="upstream-memory-")
    port = free_port()
    env = {
        **os.environ,
        "TRAJGATE_UPSTREAM_URL": upstream_url,
        "TRAJGATE_PORT": str(port),
        "TRAJGATE_DATA_DIR": data_dir,
        "TRAJGATE_HEALTH_CHECK_INTERVAL_S": "3600",
        "TRAJGATE_UPSTREAM_MAX_ATTEMPTS": "1",
    }
    trajgate = str(Path(sys.executable).with_name("trajgate"))
    gateway = subprocess.Popen([trajgate, "serve"], env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        time.sleep(1.0)
        before = rss_mib(gateway.pid)
        peak = Peak(gateway.pid)
        started = time.monotonic()
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        if args.scenario == "slow_readers":
            payload = json.dumps({**body, "model": "emulated", "stream": True}).encode()
            got: list[int] = []
            readers = [
                threading.Thread(
                    target=slow_reader, args=(url, payload, args.seconds, got, args.pause_ms / 1000)
                )
                for _ in range(args.readers)
            ]
            for reader in readers:
                reader.start()
            for reader in readers:
                reader.join()
            # the gateway records the steps of the readers that left (up to 120 s)
            left_at = time.monotonic()
            while steps_of(data_dir) < args.readers and time.monotonic() - left_at < 120:
                time.sleep(0.2)
            recorded_s = time.monotonic() - left_at
            outcome = (
                f"{len(got)} readers read {sum(got) / len(got) / 1024:.0f} KiB each, left; "
                f"steps recorded {recorded_s:.1f} s after"
            )
        else:
            stream = args.scenario != "unary_body"
            try:
                with httpx.stream(
                    "POST",
                    f"{url}/t/m/v1/chat/completions",
                    json={**body, "stream": stream},
                    timeout=args.seconds + 60,
                ) as response:
                    read = 0
                    for data in response.iter_bytes():
                        read += len(data)
                        if time.monotonic() - started > args.seconds:
                            break
                    outcome = f"status {response.status_code}, {read} bytes, {data[-120:]!r}"
            except httpx.HTTPError as exc:
                outcome = f"client error {exc!r}"
        elapsed = time.monotonic() - started
        high = peak.stop()
        time.sleep(1.0)
        steps = (
            sqlite3.connect(f"{data_dir}/pool.sqlite3")
            .execute("select outcome, count(*) from steps group by outcome")
            .fetchall()
        )
        print(
            f"{args.scenario}: RSS {before:.0f} -> peak {high:.0f} MiB (+{high - before:.0f}) "
            f"in {elapsed:.1f} s; {outcome}; steps {steps}"
        )
    finally:
        gateway.terminate()
        gateway.wait(30)
        if emulator is not None:
            emulator.stop()


if __name__ == "__main__":
    main()
