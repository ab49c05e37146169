"""Step bodies as stored: each top-level field a delta on the parent step's, or a shared blob.

Owns: the encoding of one JSON object body of a step (its client request, its upstream request,
its canonical record) against the same body of its parent step (``encode_body``), its exact
reconstruction (``decode_body``), the content-addressed ``json_blobs`` rows (``blob_row``), and
the writer's memory of a body (``BodyKeys``, ``body_keys``). Never: touches the history list
that ``datapool.steps.messages`` already stores as a delta on the parent's messages and
response (the caller names it ``skip``), reads SQL, or knows a dialect.

A coding agent re-sends, on every call, its tool list (tens of KB), its system prompt and a
history that only grows; stored as sent, turn T costs O(T) bytes and a session O(T²). Here a
body ``B`` whose parent step's same body is ``P`` is stored as a body with the same keys in the
same order, and ``steps.body_deltas[doc][f]`` (``doc`` one of ``DOCS``) says how to read field
``f`` back:

- an int ``n``: ``B[f] = P[f][:n] + stored[f]``, for a list that extends the parent's (the
  upstream messages of a translated dialect: ``stored[f]`` holds the items appended since) or a
  string (a completions prompt: the characters appended). ``n`` counts items, or characters.
- a string ``s`` (64 hex digits): ``B[f]`` is the JSON value of the ``json_blobs`` row ``s``
  (``sha256`` of the value's JSON text, ``json.dumps`` with its default separators, key order
  kept); ``stored[f]`` is null, the key kept for its place. A value of ``BLOB_MIN_BYTES`` or more
  that is not such a delta (a tool list, a system prompt, the first call's messages) is stored
  once for every step, trajectory and group that sends it.
- a list ``[k, m, items]``: ``B[f] = heads + P[f][k:m] + stored[f][k:]``, for a list whose first
  k items were replaced and whose next ones are the parent's (Claude Code's system block 0, its
  billing line with a ``cch`` that changes on every request, and the system message that
  carries it upstream and in the canonical record: without this form the whole history would
  be stored again on every call). ``heads`` are ``stored[f][:k]`` each read back by its entry of
  ``items`` against the parent's item at the same place (``P[f][i]``): null, the item as
  stored; else an *item spec*: an int ``n`` (a list or string: the parent's first n then the
  stored rest), a list ``[k, m, items]`` (the same form, one level down), or an object that
  maps some of a dict item's keys to their item specs (the other keys as stored). So a system
  message whose first text part changed stores that part, not the message. Item specs never
  name a blob.
- absent: ``stored[f]`` is ``B[f]``.

An item counts as shared when its JSON text is the parent's (``message_key``: ``1`` is not
``1.0`` and key order counts), so a body reads back as the same JSON, not merely an equal value.
A field shared with the parent as a blob stays that blob (no hashing again); a list extended is
a delta, never a new blob, so a history is never stored twice. The replaced head is looked for
only when no leading item is shared and among the first ``HEAD_ITEMS`` items: an agent that
rewrites its history elsewhere is stored from the first item that differs, as before. The same
list form (``list_delta``, ``decode_list``) stores a history list, which
``datapool.steps.messages`` cuts, when its first message changed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

# The bodies of a step that ``steps.body_deltas`` describes (its keys).
Doc = Literal["request", "upstream", "canonical"]
DOCS: tuple[Doc, ...] = ("request", "upstream", "canonical")
# A value's JSON text at least this long is stored once, in ``json_blobs`` (a tool definition is
# ~2.5 KB; short values cost less inline than a 64-character reference and a row).
BLOB_MIN_BYTES = 512
# A string field is stored as a delta on the parent's only past this many characters shared.
STRING_DELTA_MIN_CHARS = 256

# A list's items that may be replaced at its head while the rest is shared with the parent's.
HEAD_ITEMS = 4

# A field's spec in ``steps.body_deltas``: a prefix length, a blob's sha256 hex, or a list
# ``[k, m, items]`` whose ``items`` are item specs (the module docstring).
FieldSpec = int | str | list[Any]
ItemSpec = int | list[Any] | dict[str, Any] | None


class RequestMissingError(LookupError):
    """A step's body is a delta on a parent (or a blob) that is not stored, or is too short."""


