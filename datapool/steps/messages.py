"""Request JSON as stored: messages as a delta on the parent step, the upstream request as a patch.

Owns: how a step's client request and upstream request are written to ``steps.request``,
``steps.messages_base``, ``steps.upstream_request`` and ``steps.upstream_request_patch``
(``request_delta``), and their exact reconstruction on read (``expand_requests`` puts the full
JSON back on loaded rows, through the delta-chain walk of ``datapool.steps.chain``).
Never: rewrites what the client sent; a reader always sees the request exactly as it came.

An agent resends its whole history on every call, so storing each step's request whole grows
quadratically with turns. Instead (``M`` the request's history list, ``M_p`` the parent step's
full history list, ``R_p`` its response message):

- ``messages_base`` = b and ``request`` = the client's request with ``messages`` = ``M[b:]``; the
  full messages are ``H_p[:b] + M[b:]`` with ``H_p = M_p + [R_p]`` (``R_p`` left out when the
  parent has none). b is the length of the longest common prefix of ``M`` and ``H_p``, compared
  message by message as JSON text (``message_key``), so a history the client rewrote (an edited
  message, dropped thinking, truncation) only stops the prefix earlier. b = 0: the request holds
  every message; b NULL: a row written before migration 0007, or a request without a
  history list; ``request`` is then the whole request.
- The history list is the request's first list among ``HISTORY_FIELDS``: ``messages`` (chat
  completions; the Messages API, whose messages hold content blocks) or ``input`` (the
  Responses API's items; an ``input`` string is no list, so such a request is stored whole).
  The rule reads only the request itself, and cutting a list leaves a list, so the reader
  finds the same field the writer cut. A parent of another dialect is fine: the items are
  compared and copied as JSON, whatever their shape.
- ``upstream_request_patch`` = the JSON Merge Patch (RFC 7396 §2, which obsoletes RFC 7386 with
  the same algorithm) that turns the full client request into the upstream request: only what
  the gateway added or changed (``return_token_ids``, ``logprobs``, ``stream_options``). When a
  merge patch cannot say it exactly (a key set to ``null``, a different key order), or on a
  row written before migration 0007, ``upstream_request`` holds the whole upstream request
  and the patch is NULL.

The parent is the step token lineage chose (``parent_step_id``); the writer compares against
the parent's message keys it keeps in memory (``datapool.steps.lineage``), never rereads SQL for it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import inspect, select
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from datapool.db import chunks
from datapool.models import Step
from datapool.steps import chain

# Marks a loaded Step whose ``request`` attribute already holds the full request (the value is
# that very dict, so a row reloaded from the database is not mistaken for an expanded one).
_EXPANDED = "trajgate_full_request"


class RequestMissingError(LookupError):
    """A step's messages are a delta on a parent whose request is not stored (or too short)."""


# The request fields that can hold the history an agent resends, in the order they are tried.
HISTORY_FIELDS = ("messages", "input")


def history_field(request: Mapping[str, Any]) -> str | None:
    """The name of ``request``'s history list: the first of ``HISTORY_FIELDS`` whose value is
    a list; None when none is."""
    for name in HISTORY_FIELDS:
        if isinstance(request.get(name), list):
            return name
    return None


def history_of(request: Mapping[str, Any]) -> list[Any] | None:
    """``request``'s history list (``M`` of the module docstring), None when it has none."""
    name = history_field(request)
    if name is None:
        return None
    history: list[Any] = request[name]
    return history


def message_key(message: Any) -> str:
    """A message as JSON text: equal keys mean the reconstructed message is the same JSON.

    Text, not ``==``: in Python ``1 == 1.0 == True`` and dict comparison ignores key order, so a
    message equal as a Python value could still read back differently.
    """
    return json.dumps(message)


def history_keys(
    parent_keys: Sequence[str] | None, messages: Any, base: int, response_message: Any
) -> list[str] | None:
    """The keys of ``M + [R]`` for a new step (``H`` of the module docstring), sharing the
    parent's strings for the first ``base`` messages; None when ``messages`` is not a list."""
    if not isinstance(messages, list):
        return None
    keys = list(parent_keys[:base]) if parent_keys is not None and base else []
    keys += [message_key(m) for m in messages[base:]]
    if response_message is not None:
        keys.append(message_key(response_message))
    return keys


def messages_base(parent_keys: Sequence[str] | None, messages: Any) -> int | None:
    """b: how many leading ``messages`` equal the parent's ``M_p + [R_p]`` (as JSON text);
    None when ``messages`` is not a list (the request is then stored whole)."""
    if not isinstance(messages, list):
        return None
    if not parent_keys:
        return 0
    base = 0
    for key, message in zip(parent_keys, messages, strict=False):
        if message_key(message) != key:
            break
        base += 1
    return base


