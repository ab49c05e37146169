"""A long coding-agent session written into a pool, for the inspector's long-horizon checks.

Owns: the calls of one session of ``T`` turns, shaped like a coding agent's (Claude Code, Codex
CLI): a system prompt, a task, an 11-tool list of about 28 KB sent on every call, and per turn
the whole history again plus the model's tool call and a ~450-character tool result (the tool
list and system prompt are those ``bench horizon`` sends, ``trajgate.bench.agent_session``'s);
in chat completions or, like Claude Code, the Anthropic Messages API; with ``cch``, the system
prompt is Claude Code's three parts (``CCH_SYSTEM``: an attribution line whose ``cch`` changes on
every call, its identity line, and a prompt of about 6 KB), so each step's system message is new
while the rest of the history repeats the parent's. Each call goes through its
dialect's ``prepare`` (the upstream body) and ``canonical``, then ``PoolStore.record_call`` (the
pool's own write path), so the rows are what the gateway would store. Never:
times anything or asserts goals (the callers do: tests/test_inspector_horizon.py,
``scripts/inspector_view_figures.py``).

Token IDs (``P_k`` prompt, ``R_k`` response, ``k`` the turn): ``P_0`` is ``FIRST_PROMPT_TOKENS``
ids, ``P_{k+1} = P_k + R_k + E_k`` with ``E_k`` ``ENV_TOKENS`` ids for the tool result, and
``R_k`` ``RESPONSE_TOKENS`` ids, so every turn extends its parent exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from datapool.steps.records import CallRecord, ChoiceRecord
from datapool.steps.store import PoolStore
from gateway.dialects.base import Dialect
from gateway.dialects.chat_completions import ChatCompletions
from gateway.dialects.messages import Messages
from trajgate.bench.agent_session import SYSTEM_PROMPT, tools

FIRST_PROMPT_TOKENS = 600
ENV_TOKENS = 60
RESPONSE_TOKENS = 40

# Claude Code's attribution line when it believes it talks to Anthropic: the first line of its
# system block 0, with a ``cch`` that changes on every request (vLLM strips the line before
# rendering, so the engine's tokens still extend the parent's).
BILLING = "x-anthropic-billing-header: cc_version=2.0.76.4f2; cc_entrypoint=sdk-cli; cch={:05x};"
CLAUDE = "You are Claude Code, Anthropic's official CLI for Claude."
# About 6 KB of instructions after the identity line (Claude Code's own prompt is larger).
CCH_PROMPT = "\n\n".join([SYSTEM_PROMPT] * 7)


def billing(turn: int) -> str:
    """The attribution line of ``turn``: a new ``cch`` on every turn."""
    return BILLING.format((turn * 40503 + 7) % 0xFFFFF)


def cch_system(turn: int) -> list[str]:
    """Claude Code's system parts at ``turn``: attribution line, identity, instructions."""
    return [billing(turn), CLAUDE, CCH_PROMPT]


def tool_result(turn: int) -> str:
    """The ~450-character output of the tool the model called at ``turn``."""
    return (f"[turn {turn}] " + "src/module.py:12: def handler(request): return request.body ")[
        :60
    ] * 8


def response_of(turn: int) -> dict[str, Any]:
    """The model's answer at ``turn``: one tool call, as the gateway stores it."""
    arguments = json.dumps({"file_path": f"/repo/src/file_{turn}.py", "limit": 40})
    call = {"id": f"call_{turn}", "type": "function"}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{**call, "function": {"name": "Read", "arguments": arguments}}],
    }


def messages_at(turn: int, cch: bool = False) -> list[dict[str, Any]]:
    """The ``messages`` the agent sends at ``turn``: system (with ``cch``, Claude Code's parts
    as text parts of one system message), task, then per earlier turn the model's tool call
    (echoed as received) and the tool's result."""
    system: Any = SYSTEM_PROMPT
    if cch:
        system = [{"type": "text", "text": text} for text in cch_system(turn)]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Fix the failing test in tests/test_handler.py."},
    ]
    for k in range(turn):
        messages.append(response_of(k))
        messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": tool_result(k)})
    return messages


def messages_body_at(turn: int, cch: bool = False) -> dict[str, Any]:
    """The same turn as an Anthropic Messages body: the system prompt beside the messages (with
    ``cch``, Claude Code's three text blocks, the last one cached), the tools with
    ``input_schema``, ``tool_use`` and ``tool_result`` blocks."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Fix the failing test in tests/test_handler.py."}
    ]
    for k in range(turn):
        call = response_of(k)["tool_calls"][0]
        use = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"]}
        use["input"] = json.loads(call["function"]["arguments"])
        result = {"type": "tool_result", "tool_use_id": call["id"], "content": tool_result(k)}
        messages += [{"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
    system: Any = SYSTEM_PROMPT
    if cch:
        system = [{"type": "text", "text": text} for text in cch_system(turn)]
        system[-1]["cache_control"] = {"type": "ephemeral"}
    return {
        "model": "tiny",
        "max_tokens": 1024,
        "system": system,
        "messages": messages,
        "tools": tools("messages"),
    }


DIALECTS = ("chat", "messages")


@dataclass(frozen=True)
class Session:
    """What was recorded: each call's step id and the request body the agent sent."""

    step_ids: list[str]
    requests: list[dict[str, Any]]


def record_session(
    store: PoolStore,
    trajectory_id: str,
    turns: int,
    dialect_name: str = "chat",
    cch: bool = False,
) -> Session:
    """Record ``turns`` calls of one session into ``store`` (module docstring) in
    ``dialect_name`` (``chat`` or ``messages``), with Claude Code's changing system message
    when ``cch``, and return them. Raises ``ValueError`` for another dialect name."""
    dialect: Dialect
    if dialect_name == "chat":
        dialect = ChatCompletions()
    elif dialect_name == "messages":
        dialect = Messages()
    else:
        raise ValueError(f"dialect must be one of {DIALECTS}, got {dialect_name!r}")
    prompt = [(7 * i) % 5000 for i in range(FIRST_PROMPT_TOKENS)]
    step_ids: list[str] = []
    requests: list[dict[str, Any]] = []
    for turn in range(turns):
        response = [5000 + (turn * RESPONSE_TOKENS + i) % 3000 for i in range(RESPONSE_TOKENS)]
        if dialect_name == "chat":
            request = {"model": "tiny", "messages": messages_at(turn, cch), "tools": tools("chat")}
        else:
            request = messages_body_at(turn, cch)
        upstream = dialect.prepare(request).upstream_body
        choice = ChoiceRecord(
            0, response, [-0.5] * RESPONSE_TOKENS, response_of(turn), "tool_calls"
        )
        record = CallRecord(
            request=request,
            upstream_request=upstream,
            model="tiny",
            upstream="http://emulator",
            policy_version=0,
            latency_ms=1.0,
            prompt_token_ids=prompt,
            prompt_tokens=len(prompt),
            choices=[choice],
            canonical=dialect.canonical(upstream),
            history_field=dialect.history_field,
        )
        step_ids += store.record_call(trajectory_id, record)
        requests.append(request)
        prompt = [*prompt, *response, *(9000 + (turn + i) % 500 for i in range(ENV_TOKENS))]
    return Session(step_ids, requests)
