"""How rows written before a revision read, and what a revision computed from them: the pool's
and the dialects' rules as they were then, frozen here.

Owns: every rule a migration applies to existing rows. Migrations import only this module,
SQLAlchemy and Alembic, never ``gateway``, ``datapool``, ``trainer_bridge`` or ``trajgate``
(``.importlinter``; ``env.py`` excepted, which hands Alembic the pool's engine and metadata),
so a later change of the live code cannot change what an old migration does to a row. A rule
that changes later gets a migration of its own; the copy here stays as it was.

- The history field of a request stored before revision 0013 (``history_field_before_0013``).
- The request delta chain as written from revision 0007 (``StoredRequest``,
  ``messages_before_0013``, ``full_requests``): a step's history list is the parent's
  ``M_p + [R_p]`` cut to ``messages_base`` messages, plus its own ``M[b:]``; its upstream request
  is the full client request with the JSON Merge Patch (RFC 7396 §2) applied, or stored whole.
- The canonical record revision 0013 gives each step (``canonical_0013``): the record of its
  upstream body by the dialect that recorded it (``steps.endpoint``), as JSON, and its messages
  as a delta on the parent's (``messages_base``, ``message_key``, ``canonical_response_0013``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Before revision 0013 a stored request's history list (the one stored as a delta on the
# parent's) was its first list among these fields: chat's and the Messages API's ``messages``,
# the Responses API's ``input``.
HISTORY_FIELDS_BEFORE_0013 = ("messages", "input")


def history_field_before_0013(request: Mapping[str, Any]) -> str | None:
    """The field a request stored before revision 0013 keeps its history in, None when none."""
    for name in HISTORY_FIELDS_BEFORE_0013:
        if isinstance(request.get(name), list):
            return name
    return None


# ---- the request delta chain (revision 0007 up to 0013) ------------------------------------


@dataclass(frozen=True)
class StoredRequest:
    """A step row's request columns as stored before revision 0013."""

    step_id: str
    parent_step_id: str | None
    messages_base: int | None
    request: dict[str, Any]
    upstream_request: dict[str, Any] | None
    upstream_request_patch: dict[str, Any] | None
    response_message: dict[str, Any] | None

    @property
    def history_field(self) -> str | None:
        return history_field_before_0013(self.request)


def messages_before_0013(stored: Mapping[str, StoredRequest]) -> dict[str, list[Any] | None]:
    """The full history list of every step in ``stored`` (one trajectory's rows), None for a
    step without one. Walks each chain of parents iteratively (a long trajectory is a long
    chain). Raises ``LookupError`` when a step's parent is not in ``stored`` or holds fewer
    messages than its base."""
    full: dict[str, list[Any] | None] = {}
    for step_id in stored:
        chain: list[StoredRequest] = []
        current: str | None = step_id
        while current is not None and current not in full:
            entry = stored.get(current)
            if entry is None:
                raise LookupError(f"the request of step {current} is not stored")
            chain.append(entry)
            current = entry.parent_step_id if entry.messages_base else None
        for entry in reversed(chain):
            full[entry.step_id] = _messages(entry, full, stored)
    return full


def _messages(
    entry: StoredRequest,
    full: Mapping[str, list[Any] | None],
    stored: Mapping[str, StoredRequest],
) -> list[Any] | None:
    """``H_p[:b] + M[b:]``, ``H_p`` the parent's full list plus its response where needed."""
    field_name = entry.history_field
    tail = entry.request.get(field_name) if field_name is not None else None
    messages = tail if isinstance(tail, list) else None
    base = entry.messages_base
    if not base:
        return messages
    parent_id = entry.parent_step_id
    parent = full.get(parent_id) if parent_id is not None else None
    if parent_id is None or parent is None or messages is None:
        raise LookupError(
            f"step {entry.step_id} stores its messages as a delta on parent {parent_id}, "
            "whose messages are missing"
        )
    head = parent
    response = stored[parent_id].response_message if parent_id in stored else None
    if len(head) < base and response is not None:
        head = [*parent, response]
    if len(head) < base:
        raise LookupError(
            f"step {entry.step_id} needs {base} messages of its parent's history, which has "
            f"{len(head)}"
        )
    return [*head[:base], *messages]


