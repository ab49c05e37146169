"""Several conversations in one trajectory (issue 38), through the real gateway and the real vLLM:
a sub-agent whose first call ends with a system message is a new root, not a break of the main
chain; conversations that take turns each continue exactly and each export as one merged row.
"""

from __future__ import annotations

from typing import Any

import httpx
from gateway_helpers import steps_of

from datapool.settings import PoolSettings
from gateway.server import BackgroundServer
from trajgate import vllm_server

MODEL = vllm_server.SERVED_MODEL_NAME
# Claude Code's first call of every conversation: its system prompt, the task, then a system
# block after the task ("# Environment", a reminder).
ENVIRONMENT = {"role": "system", "content": "# Environment\nWorking directory: /repo"}
MAIN = [
    {"role": "system", "content": "You are the main agent."},
    {"role": "user", "content": "Fix the failing test."},
    ENVIRONMENT,
]
SUB = [
    {"role": "system", "content": "You are a search sub-agent."},
    {"role": "user", "content": "Find where the test is defined."},
    ENVIRONMENT,
]


def chat(server: BackgroundServer, trajectory_id: str, messages: list[Any], seed: int) -> Any:
    """One unary chat call through the gateway, freely sampled (8 tokens); returns the history
    the agent sends next: ``messages``, the answer echoed, a new user message."""
    answer = httpx.post(
        f"{server.url}/t/{trajectory_id}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": messages,
            "max_tokens": 8,
            "temperature": 1.0,
            "seed": seed,
        },
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    echo = {"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]}
    return [*messages, echo, {"role": "user", "content": f"Go on ({seed})."}]


def test_a_sub_agent_starting_with_system_user_system_is_a_new_root_and_both_stay_exact(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    # main 0, sub 0, main 1, sub 1: before issue 38, steps 1-4 were ``system_changed`` breaks.
    main = chat(gateway, "sub-agent", MAIN, 0)
    sub = chat(gateway, "sub-agent", SUB, 1)
    chat(gateway, "sub-agent", main, 2)
    chat(gateway, "sub-agent", sub, 3)
    main_0, sub_0, main_1, sub_1 = steps_of(pool_settings, "sub-agent")
    assert (sub_0.parent_step_id, sub_0.divergence_kind) == (None, "side_call")
    assert [s for s in (main_0, sub_0, main_1, sub_1) if "prefix_break" in s.flags] == []
    for parent, step in ((main_0, main_1), (sub_0, sub_1)):
        assert (step.parent_step_id, step.extends_parent) == (parent.id, True)
        assert (step.continuation, step.divergence_kind) == ("exact", None)
        sequence = [*parent.prompt_token_ids, *parent.response_token_ids]
        assert step.prompt_token_ids[: len(sequence)] == sequence
