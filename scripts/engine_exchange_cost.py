"""What exact continuation's engine exchanges cost vLLM's API server as a session's history grows.

Starts the real vLLM (CPU build, the tiny model; ``trajgate vllm install`` first) on a free
port, and for turn ``T`` of the horizon bench's coding-agent session
(``trajgate.bench.agent_session``, chat, 28 KB tool list, ~450-character tool results) sends
straight to vLLM, ``--repeats`` times each, alternating:

- ``render``: ``POST /v1/chat/completions/render`` of the whole conversation (what exact mode
  asks per call): the ids it answers (``rendered_tokens``);
- ``generate``: ``POST /inference/v1/generate`` of the rendered ids (8 tokens sampled; the
  prompt's blocks are in the prefix cache after the first);
- ``derender_whole_prompt`` / ``derender_prompt_tail``: ``POST /v1/chat/completions/derender``
  of one generate answer for that prompt, with ``prompt_token_ids`` the whole prompt (the
  gateway before) or its last ``gateway.engine.exact.DERENDER_SEED_IDS`` ids (now);
- ``chat``: the plain chat call of the same conversation, for scale.

Per exchange: the median of the API server process's CPU per call (its scheduler clock:
render and derender run in the API server, sampling in its engine-core child) and of the wall
time, in ms. Prints JSON.

    PYTHONPATH=. .venv/bin/python scripts/engine_exchange_cost.py --turn 20 --turn 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from gateway.engine.exact import DERENDER_SEED_IDS
from trajgate import vllm_server
from trajgate.bench import agent_session
from trajgate.bench.gateway import free_port, process_cpu_s


def _measure(pid: int, send: Callable[[], httpx.Response]) -> tuple[float, float]:
    """``(API server CPU ms, wall ms)`` of one exchange; raises on a non-200 answer."""
    cpu_before, wall_before = process_cpu_s(pid), time.perf_counter()
    answer = send()
    wall_ms = (time.perf_counter() - wall_before) * 1000.0
    cpu_after = process_cpu_s(pid)
    answer.raise_for_status()
    assert cpu_before is not None and cpu_after is not None
    return (cpu_after - cpu_before) * 1000.0, wall_ms


def run_turn(client: httpx.Client, pid: int, model: str, turn: int, repeats: int) -> dict[str, Any]:
    body = agent_session.body(
        "chat", 0, turn, "Done.", stream=False, response_tokens=8, tool_result_chars=450
    )
    body["model"] = model
    rendered = client.post("/v1/chat/completions/render", json=body)
    rendered.raise_for_status()
    request = rendered.json()
    prompt: list[int] = request["token_ids"]
    request["sampling_params"] = {**request.get("sampling_params", {}), "max_tokens": 8}
    generated = client.post("/inference/v1/generate", json=request)
    generated.raise_for_status()
    generate_answer = generated.json()

    def derender(ids: list[int]) -> Callable[[], httpx.Response]:
        derender_body = {
            "model": model,
            "generate_response": generate_answer,
            "chat_request": body,
            "prompt_token_ids": ids,
            "prompt_tokens": len(prompt),
        }
        return lambda: client.post("/v1/chat/completions/derender", json=derender_body)

    exchanges: dict[str, Callable[[], httpx.Response]] = {
        "render": lambda: client.post("/v1/chat/completions/render", json=body),
        "generate": lambda: client.post("/inference/v1/generate", json=request),
        "derender_whole_prompt": derender(prompt),
        "derender_prompt_tail": derender(prompt[-DERENDER_SEED_IDS:]),
        "chat": lambda: client.post("/v1/chat/completions", json=body),
    }
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in exchanges}
    for _ in range(repeats):  # alternated, so load changes hit every exchange alike
        for name, send in exchanges.items():
            samples[name].append(_measure(pid, send))
    texts = {
        name: client_answer_text(exchanges[name]())
        for name in ("derender_whole_prompt", "derender_prompt_tail")
    }
    return {
        "turn": turn,
        "request_bytes": len(json.dumps(body)),
        "rendered_tokens": len(prompt),
        "derender_answers_equal": texts["derender_whole_prompt"] == texts["derender_prompt_tail"],
        **{
            name: {
                "api_server_cpu_ms": round(statistics.median(c for c, _ in values), 2),
                "wall_ms": round(statistics.median(w for _, w in values), 2),
            }
            for name, values in samples.items()
        },
    }


def client_answer_text(answer: httpx.Response) -> Any:
    answer.raise_for_status()
    choices = answer.json()["choices"]
    return [(c["message"].get("content"), c["message"].get("tool_calls")) for c in choices]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turn", type=int, action="append", help="turns to measure (20, 200)")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    turns = args.turn or [20, 200]
    with tempfile.TemporaryDirectory() as scratch:
        server = vllm_server.start(port=free_port(), log_path=Path(scratch) / "vllm.log")
        try:
            assert server.pid is not None, "a vLLM we did not start: its CPU is not ours to read"
            with httpx.Client(base_url=server.url, timeout=600.0) as client:
                report = [
                    run_turn(client, server.pid, server.served_model_name, turn, args.repeats)
                    for turn in turns
                ]
        finally:
            server.stop()
    print(json.dumps({"derender_seed_ids": DERENDER_SEED_IDS, "turns": report}, indent=2))


if __name__ == "__main__":
    main()
