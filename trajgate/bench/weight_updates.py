"""``trajgate bench weight-updates``: what a full-weight update costs agents with long generations.

Owns: the rounds (``agents`` agents each stream one long generation of ``tokens`` tokens, the
end token ignored; a round ends when every agent has its whole answer, an aborted call retried
until it gets one, as an agent would), one full-weight reload per update round once every agent
has read ``update_after_tokens`` tokens, and the measurement of three arms against the same
real vLLM (dev mode): rounds without updates (``none``), with a ``drain`` update and with a
``keep`` update. Never: used by the gateway.

Comparable arms, on a machine whose load drifts (other processes share its cores):

- interleaved: each repeat runs one round of every arm back to back, the order rotated from one
  repeat to the next, so drift hits every arm alike, and each update arm's ratio is taken to the
  ``none`` round of the same repeat (the median of those paired ratios is reported, with the
  median round walls);
- the same work: the same prompts, ``max_tokens`` and ``ignore_eos`` in every arm, and every
  agent's answer checked to hold ``tokens`` tokens (``usage.completion_tokens``) and to end
  well, else the run fails (a round whose calls ended early would measure less work);
- the same cache: vLLM's prefix cache is reset before every round of every arm (an update
  resets it anyway; otherwise a ``none`` round would reuse the previous round's prompts);
- warm: ``warmup_rounds`` rounds without updates run first and are not counted;
- updates that meet calls in flight: each is published once every agent has read
  ``update_after_tokens`` tokens, and the calls it met are reported per update
  (``calls_in_flight_per_update``: kept, or drained plus aborted); an update that met none
  measures nothing and is counted in ``updates_meeting_no_call``.

No seed is sent: vLLM 0.32's CPU engine fails on a seeded request whose prefill is chunked, which
a kept call's recompute after the reload could be; with ``ignore_eos`` the work is the same
whatever is sampled. The reload reloads the served model's own directory: a full reload with the
same cost and the same pause (the exactness of the version spans with other weights is tested in
tests/test_weight_updates_kept.py).

Reported per arm: ``round_wall_s_median``, ``round_walls_s``, ``agent_wall_s_mean`` (an agent's
time to its whole answer, retries included), ``wall_ratio_to_no_updates`` (median of the paired
ratios) and ``wall_ratios``, and per update ``aborted_calls_per_update``,
``kept_calls_per_update``, ``split_unknown_calls_per_update``, ``calls_in_flight_per_update``,
``pause_ms_mean``.
"""

from __future__ import annotations

import json
import socket
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from datapool import db
from datapool.settings import PoolSettings
from gateway.app import create_app
from gateway.engine.paths import RESET_PREFIX_CACHE_PATH
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings

ABORTED = "aborted_for_weight_update"
ARMS = ("none", "drain", "keep")


class BenchError(RuntimeError):
    """An agent did not get its whole answer: the arms would not have done the same work."""


