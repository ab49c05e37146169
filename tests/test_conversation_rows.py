"""Several conversations in one trajectory (lineages), through the real gateway and the real vLLM:
a sub-agent whose first call ends with a system message is a new root, not a break of the main
chain; conversations that take turns each continue exactly and each export as one merged row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
from gateway_helpers import steps_of

from datapool.batches.build import build_rows
from datapool.batches.spec import BatchSpec
from datapool.db import make_engine
from datapool.lifecycle.transitions import close_trajectory
from datapool.models import TrajectoryStatus
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore, StoredStep
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
    # main 0, sub 0, main 1, sub 1: before lineages, steps 1-4 were ``system_changed`` breaks.
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


def chat_turn(url: str, system: str, history: list[Any], seed: int) -> list[Any]:
    """Chat Completions: the history with the answer echoed (its ``messages``)."""
    body = {"model": MODEL, "messages": [{"role": "system", "content": system}, *history]}
    answer = post(f"{url}/chat/completions", {**body, "max_tokens": 8, "seed": seed})
    return [*history, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}]


def responses_turn(url: str, system: str, history: list[Any], seed: int) -> list[Any]:
    """Responses: the input items with the output items after them (no ``seed`` there)."""
    body = {"model": MODEL, "instructions": system, "input": history, "store": False}
    answer = post(f"{url}/responses", {**body, "max_output_tokens": 8})
    return [*history, *answer["output"]]


def messages_turn(url: str, system: str, history: list[Any], seed: int) -> list[Any]:
    """Anthropic Messages: the history with the answer's content blocks as the assistant's
    (no ``seed`` there)."""
    body = {"model": MODEL, "system": system, "messages": history}
    answer = post(f"{url}/messages", {**body, "max_tokens": 8})
    return [*history, {"role": "assistant", "content": answer["content"]}]


def post(url: str, body: dict[str, Any]) -> Any:
    answer = httpx.post(url, json={**body, "temperature": 1.0}, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


Turn = Callable[[str, str, list[Any], int], list[Any]]
DIALECTS: dict[str, Turn] = {
    "chat": chat_turn,
    "responses": responses_turn,
    "messages": messages_turn,
}


def merged_rows(pool_settings: PoolSettings, trajectory_id: str) -> list[dict[str, Any]]:
    """The trajectory's rows of a merged SFT batch, as a trainer reads them."""
    store = PoolStore(make_engine(pool_settings.resolved_database_url()), pool_settings)
    close_trajectory(store.sessions, trajectory_id, TrajectoryStatus.COMPLETE, final_reward=1.0)
    rows = build_rows(store, BatchSpec(algorithm="sft", layout="merged"))[0].to_pylist()
    return [r for r in rows if r["trajectory_id"] == trajectory_id]


def assert_one_row_per_conversation(
    rows: list[dict[str, Any]], conversations: list[list[StoredStep]]
) -> None:
    """Each conversation is one row, in the order the conversations started: its last step's
    ``P + R``, its steps' ids, the loss mask 1 exactly on each step's sampled tokens (at
    ``[len(P_k), len(P_k) + len(R_k))``) with the engine's logprobs there."""
    assert [r["step_ids"] for r in rows] == [[s.id for s in c] for c in conversations]
    for row, steps in zip(rows, conversations, strict=True):
        last = steps[-1]
        assert row["input_ids"] == [*last.prompt_token_ids, *last.response_token_ids]
        expected = np.zeros(len(row["input_ids"]), dtype=np.int8)
        logprobs = np.zeros(len(row["input_ids"]), dtype=np.float32)
        for step in steps:
            start, end = (
                len(step.prompt_token_ids),
                len(step.prompt_token_ids) + len(step.response_token_ids),
            )
            expected[start:end] = 1
            logprobs[start:end] = step.response_logprobs
        assert row["loss_mask"] == expected.tolist()
        assert np.array_equal(np.asarray(row["behaviour_logprobs"], dtype=np.float32), logprobs)


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_two_conversations_taking_turns_continue_exactly_and_export_as_two_rows(
    gateway: BackgroundServer, pool_settings: PoolSettings, dialect: str
) -> None:
    # A and B alternate call by call for 3 turns each: before lineages, 6 merged rows.
    turn, url = DIALECTS[dialect], f"{gateway.url}/t/taking-turns/v1"
    histories = {"A": [], "B": []}  # type: dict[str, list[Any]]
    for k in range(3):
        for name in ("A", "B"):
            history = [*histories[name], {"role": "user", "content": f"{name} asks {k}."}]
            histories[name] = turn(url, f"You are agent {name}.", history, 10 * k + len(name))
    steps = steps_of(pool_settings, "taking-turns")
    a, b = steps[0::2], steps[1::2]
    assert [s.continuation for s in steps] == ["template"] * 2 + ["exact"] * 4
    assert [s for s in steps if "prefix_break" in s.flags] == []
    assert (b[0].parent_step_id, b[0].divergence_kind) == (None, "side_call")
    for chain in (a, b):
        assert [s.parent_step_id for s in chain[1:]] == [s.id for s in chain[:-1]]
    assert_one_row_per_conversation(merged_rows(pool_settings, "taking-turns"), [a, b])


