"""``check_shape`` checks a fitting answer a field at a time (``gateway.engine.wire._fits``)
and walks only an answer that does not fit, for the path of its first wrong value
(``_first_wrong``): the two must agree on every answer. vLLM's answers in every answer and
chunk shape of the engine room, each with one value (or a few) replaced by every kind of JSON
value, are passed by both or refused by both, with the walk's error."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.engine import answers, wire
from gateway.engine.wire import Shape, check_shape

SHAPES = {
    "chat answer": answers.CHAT_ANSWER,
    "chat chunk": answers.CHAT_CHUNK,
    "completion answer": answers.COMPLETION_ANSWER,
}
# Every kind of JSON value; a boolean apart from numbers, as JSON keeps them.
KINDS: list[Any] = ["x", 3, 2.5, True, False, None, [], [1, "a"], [None], {}, {"a": 1}]


def _token(k: int) -> dict[str, Any]:
    return {
        "token": f"t{k}",
        "logprob": -0.5 * k,
        "bytes": [116, 48 + k % 10],
        "top_logprobs": [{"token": f"t{k}", "logprob": -0.5, "bytes": [116]}, None],
    }


def chat_answer(field: str) -> dict[str, Any]:
    """A vLLM chat answer (or a chunk: ``field`` "delta") with every field of its shape, two
    choices, tool calls, reasoning, logprobs with top logprobs, usage."""
    choice = {
        "index": 0,
        field: {
            "role": "assistant",
            "content": "hi",
            "reasoning": "think",
            "reasoning_content": None,
            "refusal": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "index": 0,
                    "function": {"name": "Read", "arguments": "{}"},
                },
                {"id": "c2", "function": {"name": "Bash"}},
            ],
        },
        "logprobs": {"content": [_token(k) for k in range(4)]},
        "finish_reason": "stop",
        "stop_reason": 7,
    }
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "tiny",
        "system_fingerprint": None,
        "choices": [choice, {**copy.deepcopy(choice), "index": 1, "stop_reason": "END"}],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 6,
            "total_tokens": 11,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 1},
        },
    }


def completion_answer() -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "text": "hi",
                "logprobs": {
                    "tokens": ["h", "i"],
                    "token_logprobs": [-0.1, None],
                    "top_logprobs": [{"h": -0.1}, None],
                    "text_offset": [0, 1],
                },
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }


ANSWERS = {
    "chat answer": chat_answer("message"),
    "chat chunk": chat_answer("delta"),
    "completion answer": completion_answer(),
}


def places(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in ``value``: the path of keys and list positions from the top."""
    yield at
    if isinstance(value, dict):
        for key, child in value.items():
            yield from places(child, (*at, key))
    elif isinstance(value, list):
        for position, child in enumerate(value):
            yield from places(child, (*at, position))


def replaced(value: Any, at: tuple[Any, ...], new: Any) -> Any:
    if not at:
        return new
    changed = copy.deepcopy(value)
    holder = changed
    for step in at[:-1]:
        holder = holder[step]
    holder[at[-1]] = new
    return changed


@pytest.fixture(autouse=True, params=[1, wire._BY_FIELD_FROM], ids=["by-field", "default"])
def by_field_from(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Every list checked a field at a time (1), and as served: these answers' lists are
    short, so the default walks most of them one item at a time."""
    monkeypatch.setattr(wire, "_BY_FIELD_FROM", request.param)
    return int(request.param)


def walk_passes(value: Any, shape: Shape) -> bool:
    try:
        wire._first_wrong(value, shape, "answer")
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("name", list(SHAPES))
def test_a_fitting_answer_passes_both_ways(name: str) -> None:
    answer, shape = ANSWERS[name], SHAPES[name]
    assert wire._fits(answer, shape) and walk_passes(answer, shape)
    check_shape(answer, shape, "answer")


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_field_check_agrees_with_the_walk_on_every_replaced_value(name: str) -> None:
    answer, shape = ANSWERS[name], SHAPES[name]
    refused = 0
    for at in list(places(answer)):
        for kind in KINDS:
            broken = replaced(answer, at, copy.deepcopy(kind))
            fits = wire._fits(broken, shape)
            assert fits == walk_passes(broken, shape), (at, kind)
            if not fits:
                refused += 1
                with pytest.raises(ValueError, match=r"^expected .+ at answer"):
                    check_shape(broken, shape, "answer")
    assert refused > 100  # the replacements broke answers: not every one fits


def test_answers_broken_in_several_places_agree() -> None:
    rng = random.Random(7)
    for name, answer in ANSWERS.items():
        shape = SHAPES[name]
        for _ in range(1500):
            broken = answer
            for _ in range(rng.randint(1, 3)):
                at = rng.choice(list(places(broken)))
                broken = replaced(broken, at, copy.deepcopy(rng.choice(KINDS)))
            assert wire._fits(broken, shape) == walk_passes(broken, shape), broken


def test_the_error_names_the_first_wrong_value() -> None:
    at = ("choices", 1, "logprobs", "content", 3, "top_logprobs", 0, "bytes", 0)
    broken = replaced(ANSWERS["chat answer"], at, 1.5)
    with pytest.raises(ValueError) as raised:
        check_shape(broken, answers.CHAT_ANSWER, "answer")
    assert str(raised.value) == (
        "expected int at answer.choices[1].logprobs.content[3].top_logprobs[0].bytes[0], "
        "got float: 1.5"
    )
