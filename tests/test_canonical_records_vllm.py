"""One canonical call record from every dialect, through the real gateway and the real vLLM:
the same conversation with a tool call sent as chat, Responses and Messages gives
the same engine prompt, the same canonical record, the same built-in reward values and the same
break kind for the same history change; a side call is a new root in each. The pool-side
checks on hand-made records are in ``test_canonical_records.py``.

Exact continuation is the default: a history the agent really changed is still a
recorded break there, and an echo of the generated turn is no break at all; the template mode
shows how the echo would render (``tool_call_rerendered``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from gateway_helpers import steps_of
from tests_support import free_port

from datapool.rewards.functions import step_tool_call_format, tool_call_format
from datapool.rewards.step_rewards import StepRewardContext
from datapool.rewards.values import RewardContext
from datapool.settings import PoolSettings
from datapool.steps.store import StoredStep
from gateway.app import create_app
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings
from trajgate import vllm_server

SYSTEM = "You answer with the weather tool."
TASK = "Weather in Paris?"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
ARGUMENTS = json.dumps({"city": "Paris"})  # '{"city": "Paris"}': json.dumps, as Messages sends


def history(
    system: str = SYSTEM,
    think: str | None = None,
    arguments: str | None = ARGUMENTS,
    result: str = "sunny",
    more: str | None = None,
) -> dict[str, Any]:
    """A conversation past one tool call (none when ``arguments`` is None), in words every
    dialect can say: ``think`` is the assistant's text before its call (a ``<think>`` block
    the template renders in the last turn), ``more`` a user message after the result."""
    return {
        "system": system,
        "think": think,
        "arguments": arguments,
        "result": result,
        "more": more,
    }


def chat(turn: dict[str, Any]) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": turn["system"]},
        {"role": "user", "content": TASK},
    ]
    if turn.get("arguments") is not None:
        call = {"name": "weather", "arguments": turn["arguments"]}
        messages += [
            {
                "role": "assistant",
                "content": turn["think"],
                "tool_calls": [{"id": "c1", "type": "function", "function": call}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": turn["result"]},
        ]
    if turn["more"] is not None:
        messages.append({"role": "user", "content": turn["more"]})
    return {
        "messages": messages,
        "tools": [
            {
                "type": "function",
                "function": {"name": "weather", "strict": True, "parameters": SCHEMA},
            }
        ],
    }


def responses(turn: dict[str, Any]) -> dict[str, Any]:
    items: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    if turn.get("arguments") is not None:
        if turn["think"] is not None:
            # A string, as chat's content: a list of output_text parts is the same text to
            # the template but another content shape in the record.
            items.append({"type": "message", "role": "assistant", "content": turn["think"]})
        items += [
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "weather",
                "arguments": turn["arguments"],
            },
            {"type": "function_call_output", "call_id": "c1", "output": turn["result"]},
        ]
    if turn["more"] is not None:
        items.append({"role": "user", "content": turn["more"]})
    return {
        "instructions": turn["system"],
        "input": items,
        "tools": [{"type": "function", "name": "weather", "strict": True, "parameters": SCHEMA}],
    }


def messages(turn: dict[str, Any]) -> dict[str, Any]:
    said: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    if turn.get("arguments") is not None:
        text = [] if turn["think"] is None else [{"type": "text", "text": turn["think"]}]
        use = {"type": "tool_use", "id": "toolu_c1", "name": "weather"}
        result = {"type": "tool_result", "tool_use_id": "toolu_c1", "content": turn["result"]}
        more = [] if turn["more"] is None else [{"type": "text", "text": turn["more"]}]
        said += [
            {
                "role": "assistant",
                "content": [*text, {**use, "input": json.loads(turn["arguments"])}],
            },
            {"role": "user", "content": [result, *more]},
        ]
    return {
        "system": turn["system"],
        "messages": said,
        "tools": [{"name": "weather", "strict": True, "input_schema": SCHEMA}],
    }


# How each dialect asks for (at most) N tokens, forces the weather tool, and is reached.
DIALECTS: dict[str, tuple[str, Callable[[dict[str, Any]], dict[str, Any]], str, Any]] = {
    "chat": (
        "/v1/chat/completions",
        chat,
        "max_tokens",
        {"type": "function", "function": {"name": "weather"}},
    ),
    "responses": (
        "/v1/responses",
        responses,
        "max_output_tokens",
        {"type": "function", "name": "weather"},
    ),
    "messages": ("/v1/messages", messages, "max_tokens", {"type": "tool", "name": "weather"}),
}


def body(
    dialect: str, turn: dict[str, Any], max_tokens: int, *, force: bool = False
) -> dict[str, Any]:
    _path, build, limit, choice = DIALECTS[dialect]
    sent = {"model": "tiny", "temperature": 0, limit: max_tokens, **build(turn)}
    if force:
        sent["tool_choice"] = choice
    return sent


@pytest.fixture(params=["exact", "template"])
def gateway(
    request: pytest.FixtureRequest, vllm: vllm_server.VLLMServer, sqlite_pool: PoolSettings
) -> Iterator[tuple[BackgroundServer, str]]:
    settings = GatewaySettings(upstream_url=vllm.url, port=free_port(), continuation=request.param)
    server = BackgroundServer(create_app(settings, sqlite_pool), port=settings.port).start()
    yield server, request.param
    server.stop()


def send(server: BackgroundServer, dialect: str, trajectory_id: str, sent: dict[str, Any]) -> Any:
    path = DIALECTS[dialect][0]
    answer = httpx.post(f"{server.url}/t/{trajectory_id}{path}", json=sent, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()


def echo(dialect: str, answer: dict[str, Any], result: str) -> dict[str, Any]:
    """The next body an agent of ``dialect`` sends: the history, the generated turn exactly
    as it was answered, and the tool's result."""
    sent = body(dialect, history(arguments=None), 2)
    if dialect == "chat":
        message = answer["choices"][0]["message"]
        call_id = message["tool_calls"][0]["id"]
        sent["messages"] += [
            {
                "role": "assistant",
                "content": message["content"],
                "tool_calls": message["tool_calls"],
            },
            {"role": "tool", "tool_call_id": call_id, "content": result},
        ]
    elif dialect == "responses":
        calls = [item for item in answer["output"] if item["type"] == "function_call"]
        sent["input"] += [
            *({k: item[k] for k in ("type", "call_id", "name", "arguments")} for item in calls),
            {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": result},
        ]
    else:
        uses = [block for block in answer["content"] if block["type"] == "tool_use"]
        sent["messages"] += [
            {"role": "assistant", "content": answer["content"]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": uses[0]["id"], "content": result}
                ],
            },
        ]
    return sent


