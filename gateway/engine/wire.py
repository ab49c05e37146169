"""JSON as the engine writes and reads it, and the checks an answer passes before any of it is
captured: the one way the gateway parses what vLLM sends.

Owns: exact JSON parsing (``loads``, ``loads_object``: orjson where its value is ``json``'s) and
writing (``dumps``: as vLLM's pydantic writes it); ``UNREADABLE``, the errors reading an answer
of the wrong kind raises; the ``Shape`` of an answer and its check (``check_shape``; vLLM's own
shapes are ``gateway.engine.answers``); token ids as the engine sent them (``token_ids``,
``CheckedIds``) and a choice's index (``choice_index``). Never: tokenizes or decodes, or makes
up a value vLLM did not send; flags a step (``gateway.capture``).

Imports: orjson and the standard library only, so the dialects (which read vLLM's answers) and
the proxy may import it (``.importlinter``: the dialects' contract names it).
"""

from __future__ import annotations

import json
import re
from functools import cache
from itertools import chain, repeat
from typing import Any, NoReturn

import orjson

# An integer literal of 19 or more digits may not fit in 64 bits, where orjson would hand back a
# float instead of the exact int (not a float's digits: no '.' before, no '.', 'e' or digit after).
_LONG_INT = re.compile(rb"(?<![\d.])\d{19,}(?![\d.eE])")
# Every digit made '0', so one substring test finds any run of 19 digits: 30 times cheaper than
# the regex above over an answer with 1,000 prompt ids (62 us against 1.8 ms), which then runs
# only where such a run exists.
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_NINETEEN_DIGITS = b"0" * 19


def loads(data: bytes) -> Any:
    """Parse JSON exactly as ``json.loads`` does, with orjson where the result is the same.

    orjson is several times faster, but turns integers past 64 bits into floats and refuses what
    ``json.loads`` accepts beyond the standard (``NaN``, lone surrogates); those go to ``json``.
    Raises ``json.JSONDecodeError`` (a ``ValueError``) on invalid JSON.
    """
    if not may_hold_long_int(data):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)


def may_hold_long_int(data: bytes | bytearray) -> bool:
    """Whether ``data`` (JSON text) may hold an integer literal of 19 or more digits, which
    orjson would read as a float (past 64 bits) where ``json`` keeps the exact int. False is
    certain; True sends the text to ``json``."""
    return (
        _NINETEEN_DIGITS in data.translate(_DIGITS_AS_ZERO) and _LONG_INT.search(data) is not None
    )


# What reading an upstream answer the capture cannot read raises: bytes that are not UTF-8 or
# not JSON (``ValueError``: ``UnicodeDecodeError``, ``JSONDecodeError``), and a value of the wrong
# kind where a dialect reads a field (``{"choices": 5}``: ``TypeError``, ``AttributeError``,
# ``KeyError``, ``IndexError``). vLLM never sends such an answer; the proxy turns any of them,
# raised while a dialect reads one event or one unary body, into ``upstream_error``.
UNREADABLE = (ValueError, TypeError, AttributeError, KeyError, IndexError)


def loads_object(data: bytes) -> dict[str, Any]:
    """``loads`` of an upstream answer or stream event, which must be a JSON object. Raises
    ``ValueError`` (one of ``UNREADABLE``) for invalid UTF-8, invalid JSON or another value."""
    value = loads(data)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}: {data[:80]!r}")
    return value


# The shape of an upstream answer as the capture and the dialects read it
# (``check_shape``): a tuple of the JSON types a value may have, ``{name: shape}`` for an
# object (other names pass unread), ``[shape]`` for a list of such items.
Shape = tuple[type, ...] | dict[str, "Shape"] | list["Shape"]
TEXT: Shape = (str,)
INTEGER: Shape = (int,)
NUMBER: Shape = (int, float)


def check_shape(value: Any, shape: Shape, where: str) -> None:
    """Raise ``ValueError`` (one of ``UNREADABLE``) naming the first value in ``value`` whose
    JSON type is not the one ``shape`` gives its field (``where``: the path so far).

    A field that is absent or ``null`` passes (the capture records it as missing); a boolean
    is no number (JSON keeps them apart; Python's ``bool`` is an ``int``). Every field a
    dialect reads from an answer is in its shape, so a value of the wrong kind makes the whole
    answer unreadable before any of it is captured or relayed, instead of failing later where
    it is used (a ``TypeError`` joining a number into the message, after the client's stream
    was cut) or being stored as text (``finish_reason: 5`` as ``'5'``).

    An answer that fits is only read by ``_fits``, which checks a list of objects a field at
    a time (each field's values gathered and their types collected by ``map`` and ``set``, C
    loops) instead of walking every value with its path: a 200-token answer's logprobs are
    about 2,000 values, and the walk took a fifth of the gateway's CPU of a short unary call
    (py-spy, ``trajgate bench gateway --concurrency 64 --stream false``). Only an answer that
    does not fit is walked (``_first_wrong``), for the path of its first wrong value.
    """
    if not _fits(value, shape):
        _first_wrong(value, shape, where)


