"""The exact prompt spliced from the text of render's ids is the one spliced from the parsed
list: ``TurnPrefix.splice_text`` against ``TurnPrefix.splice``, and the engine room's reading
of a render answer (``_read_render``) whether its ids are written plainly (the text path) or
not (parsed whole, as before)."""

from __future__ import annotations

import random
from typing import Any

import httpx
import orjson
import pytest

from datapool.steps.payloads import pack_ids
from gateway.engine.errors import UnreadableAnswerError
from gateway.engine.exact import _plain_render, _prompt_of, _read_render
from gateway.proxy.continuation.prompt import TurnPrefix, turn_prefix

END = 2
# Ids whose text holds the end token's digit, so a search for "2" alone would find them.
LOOKALIKES = [2, 2, 12, 21, 22, 222, 20, 102, 0, 1, 3]


def _prefix(sequence: list[int]) -> TurnPrefix:
    prefix = turn_prefix(pack_ids(sequence), END)
    assert prefix is not None
    return prefix


def _text(ids: list[int]) -> bytes:
    return orjson.dumps(ids)[1:-1]


def test_the_text_splice_is_the_list_splice_for_every_rendering() -> None:
    rng = random.Random(7)
    for _ in range(5000):
        sequence = [rng.choice(LOOKALIKES) for _ in range(rng.randrange(1, 12))]
        rendered = [rng.choice(LOOKALIKES) for _ in range(rng.randrange(1, 30))]
        prefix = _prefix(sequence)
        assert prefix.splice_text(_text(rendered)) == prefix.splice(rendered), (
            sequence,
            rendered,
        )


def test_the_text_splice_by_hand() -> None:
    # S = [5, 2, 7] stopped before the end token: closed here, S' = [5, 2, 7, 2], 2 closes.
    prefix = _prefix([5, 2, 7])
    assert (prefix.token_ids, prefix.closes, prefix.closed_here) == ([5, 2, 7, 2], 2, 1)
    # F = [5, 22, 2, 12, 2, 21, 2, 9]: closes at 2 and 4 (22, 12, 21 are not closes), so the
    # suffix is F[5:] = [21, 2, 9] and suffix_tokens = 1 + 3.
    spliced = prefix.splice_text(b"5,22,2,12,2,21,2,9")
    assert spliced is not None
    assert (spliced.token_ids, spliced.suffix_tokens) == ([5, 2, 7, 2, 21, 2, 9], 4)
    # adjacent closes share their comma: F = [2, 2, 4] has its 2nd close at 1, suffix [4]
    assert _prefix([2, 2]).splice_text(b"2,2,4") == _prefix([2, 2]).splice([2, 2, 4])
    assert _prefix([2, 2]).splice_text(b"2,2") is None  # nothing after the boundary
    assert _prefix([2, 2]).splice_text(b"2,12,22") is None  # one close only


def _render(content: bytes) -> httpx.Response:
    return httpx.Response(200, content=content)


def _answer(ids_text: bytes, **extra: Any) -> bytes:
    rest = orjson.dumps({"sampling_params": {"n": 1}, **extra})
    return b'{"request_id":"r","token_ids":[' + ids_text + b"]," + rest[1:]


@pytest.mark.parametrize(
    "ids_text",
    [
        b"5,22,2,12,2,21,2,9",  # plain: spliced from the text
        b"5, 22, 2, 12, 2, 21, 2, 9",  # spaces: parsed whole
    ],
)
def test_a_render_answer_gives_the_same_prompt_read_either_way(ids_text: bytes) -> None:
    request, _, spliced = _read_render(_render(_answer(ids_text)), _prefix([5, 2, 7]))
    assert request["sampling_params"] == {"n": 1}
    assert spliced is not None
    assert (spliced.token_ids, spliced.suffix_tokens) == ([5, 2, 7, 2, 21, 2, 9], 4)


@pytest.mark.parametrize(
    "content",
    [
        _answer(b"5, 2"),  # a space
        _answer(b"5,-2"),  # a sign
        _answer(b"5,2.0"),  # a fraction
        _answer(b"5,,2"),
        _answer(b",5,2"),
        _answer(b"5,2,"),
        _answer(b""),
        _answer(b"5,2", features={"token_ids": [1]}),  # the name twice
        b'{"x":{"token_ids":[1,2]},"token_ids":null,"sampling_params":{}}',  # not top level
    ],
)
def test_ids_not_written_plainly_are_read_whole(content: bytes) -> None:
    assert _plain_render(_render(content)) is None


def test_the_plain_text_is_what_lies_between_the_brackets() -> None:
    plain = _plain_render(_render(_answer(b"5,22,2")))
    assert plain is not None
    request, text = plain
    assert text == b"5,22,2" and request["token_ids"] == []


@pytest.mark.parametrize(
    "ids_text",
    [
        b"5,2,2,01",  # a leading zero in the suffix: no JSON
        b"5,2,2,2147483648",  # past int32 in the suffix
        b"5,2,2,99999999999999999999999",  # past 64 bits in the suffix
    ],
)
def test_a_bad_id_in_the_suffix_of_plain_text_is_unreadable(ids_text: bytes) -> None:
    with pytest.raises(UnreadableAnswerError):
        _, rendered, spliced = _read_render(_render(_answer(ids_text)), _prefix([5, 2]))
        _prompt_of(rendered, spliced)


def test_plain_ids_without_a_boundary_are_parsed_and_checked_whole() -> None:
    # S = [5, 2, 2] has 2 closes; F = [5, 2, 9] has one: the template's own ids are the
    # prompt, so every one of them is read and checked (an id past int32 is refused).
    _, rendered, spliced = _read_render(_render(_answer(b"5,2,9")), _prefix([5, 2, 2]))
    assert spliced is None and _prompt_of(rendered, spliced) == [5, 2, 9]
    with pytest.raises(UnreadableAnswerError):
        _, rendered, spliced = _read_render(_render(_answer(b"5,2,2147483648")), _prefix([5, 2, 2]))
        _prompt_of(rendered, spliced)
