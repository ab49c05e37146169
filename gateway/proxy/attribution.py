"""Who a call belongs to, and its body as one JSON object: the checks before any upstream call.

Owns: the trajectory id syntax, reading the body as one JSON object within the size limit, and
attribution by URL, ``X-Trajgate-Trajectory`` / ``X-Trajgate-Group`` / ``X-Trajgate-Channel``
headers or the API key's binding (the key read from ``Authorization: Bearer`` or
``x-api-key``), and the conversation (lineage) the headers name (``gateway.proxy.lineages``).
Never: writes anything; a request refused here leaves the pool untouched. What
a body must hold to be captured is its dialect's check (``gateway.dialects``).
"""

from __future__ import annotations

import json
import math
import re
import sys
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import Request

from datapool.steps.records import LineageRecord
from gateway.auth import KeyGrant, api_key
from gateway.engine.wire import may_hold_long_int
from gateway.errors import (
    AuthenticationError,
    InvalidRequestError,
    PayloadTooLargeError,
    PermissionDeniedError,
)
from gateway.proxy.lineages import lineage_of
from gateway.state import GatewayState

TRAJECTORY_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$")
GROUP_ID_PATTERN = TRAJECTORY_ID_PATTERN  # group ids are path segments too
CHANNEL_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$")


def check_trajectory_id(trajectory_id: str) -> str:
    """Raise ``InvalidRequestError`` unless the id is 1-200 of ``[A-Za-z0-9._:-]``."""
    return _check_name(trajectory_id, TRAJECTORY_ID_PATTERN, "trajectory id", 200, "trajectory_id")


def _check_name(value: str, pattern: re.Pattern[str], what: str, most: int, param: str) -> str:
    if not pattern.fullmatch(value):  # `$` alone would match before a final newline
        raise InvalidRequestError(
            f"{what} must be 1-{most} characters of letters, digits, '.', '_', ':' or '-' "
            f"starting with a letter or digit; got {value[:80]!r}",
            param=param,
        )
    return value


def _refuse_constant(name: str) -> Any:
    """``NaN``, ``Infinity`` and ``-Infinity`` are not JSON (RFC 8259 §6); Python's parser takes
    them, vLLM and the pool would not."""
    raise InvalidRequestError(f"request body is not valid JSON: {name} is not a JSON number")


def _finite_float(literal: str) -> float:
    """A JSON number with a fraction or exponent as a float; one past a double's range
    (``1e999``) would be read as infinity, which no JSON writer can write back."""
    number = float(literal)
    if not math.isfinite(number):
        raise InvalidRequestError(
            f"request body holds the number {literal[:40]}, beyond a 64-bit float "
            f"(at most about {sys.float_info.max:.4g} in magnitude)"
        )
    return number


# JSON nesting deeper than this is refused (400): real bodies (messages, content parts, tool
# JSON schemas) nest a few dozen levels at most, while recursive code downstream (hashing,
# serialising, translating) would fail near Python's recursion limit of 1000.
MAX_JSON_DEPTH = 128
# The escape of a UTF-16 surrogate (D800-DFFF); a raw surrogate cannot come in valid UTF-8.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json(data: bytes | bytearray, *, refuse_nul: bool = False) -> Any:
    """``data`` parsed as strict JSON (RFC 8259) that every part behind the gateway can take.

    Raises ``InvalidRequestError`` (400) when ``data`` is not UTF-8 or not JSON, holds ``NaN``
    or ``Infinity``, a number past a 64-bit float (``1e999``), a string with a lone UTF-16
    surrogate (``"\\ud800"``: not text, and not storable as UTF-8), nesting deeper than
    ``MAX_JSON_DEPTH``, or, with ``refuse_nul``, a NUL character (``"\\u0000"``), which
    PostgreSQL's text columns cannot hold. Surrogate pairs (``"\\ud83d\\ude00"``) are fine.
    """
    value = _orjson_exactly(data)
    if value is _NOT_PARSED:
        value = _parse_strictly(data)
    # A string check needs a walk only when the raw bytes say it might fail (rare in real
    # bodies). The depth is always walked: over the containers alone, a few microseconds for
    # a short body, and cheaper at turn 200 of a coding-agent session (0.16 ms) than counting
    # the brackets of its 170 KB to skip it for bodies of no more than MAX_JSON_DEPTH
    # containers, which cannot nest deeper (0.24 ms, and a long body needs the walk anyway).
    surrogates = _SURROGATE_ESCAPE.search(data) is not None
    nul = refuse_nul and b"\\u0000" in data
    if surrogates or nul:
        _check_values(value, surrogates=surrogates, nul=nul)
    else:
        _check_depth(value)
    return value


_NOT_PARSED = object()