def rewards_of(steps: list[StoredStep]) -> tuple[float | None, list[float | None]]:
    """``tool_call_format`` of the trajectory, and ``step_tool_call_format`` of each step."""
    context = RewardContext("t", None, "train", {}, steps)
    per_step = [step_tool_call_format(StepRewardContext(context, step)) for step in steps]
    return tool_call_format(context), per_step


def test_one_conversation_in_three_dialects_is_one_prompt_one_record_and_one_reward(
    gateway: tuple[BackgroundServer, str], sqlite_pool: PoolSettings
) -> None:
    server, mode = gateway
    firsts: dict[str, StoredStep] = {}
    seconds: dict[str, StoredStep] = {}
    rewards = {}
    for dialect in DIALECTS:
        trajectory_id = f"{mode}-{dialect}-same"
        # Turn 1: the weather tool forced (strict: vLLM constrains the arguments to the
        # schema); 192 tokens, since the tiny model pads a forced call with whitespace.
        answer = send(
            server, dialect, trajectory_id, body(dialect, history(arguments=None), 192, force=True)
        )
        # Turn 2: the generated call echoed exactly as answered, and its result.
        send(server, dialect, trajectory_id, echo(dialect, answer, "sunny"))
        first, second = steps_of(sqlite_pool, trajectory_id)
        firsts[dialect], seconds[dialect] = first, second
        rewards[dialect] = rewards_of([first, second])
    chat_first, chat_second = firsts["chat"], seconds["chat"]
    for dialect in ("responses", "messages"):
        # The same engine prompt, the same record, the same sampled call.
        assert firsts[dialect].prompt_token_ids == chat_first.prompt_token_ids, dialect
        assert firsts[dialect].call == chat_first.call, dialect
        assert (
            firsts[dialect].response.tool_calls[0].arguments
            == chat_first.response.tool_calls[0].arguments
        )
        assert seconds[dialect].prompt_token_ids == chat_second.prompt_token_ids, dialect
        second_call, chat_call = seconds[dialect].call, chat_second.call
        assert second_call is not None and chat_call is not None
        # Turn 2's record differs only in the generated call's id (vLLM draws one per call).
        assert _without_call_ids(second_call.to_json()) == _without_call_ids(chat_call.to_json()), (
            dialect
        )
    # tool_call_format: turn 1's one call names the offered tool with the required "city"
    # (the schema forced it) -> 1/1 for the trajectory and for that step; turn 2 made a
    # call too, or none (None): whatever it was, the same in every dialect.
    assert rewards["chat"][0] is not None and rewards["chat"][1][0] == 1.0
    assert rewards["responses"] == rewards["chat"] == rewards["messages"]
    kinds = {
        d: (s.parent_step_id == firsts[d].id, "prefix_break" in s.flags, s.divergence_kind)
        for d, s in seconds.items()
    }
    if mode == "exact":
        # The echo of the generated turn continues its own token ids: no break.
        assert set(kinds.values()) == {(True, False, None)}, kinds
    else:
        # The template renders the parsed call, not the sampled text: a break, the same kind.
        assert set(kinds.values()) == {(True, True, "tool_call_rerendered")}, kinds


