"""Request JSON as stored: messages as a delta on the parent step, the upstream request as a patch.

Owns: how a step's client request, upstream request and canonical record are written to
``steps.request``, ``steps.messages_base``, ``steps.upstream_request``,
``steps.upstream_request_patch``, ``steps.canonical`` and ``steps.canonical_base``
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
  every message, or, when ``steps.body_deltas`` gives the history field a list spec
  ``[k, m, items]`` (``datapool.steps.bodies``), its first k messages replaced (as deltas on
  ``H_p``'s) then ``H_p[k:m]`` then ``M[m:]``: a history whose first message changes on every
  call (Claude Code's billing line with its ``cch``, in the system message) is stored by what
  changed, not whole. b NULL: a row written before migration 0007, or a request without a
  history list; ``request`` is then the whole request.
- The history list is the request's field named by the call's dialect
  (``CallRecord.history_field``, stored as ``steps.history_field``: e.g. chat's ``messages``,
  the Responses API's ``input``); a value that is no list (an ``input`` string) is stored
  whole. Cutting a list leaves a list, so the reader finds the same field the writer cut. A
  parent of another dialect is fine: the items are compared and copied as JSON, whatever their
  shape. This module never names a dialect's field.
- The canonical record (``datapool.steps.canonical``) is stored the same way: ``canonical`` =
  its JSON with ``messages`` cut to ``C[c:]``, ``canonical_base`` = c, the longest common prefix
  of its messages ``C`` and the parent's ``C_p + [R_p]`` (``R_p`` in canonical form,
  ``canonical.response_of``). NULL ``canonical``: a call recorded without one.
- ``upstream_request_patch`` = the JSON Merge Patch (RFC 7396 §2, which obsoletes RFC 7386 with
  the same algorithm) that turns the full client request into the upstream request: only what
  the gateway added or changed (``return_token_ids``, ``logprobs``, ``stream_options``), for a
  body the gateway passes through. When a merge patch cannot say it exactly (a key set to
  ``null``, a different key order) or would hold an array (a translated body: a merge patch
  replaces an array whole, so it would grow with the history), ``upstream_request`` holds the
  upstream request and the patch is NULL.
- Beyond the history lists, every body (the request's other fields, the upstream request when
  no patch says it, the canonical record's other fields) is stored by ``datapool.steps.bodies``
  against the parent step's same body: a list or string that extends the parent's as the part
  appended, a large value (a tool list, a system prompt) as a shared ``json_blobs`` row;
  ``steps.body_deltas`` says which. NULL: every field as stored (rows before migration 0015).

The parent is the step token lineage chose (``parent_step_id``); the writer compares against
the parent's message keys it keeps in memory (``datapool.steps.lineage``), never rereads SQL for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import inspect, select
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from datapool.db import chunks
from datapool.models import JsonBlob, Step
from datapool.steps import chain
from datapool.steps.bodies import (
    BodyKeys,
    Doc,
    EncodedBody,
    FieldSpec,
    ListText,
    RequestMissingError,
    based_on_parent,
    blob_shas,
    decode_body,
    decode_list,
    encode_body,
    head_replaced,
    list_delta,
    load_blob,
    message_key,
    orjson_text,
    proved_prefix,
)
from datapool.steps.canonical import CanonicalCall, response_of

__all__ = ["RequestMissingError", "message_key"]  # re-exported: migrations 0007 and 0013 use them

# Marks a loaded Step whose ``request`` attribute already holds the full request (the value is
# that very dict, so a row reloaded from the database is not mistaken for an expanded one).
_EXPANDED = "trajgate_full_request"


def history_of(request: Mapping[str, Any], field_name: str | None) -> list[Any] | None:
    """``request``'s history list (``M`` of the module docstring): its ``field_name`` when that
    is a list, else None."""
    if field_name is None:
        return None
    history = request.get(field_name)
    return history if isinstance(history, list) else None


def canonical_response_key(response_message: Any) -> Any:
    """The JSON of a step's response as its canonical message (``R_p`` of ``C_p + [R_p]``)."""
    return response_of(response_message).to_json()