def stored_request(request: dict[str, Any], base: int | None) -> dict[str, Any]:
    """The request as stored: its history list cut to ``M[b:]`` (a new dict; ``request`` is
    kept)."""
    name = history_field(request)
    if not base or name is None:
        return request
    return {**request, name: request[name][base:]}


@dataclass(frozen=True)
class RequestDelta:
    """A call's two requests as its step rows store them (columns of the module docstring)."""

    request: dict[str, Any]  # ``steps.request``: the client's request with ``M[b:]``
    messages_base: int | None  # b
    upstream_request: dict[str, Any] | None  # whole, only when no merge patch says it
    upstream_request_patch: dict[str, Any] | None


def request_delta(
    parent_keys: Sequence[str] | None, request: dict[str, Any], upstream_request: dict[str, Any]
) -> RequestDelta:
    """Store ``request`` as a delta on the parent's ``H_p`` (``parent_keys``; None when the
    parent is not a lineage candidate, so the messages are stored whole) and
    ``upstream_request`` as a merge patch on ``request``."""
    base = messages_base(parent_keys, history_of(request))
    patch = merge_patch(request, upstream_request)
    return RequestDelta(
        stored_request(request, base),
        base,
        upstream_request if patch is None else None,
        patch,
    )


# ---- JSON Merge Patch (RFC 7396 §2) ---------------------------------------------------------


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """``MergePatch(target, patch)`` of RFC 7396 §2, without changing ``target``.

    A patch that is not an object replaces the target; in an object patch a ``null`` value
    removes the key and any other value is merged recursively (a non-object target becomes {}).
    """
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for name, value in patch.items():
        if value is None:
            result.pop(name, None)
        else:
            result[name] = apply_merge_patch(result.get(name), value)
    return result


def merge_patch(source: dict[str, Any], target: dict[str, Any]) -> dict[str, Any] | None:
    """A merge patch ``p`` with ``apply_merge_patch(source, p)`` identical to ``target`` (same
    JSON, key order included), or None when no merge patch says it (``target`` sets a key to
    ``null``, reorders keys, or holds a ``null`` inside an object the source lacks)."""
    patch = _diff(source, target)
    return patch if _identical(apply_merge_patch(source, patch), target) else None