def message_key(value: Any) -> str:
    """A JSON value as its text: equal keys mean the reconstructed value is the same JSON.

    Text, not ``==``: in Python ``1 == 1.0 == True`` and dict comparison ignores key order, so a
    value equal in Python could still read back differently.
    """
    return json.dumps(value)


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")  # a lone surrogate (JSON allows one) too


def _string_hash(text: str) -> bytes:
    return hashlib.sha256(_utf8(text)).digest()


@dataclass(frozen=True, eq=False)
class ListText:
    """A list remembered by its JSON text as orjson writes it (compact), so that a later list
    is proved to begin with the same items by comparing bytes, without writing either with
    ``json`` (at turn 200 of a coding-agent session, 146 KB of text: ``json.dumps`` of the
    history 0.6 ms, ``orjson.dumps`` 20 µs, a sha256 of the text 75-120 µs, a comparison of
    it 2 µs). The text less its closing ``]`` is ``buffer[:head] + tail``: ``tail`` the list's
    last item with its separator (a history's response, which a client may echo in its own
    form), empty when not kept. ``buffer`` is shared along a chain of steps (``list_text``):
    what its first ``head`` bytes hold never changes, so the chain holds its longest text once
    (as ``datapool.steps.lineage`` shares token sequences); ``grown`` is what this one added
    to it (bytes)."""

    buffer: bytearray
    head: int
    tail: bytes = b""
    grown: int = 0

    @property
    def whole(self) -> int:
        """The length of the list's open text (bytes), its last item included."""
        return self.head + len(self.tail)

    @property
    def has_head(self) -> bool:
        """Whether the text less its last item is kept apart (an item was appended to a
        non-empty list)."""
        return bool(self.tail) and self.head > 1

    def text(self) -> bytes:
        """The list's open text (no closing ``]``)."""
        return bytes(self.buffer[: self.head]) + self.tail


