"""The main job on the embedded defaults (``trajgate demo``).

Sets up and runs, idempotently: the tiny model, vLLM's environment, a vLLM server, the pool on
SQLite, the gateway; then runs the unmodified OpenAI-SDK agent in ``examples/`` against the
gateway as a separate process and prints the steps the pool captured. Later issues extend this
into the full loop (rewards, curation, batches, RL updates, LoRA hot-load).
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from datapool import db
from datapool.db import make_engine
from datapool.settings import PoolSettings
from datapool.store import PoolStore
from gateway.app import create_app
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings
from trajgate import tinymodel, vllm_server

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"


def _say(echo: bool, text: str) -> None:
    if echo:
        print(text, flush=True)


def run_demo(
    *, gateway_port: int = 8000, vllm_port: int = 8100, echo: bool = True
) -> dict[str, Any]:
    """Run one captured agent episode end to end and return a summary of what the pool holds."""
    _say(echo, "[1/5] tiny model")
    model_dir = tinymodel.generate(vllm_server.default_model_dir())
    _say(echo, "[2/5] vLLM environment (first time: several minutes)")
    vllm_server.install(log=echo)
    _say(echo, f"[3/5] vLLM server on port {vllm_port}")
    server = vllm_server.start(model_dir, port=vllm_port)
    try:
        pool = PoolSettings()
        db.upgrade(pool.resolved_database_url())
        settings = GatewaySettings(upstream_url=server.url, port=gateway_port)
        gateway = BackgroundServer(create_app(settings, pool), port=gateway_port).start()
        trajectory_id = f"demo-{uuid.uuid4().hex[:8]}"
        base_url = f"{gateway.url}/t/{trajectory_id}/v1"
        _say(echo, f"[4/5] gateway at {gateway.url}; agent base_url={base_url}")
        try:
            agent = subprocess.run(
                [
                    sys.executable,
                    str(EXAMPLES_DIR / "openai_tool_agent.py"),
                    "--base-url",
                    base_url,
                ],
                check=True,
                capture_output=True,
                text=True,
            )
        finally:
            gateway.stop()
        engine = make_engine(pool.resolved_database_url())
        steps = PoolStore(engine).steps_of(trajectory_id)
        engine.dispose()
    finally:
        server.stop()  # no-op when we reused a server someone else started
    _say(
        echo,
        f"[5/5] captured {len(steps)} steps of trajectory {trajectory_id} "
        f"in {pool.resolved_database_url()}",
    )
    summary_steps = []
    for step in steps:
        row = {
            "step_id": step.id,
            "step_index": step.step_index,
            "policy_version": step.policy_version,
            "finish_reason": step.finish_reason,
            "prompt_tokens": len(step.prompt_token_ids or []),
            "response_tokens": len(step.response_token_ids or []),
            "response_token_ids_head": (step.response_token_ids or [])[:12],
            "response_logprobs_head": [round(x, 4) for x in (step.response_logprobs or [])[:6]],
            "tool_calls": [
                call["function"] for call in (step.response_message or {}).get("tool_calls") or []
            ],
            "extends_parent": step.extends_parent,
            "divergence_offset": step.divergence_offset,
            "flags": step.flags,
            "latency_ms": round(step.latency_ms, 1),
        }
        summary_steps.append(row)
        if echo:
            print(
                f"  step {row['step_index']}: {row['prompt_tokens']} prompt ids -> "
                f"{row['response_tokens']} sampled ids {row['response_token_ids_head']}... "
                f"logprobs {row['response_logprobs_head']}... finish={row['finish_reason']} "
                f"extends_parent={row['extends_parent']} flags={row['flags']} "
                f"tool_calls={row['tool_calls']} latency={row['latency_ms']} ms"
            )
    _say(echo, f"agent said: {agent.stdout.strip()}")
    return {
        "trajectory_id": trajectory_id,
        "database_url": pool.resolved_database_url(),
        "steps_captured": len(steps),
        "steps": summary_steps,
    }