def full_requests(
    entry: StoredRequest, messages: list[Any] | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A step's full client request and upstream request, given its full history
    ``messages``. Raises ``LookupError`` when it has neither upstream request nor patch."""
    request = entry.request
    name = entry.history_field
    if entry.messages_base is not None and messages is not None and name is not None:
        request = {**request, name: messages}
    if entry.upstream_request_patch is not None:
        return request, _apply_merge_patch(request, entry.upstream_request_patch)
    if entry.upstream_request is not None:
        return request, entry.upstream_request
    raise LookupError(f"step {entry.step_id} has neither upstream request nor patch")


def _apply_merge_patch(target: Any, patch: Any) -> Any:
    """``MergePatch(target, patch)`` of RFC 7396 §2, without changing ``target``."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for name, value in patch.items():
        if value is None:
            result.pop(name, None)
        else:
            result[name] = _apply_merge_patch(result.get(name), value)
    return result


# ---- the canonical record of revision 0013 -------------------------------------------------

# The dialects whose upstream body is a chat body, and the one whose body is a prompt.
_CHAT_ENDPOINTS = ("chat.completions", "responses", "messages")
_PROMPT_ENDPOINT = "completions"
# The endpoints a dialect served at revision 0013: the steps that get a record.
ENDPOINTS_0013 = (*_CHAT_ENDPOINTS, _PROMPT_ENDPOINT)
# An engine body's fields that are no sampling parameter.
_NOT_SAMPLING = frozenset(
    (
        "model",
        "messages",
        "prompt",
        "tools",
        "stream",
        "stream_options",
        "return_token_ids",
        "logprobs",
    )
)


def canonical_0013(endpoint: str, upstream_request: Mapping[str, Any]) -> dict[str, Any]:
    """The canonical record's JSON (``{"messages", "tools", "sampling", "prompt"}``, messages
    whole) of a step recorded by ``endpoint`` with this upstream body. Raises ``ValueError``
    for an endpoint not in ``ENDPOINTS_0013``."""
    sampling = {k: v for k, v in upstream_request.items() if k not in _NOT_SAMPLING}
    if endpoint == _PROMPT_ENDPOINT:
        prompt = upstream_request.get("prompt")
        return {
            "messages": None,
            "tools": [],
            "sampling": sampling,
            "prompt": prompt if isinstance(prompt, str | list) else None,
        }
    if endpoint not in _CHAT_ENDPOINTS:
        raise ValueError(f"endpoint must be one of {ENDPOINTS_0013}, got {endpoint!r}")
    messages = upstream_request.get("messages")
    return {
        "messages": [_chat_message(m) for m in messages if isinstance(m, Mapping)]
        if isinstance(messages, list)
        else None,
        "tools": [_tool(t) for t in upstream_request.get("tools") or () if isinstance(t, Mapping)],
        "sampling": sampling,
        "prompt": None,
    }


def canonical_response_0013(response_message: Any) -> dict[str, Any]:
    """A step's ``response_message`` as its canonical message's JSON (``R_p`` of the
    canonical ``C_p + [R_p]``; an empty assistant message when None)."""
    if not isinstance(response_message, Mapping):
        return {"role": "assistant", "content": None}
    return _message(response_message)


def message_key(message: Any) -> str:
    """A message as JSON text: equal keys mean the same JSON (``1``, ``1.0`` and ``True``
    differ, as do key orders)."""
    return json.dumps(message)


def messages_base(parent_keys: Sequence[str] | None, messages: list[Any]) -> int:
    """How many leading ``messages`` equal the parent's keys (``message_key``)."""
    if not parent_keys:
        return 0
    base = 0
    for key, message in zip(parent_keys, messages, strict=False):
        if message_key(message) != key:
            break
        base += 1
    return base


def _chat_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chat message's canonical JSON; ``reasoning_content`` (the older name) is its
    ``reasoning`` when it has none."""
    return _message(message, message.get("reasoning_content"))


def _message(message: Mapping[str, Any], older_reasoning: Any = None) -> dict[str, Any]:
    """A message's canonical JSON: role and content, then ``reasoning`` (else
    ``older_reasoning``), ``tool_calls``, ``tool_call_id`` and ``name`` when set; a field of
    the wrong type reads as unset, an empty content beside tool calls as None, a call's
    ``arguments`` that is no string as its JSON text."""
    calls = [_tool_call(c) for c in message.get("tool_calls") or () if isinstance(c, dict)]
    content = message.get("content")
    content = content if isinstance(content, str | list) else None
    value: dict[str, Any] = {
        "role": str(message.get("role") or "assistant"),
        "content": None if content == "" and calls else content,
    }
    reasoning = message.get("reasoning")
    reasoning = reasoning if isinstance(reasoning, str) else older_reasoning
    if isinstance(reasoning, str):
        value["reasoning"] = reasoning
    if calls:
        value["tool_calls"] = calls
    for name in ("tool_call_id", "name"):
        if isinstance(message.get(name), str):
            value[name] = message[name]
    return value


def _tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    function = function if isinstance(function, Mapping) else {}
    arguments = function.get("arguments")
    call_id = call.get("id")
    return {
        "id": call_id if isinstance(call_id, str) else None,
        "type": "function",
        "function": {
            "name": str(function.get("name") or ""),
            "arguments": arguments
            if isinstance(arguments, str)
            else ("" if arguments is None else json.dumps(arguments)),
        },
    }


def _tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    kind = str(tool.get("type") or "function")
    function = tool.get("function")
    if kind != "function":
        return {"type": kind, "name": str(tool.get("name") or "")}
    if not isinstance(function, Mapping):
        return {"type": "function", "function": {"name": str(tool.get("name") or "")}}
    value: dict[str, Any] = {"name": str(function.get("name") or "")}
    if isinstance(function.get("description"), str):
        value["description"] = function["description"]
    if isinstance(function.get("parameters"), dict):
        value["parameters"] = function["parameters"]
    return {"type": "function", "function": value}