def history_keys(
    parent_keys: Sequence[str] | None, messages: Any, base: int, response_message: Any
) -> list[str] | None:
    """The keys of ``M + [R]`` for a new step (``H`` of the module docstring), sharing the
    parent's strings for the first ``base`` messages, or, when none is shared but the first
    messages were replaced (``bodies.head_replaced``: a system message with a line that
    changes on every call), for the run after them: what a call dumps and the writer keeps
    does not grow with the history. None when ``messages`` is not a list."""
    if not isinstance(messages, list):
        return None
    k, m = 0, base
    if not base and parent_keys:
        k, m = head_replaced(messages, parent_keys) or (0, 0)
    keys = [message_key(message) for message in messages[:k]]
    keys += parent_keys[k:m] if parent_keys is not None and m else []
    keys += [message_key(message) for message in messages[m:]]
    if response_message is not None:
        keys.append(message_key(response_message))
    return keys


def messages_base(
    parent_keys: Sequence[str] | None,
    messages: Any,
    text: bytes | None = None,
    proof: ListText | None = None,
) -> int | None:
    """b: how many leading ``messages`` equal the parent's ``M_p + [R_p]`` (as JSON text);
    None when ``messages`` is not a list (the request is then stored whole). ``text``:
    ``messages``' orjson text (``bodies.orjson_text``), ``proof``: the parent's ``ListText``
    of ``M_p + [R_p]`` (``bodies.proved_prefix``; the same answer, without a ``json.dumps`` of
    the history)."""
    if not isinstance(messages, list):
        return None
    if not parent_keys:
        return 0
    return proved_prefix(messages, text, parent_keys, proof)


def stored_request(
    request: dict[str, Any], field_name: str | None, base: int | None
) -> dict[str, Any]:
    """The request as stored: its history list cut to ``M[b:]`` (a new dict; ``request`` is
    kept)."""
    if not base or history_of(request, field_name) is None:
        return request
    assert field_name is not None
    return {**request, field_name: request[field_name][base:]}


@dataclass(frozen=True)
class RequestDelta:
    """A call's two requests as its step rows store them (columns of the module docstring)."""

    request: dict[str, Any]  # ``steps.request``: the client's request with ``M[b:]``
    messages_base: int | None  # b
    upstream_request: dict[str, Any] | None  # whole, only when no merge patch says it
    upstream_request_patch: dict[str, Any] | None
    canonical: dict[str, Any] | None = None  # ``steps.canonical``: its JSON with ``C[c:]``
    canonical_base: int | None = None  # c
    canonical_messages: list[Any] | None = None  # C whole (not stored: for the lineage memory)
    # ``steps.body_deltas`` (``datapool.steps.bodies``); None when every field is as stored.
    body_deltas: dict[str, dict[str, FieldSpec]] | None = None
    # The ``json_blobs`` rows (sha -> JSON text) the step needs that its parent did not.
    new_blobs: dict[str, str] = field(default_factory=dict)
    # Each body's memory for the children's deltas (the upstream's only when stored whole).
    bodies: Mapping[Doc, BodyKeys] = field(default_factory=dict)
    # ``M`` and ``C`` as orjson wrote them (``bodies.orjson_text``; None: not a list, or not
    # writable), from which the lineage memory makes each step's ``ListText`` of ``H``.
    history_text: bytes | None = None
    canonical_text: bytes | None = None


@dataclass(frozen=True)
class ParentKeys:
    """The parent's message keys (``message_key``): ``H_p`` of its request history and of its
    canonical messages; None when the parent is not a lineage candidate (stored whole).
    ``request_text`` and ``canonical_text``: the ``bodies.ListText`` of those two lists
    (None: not known, the keys alone are compared)."""

    request: Sequence[str] | None
    canonical: Sequence[str] | None
    bodies: Mapping[Doc, BodyKeys] = field(default_factory=dict)  # ``RequestDelta.bodies``
    request_text: ListText | None = None
    canonical_text: ListText | None = None


