"""The last walk over each trajectory's history, kept so the next call walks only what it adds.

Owns: ``WalkMemory``, per trajectory the walk of the last exact-channel call (``Walk``: its
upstream chat messages as JSON text, their canonical messages and ``history.HistoryKeys``),
bounded in bytes over all trajectories (LRU), and ``Walk.shared_with``, how many leading
messages of a new call are proved to be that walk's. Never: trusts a walk it has not proved
identical (a client that rewrites any earlier message, or changes anything the template
renders, gets the whole walk, as if nothing were kept), and never holds what it cannot count.

An agent re-sends its whole history on every call: turn ``T`` of a session sends ``T`` earlier
exchanges and one new. Making each message's canonical form and its key again on every call
costs ``O(T)`` Python work per call (``O(T^2)`` per session: DESIGN.md invariant 10); with the
last walk kept, a call makes them for its new messages only.

The proof: ``M`` the upstream body's ``messages``, serialised once by orjson (C, ~0.1 ms per
100 KB, about the cost of reading it). When the kept walk's text ``W`` (``n`` messages) less
its closing ``]`` is a prefix of ``M``'s text, followed by ``,``, then ``M[:n]`` are the kept
messages as JSON text, one by one: a JSON array's text splits into its items one way only.
Equal orjson text is equal JSON for what a parsed body holds (a body's numbers are finite, the
parse refuses NaN and infinities; a value orjson cannot write, an integer past 64 bits or a
lone surrogate, makes the call walk whole and be kept nowhere). And the same messages under the
same render key (``history.render_key``, compared as text) give the same canonical messages
(``canonical_of_chat`` reads each message alone) and the same keys.

Bytes: an entry counts its text twice (the text kept, and its canonical messages, which hold
the same strings); ``WalkMemory.max_bytes`` (``TRAJGATE_CONTINUATION_HISTORY_MEMORY_MB``)
bounds the sum, the least recently used trajectory going first; a history larger than the
whole bound is not kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from datapool.steps.canonical import CanonicalCall, Message
from gateway.proxy.continuation.history import HistoryKeys, history_keys


@dataclass(frozen=True)
class Walk:
    """One call's walk: ``text`` its upstream messages as orjson wrote them ``[N]``,
    ``render_key`` its ``history.render_key``, ``dialect`` the name of the dialect whose
    ``canonical`` made ``messages``, its canonical messages ``[N]``, and ``keys`` their
    ``HistoryKeys``."""

    text: bytes
    render_key: str
    dialect: str
    messages: tuple[Message, ...]
    keys: HistoryKeys

    @property
    def size_bytes(self) -> int:
        return 2 * len(self.text)

    def shared_with(self, text: bytes, render_key: str, dialect: str) -> int:
        """How many leading messages of a call of ``dialect`` whose messages' text is
        ``text`` and render key ``render_key`` are this walk's, proved as the module docstring
        says: all of this walk's messages, or 0."""
        kept = len(self.text) - 1  # without the closing "]"
        if (
            render_key != self.render_key
            or dialect != self.dialect
            or len(text) <= kept
            or not self.messages
            or text[kept] != 0x2C  # ","
            or text[:kept] != self.text[:kept]
        ):
            return 0
        return len(self.messages)


def messages_text(messages: Any) -> bytes | None:
    """``messages`` as orjson writes them (no spaces), or None when orjson cannot write them
    (an integer past 64 bits, a lone surrogate: such a call is walked whole and kept nowhere)."""
    try:
        return orjson.dumps(messages)
    except orjson.JSONEncodeError:
        return None


class WalkMemory:
    """The last ``Walk`` of each trajectory, at most ``max_bytes`` in all (``Walk.size_bytes``,
    least recently used trajectory dropped first)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self._walks: OrderedDict[str, Walk] = OrderedDict()

    def last(self, trajectory_id: str) -> Walk | None:
        walk = self._walks.get(trajectory_id)
        if walk is not None:
            self._walks.move_to_end(trajectory_id)
        return walk

    def keep(self, trajectory_id: str, walk: Walk) -> None:
        """Keep ``walk`` as the trajectory's last (replacing the one before); a walk larger
        than ``max_bytes`` only drops the one before."""
        self.forget(trajectory_id)
        if walk.size_bytes > self.max_bytes:
            return
        self._walks[trajectory_id] = walk
        self.held_bytes += walk.size_bytes
        while self.held_bytes > self.max_bytes:
            _, dropped = self._walks.popitem(last=False)
            self.held_bytes -= dropped.size_bytes

    def forget(self, trajectory_id: str) -> None:
        walk = self._walks.pop(trajectory_id, None)
        if walk is not None:
            self.held_bytes -= walk.size_bytes


def walk_history(
    memory: WalkMemory,
    trajectory_id: str,
    upstream_messages: Any,
    body_render_key: str,
    dialect: str,
    canonical_of: Callable[[tuple[Message, ...]], CanonicalCall],
) -> tuple[CanonicalCall, HistoryKeys | None]:
    """The call's canonical record and the ``HistoryKeys`` of its messages (None without a
    conversation), made for the messages the trajectory's last walk does not prove the same
    (all of them when none is kept); the call's walk is then kept as the trajectory's last.
    ``upstream_messages``: the upstream chat body's ``messages``; ``canonical_of(known)``:
    the dialect's record of the body given the canonical messages already made
    (``Dialect.canonical_continuing``)."""
    whole = isinstance(upstream_messages, list)
    text = messages_text(upstream_messages) if whole else None
    last = memory.last(trajectory_id)
    shared = 0
    if last is not None and text is not None:
        shared = last.shared_with(text, body_render_key, dialect)
    canonical = canonical_of(last.messages if last is not None and shared else ())
    messages = canonical.messages
    if messages is None:
        return canonical, None
    earlier = last.keys if last is not None and shared else None
    keys = history_keys(body_render_key, messages, earlier)
    # Kept only where message k of the record is message k of the body (every one an object).
    if text is not None and len(messages) == len(upstream_messages):
        memory.keep(trajectory_id, Walk(text, body_render_key, dialect, messages, keys))
    return canonical, keys