def _diff(source: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
    patch: dict[str, Any] = {key: None for key in source if key not in target}
    for key, value in target.items():
        if key in source:
            if _identical(source[key], value):
                continue
            if isinstance(value, dict) and isinstance(source[key], dict):
                patch[key] = _diff(source[key], value)
                continue
        patch[key] = value
    return patch


def _identical(a: Any, b: Any) -> bool:
    """Same JSON: same types (``1`` is not ``1.0`` nor ``True``), same key order."""
    if a is b:  # the gateway's upstream body shares the client's messages list
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# ---- reconstruction -------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredRequest:
    """What reconstructing a step's requests needs from its row, as stored."""

    step_id: str
    parent_step_id: str | None
    messages_base: int | None
    request: dict[str, Any]
    upstream_request: dict[str, Any] | None
    upstream_request_patch: dict[str, Any] | None
    response_message: dict[str, Any] | None


@dataclass(frozen=True)
class FullRequest:
    """A step's requests exactly as the client sent them and as they went upstream."""

    request: dict[str, Any]
    upstream_request: dict[str, Any]


def reconstruct_messages(
    stored: Mapping[str, StoredRequest],
    step_ids: Iterable[str],
    known: Mapping[str, list[Any]] | None = None,
) -> dict[str, list[Any] | None]:
    """Full history lists ``[M]`` of ``step_ids`` (and of every ancestor they needed);
    ``stored`` must hold each one's chain of parents down to a step with b = 0 or NULL, or one
    in ``known`` (full lists already at hand). None for a request without a history list.

    One walk per chain (``datapool.steps.chain``), every step computed once. Raises
    ``RequestMissingError`` when a parent is absent or shorter than a base.
    """

    def apply(entry: StoredRequest, full: Mapping[str, list[Any] | None]) -> list[Any] | None:
        return _messages(entry, full, stored)

    return chain.resolve(step_ids, stored, _based_on, apply, _request_missing, known)


def _based_on(entry: StoredRequest) -> str | None:
    """The step whose history ``entry``'s messages are a delta on; None when stored whole."""
    return entry.parent_step_id if entry.messages_base else None


def _request_missing(step_id: str) -> RequestMissingError:
    return RequestMissingError(f"the request of step {step_id} is not stored")


def _messages(
    entry: StoredRequest,
    full: Mapping[str, list[Any] | None],
    stored: Mapping[str, StoredRequest],
) -> list[Any] | None:
    """``H_p[:b] + M[b:]`` (module docstring); the parent's full messages are in ``full``."""
    messages = history_of(entry.request)
    if not entry.messages_base:
        return messages if isinstance(messages, list) else None
    parent_id = entry.parent_step_id
    parent = full.get(parent_id) if parent_id is not None else None
    if parent_id is None or parent is None or not isinstance(messages, list):
        raise RequestMissingError(
            f"step {entry.step_id} stores its messages as a delta on parent {parent_id}, "
            "whose messages are missing"
        )
    head = parent
    if len(head) < entry.messages_base:
        response = stored[parent_id].response_message if parent_id in stored else None
        head = [*parent, response] if response is not None else parent
    if len(head) < entry.messages_base:
        raise RequestMissingError(
            f"step {entry.step_id} needs {entry.messages_base} messages of its parent's "
            f"history, which has {len(head)}"
        )
    return [*head[: entry.messages_base], *messages]


def full_request(entry: StoredRequest, messages: list[Any] | None) -> FullRequest:
    """A step's full client and upstream requests, given its full ``messages``."""
    request = entry.request
    name = history_field(request)
    if entry.messages_base is not None and messages is not None and name is not None:
        request = {**request, name: messages}
    if entry.upstream_request_patch is not None:
        upstream = apply_merge_patch(request, entry.upstream_request_patch)
    elif entry.upstream_request is not None:
        upstream = entry.upstream_request
    else:
        raise RequestMissingError(f"step {entry.step_id} has neither upstream request nor patch")
    return FullRequest(request, upstream)


def _stored_of(row: Step) -> StoredRequest:
    return StoredRequest(
        row.id,
        row.parent_step_id,
        row.messages_base,
        row.request,
        row.upstream_request,
        row.upstream_request_patch,
        row.response_message,
    )


def is_expanded(row: Step) -> bool:
    """Whether ``row.request`` is already the full request (``expand_requests`` ran on it)."""
    return inspect(row).info.get(_EXPANDED) is row.__dict__.get("request", _EXPANDED)


def expand_requests(session: Session, rows: Iterable[Step]) -> None:
    """Put the full client and upstream requests on loaded ``rows`` (``row.request``,
    ``row.upstream_request``), as committed values: nothing is written back.

    Ancestors missing from ``rows`` are read with one query per batch of trajectories (the
    stored requests of a whole trajectory are about the size of its last full request, since
    each message is stored once). Idempotent per row. Raises ``RequestMissingError`` on a
    broken chain.
    """
    todo = [row for row in rows if not is_expanded(row)]
    if not todo:
        return
    stored: dict[str, StoredRequest] = {}
    known: dict[str, list[Any]] = {}
    for row in todo:
        stored[row.id] = _stored_of(row)
    # Trajectories whose rows lack an ancestor some row's messages are a delta on.
    needed = {row.trajectory_id for row in todo if chain.walk(row.id, stored, _based_on)[1]}
    if needed:
        trajectory_ids = sorted(needed)
        for chunk in chunks(trajectory_ids):
            for values in session.execute(
                select(
                    Step.id,
                    Step.parent_step_id,
                    Step.messages_base,
                    Step.request,
                    Step.upstream_request,
                    Step.upstream_request_patch,
                    Step.response_message,
                ).where(Step.trajectory_id.in_(chunk))
            ):
                stored.setdefault(values[0], StoredRequest(*values))
    for row in rows:  # rows already expanded serve as known full messages
        if is_expanded(row):
            messages = history_of(row.request)
            if messages is not None:
                known[row.id] = messages
    full = reconstruct_messages(stored, [row.id for row in todo], known)
    for row in todo:
        result = full_request(stored[row.id], full[row.id])
        set_committed_value(row, "request", result.request)
        set_committed_value(row, "upstream_request", result.upstream_request)
        inspect(row).info[_EXPANDED] = result.request


def engine_chat(
    request: Mapping[str, Any], upstream_request: Mapping[str, Any] | None
) -> tuple[list[Any] | None, Any]:
    """The chat messages and tools the engine rendered for a step's full requests.

    They are the upstream body's: for chat completions the client's own; for a translating
    dialect (Responses, Messages) the chat form the gateway sent, with any
    ``previous_response_id`` history included. ``(None, None)`` for completions (a prompt, no
    messages). Exports use these so every dialect exports the conversation the policy saw.
    """
    for body in (upstream_request or {}, request):  # a step without an upstream body: the client's
        messages = body.get("messages")
        if isinstance(messages, list):
            return list(messages), body.get("tools")
    return None, None