_NONE = type(None)
_LIST_OR_NULL = frozenset((list, _NONE))
_OBJECT_OR_NULL = frozenset((dict, _NONE))
# From this many items a list is checked a field at a time: below it, the sets and maps cost
# more than walking the items (a stream chunk's one token: 3 us walked, 40 us by field).
_BY_FIELD_FROM = 8


@cache
def _or_null(kinds: tuple[type, ...]) -> frozenset[type]:
    return frozenset((*kinds, _NONE))


def _fits(value: Any, shape: Shape) -> bool:
    """Whether ``check_shape`` passes ``value``: the same rules, without paths."""
    if value is None:
        return True
    if isinstance(shape, tuple):
        return type(value) in shape
    if isinstance(shape, dict):
        if type(value) is not dict:
            return False
        for name, field_shape in shape.items():
            field = value.get(name)
            if field is not None and not _fits(field, field_shape):
                return False
        return True
    return type(value) is list and _items_fit(value, shape[0])


def _items_fit(items: list[Any], shape: Shape) -> bool:
    """Whether every item of ``items`` (each may be null) fits ``shape``: a few items (a
    stream chunk's) one by one, more a field at a time."""
    if len(items) < _BY_FIELD_FROM:
        return all(map(_fits, items, repeat(shape)))
    kinds = set(map(type, items))
    if isinstance(shape, tuple):
        return kinds <= _or_null(shape)
    if isinstance(shape, dict):
        return kinds <= _OBJECT_OR_NULL and _column_fits(list(filter(None, items)), shape)
    # lists of lists: their items, one list
    return kinds <= _LIST_OR_NULL and _items_fit(
        list(chain.from_iterable(filter(None, items))), shape[0]
    )


def _column_fits(objects: list[dict[str, Any]], shape: dict[str, Shape]) -> bool:
    """Whether each of ``objects`` (dicts) fits ``shape``, checked a field at a time."""
    for name, field_shape in shape.items():
        if not _items_fit(list(map(dict.get, objects, repeat(name))), field_shape):
            return False
    return True


def _first_wrong(value: Any, shape: Shape, where: str) -> None:
    """``check_shape``'s walk with paths: raises for the first value that does not fit."""
    if value is None:
        return
    if isinstance(shape, dict):
        if type(value) is not dict:
            _wrong_kind(value, "an object", where)
        for name, field_shape in shape.items():
            field = value.get(name)
            if field is not None:
                _first_wrong(field, field_shape, f"{where}.{name}")
    elif isinstance(shape, list):
        if type(value) is not list:
            _wrong_kind(value, "a list", where)
        item_shape = shape[0]
        for position, item in enumerate(value):
            _first_wrong(item, item_shape, f"{where}[{position}]")
    elif type(value) not in shape:
        _wrong_kind(value, " or ".join(kind.__name__ for kind in shape), where)


def _wrong_kind(value: Any, expected: str, where: str) -> NoReturn:
    raise ValueError(f"expected {expected} at {where}, got {type(value).__name__}: {value!r:.80}")


def dumps(value: dict[str, Any] | list[Any]) -> bytes:
    """JSON as vLLM serialises it (pydantic: compact, UTF-8 as is, shortest float digits).

    orjson refuses integers past 64 bits and strings with lone surrogates, which pydantic would
    write; those values fall back to ``json`` (same layout; floats may then differ in notation).
    """
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode(
            "utf-8", "surrogatepass"
        )


_INT32_END = 2**31


class CheckedIds(list[int]):
    """Token ids already read by ``token_ids``, or made only of such ids (an exact prompt:
    a captured turn's ids and a slice of the render's), which ``token_ids`` passes as they
    are: the exact prompt is ~20k ids at turn 200 of a coding-agent session, and checking
    them again when the answer is read cost 0.5 ms a call. A client's JSON never makes one."""


def token_ids(value: Any) -> list[int] | None:
    """``value`` as token ids ``[T]`` exactly as the engine sent them (None: not reported).

    Raises ``ValueError`` (one of ``UNREADABLE``) for anything that is not a list of int32
    token ids (``0 <= id < 2**31``; a bool is no id): such an answer cannot be captured, and
    an id we took from it would be one the policy never sampled.
    """
    if value is None:
        return None
    if type(value) is CheckedIds:
        return value
    # Each test a builtin's one pass in C, not a Python step per id: the event loop checks
    # every prompt id of every call (~20k at turn 200 of a coding-agent session). ``count``
    # compares types by identity, so a bool (or any int subclass) is no id, as before.
    if not isinstance(value, list) or (
        value
        and not (
            list(map(type, value)).count(int) == len(value)
            and min(value) >= 0
            and max(value) < _INT32_END
        )
    ):
        raise ValueError(f"expected a list of int32 token ids, got {str(value)[:80]}")
    return value


def choice_index(value: Any, n_choices: int) -> int:
    """A choice's ``index`` as the engine sent it. Raises ``ValueError`` (one of
    ``UNREADABLE``) unless it is an integer from 0 to ``n_choices - 1``."""
    if type(value) is not int or not 0 <= value < n_choices:
        raise ValueError(f"expected a choice index from 0 to {n_choices - 1}, got {value!r:.40}")
    return value