def orjson_text(value: Any) -> bytes | None:
    """``value``'s JSON as orjson writes it, or None where orjson cannot write it (an integer
    past 64 bits, a lone surrogate): such a list is compared by ``shared_prefix`` alone."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return None


_NO_ITEM = object()


def list_text(
    text: bytes | None, parent: ListText | None = None, appended: Any = _NO_ITEM
) -> ListText | None:
    """The ``ListText`` of the list whose orjson text is ``text``, or, with ``appended``, of
    that list with ``appended`` after its items; None when there is no text or orjson cannot
    write ``appended``. Its buffer is ``parent``'s (the parent step's same list), extended in
    place, when the two texts agree as far as both go (the list extends the parent's, or is a
    sibling's or an earlier turn's); else a new one. Callers keep no text for a list that
    shares no leading item with its parent's (a first message replaced on every call): one
    new buffer per step would hold the history once per step."""
    if text is None:
        return None
    n = len(text) - 1  # without the closing "]"
    buffer, grown = _shared_buffer(text, n, parent)
    if appended is _NO_ITEM:
        return ListText(buffer, n, b"", grown)
    item = orjson_text(appended)
    if item is None:
        return None
    return ListText(buffer, n, (b"," if n > 1 else b"") + item, grown)  # "[]" has no items


def _shared_buffer(text: bytes, n: int, parent: ListText | None) -> tuple[bytearray, int]:
    """A buffer whose first ``n`` bytes are ``text[:n]`` and how many bytes it grew: the
    parent's when it agrees with ``text[:n]`` on their common length (a memcmp), else a new
    one. No view of a buffer outlives a call: a buffer with one cannot grow."""
    with memoryview(text) as view:
        if parent is not None:
            buffer = parent.buffer
            size = len(buffer)
            if size <= n and text.startswith(buffer):
                buffer += view[size:n]
                return buffer, n - size
            if size > n and buffer.startswith(view[:n]):
                return buffer, 0
        return bytearray(view[:n]), n


def _begins(text: bytes, proof: ListText, whole: bool) -> bool:
    """Whether the list text ``text`` begins with the items whose open text is ``proof``'s
    (its head alone, or ``whole`` with its last item), the next byte ending one of them: a
    JSON array's text splits into its items one way only, so those are its first items, as
    JSON. Bytes compared, not digests: no hash of the history on every call."""
    n = proof.whole if whole else proof.head
    if len(text) <= n or text[n] not in b",]":
        return False
    if whole and not text.startswith(proof.tail, proof.head):
        return False
    with memoryview(proof.buffer) as view:
        return text.startswith(view[: proof.head])


def proved_prefix(
    values: Sequence[Any],
    text: bytes | None,
    theirs: Sequence[str],
    proof: ListText | None,
) -> int:
    """``shared_prefix(values, theirs)``, proved from texts where it can be: ``text`` is
    ``values``' orjson text (``orjson_text``) and ``proof`` the ``ListText`` of the parent's
    list whose keys are ``theirs``. Equal orjson texts are equal JSON values, types and key
    order included (orjson writes a double in its shortest form and never writes NaN), so
    their ``json.dumps`` texts, which ``shared_prefix`` compares, are equal too. Where the
    proof does not settle it (no text or proof, the parent's items not all there), the answer
    is ``shared_prefix``'s own."""
    m = len(theirs)
    if text is None or proof is None or m == 0:
        return shared_prefix(values, theirs)
    if not proof.has_head or m == 1:
        return m if _begins(text, proof, whole=True) else shared_prefix(values, theirs)
    if not _begins(text, proof, whole=False):
        return shared_prefix(values, theirs)
    if _begins(text, proof, whole=True):
        return m
    # The first m - 1 items are the parent's; the last of its items is compared alone.
    if len(values) >= m and message_key(values[m - 1]) == theirs[m - 1]:
        return m
    return m - 1


@dataclass(frozen=True)
class BodyKeys:
    """What the writer keeps of a step's body for its children's deltas: per list field the
    ``message_key`` of each item (strings shared with the parent's for the common prefix), per
    long string field ``(length, sha256)``, and the blob each blob-stored field is."""

    lists: Mapping[str, Sequence[str]] = field(default_factory=dict)
    strings: Mapping[str, tuple[int, bytes]] = field(default_factory=dict)
    blobs: Mapping[str, str] = field(default_factory=dict)  # field -> sha256 hex
    # Per list field its first ``HEAD_ITEMS`` items (the values: a replaced head item is
    # stored as a delta on the parent's).
    heads: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    # Per list field its ``ListText`` (``proved_prefix``); a field without one is compared by
    # its keys alone.
    texts: Mapping[str, ListText] = field(default_factory=dict)


@dataclass(frozen=True)
class EncodedBody:
    """A body as stored (``stored``, its ``spec`` for ``steps.body_deltas``), its memory for
    the children (``keys``) and the blob rows it needs that its parent did not (sha -> text)."""

    stored: dict[str, Any]
    spec: dict[str, FieldSpec]
    keys: BodyKeys
    new_blobs: dict[str, str]


def blob_sha(text: str) -> str:
    """The ``json_blobs`` key of a value whose JSON text is ``text``: its sha256, hex."""
    return hashlib.sha256(_utf8(text)).hexdigest()


def shared_prefix(values: Sequence[Any], theirs: Sequence[str]) -> int:
    """How many leading ``values`` have the JSON text of the keys ``theirs`` (``message_key``
    of each of the parent's items), in order.

    An agent appends, so the likely answers are checked first with one ``json.dumps`` of the
    first m values against ``theirs[:m]`` joined as a JSON array (a JSON array's text splits
    into its items one way only, so equal texts mean equal items), in C: m = all of
    ``theirs``, then all but the last (the parent's response, which a client may echo in its
    own form). The second answer is read from the first one's dump (the same text up to the
    separator before the last item), so an echo in another form costs one dump, not two. Only
    when both fail is each value dumped and compared (a history rewritten at some message)."""
    m = len(theirs)
    if m > 0 and len(values) >= m:
        text = json.dumps(values[:m])
        if text == "[" + ", ".join(theirs) + "]":
            return m
        if m > 1 and text.startswith("[" + ", ".join(theirs[: m - 1]) + ", "):
            return m - 1
    elif (
        m > 1 and len(values) == m - 1 and json.dumps(values) == "[" + ", ".join(theirs[:-1]) + "]"
    ):
        return m - 1
    n = 0
    for value, key in zip(values, theirs, strict=False):
        if message_key(value) != key:
            break
        n += 1
    return n


def head_replaced(values: Sequence[Any], theirs: Sequence[str]) -> tuple[int, int] | None:
    """``(k, m)`` for ``values`` whose first item is not the parent's (``theirs``: the
    ``message_key`` of each of its items): the first k items differ (``k <= HEAD_ITEMS``) and
    ``values[k:m]`` are ``theirs[k:m]`` (``m > k``); None when no item among the first
    ``HEAD_ITEMS`` + 1 starts such a run. One item is dumped per place tried, then one
    ``shared_prefix`` from the first that matches."""
    for k in range(1, min(HEAD_ITEMS, len(values) - 1, len(theirs) - 1) + 1):
        if message_key(values[k]) == theirs[k]:
            return k, k + shared_prefix(values[k:], theirs[k:])
    return None


def list_delta(
    values: Sequence[Any], heads: Sequence[Any], k: int, m: int
) -> tuple[list[Any], list[Any]]:
    """``(stored, [k, m, items])`` of ``values`` whose ``[k:m]`` are the parent's (see
    ``head_replaced``): each of the first k items stored as a delta on the parent's item at the
    same place (``heads``, the parent's first items; one not at hand is stored as it is), then
    ``values[m:]``."""
    stored: list[Any] = []
    items: list[ItemSpec] = []
    for i in range(k):
        item, how = _encode_item(values[i], heads[i]) if i < len(heads) else (values[i], None)
        stored.append(item)
        items.append(how)
    return [*stored, *values[m:]], [k, m, items]


def _encode_item(value: Any, parent: Any) -> tuple[Any, ItemSpec]:
    """A replaced head item as stored and its item spec (module docstring) against the
    parent's item ``parent``: a dict key by key, a list as its parent's head or prefix plus the
    rest; anything else (or nothing shared) as it is, spec None."""
    if isinstance(value, dict) and isinstance(parent, dict):
        stored: dict[str, Any] = {}
        spec: dict[str, Any] = {}
        for name, item in value.items():
            stored[name], how = _encode_item(item, parent[name]) if name in parent else (item, None)
            if how is not None:
                spec[name] = how
        return (stored, spec) if spec else (value, None)
    if isinstance(value, list) and isinstance(parent, list) and parent:
        theirs = [message_key(item) for item in parent]
        n = shared_prefix(value, theirs)
        if n:
            return value[n:], n
        found = head_replaced(value, theirs)
        if found is not None:
            return list_delta(value, parent, *found)
    return value, None


def encode_body(
    body: dict[str, Any],
    parent: BodyKeys | None,
    skip: str | None = None,
    skip_heads: Sequence[Any] = (),
) -> EncodedBody:
    """``body`` stored against its parent step's same body, whose memory is ``parent`` (None:
    no parent, or one whose body is not remembered: no field is then a delta); ``skip`` names
    a field stored as it is (the history list another delta already cut), whose full list
    begins with ``skip_heads`` (kept for the children). See the module docstring for the
    rules."""
    stored: dict[str, Any] = {}
    spec: dict[str, FieldSpec] = {}
    lists: dict[str, Sequence[str]] = {}
    strings: dict[str, tuple[int, bytes]] = {}
    blobs: dict[str, str] = {}
    heads: dict[str, Sequence[Any]] = {}
    texts: dict[str, ListText] = {}
    new_blobs: dict[str, str] = {}
    for name, value in body.items():
        if name == skip:
            stored[name] = value
            heads[name] = skip_heads[:HEAD_ITEMS]
            continue
        text: str | None = None
        if isinstance(value, list):
            heads[name] = value[:HEAD_ITEMS]
            theirs = parent.lists.get(name) if parent is not None else None
            own = orjson_text(value)
            proof = parent.texts.get(name) if parent is not None else None
            n = 0 if theirs is None else proved_prefix(value, own, theirs, proof)
            # A list with a replaced head (n == 0 against a parent's) keeps no text: its
            # children would not begin with it either, and a new buffer per call would hold
            # the history once per step.
            known = list_text(own, proof) if n or not theirs else None
            if known is not None:
                texts[name] = known
            found = None if n or not theirs else head_replaced(value, theirs)
            # One string per shared item, not one per step; only the new items are dumped.
            k, m = found or (0, n)
            keys = [
                *(message_key(item) for item in value[:k]),
                *(theirs or ())[k:m],
                *(message_key(item) for item in value[m:]),
            ]
            lists[name] = keys
            if theirs is not None:
                assert parent is not None
                identical = n == len(keys) == len(theirs)
                sha = parent.blobs.get(name)
                if identical and sha is not None:
                    stored[name], spec[name], blobs[name] = None, sha, sha
                    continue
                if n:
                    stored[name], spec[name] = value[n:], n
                    continue
                if found is not None:
                    stored[name], spec[name] = list_delta(value, parent.heads.get(name, ()), k, m)
                    continue
            text = "[" + ", ".join(keys) + "]"  # json.dumps of the list, from its items' keys
        elif isinstance(value, str) and len(value) >= STRING_DELTA_MIN_CHARS:
            theirs_string = parent.strings.get(name) if parent is not None else None
            if theirs_string is not None and theirs_string[0] < len(value):
                length, digest = theirs_string
                head = hashlib.sha256(_utf8(value[:length]))
                if head.digest() == digest:
                    head.update(_utf8(value[length:]))  # the whole string's, in one pass
                    strings[name] = (len(value), head.digest())
                    stored[name], spec[name] = value[length:], length
                    continue
            strings[name] = (len(value), _string_hash(value))
        if text is None:
            text = message_key(value)
        if len(text) < BLOB_MIN_BYTES:
            stored[name] = value
            continue
        sha = blob_sha(text)
        stored[name], spec[name], blobs[name] = None, sha, sha
        if parent is None or sha not in parent.blobs.values():
            new_blobs[sha] = text
    return EncodedBody(stored, spec, BodyKeys(lists, strings, blobs, heads, texts), new_blobs)


def body_keys(
    body: Mapping[str, Any],
    spec: Mapping[str, FieldSpec] | None,
    key: Callable[[Any], str] = message_key,
) -> BodyKeys:
    """The memory ``encode_body`` would keep of ``body`` (a full body, read back), given the
    ``spec`` it was stored with: for a writer that rebuilds its memory from the pool. ``key``
    is ``message_key``, or one that returns the same string for an item shared with the
    parent's body (a read-back body shares its parent's item objects), so a trajectory's
    memory holds each item's text once, not once per step."""
    lists = {
        name: [key(item) for item in value]
        for name, value in body.items()
        if isinstance(value, list)
    }
    strings = {
        name: (len(value), _string_hash(value))
        for name, value in body.items()
        if isinstance(value, str) and len(value) >= STRING_DELTA_MIN_CHARS
    }
    blobs = {name: s for name, s in (spec or {}).items() if isinstance(s, str)}
    heads = {name: value[:HEAD_ITEMS] for name, value in body.items() if isinstance(value, list)}
    return BodyKeys(lists, strings, blobs, heads)


def decode_body(
    step_id: str,
    stored: Mapping[str, Any],
    spec: Mapping[str, FieldSpec] | None,
    parent: Mapping[str, Any] | None,
    blobs: Mapping[str, Any],
) -> dict[str, Any]:
    """The full body of step ``step_id`` from its ``stored`` form and ``spec``, its parent's
    full same body (``parent``) and the blob values by sha (``blobs``).

    Raises ``RequestMissingError`` when a blob is not stored or the parent's body is missing,
    of another type or shorter than a delta's base.
    """
    if not spec:
        return dict(stored)
    body: dict[str, Any] = {}
    for name, value in stored.items():
        how = spec.get(name)
        if how is None:
            body[name] = value
        elif isinstance(how, str):
            if how not in blobs:
                raise RequestMissingError(
                    f"step {step_id} stores its {name!r} as blob {how}, which is not stored"
                )
            body[name] = blobs[how]
        else:
            body[name] = _decode_item(step_id, name, value, how, _field(parent, name))
    return body


def decode_list(step_id: str, name: str, stored: Any, spec: list[Any], parent: Any) -> list[Any]:
    """A list stored as ``[k, m, items]`` (module docstring) back whole, given the parent's
    full list ``parent``. Raises ``RequestMissingError`` when the parent's list is missing or
    shorter than m, or the stored one shorter than k."""
    k, m, items = spec
    if not (isinstance(parent, list) and isinstance(stored, list)) or len(parent) < m:
        raise RequestMissingError(
            f"step {step_id} stores {name!r} as {k} new items, then items {k}..{m} of its "
            f"parent's; the parent's is {_described(parent)}"
        )
    if len(stored) < k or len(items) != k:
        raise RequestMissingError(
            f"step {step_id} stores {name!r} with {k} new items but holds {len(stored)}"
        )
    heads = [_decode_item(step_id, name, stored[i], items[i], parent[i]) for i in range(k)]
    return [*heads, *parent[k:m], *stored[k:]]


def _decode_item(step_id: str, name: str, stored: Any, how: Any, parent: Any) -> Any:
    """``stored`` read back by its item spec ``how`` against the parent's ``parent``."""
    if how is None:
        return stored
    if isinstance(how, list):
        return decode_list(step_id, name, stored, how, parent)
    if isinstance(how, dict):
        if not (isinstance(stored, dict) and isinstance(parent, dict)):
            raise RequestMissingError(
                f"step {step_id} stores {name!r} as a delta on its parent's object; the "
                f"parent's is {_described(parent)}"
            )
        return {
            key: _decode_item(step_id, f"{name}.{key}", value, how.get(key), parent.get(key))
            for key, value in stored.items()
        }
    if isinstance(how, int) and not isinstance(how, bool):
        if isinstance(parent, list) and isinstance(stored, list) and len(parent) >= how:
            return [*parent[:how], *stored]
        if isinstance(parent, str) and isinstance(stored, str) and len(parent) >= how:
            return parent[:how] + stored
        raise RequestMissingError(
            f"step {step_id} stores {name!r} as {how} of its parent's then a "
            f"{type(stored).__name__}; the parent's is {_described(parent)}"
        )
    raise RequestMissingError(
        f"step {step_id} stores {name!r} with a delta of unknown form {how!r}: expected an int, "
        "a list [k, m, items], an object or null"
    )


def _field(parent: Mapping[str, Any] | None, name: str) -> Any:
    return None if parent is None else parent.get(name)


def _described(value: Any) -> str:
    if isinstance(value, list | str):
        return f"a {type(value).__name__} of {len(value)}"
    return "missing" if value is None else f"a {type(value).__name__}"


def based_on_parent(spec: Mapping[str, Mapping[str, FieldSpec]] | None) -> bool:
    """Whether a step's ``body_deltas`` has a field stored as a delta on its parent's."""
    return bool(spec) and any(
        isinstance(how, int | list) for fields in (spec or {}).values() for how in fields.values()
    )


def blob_shas(spec: Mapping[str, Mapping[str, FieldSpec]] | None) -> set[str]:
    """The ``json_blobs`` rows a step's ``body_deltas`` refers to."""
    return {
        how for fields in (spec or {}).values() for how in fields.values() if isinstance(how, str)
    }


def load_blob(text: str) -> Any:
    """A ``json_blobs.body`` back as its JSON value."""
    return json.loads(text)