def request_delta(
    parent: ParentKeys,
    request: dict[str, Any],
    upstream_request: dict[str, Any],
    history_field: str | None,
    canonical: CanonicalCall | None,
) -> RequestDelta:
    """Store ``request`` as a delta on the parent's ``H_p``, ``canonical`` as a delta on its
    ``C_p + [R_p]``, ``upstream_request`` as a merge patch on ``request`` where one says it
    without an array, and every other field through ``datapool.steps.bodies``."""
    history = history_of(request, history_field)
    history_text = None if history is None else orjson_text(history)
    base = messages_base(parent.request, history, history_text, parent.request_text)
    stored, history_spec = _cut(
        request, history_field, history, base, parent.request, parent.bodies.get("request")
    )
    encoded: dict[Doc, EncodedBody] = {
        "request": encode_body(
            stored,
            parent.bodies.get("request"),
            history_field if history is not None else None,
            history or (),
        )
    }
    if history_spec is not None:
        assert history_field is not None
        encoded["request"].spec[history_field] = history_spec
    patch = merge_patch(request, upstream_request)
    if patch is not None and any(isinstance(value, list) for value in patch.values()):
        patch = None
    if patch is None:
        encoded["upstream"] = encode_body(upstream_request, parent.bodies.get("upstream"))
    stored_canonical, canonical_base, messages, canonical_text = None, None, None, None
    if canonical is not None:
        record = canonical.to_json()
        messages = record["messages"]
        canonical_text = orjson_text(messages) if isinstance(messages, list) else None
        canonical_base = messages_base(
            parent.canonical, messages, canonical_text, parent.canonical_text
        )
        parent_body = parent.bodies.get("canonical")
        stored_canonical, messages_spec = _cut(
            record, "messages", messages, canonical_base, parent.canonical, parent_body
        )
        encoded["canonical"] = encode_body(
            stored_canonical,
            parent_body,
            "messages" if messages is not None else None,
            messages or (),
        )
        if messages_spec is not None:
            encoded["canonical"].spec["messages"] = messages_spec
    deltas: dict[str, dict[str, FieldSpec]] = {
        doc: body.spec for doc, body in encoded.items() if body.spec
    }
    new_blobs: dict[str, str] = {}
    for body in encoded.values():
        new_blobs.update(body.new_blobs)
    upstream = encoded.get("upstream")
    return RequestDelta(
        encoded["request"].stored,
        base,
        None if upstream is None else upstream.stored,
        patch,
        None if canonical is None else encoded["canonical"].stored,
        canonical_base,
        messages,
        deltas or None,
        new_blobs,
        {doc: body.keys for doc, body in encoded.items()},
        history_text,
        canonical_text,
    )


def _cut(
    body: dict[str, Any],
    field_name: str | None,
    history: list[Any] | None,
    base: int | None,
    parent_keys: Sequence[str] | None,
    parent_body: BodyKeys | None,
) -> tuple[dict[str, Any], list[Any] | None]:
    """``body`` with its history list as stored and that list's ``steps.body_deltas`` spec: cut
    to ``M[b:]`` (spec None) when it shares a prefix with ``H_p``; when it shares none, its
    first messages replaced and the next ones ``H_p``'s (a system prompt with a line that
    changes on every call), the list form of ``datapool.steps.bodies`` (``[k, m, items]``
    against ``H_p``, the first messages as deltas on the parent's); else whole."""
    if base or not history or not parent_keys or field_name is None:
        return stored_request(body, field_name, base), None
    found = head_replaced(history, parent_keys)
    if found is None:
        return body, None
    heads = parent_body.heads.get(field_name, ()) if parent_body is not None else ()
    tail, spec = list_delta(history, heads, *found)
    return {**body, field_name: tail}, spec


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
    history_field: str | None = None
    canonical: dict[str, Any] | None = None
    canonical_base: int | None = None
    body_deltas: dict[str, dict[str, FieldSpec]] | None = None