@dataclass
class Agent:
    """One agent of a round: ``read`` counts the chunks read so far (all attempts),
    ``aborted`` the attempts a drain update cut, ``wall_s`` its time to the whole answer."""

    url: str
    index: int
    tokens: int
    read: int = 0
    aborted: int = 0
    wall_s: float = 0.0
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        started = time.perf_counter()
        try:
            while not self._attempt():
                self.aborted += 1
        except Exception as exc:  # reported by the round: never a silently short answer
            self.error = repr(exc)
        self.wall_s = time.perf_counter() - started
        self.done.set()

    def _attempt(self) -> bool:
        """One streamed call; False when a drain update aborted it (the agent retries)."""
        body = {
            "model": "tiny",
            "messages": [
                {"role": "user", "content": f"Tell me a long story, number {self.index}."}
            ],
            "max_tokens": self.tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        completion_tokens = None
        finish = None
        with httpx.stream("POST", self.url, json=body, timeout=600) as response:
            for line in response.iter_lines():
                if ABORTED in line:
                    return False
                if not line.startswith("data: {"):
                    continue
                self.read += 1
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    completion_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    finish = choice.get("finish_reason") or finish
            status = response.status_code
        if status != 200 or finish != "length" or completion_tokens != self.tokens:
            raise BenchError(
                f"agent {self.index}: status {status}, finish_reason {finish!r}, "
                f"{completion_tokens} tokens; expected 200, 'length', {self.tokens}"
            )
        return True


def _round(
    gateway_url: str,
    vllm_url: str,
    agents: int,
    tokens: int,
    update: dict[str, Any] | None,
    after: int,
) -> tuple[float, float, dict[str, Any] | None]:
    """One round: (its wall s, the agents' mean wall s, the update's report or None)."""
    httpx.post(f"{vllm_url}{RESET_PREFIX_CACHE_PATH}", timeout=60).raise_for_status()
    crew = [
        Agent(f"{gateway_url}/t/bench-{time.time_ns()}-{i}/v1/chat/completions", i, tokens)
        for i in range(agents)
    ]
    threads = [threading.Thread(target=agent.run, daemon=True) for agent in crew]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    report = None
    if update is not None:
        while min(agent.read for agent in crew) < after:
            if any(agent.done.is_set() for agent in crew):
                break  # an agent ended first: the update would meet fewer calls (reported)
            time.sleep(0.01)
        answer = httpx.post(f"{gateway_url}/admin/weight-updates", json=update, timeout=600)
        answer.raise_for_status()
        report = answer.json()
    for thread in threads:
        thread.join()
    wall_s = time.perf_counter() - started
    failed = [agent.error for agent in crew if agent.error]
    if failed:
        raise BenchError("; ".join(failed))
    return wall_s, statistics.fmean(agent.wall_s for agent in crew), report


def run_weight_update_benchmark(
    vllm_url: str,
    model_dir: Path,
    *,
    agents: int = 4,
    tokens: int = 200,
    rounds: int = 3,
    warmup_rounds: int = 1,
    update_after_tokens: int = 20,
    drain_timeout_s: float = 2.0,
) -> dict[str, Any]:
    """Run ``warmup_rounds`` uncounted rounds, then ``rounds`` repeats of one round per arm
    (none, drain, keep; order rotated per repeat) through one gateway in front of ``vllm_url``
    (a vLLM in dev mode serving ``model_dir`` as ``tiny``); see the module doc.

    Raises:
        BenchError: an agent's answer was not ``tokens`` tokens ending on the length limit.
        httpx.HTTPStatusError: vLLM or the gateway refused a reset or an update.
    """
    with tempfile.TemporaryDirectory(prefix="trajgate-bench-wu-") as tmp:
        url = f"sqlite:///{Path(tmp) / 'pool.sqlite3'}"
        db.upgrade(url)
        pool = PoolSettings(data_dir=Path(tmp) / "data", database_url=url)
        settings = GatewaySettings(
            upstream_url=vllm_url, port=_free_port(), weight_update_drain_timeout_s=drain_timeout_s
        )
        server = BackgroundServer(create_app(settings, pool), port=settings.port).start()
        walls: dict[str, list[float]] = {arm: [] for arm in ARMS}
        agent_walls: dict[str, list[float]] = {arm: [] for arm in ARMS}
        reports: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
        try:
            httpx.post(
                f"{server.url}/admin/policy-versions",
                json={"version": 0, "model_name": "tiny"},
                timeout=60,
            ).raise_for_status()
            for _ in range(warmup_rounds):
                _round(server.url, vllm_url, agents, tokens, None, update_after_tokens)
            version = 0
            for repeat in range(rounds):
                order = ARMS[repeat % 3 :] + ARMS[: repeat % 3]
                for arm in order:
                    update = None
                    if arm != "none":
                        version += 1
                        update = {
                            "version": version,
                            "model_name": "tiny",
                            "weights_location": str(model_dir),
                            "mode": arm,
                        }
                    wall, agent_wall, report = _round(
                        server.url, vllm_url, agents, tokens, update, update_after_tokens
                    )
                    walls[arm].append(wall)
                    agent_walls[arm].append(agent_wall)
                    if report is not None:
                        reports[arm].append(report)
        finally:
            server.stop()
    results: dict[str, Any] = {}
    for arm in ARMS:
        ratios = [wall / base for wall, base in zip(walls[arm], walls["none"], strict=True)]
        in_flight = [
            r["kept_calls"] + r["drained_calls"] + r["aborted_calls"] for r in reports[arm]
        ]
        results[arm] = {
            "round_wall_s_median": statistics.median(walls[arm]),
            "round_walls_s": walls[arm],
            "agent_wall_s_mean": statistics.fmean(agent_walls[arm]),
            "wall_ratio_to_no_updates": statistics.median(ratios),
            "wall_ratios": ratios,
            "aborted_calls_per_update": _per_update(reports[arm], "aborted_calls"),
            "kept_calls_per_update": _per_update(reports[arm], "kept_calls"),
            "split_unknown_calls_per_update": _per_update(reports[arm], "split_unknown_calls"),
            "drained_calls_per_update": _per_update(reports[arm], "drained_calls"),
            "calls_in_flight_per_update": (statistics.fmean(in_flight) if in_flight else None),
            "updates_meeting_no_call": sum(1 for n in in_flight if n == 0),
            "pause_ms_mean": _per_update(reports[arm], "pause_ms"),
        }
    return {
        "agents": agents,
        "tokens": tokens,
        "rounds": rounds,
        "warmup_rounds": warmup_rounds,
        "update_after_tokens": update_after_tokens,
        "drain_timeout_s": drain_timeout_s,
        "arms": results,
    }


def _per_update(reports: list[dict[str, Any]], key: str) -> float | None:
    return statistics.fmean(float(r[key]) for r in reports) if reports else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