def _without_call_ids(record: dict[str, Any]) -> dict[str, Any]:
    for message in record["messages"]:
        for call in message.get("tool_calls") or ():
            call["id"] = None
        if message.get("tool_call_id") is not None:
            message["tool_call_id"] = None
    return record


# (what the agent changed in turn 2, the turn before and after, what every dialect must
# record for turn 2: (a child of turn 1, a prefix break, its kind))
CHANGES = [
    (
        "reasoning stripped",
        history(think="<think>plan</think>"),
        history(think=None),
        (True, True, "thinking_stripped"),
    ),
    # vLLM parses a tool call's arguments before the template renders them, so compact
    # arguments (Qwen Code re-serialises them so) are the same prompt: no break, turn 2 is a
    # fork of turn 1 (a sibling), in every dialect. The kind of such a change where the tokens
    # do differ is test_canonical_records.py's.
    (
        "arguments re-serialised",
        history(),
        history(arguments='{"city":"Paris"}'),
        (False, False, None),
    ),
    ("a turn rewritten", history(), history(result="rainy"), (True, True, "history_rewritten")),
]


@pytest.mark.parametrize(
    ("what", "before", "after", "expected"), CHANGES, ids=[c[0] for c in CHANGES]
)
def test_the_same_history_change_is_the_same_break_kind_in_every_dialect(
    gateway: tuple[BackgroundServer, str],
    sqlite_pool: PoolSettings,
    what: str,
    before: dict[str, Any],
    after: dict[str, Any],
    expected: tuple[bool, bool, str | None],
) -> None:
    server, mode = gateway
    # The Messages API sends a tool call's input as an object that the gateway serialises:
    # its client cannot re-serialise the arguments, so that change is the other two's.
    dialects = ["chat", "responses"] if "arguments" in what else list(DIALECTS)
    found = {}
    for dialect in dialects:
        trajectory_id = f"{mode}-{dialect}-{what.replace(' ', '-')}"
        send(server, dialect, trajectory_id, body(dialect, before, 2))
        send(server, dialect, trajectory_id, body(dialect, after, 2))
        first, second = steps_of(sqlite_pool, trajectory_id)
        # A change of the history is a break in either mode (exact continuation never
        # continues a rewritten history), parented on turn 1 by token ids.
        found[dialect] = (
            second.parent_step_id == first.id,
            "prefix_break" in second.flags,
            second.divergence_kind,
        )
    assert set(found.values()) == {expected}, found


def test_a_side_call_is_a_new_root_in_every_dialect(
    gateway: tuple[BackgroundServer, str], sqlite_pool: PoolSettings
) -> None:
    server, mode = gateway
    for dialect in DIALECTS:
        trajectory_id = f"{mode}-{dialect}-side"
        send(server, dialect, trajectory_id, body(dialect, history(), 2))
        title = history(system="Write a title for the conversation.", arguments=None)
        send(server, dialect, trajectory_id, body(dialect, title, 2))
        send(server, dialect, trajectory_id, body(dialect, history(more="And London?"), 2))
        main, side, again = steps_of(sqlite_pool, trajectory_id)
        assert (side.parent_step_id, side.divergence_kind) == (None, "side_call"), dialect
        assert "prefix_break" not in side.flags, dialect
        # The main chain goes on from turn 1 (a new user turn after it: its prompt shares
        # turn 1's, not the side call's), whatever the side call did in between.
        assert again.parent_step_id == main.id, dialect
