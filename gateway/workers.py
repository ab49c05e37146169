"""Several worker processes of one gateway on one host (``trajgate serve --workers N``): what
they share, and how one of them answers for all.

Owns: the worker directory (``TRAJGATE_WORKER_DIR``, made by the serving parent; one Unix
socket per worker, ``<pid>.sock``), each worker's ``PeerServer`` (a daemon thread on that socket
that answers ``metrics`` with the worker's own Prometheus exposition and ``lag`` with its event
loop's heartbeat lag), ``gather_metrics`` (every live worker's exposition, merged into one: what
``GET /metrics`` answers in any worker) and ``WorkerLag`` (the slowest worker's loop lag: what
the parent's liveness port answers from).

Merging: counters, histograms and summaries are summed per (sample, labels); ``*_created``
samples keep the earliest; gauges are summed (queue depths, calls in flight), except
``trajgate_upstream_healthy``, ``trajgate_upstream_exact_continuation`` and
``trajgate_pool_writable``, which take the minimum (a 0 in any worker shows, and a probe still
running in one, -1). A worker that does not answer within ``PEER_TIMEOUT_S`` is left out of that
scrape (a dead one's socket is removed once its pid is gone).

Never: shares state other than through the pool's database. Everything a call needs is read
from the database (docs/deployment.md, "Stateless gateways"); what each worker keeps in memory
(the API-key cache, the lineage cache, the policy registry) is a cache with the same bounds it
has across hosts. Full-weight updates are refused with several workers (``gateway.api.admin``):
the pause would hold only the worker that received it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from gateway.liveness import SocketThreadServer

log = logging.getLogger("trajgate.gateway.workers")

WORKER_DIR_ENV = "TRAJGATE_WORKER_DIR"
PEER_TIMEOUT_S = 2.0  # a worker's thread answers in microseconds; this only bounds a dead one
_MIN_GAUGES = frozenset(
    {
        "trajgate_upstream_healthy",
        "trajgate_upstream_exact_continuation",
        "trajgate_pool_writable",
    }
)
_REQUESTS = (b"metrics", b"lag")


class PeerServer(SocketThreadServer):
    """This worker's answers to its siblings, on ``<directory>/<pid>.sock``, from one daemon
    thread: ``metrics`` → ``render()``, ``lag`` → ``lag_s()`` as ASCII seconds.
    Never touches the event loop: both callables only read counters."""

    def __init__(
        self, directory: Path, render: Callable[[], bytes], lag_s: Callable[[], float]
    ) -> None:
        """Binds now: raises ``OSError`` when the directory is not writable."""
        self.path = directory / f"{os.getpid()}.sock"
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # left by an earlier process that had this pid
        self._render = render
        self._lag_s = lag_s
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        listener.listen(16)
        super().__init__(listener, "worker-peer")

    def stop(self) -> None:
        super().stop()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _answer(self, connection: socket.socket) -> None:
        connection.settimeout(PEER_TIMEOUT_S)
        request = connection.recv(64).strip()
        if request == b"metrics":
            connection.sendall(self._render())
        elif request == b"lag":
            connection.sendall(f"{self._lag_s():.3f}".encode())


def _ask(path: Path, request: bytes) -> bytes | None:
    """One request to one worker; None when it does not answer (a dead worker's socket is
    removed)."""
    assert request in _REQUESTS, f"expected one of {_REQUESTS}, got {request!r}"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
            peer.settimeout(PEER_TIMEOUT_S)
            peer.connect(str(path))
            peer.sendall(request + b"\n")
            chunks = []
            while chunk := peer.recv(65536):
                chunks.append(chunk)
            return b"".join(chunks)
    except OSError:
        if path.stem.isdigit() and not _pid_alive(int(path.stem)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ask_all(directory: Path, request: bytes) -> list[bytes]:
    """Every live worker's answer to ``request`` (``b"metrics"`` or ``b"lag"``)."""
    answers = (_ask(path, request) for path in sorted(directory.glob("*.sock")))
    return [answer for answer in answers if answer is not None]


def gather_metrics(directory: Path) -> bytes:
    """Every live worker's ``/metrics``, merged (rules in the module docstring), as Prometheus
    text exposition bytes."""
    texts = [answer.decode() for answer in ask_all(directory, b"metrics")]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(texts))
    return generate_latest(registry)


class _Merged(Collector):
    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for text in self.texts:
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                samples = values.setdefault(merged.name, {})
                for sample in family.samples:
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    earliest_or_lowest = sample.name.endswith("_created") or (
                        family.type == "gauge" and family.name in _MIN_GAUGES
                    )
                    if key not in samples:
                        samples[key] = sample.value
                    elif earliest_or_lowest:
                        samples[key] = min(samples[key], sample.value)
                    else:
                        samples[key] += sample.value
        for name, family in families.items():
            for (sample_name, labels), value in values[name].items():
                family.add_sample(sample_name, dict(labels), value)
            yield family


class WorkerLag:
    """The slowest worker's event-loop lag (seconds), asked of every worker when read; infinite
    while no worker answers (none started yet, or all wedged), so liveness says 503.
    ``answering``: how many workers answered the last read."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.answering = 0

    def lag_s(self) -> float:
        lags = [float(answer) for answer in ask_all(self.directory, b"lag") if answer]
        self.answering = len(lags)
        return max(lags, default=float("inf"))

    def workers(self) -> int:
        return self.answering