def _orjson_exactly(data: bytes | bytearray) -> Any:
    """``data`` parsed by orjson where its value is exactly ``_parse_strictly``'s, else
    ``_NOT_PARSED``: the parse is the floor of a call's cost, and at turn 200 of a coding-agent
    session (170 KB) orjson takes a few tenths of a ms where ``json`` with its hooks takes a
    few ms. orjson refuses what the strict parse refuses (invalid UTF-8 or JSON, ``NaN``,
    ``Infinity``, a number past a double, a lone surrogate) and parses floats to the same
    doubles, but turns an integer past 64 bits into a float: a body with a run of 19 digits
    (``wire.loads``'s test) goes to ``json``, as does anything orjson refuses (for the
    strict parse's own error)."""
    if may_hold_long_int(data):
        return _NOT_PARSED
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return _NOT_PARSED


def _parse_strictly(data: bytes | bytearray) -> Any:
    """``data`` parsed by ``json`` with the hooks that refuse what is not strict JSON; raises
    ``InvalidRequestError`` for what ``parse_json`` refuses at parsing."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid UTF-8: {exc}") from exc
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError as exc:
        raise _too_deep() from exc
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from exc
    except ValueError as exc:  # an integer of more than 4300 digits (sys.int_info)
        raise InvalidRequestError(f"request body holds a number too long to read: {exc}") from exc


def _too_deep() -> InvalidRequestError:
    return InvalidRequestError(f"request body nests deeper than {MAX_JSON_DEPTH} levels")


def _check_depth(value: Any) -> None:
    """Raise ``InvalidRequestError`` when ``value`` nests containers deeper than
    ``MAX_JSON_DEPTH``. Level by level: each level's children gathered by ``list.extend`` and
    its containers kept by one comprehension, C loops both, where a walk that pops each
    container took 0.3 ms at turn 200 of a coding-agent session (about 4,000 containers in 8
    levels) and this a tenth of that (``_check_values`` gives the same answer)."""
    level = [value] if type(value) is dict or type(value) is list else []
    depth = 0
    while level:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        children: list[Any] = []
        for item in level:
            children.extend(item.values() if type(item) is dict else item)
        level = [child for child in children if type(child) is dict or type(child) is list]


def _check_values(value: Any, *, surrogates: bool, nul: bool) -> None:
    """Walk ``value`` (iteratively: it may be deep) for what ``parse_json`` refuses: its depth,
    and its strings (keys and values) only when a string check is asked (a depth alone needs
    only the objects and lists: at turn 200 of a coding-agent session, about 6 times fewer
    items than with every string)."""
    strings = surrogates or nul
    todo: list[tuple[Any, int]] = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            if strings:
                todo.extend((key, depth) for key in item)
                todo.extend((child, depth + 1) for child in item.values())
            else:
                todo.extend((c, depth + 1) for c in item.values() if isinstance(c, dict | list))
        elif isinstance(item, list):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            if strings:
                todo.extend((child, depth + 1) for child in item)
            else:
                todo.extend((c, depth + 1) for c in item if isinstance(c, dict | list))
        elif isinstance(item, str):
            if surrogates and _SURROGATE.search(item):
                raise InvalidRequestError(
                    f"request body holds a lone UTF-16 surrogate in the string {item[:40]!r}: "
                    "not text (a surrogate must be half of a pair)"
                )
            if nul and "\x00" in item:
                raise InvalidRequestError(
                    f"request body holds a NUL character (\\u0000) in the string {item[:40]!r}: "
                    "the pool cannot store it"
                )


# The length of the steps' and call attempts' ``idempotency_key`` columns (String(200)).
IDEMPOTENCY_KEY_MAX_CHARS = 200


def check_idempotency_key(key: str | None) -> str | None:
    """The ``Idempotency-Key`` header as stored (None when absent or empty); raise
    ``InvalidRequestError`` past ``IDEMPOTENCY_KEY_MAX_CHARS`` characters, before vLLM is asked
    (PostgreSQL would refuse it at the commit, after the tokens were sampled; SQLite would
    keep it whole: one answer on both)."""
    if key and len(key) > IDEMPOTENCY_KEY_MAX_CHARS:
        raise InvalidRequestError(
            f"Idempotency-Key must be at most {IDEMPOTENCY_KEY_MAX_CHARS} characters, got "
            f"{len(key)}",
            param="Idempotency-Key",
        )
    return key or None


# The length of the steps' ``model`` column (String(200)).
MODEL_MAX_CHARS = 200


def check_model(body: dict[str, Any]) -> None:
    """Raise ``InvalidRequestError`` when the body's ``model`` is a string the step cannot
    store: past ``MODEL_MAX_CHARS`` characters, or holding NUL (PostgreSQL's text columns
    cannot). vLLM may sample for such a name; the commit would then fail after the tokens were
    paid for. A model that is no string is the dialect's or the engine's to refuse."""
    model = body.get("model")
    if not isinstance(model, str):
        return
    if len(model) > MODEL_MAX_CHARS or "\x00" in model:
        got = f"{len(model)} characters" + (" with NUL" if "\x00" in model else "")
        raise InvalidRequestError(
            f"model must be at most {MODEL_MAX_CHARS} characters without NUL, got {got}",
            param="model",
        )


def check_engine_fields(body: dict[str, Any], allow_kv_transfer_params: bool) -> None:
    """Raise ``InvalidRequestError`` for ``kv_transfer_params`` in a client's body unless the
    gateway allows it (``allow_client_kv_transfer_params``): vLLM samples from the prompt ids it
    carries, so the client, not the engine's rendering, would choose what the step records."""
    if "kv_transfer_params" in body and not allow_kv_transfer_params:
        raise InvalidRequestError(
            "kv_transfer_params chooses the prompt vLLM samples from; this gateway does not "
            "accept it from clients (TRAJGATE_ALLOW_CLIENT_KV_TRANSFER_PARAMS)",
            param="kv_transfer_params",
        )