def test_a_side_call_between_main_turns_leaves_the_main_chain_one_row(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    # main 0, a title call, main 1, main 2: before lineages, rows [0], [title], [1, 2].
    main = chat(gateway, "side-row", MAIN, 0)
    title = [{"role": "system", "content": "Write a title."}, MAIN[1]]
    chat(gateway, "side-row", title, 1)
    main = chat(gateway, "side-row", main, 2)
    chat(gateway, "side-row", main, 3)
    main_0, side, main_1, main_2 = steps_of(pool_settings, "side-row")
    assert side.divergence_kind == "side_call"
    rows = merged_rows(pool_settings, "side-row")
    assert_one_row_per_conversation(rows, [[main_0, main_1, main_2], [side]])


@pytest.mark.parametrize("shape", ["title_after_a_bare_task", "sub_agent_after_a_first_turn"])
def test_a_conversation_start_as_long_as_the_main_history_is_a_side_call(
    gateway: BackgroundServer, pool_settings: PoolSettings, shape: str
) -> None:
    # Found by a new user: a start with as many messages as the main's first prompt + answer
    # was a break (history_rewritten / system_changed), and the main chain's next exact turn
    # was flagged after it; a prefix_break curation rule then dropped the whole trajectory.
    trajectory = f"short-{shape}"
    if shape == "title_after_a_bare_task":
        first, start = [MAIN[1]], [{"role": "system", "content": "Write a title."}, MAIN[1]]
    else:
        first, start = MAIN[:2], SUB
    main = chat(gateway, trajectory, first, 0)
    side = chat(gateway, trajectory, start, 1)
    main = chat(gateway, trajectory, main, 2)
    chat(gateway, trajectory, side, 3)
    main_0, side_0, main_1, side_1 = steps_of(pool_settings, trajectory)
    assert (side_0.parent_step_id, side_0.divergence_kind) == (None, "side_call")
    assert [s for s in (main_0, side_0, main_1, side_1) if "prefix_break" in s.flags] == []
    assert (main_1.parent_step_id, side_1.parent_step_id) == (main_0.id, side_0.id)
    rows = merged_rows(pool_settings, trajectory)
    assert_one_row_per_conversation(rows, [[main_0, main_1], [side_0, side_1]])


def test_continuing_the_first_answer_after_a_resend_is_exact_like_a_choice_of_n(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    # The same request twice (a retry), then the agent goes on from the FIRST answer: before
    # lineages that step was flagged ``history_rewritten`` (it leaves the re-send's answer);
    # going on from choice 0 of one n=2 call was not. Both are a sibling's exact continuation.
    first = chat(gateway, "resend", MAIN[:2], 0)
    chat(gateway, "resend", MAIN[:2], 1)
    chat(gateway, "resend", first, 2)
    answered, again, going_on = steps_of(pool_settings, "resend")
    assert (again.parent_step_id, again.prompt_token_ids) == (None, answered.prompt_token_ids)
    assert again.response_token_ids != answered.response_token_ids  # two different answers
    assert (going_on.parent_step_id, going_on.extends_parent) == (answered.id, True)
    assert (going_on.continuation, going_on.divergence_kind) == ("exact", None)
    assert [s for s in (answered, again, going_on) if "prefix_break" in s.flags] == []


def test_a_dropped_middle_turn_is_a_history_truncated_break(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    # [system, task, a0, go on 0] → a1; then the agent drops its first exchange (task, a0) and
    # sends [system, go on 0, a1, go on 1]: the parent's messages with whole turns removed.
    # Before lineages this break was labelled ``history_rewritten``.
    history = chat(gateway, "dropped", MAIN[:2], 0)
    history = chat(gateway, "dropped", history, 1)
    chat(gateway, "dropped", [history[0], *history[3:]], 2)
    _, second, dropped = steps_of(pool_settings, "dropped")
    assert (dropped.parent_step_id, dropped.extends_parent) == (second.id, False)
    assert "prefix_break" in dropped.flags and dropped.divergence_kind == "history_truncated"
