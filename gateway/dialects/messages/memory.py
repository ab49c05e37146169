"""The Messages → chat translation of recent conversations, kept so a call that re-sends its
history translates only the messages it added.

Owns: ``TranslationMemory``, the chat messages recent calls' Messages ``messages`` became
(``Kept``: the client's ``messages`` as orjson text ``[N]``, and the chat messages they were
translated into, the system prompt excluded), bounded in bytes (LRU), and ``Kept.shared_with``,
how many leading messages of a new body are proved to be a kept entry's. Never: trusts an
entry it has not proved identical (any changed byte of an earlier message: the body is
translated whole, as if nothing were kept), and never reads which trajectory a call belongs
to (a dialect does not know; the text is the key).

An agent re-sends its whole history: turn ``T`` of a Claude Code session sends ``T`` earlier
exchanges and one new, and translating each message again costs ``O(T)`` Python work per call
(0.48 ms at turn 200 of the horizon bench, 0.08 ms at turn 10). A Messages message becomes its
chat messages alone (``request._message`` reads nothing else; its position names a field in an
error only, and a kept message raised none), so proved-equal messages have equal translations.

The proof is ``gateway.proxy.continuation.walk``'s: ``M`` the body's ``messages`` written once
by orjson (~0.04 ms at turn 200). When a kept text ``W`` (``n`` messages) less its closing ``]``
is a prefix of ``M``'s text, followed by ``,``, then ``M[:n]`` are the kept messages as JSON
text one by one (a JSON array's text splits into its items one way only), and equal orjson
text is equal JSON for what a parsed body holds (finite numbers; a value orjson cannot write,
an integer past 64 bits or a lone surrogate, makes the call translate whole and be kept
nowhere).

Lookup: entries are grouped by the first ``KEY_BYTES`` bytes of their text (a session's task,
which every call of it re-sends; a shorter history, cheap to translate, is not kept); a group
keeps its ``ENTRIES_PER_KEY`` latest entries, so the
rollouts of one task (a GRPO group, the same first message) each find their own last call. The
kept chat messages are shared by the calls that reuse them: nothing downstream changes a
message of an upstream body in place (the pool stores it, the engine reads it).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.dialects.wire import ChatMessage

KEY_BYTES = 512  # the text's head that groups entries: the task's first message, usually
ENTRIES_PER_KEY = 8  # rollouts of one task kept side by side
MEMORY_BYTES = 64 * 2**20  # all entries, counted as twice their text (the chat holds the same)


@dataclass(frozen=True, eq=False)  # compared by identity: never history against history
class Kept:
    """One body's ``messages`` as orjson wrote them (``text``) and the chat messages they
    became (``chat``, without the system message; message ``i`` of the body gave
    ``chat[ends[i - 1]:ends[i]]``: a user turn with tool results becomes several)."""

    text: bytes
    chat: tuple[ChatMessage, ...]
    ends: tuple[int, ...]  # [N]: after message i, how many chat messages it and those before gave

    @property
    def size_bytes(self) -> int:
        return 2 * len(self.text)

    def shared_with(self, text: bytes) -> int:
        """How many leading messages of a body whose ``messages`` text is ``text`` are this
        entry's, as the module docstring proves: all of them, or 0 (also when ``text`` adds
        none: a body equal to this one is no continuation of it)."""
        kept = len(self.text) - 1  # without the closing "]"
        if len(text) <= kept or text[kept] != 0x2C or text[:kept] != self.text[:kept]:  # ","
            return 0
        return len(self.ends)


def messages_text(messages: Any) -> bytes | None:
    """``messages`` as orjson writes them, or None when it cannot (the call is translated
    whole and kept nowhere)."""
    try:
        return orjson.dumps(messages)
    except orjson.JSONEncodeError:
        return None


class TranslationMemory:
    """Recent ``Kept`` entries, at most ``max_bytes`` in all (``Kept.size_bytes``, least
    recently used group dropped first)."""

    def __init__(self, max_bytes: int = MEMORY_BYTES) -> None:
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self._groups: OrderedDict[bytes, list[Kept]] = OrderedDict()

    def longest(self, text: bytes) -> tuple[Kept | None, int]:
        """The kept entry sharing the most leading messages with a body whose ``messages``
        text is ``text``, and how many (``None, 0`` when none does)."""
        group = self._groups.get(text[:KEY_BYTES])
        best: Kept | None = None
        shared = 0
        for kept in group or ():
            n = kept.shared_with(text)
            if n > shared:
                best, shared = kept, n
        if group is not None:
            self._groups.move_to_end(text[:KEY_BYTES])
        return best, shared

    def keep(self, kept: Kept, replaces: Kept | None) -> None:
        """Keep ``kept`` as its group's latest, in place of ``replaces`` (the entry it
        extends, now outdated) when given and of an entry of the same text; an entry larger
        than ``max_bytes``, or whose text is no longer than ``KEY_BYTES``, is not kept."""
        if kept.size_bytes > self.max_bytes or len(kept.text) <= KEY_BYTES:
            return  # a text no longer than its key: a continuation's head would differ
        key = kept.text[:KEY_BYTES]
        group = self._groups.setdefault(key, [])
        self._groups.move_to_end(key)
        # the entry it extends, and one of the same text (a retry)
        outdated = [e for e in group if e is replaces or e.text == kept.text]
        if outdated:
            group[:] = [e for e in group if not any(e is o for o in outdated)]
            self.held_bytes -= sum(e.size_bytes for e in outdated)
        group.append(kept)
        self.held_bytes += kept.size_bytes
        if len(group) > ENTRIES_PER_KEY:
            self.held_bytes -= group.pop(0).size_bytes
        while self.held_bytes > self.max_bytes:
            _, dropped = self._groups.popitem(last=False)
            self.held_bytes -= sum(entry.size_bytes for entry in dropped)