@dataclass(frozen=True)
class FullRequest:
    """A step's requests exactly as the client sent them and as they went upstream, and its
    canonical record's JSON (None when it has none)."""

    request: dict[str, Any]
    upstream_request: dict[str, Any]
    canonical: dict[str, Any] | None = None


@dataclass(frozen=True)
class _History:
    """One delta-stored list of a step (its request history, or its canonical messages)."""

    entry: StoredRequest
    canonical: bool

    @property
    def base(self) -> int | None:
        return self.entry.canonical_base if self.canonical else self.entry.messages_base

    @property
    def spec(self) -> list[Any] | None:
        """The list's ``[k, m, items]`` spec (first messages replaced), None when cut by
        ``base`` or stored whole."""
        entry = self.entry
        if self.canonical:
            how = ((entry.body_deltas or {}).get("canonical") or {}).get("messages")
        else:
            how = ((entry.body_deltas or {}).get("request") or {}).get(entry.history_field or "")
        return how if isinstance(how, list) else None

    @property
    def tail(self) -> list[Any] | None:
        entry = self.entry
        if self.canonical:
            messages = (entry.canonical or {}).get("messages")
            return messages if isinstance(messages, list) else None
        return history_of(entry.request, entry.history_field)

    def response(self) -> Any:
        response = self.entry.response_message
        if self.canonical and response is not None:
            return canonical_response_key(response)
        return response


def reconstruct_messages(
    stored: Mapping[str, StoredRequest],
    step_ids: Iterable[str],
    known: Mapping[str, list[Any]] | None = None,
    *,
    canonical: bool = False,
) -> dict[str, list[Any] | None]:
    """Full history lists ``[M]`` of ``step_ids`` (and of every ancestor they needed), or with
    ``canonical`` their canonical messages ``[C]``; ``stored`` must hold each one's chain of
    parents down to a step with base 0 or NULL, or one in ``known`` (full lists already at
    hand). None for a step without such a list.

    One walk per chain (``datapool.steps.chain``), every step computed once. Raises
    ``RequestMissingError`` when a parent is absent or shorter than a base.
    """
    histories = {step_id: _History(entry, canonical) for step_id, entry in stored.items()}

    def apply(history: _History, full: Mapping[str, list[Any] | None]) -> list[Any] | None:
        return _messages(history, full, histories)

    return chain.resolve(step_ids, histories, _based_on, apply, _request_missing, known)


def _based_on(history: _History) -> str | None:
    """The step whose list ``history``'s is a delta on; None when stored whole."""
    return history.entry.parent_step_id if history.base or history.spec else None


def _request_missing(step_id: str) -> RequestMissingError:
    return RequestMissingError(f"the request of step {step_id} is not stored")


def _messages(
    history: _History,
    full: Mapping[str, list[Any] | None],
    histories: Mapping[str, _History],
) -> list[Any] | None:
    """``H_p[:b] + M[b:]`` (module docstring), or ``M`` stored with its first messages
    replaced (``_cut``); the parent's full list is in ``full``."""
    entry, messages, spec = history.entry, history.tail, history.spec
    # The parent's messages the list needs: H_p[:b], or H_p[:m] of a list spec.
    base = history.base or (0 if spec is None else int(spec[1]))
    if not base:
        return messages
    parent_id = entry.parent_step_id
    parent = full.get(parent_id) if parent_id is not None else None
    if parent_id is None or parent is None or messages is None:
        raise RequestMissingError(
            f"step {entry.step_id} stores its messages as a delta on parent {parent_id}, "
            "whose messages are missing"
        )
    head = parent
    if len(head) < base and parent_id in histories:
        response = histories[parent_id].response()
        head = [*parent, response] if response is not None else parent
    if len(head) < base:
        raise RequestMissingError(
            f"step {entry.step_id} needs {base} messages of its parent's history, which has "
            f"{len(head)}"
        )
    if spec is not None:
        return decode_list(entry.step_id, "messages", messages, spec, head[:base])
    return [*head[:base], *messages]


