"""``trajgate bench weight-updates``: what a full-weight update costs agents with long generations.

Owns: the rounds (``agents`` agents each stream one long generation of ``tokens`` tokens, the
end token ignored; a round ends when every agent has its answer, an aborted call retried until
it gets one, as an agent would), one full-weight reload per round once every agent has read
``update_after_tokens`` tokens, and the measurement, side by side in one run: rounds without
updates, with ``drain`` updates and with ``keep`` updates against the same real vLLM (dev mode).
Never: used by the gateway.

Reported per mode: the mean wall time of a round, its ratio to the rounds without updates, the
calls aborted per update, the calls kept and those whose split was unknown. The reload reloads
the served model's own directory: a full reload with the same cost and the same pause (the
exactness of the version spans is tested in tests/test_weight_updates_kept.py with different
weights).
"""

from __future__ import annotations

import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from datapool import db
from datapool.settings import PoolSettings
from gateway.app import create_app
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings

ABORTED = "aborted_for_weight_update"


def _agent(url: str, tokens: int, read: list[int], index: int, aborted: list[int]) -> None:
    """One long streamed generation, retried while a drain update aborts it."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"Tell me a long story, number {index}."}],
        "max_tokens": tokens,
        "temperature": 1.0,
        "ignore_eos": True,
        "stream": True,
    }
    while True:
        cut = False
        with httpx.stream("POST", url, json=body, timeout=600) as response:
            for line in response.iter_lines():
                if ABORTED in line:
                    cut = True
                elif line.startswith("data: {"):
                    read[index] += 1
        if not cut:
            return
        aborted[index] += 1


def _round(
    gateway_url: str, agents: int, tokens: int, update: dict[str, Any] | None, after: int
) -> tuple[float, dict[str, Any] | None]:
    read, aborted = [0] * agents, [0] * agents
    threads = [
        threading.Thread(
            target=_agent,
            args=(
                f"{gateway_url}/t/bench-{time.time_ns()}-{i}/v1/chat/completions",
                tokens,
                read,
                i,
                aborted,
            ),
            daemon=True,
        )
        for i in range(agents)
    ]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    report = None
    if update is not None:
        while min(read) < after:
            time.sleep(0.01)
        answer = httpx.post(f"{gateway_url}/admin/weight-updates", json=update, timeout=600)
        answer.raise_for_status()
        report = answer.json()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, report


def run_weight_update_benchmark(
    vllm_url: str,
    model_dir: Path,
    *,
    agents: int = 4,
    tokens: int = 200,
    rounds: int = 2,
    update_after_tokens: int = 20,
    drain_timeout_s: float = 2.0,
) -> dict[str, Any]:
    """Run ``rounds`` rounds in each mode (none, drain, keep) through one gateway in front of
    ``vllm_url`` (a vLLM in dev mode serving ``model_dir`` as ``tiny``); see the module doc."""
    with tempfile.TemporaryDirectory(prefix="trajgate-bench-wu-") as tmp:
        url = f"sqlite:///{Path(tmp) / 'pool.sqlite3'}"
        db.upgrade(url)
        pool = PoolSettings(data_dir=Path(tmp) / "data", database_url=url)
        settings = GatewaySettings(
            upstream_url=vllm_url, port=_free_port(), weight_update_drain_timeout_s=drain_timeout_s
        )
        server = BackgroundServer(create_app(settings, pool), port=settings.port).start()
        try:
            httpx.post(
                f"{server.url}/admin/policy-versions",
                json={"version": 0, "model_name": "tiny"},
                timeout=60,
            ).raise_for_status()
            version = 0
            results: dict[str, Any] = {}
            for mode in ("none", "drain", "keep"):
                walls: list[float] = []
                reports: list[dict[str, Any]] = []
                for _ in range(rounds):
                    update = None
                    if mode != "none":
                        version += 1
                        update = {
                            "version": version,
                            "model_name": "tiny",
                            "weights_location": str(model_dir),
                            "mode": mode,
                        }
                    wall, report = _round(server.url, agents, tokens, update, update_after_tokens)
                    walls.append(wall)
                    if report is not None:
                        reports.append(report)
                results[mode] = {
                    "round_wall_s": sum(walls) / len(walls),
                    "aborted_calls_per_update": _per_update(reports, "aborted_calls"),
                    "kept_calls_per_update": _per_update(reports, "kept_calls"),
                    "split_unknown_calls_per_update": _per_update(reports, "split_unknown_calls"),
                    "pause_ms_mean": _per_update(reports, "pause_ms"),
                    "drained_calls_per_update": _per_update(reports, "drained_calls"),
                    "round_walls_s": walls,
                }
        finally:
            server.stop()
    base = results["none"]["round_wall_s"]
    for mode in ("drain", "keep"):
        results[mode]["wall_ratio_to_no_updates"] = results[mode]["round_wall_s"] / base
    return {
        "agents": agents,
        "tokens": tokens,
        "rounds": rounds,
        "drain_timeout_s": drain_timeout_s,
        "modes": results,
    }


def _per_update(reports: list[dict[str, Any]], key: str) -> float | None:
    return sum(float(r[key]) for r in reports) / len(reports) if reports else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
