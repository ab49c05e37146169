"""What a captured call is checked for, whatever its API dialect.

Owns: the step flags (integrity flags that keep a step out of training, quality facts left to
curation) and how they are derived from the sampled IDs, logprobs, usage and the request body;
exact JSON parsing of upstream answers; the re-send hash. Where the IDs and logprobs sit in an
answer is each dialect's business (``gateway.dialects``). Never: tokenizes or decodes; an ID or
logprob vLLM did not send is recorded as missing, never made up.

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, NoReturn

import orjson

from datapool.steps.records import ChoiceRecord

# Integrity flags: a step carrying one is kept for inspection, never exported for training.
IDS_MISSING = "ids_missing"
IDS_INCOMPLETE = "ids_incomplete"
PROMPT_IDS_MISSING = "prompt_ids_missing"
ABORTED = "aborted"
# The engine's answer ended without a finish reason for the choice (a stream cut off, or a
# unary ``finish_reason: null``): its tokens may be a prefix of what was sampled.
UNFINISHED = "unfinished"
# Quality facts: recorded, left to curation.
TRUNCATED = "truncated"
TOOL_CALL_TRUNCATED = "tool_call_truncated"
THINKING_OFF = "thinking_off"
PREFILL = "prefill"

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
    if _NINETEEN_DIGITS not in data.translate(_DIGITS_AS_ZERO) or _LONG_INT.search(data) is None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)


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
    """
    if value is None:
        return
    if isinstance(shape, dict):
        if type(value) is not dict:
            _wrong_kind(value, "an object", where)
        for name, field_shape in shape.items():
            field = value.get(name)
            if field is not None:
                check_shape(field, field_shape, f"{where}.{name}")
    elif isinstance(shape, list):
        if type(value) is not list:
            _wrong_kind(value, "a list", where)
        item_shape = shape[0]
        for position, item in enumerate(value):
            check_shape(item, item_shape, f"{where}[{position}]")
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


def request_hash(dialect: str, body: dict[str, Any]) -> str:
    """SHA-256 of the dialect's name and the client's body as canonical JSON (sorted keys):
    re-send detection.

    The text hashed is ``json.dumps([dialect, body], sort_keys=True, separators=(",", ":"))``
    (stored hashes must not change). orjson writes it in a tenth of the time where its text
    is byte for byte that one (``_as_json_writes``), the stdlib otherwise."""
    try:
        text: bytes | None = orjson.dumps([dialect, body], option=orjson.OPT_SORT_KEYS)
    except TypeError:  # an integer past 64 bits, a lone surrogate
        text = None
    if text is None or not _as_json_writes(text):
        text = json.dumps([dialect, body], sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(text).hexdigest()


def _as_json_writes(text: bytes) -> bool:
    """Whether orjson's ``text`` (compact, keys sorted) is what ``json.dumps`` with
    ``ensure_ascii`` writes for the same value. Both sort keys by code point, write integers,
    ``true``, ``false``, ``null`` and the escapes of ``"``, ``\\`` and controls alike, and
    floats alike except below 1e-4 in magnitude, where orjson writes ``0.0000...`` or a
    negative exponent without its leading zero (``1e-6``; json ``1e-06``; checked on 150,000
    doubles by the test). So: only printable ASCII (json escapes the rest, DEL included), and
    neither ``0.0000`` nor a digit before ``e-`` anywhere (in a string too: such a body only
    takes the stdlib's path)."""
    if not text.isascii() or b"\x7f" in text or b"0.0000" in text:
        return False
    at = text.find(b"e-")
    while at != -1:
        if at and 0x30 <= text[at - 1] <= 0x39:
            return False
        at = text.find(b"e-", at + 2)
    return True


def quality_flags(
    body: dict[str, Any], finish_reason: str | None, message: dict[str, Any] | None
) -> list[str]:
    """Facts curation may act on: truncated at max_tokens, a tool call cut mid-call (C18),
    thinking turned off, an assistant prefill (C09). Sampling under a grammar (``constrained``)
    is the proxy's (``gateway.proxy.sampling``): it knows the replicas' tool strict level."""
    flags: list[str] = []
    if finish_reason == "length":
        flags.append(TRUNCATED)
        text = str((message or {}).get("content") or (message or {}).get("text") or "")
        if "<tool_call>" in text and "</tool_call>" not in text.split("<tool_call>")[-1]:
            flags.append(TOOL_CALL_TRUNCATED)
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False:
        flags.append(THINKING_OFF)
    if body.get("continue_final_message") is True:
        flags.append(PREFILL)
    return flags


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


def integrity_flags(
    ids: list[int] | None, logprobs: list[float] | None, prompt_ids: list[int] | None
) -> list[str]:
    """``ids_missing`` when sampled IDs ``[T]`` or logprobs are absent, ``ids_incomplete`` when
    their lengths differ, ``prompt_ids_missing`` when the prompt IDs are absent or empty (no
    template renders an empty prompt, and vLLM refuses one it tokenizes itself: an empty list
    is a prompt the engine was handed, not the one it rendered)."""
    flags: list[str] = []
    if ids is None or logprobs is None:
        flags.append(IDS_MISSING)
    elif len(ids) != len(logprobs):
        flags.append(IDS_INCOMPLETE)
    if not prompt_ids:
        flags.append(PROMPT_IDS_MISSING)
    return flags


def check_against_usage(choices: list[ChoiceRecord], completion_tokens: int | None) -> None:
    """Flag every choice ``ids_incomplete`` when the sampled IDs do not add up to
    ``usage.completion_tokens``; nothing is padded or shifted to make them agree (C05)."""
    total = sum(len(choice.response_token_ids or []) for choice in choices)
    if completion_tokens is None or total == completion_tokens:
        return
    for choice in choices:
        if IDS_MISSING not in choice.flags and IDS_INCOMPLETE not in choice.flags:
            choice.flags.append(IDS_INCOMPLETE)