def full_request(
    entry: StoredRequest,
    messages: list[Any] | None,
    canonical: list[Any] | None = None,
    *,
    parent: FullRequest | None = None,
    blobs: Mapping[str, Any] | None = None,
) -> FullRequest:
    """A step's full client and upstream requests, given its full ``messages``, and its
    canonical record given its full ``canonical`` messages; ``parent`` (the parent step's, when
    ``entry.body_deltas`` has a delta on it) and ``blobs`` (values by sha, every one
    ``entry.body_deltas`` names) read its other fields back (``datapool.steps.bodies``).

    Raises ``RequestMissingError`` when something the row needs is not given."""
    deltas = entry.body_deltas or {}
    blobs = blobs or {}
    step_id = entry.step_id
    request = entry.request
    name = entry.history_field
    if entry.messages_base is not None and messages is not None and name is not None:
        request = {**request, name: messages}
    request = decode_body(
        step_id,
        request,
        _without(deltas.get("request"), name),
        None if parent is None else parent.request,
        blobs,
    )
    if entry.upstream_request_patch is not None:
        upstream = apply_merge_patch(request, entry.upstream_request_patch)
    elif entry.upstream_request is not None:
        upstream = decode_body(
            step_id,
            entry.upstream_request,
            deltas.get("upstream"),
            None if parent is None else parent.upstream_request,
            blobs,
        )
    else:
        raise RequestMissingError(f"step {step_id} has neither upstream request nor patch")
    record = entry.canonical
    if record is not None and entry.canonical_base is not None and canonical is not None:
        record = {**record, "messages": canonical}
    if record is not None:
        record = decode_body(
            step_id,
            record,
            _without(deltas.get("canonical"), "messages"),
            None if parent is None else parent.canonical,
            blobs,
        )
    return FullRequest(request, upstream, record)


def _without(
    spec: Mapping[str, FieldSpec] | None, name: str | None
) -> Mapping[str, FieldSpec] | None:
    """A body's spec less its history list's, which ``reconstruct_messages`` has applied."""
    if not spec or name not in spec:
        return spec
    return {key: how for key, how in spec.items() if key != name}


_STORED_COLUMNS = (
    Step.id,
    Step.parent_step_id,
    Step.messages_base,
    Step.request,
    Step.upstream_request,
    Step.upstream_request_patch,
    Step.response_message,
    Step.history_field,
    Step.canonical,
    Step.canonical_base,
    Step.body_deltas,
)


def _stored_of(row: Step) -> StoredRequest:
    return StoredRequest(*(getattr(row, column.key) for column in _STORED_COLUMNS))


def is_expanded(row: Step) -> bool:
    """Whether ``row.request`` is already the full request (``expand_requests`` ran on it)."""
    return inspect(row).info.get(_EXPANDED) is row.__dict__.get("request", _EXPANDED)