def check_group_id(group_id: str | None) -> str | None:
    """Raise ``InvalidRequestError`` unless the group id is None or 1-200 of
    ``[A-Za-z0-9._:-]`` starting with a letter or digit (it appears in URL paths)."""
    if group_id is None:
        return None
    return _check_name(group_id, GROUP_ID_PATTERN, "group id", 200, "group_id")


def check_channel(channel: str | None) -> str | None:
    """Raise ``InvalidRequestError`` unless the channel is None or 1-100 of
    ``[A-Za-z0-9._:-]`` starting with a letter or digit."""
    if channel is None:
        return None
    return _check_name(channel, CHANNEL_PATTERN, "channel", 100, "channel")


async def read_json_object(request: Request, max_body_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object; 413 past ``max_body_bytes``, 400 when not an object
    or not what ``parse_json`` takes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise PayloadTooLargeError(
            f"request body of {declared} bytes exceeds the limit of {max_body_bytes} bytes",
            code="payload_too_large",
        )
    # One buffer the chunks are appended to: a list joined at the end held the body twice
    # at once, and a call's body is already held several times over while it is processed
    # (docs/gateway.md, "Large bodies").
    data = bytearray()
    async for chunk in request.stream():
        if len(data) + len(chunk) > max_body_bytes:
            raise PayloadTooLargeError(
                f"request body exceeds the limit of {max_body_bytes} bytes",
                code="payload_too_large",
            )
        data += chunk
    body = parse_json(data)
    if not isinstance(body, dict):
        raise InvalidRequestError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


@dataclass(frozen=True)
class Attribution:
    trajectory_id: str
    group_id: str | None
    channel: str | None
    # The channel the call's API key is bound to: it may write only into that channel.
    key_channel: str | None = None
    # The conversation its headers name (``gateway.proxy.lineages``); None: the pool infers it.
    lineage: LineageRecord | None = None


async def attribute(
    state: GatewayState, request: Request, url_trajectory_id: str | None
) -> Attribution:
    """Which trajectory a call belongs to: URL, else ``X-Trajgate-Trajectory``, else the API
    key's bound trajectory, else a fresh anonymous one. Raises 401/403 for bad keys, 400
    ``trajectory_id_conflict`` when the URL and the header name different trajectories. A key
    the cache does not hold is looked up off the event loop (``KeyRing.verify``)."""
    grant: KeyGrant | None = None
    token = api_key(request)
    if state.settings.api_key_required:
        if token is None:
            raise AuthenticationError(
                "an API key is required: send 'Authorization: Bearer tg-...' or "
                "'x-api-key: tg-...'",
                code="missing_api_key",
            )
        grant = await state.keys.verify(token)
    elif token is not None and token.startswith("tg-"):
        grant = await state.keys.verify(token)
    header_id = request.headers.get("x-trajgate-trajectory")
    if url_trajectory_id is not None and header_id is not None and header_id != url_trajectory_id:
        # Both name the call's trajectory: recording it in either would file the other's steps
        # wrongly, so neither is chosen silently.
        raise InvalidRequestError(
            f"the URL names trajectory {url_trajectory_id!r} and X-Trajgate-Trajectory names "
            f"{header_id!r}; send one, or the same id in both",
            param="trajectory_id",
            code="trajectory_id_conflict",
        )
    trajectory_id = url_trajectory_id or header_id or (grant.trajectory_id if grant else None)
    trajectory_id = check_trajectory_id(trajectory_id or f"anon-{uuid.uuid4()}")
    if grant and grant.trajectory_id and grant.trajectory_id != trajectory_id:
        raise PermissionDeniedError(
            f"this API key is bound to trajectory {grant.trajectory_id!r}, not {trajectory_id!r}"
        )
    channel = request.headers.get("x-trajgate-channel") or (grant.channel if grant else None)
    if grant and grant.channel and channel != grant.channel:
        raise PermissionDeniedError(
            f"this API key is bound to channel {grant.channel!r}, not {channel!r}"
        )
    # Checked before vLLM samples anything: a value the pool cannot store would otherwise
    # surface only at the commit, after the tokens were paid for.
    group_id = check_group_id(request.headers.get("x-trajgate-group"))
    key_channel = grant.channel if grant else None
    lineage = lineage_of(request.headers)
    return Attribution(trajectory_id, group_id, check_channel(channel), key_channel, lineage)
