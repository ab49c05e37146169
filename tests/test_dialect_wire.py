"""The dialects' typed view of vLLM's answers (``gateway.dialects.wire``) says what the
runtime shape check (``gateway.engine.answers``) checks: the same fields, the same JSON types.

A value is read through these ``TypedDict``s right after ``check_shape`` ran on it, so a field
typed here but not checked there (or checked as another type) would be a type that lies. The
same holds for the chat body's sampling fields (``ChatSampling``), written from the values the
translations' field tables checked.
"""

from __future__ import annotations

import functools
import operator
import types
import typing
from typing import Any, get_args, get_origin, get_type_hints, is_typeddict

import pytest

from gateway.dialects import wire
from gateway.dialects.messages import request as messages_request
from gateway.dialects.responses import request as responses_request
from gateway.engine import answers
from gateway.engine.wire import INTEGER, NUMBER, TEXT, Shape

# Checked apart from the shape (``gateway.engine.wire.token_ids``: int32 ids).
CHECKED_APART = {"token_ids", "prompt_token_ids"}
# JSON types of a shape → the Python type the TypedDict names (a number may be an int).
LEAVES: dict[tuple[type, ...], set[Any]] = {
    TEXT: {str},
    INTEGER: {int},
    NUMBER: {float},
    (int, str): {int, str},
}


def _without_none(hint: Any) -> Any:
    """``X | None`` → ``X`` (every answer field may be null: ``check_shape`` passes it)."""
    if get_origin(hint) in (typing.Union, types.UnionType):
        members = [arg for arg in get_args(hint) if arg is not type(None)]
        assert len(members) == len(get_args(hint)) - 1, f"{hint} must allow null"
        return functools.reduce(operator.or_, members)
    raise AssertionError(f"{hint} must allow null: check_shape lets null pass")


def _agrees(hint: Any, shape: Shape, where: str) -> None:
    if isinstance(shape, dict):
        assert is_typeddict(hint), f"{where}: the shape is an object, the type {hint}"
        fields = get_type_hints(hint)
        for name, field_shape in shape.items():
            assert name in fields, f"{where}.{name} is checked but not typed"
            _agrees(_without_none(fields[name]), field_shape, f"{where}.{name}")
        unchecked = set(fields) - set(shape) - CHECKED_APART
        assert unchecked == set(), f"{where}: typed but never checked: {unchecked}"
    elif isinstance(shape, list):
        assert get_origin(hint) is list, f"{where}: the shape is a list, the type {hint}"
        (item,) = get_args(hint)
        if shape[0] == {}:  # a list whose items are not read
            return
        _agrees(item, shape[0], f"{where}[]")
    else:
        kinds = set(get_args(hint)) if get_args(hint) else {hint}
        assert kinds == LEAVES[shape], f"{where}: checked as {shape}, typed {hint}"


@pytest.mark.parametrize(
    ("typed", "shape"),
    [
        (wire.AnswerChoice, answers.CHAT_ANSWER["choices"][0]),
        (wire.ChunkChoice, answers.CHAT_CHUNK["choices"][0]),
        (wire.CompletionChoice, answers.COMPLETION_ANSWER["choices"][0]),
    ],
    ids=["chat answer choice", "chat chunk choice", "completion choice"],
)
def test_every_choice_field_read_typed_is_the_one_the_shape_check_checks(
    typed: Any, shape: Shape
) -> None:
    _agrees(typed, shape, "choices[]")


def test_the_top_level_of_an_answer_is_typed_as_the_shape_check_checks_it() -> None:
    top = {name: shape for name, shape in answers.CHAT_ANSWER.items()}
    fields = get_type_hints(wire.Answer)
    assert set(fields) - CHECKED_APART == set(top)
    for name, shape in top.items():
        if name != "choices":  # its items: the test above, per dialect
            _agrees(_without_none(fields[name]), shape, name)
    assert answers.COMPLETION_ANSWER.keys() == answers.CHAT_ANSWER.keys()


def test_a_field_typed_but_unchecked_is_caught() -> None:
    class Extra(wire.AnswerFunctionCall, total=False):
        unchecked: str | None

    with pytest.raises(AssertionError, match="typed but never checked"):
        _agrees(Extra, {"name": TEXT, "arguments": TEXT}, "function")


@pytest.mark.parametrize("table", [messages_request.SAMPLING, responses_request.SAMPLING])
def test_a_sampling_table_checks_each_field_as_chat_sampling_types_it(table: Any) -> None:
    # ``copy_fields`` writes each value it checked against the table into a ``ChatSampling``
    # under the table's chat name; an int is a float to the type (PEP 484's numeric tower).
    fields = get_type_hints(wire.ChatSampling)
    assert set(get_args(wire.SamplingName)) == set(fields) - {"stop"}
    for spec in table.values():
        kinds = spec.kind if isinstance(spec.kind, tuple) else (spec.kind,)
        typed = fields[spec.chat_name]
        assert all(kind is typed or (kind is int and typed is float) for kind in kinds), spec