def expand_requests(session: Session, rows: Iterable[Step]) -> None:
    """Put the full client and upstream requests and canonical record on loaded ``rows``
    (``row.request``, ``row.upstream_request``, ``row.canonical``), as committed values:
    nothing is written back.

    Ancestors missing from ``rows`` are read with one query per batch of trajectories (the
    stored requests of a whole trajectory are about the size of its last full request, since
    each message is stored once). Idempotent per row. Raises ``RequestMissingError`` on a
    broken chain.
    """
    todo = [row for row in rows if not is_expanded(row)]
    if not todo:
        return
    stored: dict[str, StoredRequest] = {}
    for row in todo:
        stored[row.id] = _stored_of(row)

    views = [{k: _History(v, canonical) for k, v in stored.items()} for canonical in (False, True)]
    # Trajectories whose rows lack an ancestor some row's lists or bodies are a delta on.
    needed = {
        row.trajectory_id
        for row in todo
        if any(chain.walk(row.id, view, _based_on)[1] for view in views)
        or chain.walk(row.id, stored, _body_based_on)[1]
    }
    if needed:
        trajectory_ids = sorted(needed)
        for chunk in chunks(trajectory_ids):
            for values in session.execute(
                select(*_STORED_COLUMNS).where(Step.trajectory_id.in_(chunk))
            ):
                stored.setdefault(values[0], StoredRequest(*values))
    known: dict[str, list[Any]] = {}
    known_canonical: dict[str, list[Any]] = {}
    known_bodies: dict[str, FullRequest] = {}
    for row in rows:  # rows already expanded serve as known full lists and bodies
        if is_expanded(row):
            messages = history_of(row.request, row.history_field)
            if messages is not None:
                known[row.id] = messages
            canonical = (row.canonical or {}).get("messages")
            if isinstance(canonical, list):
                known_canonical[row.id] = canonical
            if row.upstream_request is not None:
                known_bodies[row.id] = FullRequest(row.request, row.upstream_request, row.canonical)
    ids = [row.id for row in todo]
    # Every stored entry: a body's delta chain may need an ancestor no list chain needed.
    every = list(stored)
    full = reconstruct_messages(stored, every, known)
    full_canonical = reconstruct_messages(stored, every, known_canonical, canonical=True)
    blobs = _load_blobs(session, stored.values())

    def apply(entry: StoredRequest, bodies: Mapping[str, FullRequest]) -> FullRequest:
        parent = bodies.get(entry.parent_step_id) if entry.parent_step_id is not None else None
        return full_request(
            entry, full[entry.step_id], full_canonical[entry.step_id], parent=parent, blobs=blobs
        )

    results = chain.resolve(ids, stored, _body_based_on, apply, _request_missing, known_bodies)
    for row in todo:
        result = results[row.id]
        set_committed_value(row, "request", result.request)
        set_committed_value(row, "upstream_request", result.upstream_request)
        set_committed_value(row, "canonical", result.canonical)
        inspect(row).info[_EXPANDED] = result.request


def _body_based_on(entry: StoredRequest) -> str | None:
    """The step whose bodies ``entry``'s are a delta on (``datapool.steps.bodies``); None when
    no field is."""
    return entry.parent_step_id if based_on_parent(entry.body_deltas) else None


def _load_blobs(session: Session, entries: Iterable[StoredRequest]) -> dict[str, Any]:
    """The JSON values of every ``json_blobs`` row ``entries`` refer to, by sha (one query per
    chunk of shas; a trajectory refers to few)."""
    shas = sorted(set().union(*(blob_shas(entry.body_deltas) for entry in entries)))
    blobs: dict[str, Any] = {}
    for chunk in chunks(shas):
        for sha, text in session.execute(
            select(JsonBlob.sha256, JsonBlob.body).where(JsonBlob.sha256.in_(chunk))
        ):
            blobs[sha] = load_blob(text)
    return blobs


def canonical_call(row: Step) -> CanonicalCall | None:
    """The canonical record of an expanded step row (``expand_requests``), None without one."""
    return None if row.canonical is None else CanonicalCall.from_json(row.canonical)


def engine_chat(row: Step) -> tuple[list[Any] | None, list[Any] | None]:
    """The messages and tools (JSON of the canonical record) the engine was asked with, for an
    expanded step row; ``(None, None)`` for a call without messages (a completions prompt) or
    without a record. Exports use these, so every dialect exports the conversation the policy
    saw, in one form. ``tools`` is None when none was offered."""
    record = row.canonical
    if record is None or not isinstance(record.get("messages"), list):
        return None, None
    return list(record["messages"]), record.get("tools") or None
