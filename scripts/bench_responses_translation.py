"""CPU of the Responses dialect's translation of a Codex-shaped call, with and without the
translation memory (``gateway.dialects.translation_memory``).

The history: Codex's recorded opening items (``tests/data/codex_request.json``: its developer
instructions, skills, environment and task), then per turn a reasoning item, a
``function_call`` and its ``function_call_output`` (``trajgate.bench.agent_session``'s
~450-character tool results), and every fourth turn an assistant answer and the user's next
message. Turn ``T`` sends the opening and ``T`` turns. For turn ``T`` of each ``--turn``, the
time of the call of turn ``T`` right after turn ``T - 1``'s (process CPU,
``time.process_time``; bodies parsed outside the timed part), in ms per call, the minimum
over ``--rounds`` rounds of ``--calls`` calls:

- ``translate_body``: with a memory that holds turn ``T - 1``'s entry, and without a memory;
- ``Responses.prepare``: on a dialect that prepared turn ``T - 1`` just before, and on a
  fresh dialect (nothing kept: the whole input translated, then kept).

Prints one JSON line per turn. Run:

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_responses_translation.py [--turn 10 --turn 199]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from gateway.dialects.responses import Responses
from gateway.dialects.responses.request import ResponsesMemory, translate_body
from trajgate.bench import agent_session

ROOT = Path(__file__).resolve().parent.parent
TOOL_RESULT_CHARS = 450


def opening() -> list[dict[str, Any]]:
    recorded = json.loads((ROOT / "tests" / "data" / "codex_request.json").read_text())
    items: list[dict[str, Any]] = recorded["input"][:4]
    return items


def turn_items(turn: int) -> list[dict[str, Any]]:
    """The items turn ``turn`` adds to the input."""
    reasoning = f"The failure at turn {turn} points at the nested list branch; read it next. "
    items: list[dict[str, Any]] = [
        {
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": reasoning * 2}],
            "encrypted_content": None,
        },
        {
            "type": "function_call",
            "name": "exec_command",
            "arguments": json.dumps({"cmd": f"python -m pytest tests/test_parser.py -q -k {turn}"}),
            "call_id": f"call_{turn}",
        },
        {
            "type": "function_call_output",
            "call_id": f"call_{turn}",
            "output": agent_session.tool_result(0, turn, TOOL_RESULT_CHARS),
        },
    ]
    if turn % 4 == 3:
        answer = f"Turn {turn}: the parser's nested lists fail; trying the next fix."
        items += [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": answer}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "go on"}],
            },
        ]
    return items


def body_bytes(turn: int) -> bytes:
    items = opening()
    for earlier in range(turn):
        items += turn_items(earlier)
    body = {
        "model": "gpt-5-codex",
        "instructions": agent_session.SYSTEM_PROMPT,
        "input": items,
        "tools": agent_session.tools("responses"),
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
    }
    return orjson.dumps(body)


def min_ms(rounds: int, calls: int, call: Callable[[], Callable[[], object]]) -> float:
    """The least mean CPU (ms) of ``calls`` timed calls over ``rounds`` rounds; ``call()``
    does the untimed part and returns the timed one."""
    best = float("inf")
    for _ in range(rounds):
        spent = 0.0
        for _ in range(calls):
            timed = call()
            start = time.process_time()
            timed()
            spent += time.process_time() - start
        best = min(best, spent / calls)
    return best * 1000


def figures(turn: int, rounds: int, calls: int) -> dict[str, Any]:
    before, sent = body_bytes(turn - 1), body_bytes(turn)

    def with_memory() -> Callable[[], object]:
        memory = ResponsesMemory()
        translate_body(orjson.loads(before), memory)
        body = orjson.loads(sent)
        return lambda: translate_body(body, memory)

    def without_memory() -> Callable[[], object]:
        body = orjson.loads(sent)
        return lambda: translate_body(body)

    def prepare_after() -> Callable[[], object]:
        dialect = Responses()
        dialect.prepare(orjson.loads(before))
        body = orjson.loads(sent)
        return lambda: dialect.prepare(body)

    def prepare_fresh() -> Callable[[], object]:
        dialect = Responses()
        body = orjson.loads(sent)
        return lambda: dialect.prepare(body)

    return {
        "turn": turn,
        "items": len(orjson.loads(sent)["input"]),
        "input_bytes": len(orjson.dumps(orjson.loads(sent)["input"])),
        "translate_body_with_memory_ms": round(min_ms(rounds, calls, with_memory), 4),
        "translate_body_without_memory_ms": round(min_ms(rounds, calls, without_memory), 4),
        "prepare_after_previous_turn_ms": round(min_ms(rounds, calls, prepare_after), 4),
        "prepare_fresh_dialect_ms": round(min_ms(rounds, calls, prepare_fresh), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turn", type=int, action="append", help="turns to time (10, 199)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    for turn in args.turn or [10, 199]:
        print(json.dumps(figures(turn, args.rounds, args.calls)))


if __name__ == "__main__":
    main()
