"""The chat messages recent calls' client histories became, kept so a call that re-sends its
history translates only the items it added. Used by ``gateway.dialects.messages`` (a body's
``messages``) and ``gateway.dialects.responses`` (a body's ``input`` list).

Owns: ``TranslationMemory``, recent translations (``Kept``: a body's history items as orjson
text ``[N]``, the chat messages they were translated into, the system message excluded, and
what the translation carried past the last item, ``pending``), bounded in bytes (LRU), and
``Kept.shared_with``, how many leading items of a new body are proved to be a kept entry's.
Never: translates an item (each dialect folds its own), trusts an entry it has not proved
identical (any changed byte of an earlier item: the body is translated whole, as if nothing
were kept), and never reads which trajectory a call belongs to (a dialect does not know; the
text is the key).

An agent re-sends its whole history: turn ``T`` of a Claude Code or Codex session sends ``T``
earlier exchanges and one new, and translating each item again costs ``O(T)`` Python work per
call (Messages: 0.48 ms at turn 200 of the horizon bench, 0.08 ms at turn 10). Each dialect's
translation of its items is a left fold: item ``i`` is read with the chat messages of the
items before it and the state the fold carries (``pending``; Responses: the reasoning text no
message took yet; Messages: none), and its position names a field in an error only (a kept
item raised none). So the translation of a body whose first ``n`` items are a kept entry's
resumes at item ``n`` from the entry's ``chat`` and ``pending``, and gives what a translation
from scratch gives, as long as nothing changes a kept message in place: an entry's messages
are shared by the calls that reuse it and by the upstream bodies they went into (nothing
downstream changes a message of an upstream body; a fold that would extend its last message,
Responses' ``function_call``, extends a copy).

The proof is ``gateway.proxy.continuation.walk``'s: ``M`` the body's items written once by
orjson (~0.04 ms at turn 200). When a kept text ``W`` (``n`` items) less its closing ``]`` is
a prefix of ``M``'s text, followed by ``,``, then ``M[:n]`` are the kept items as JSON text
one by one (a JSON array's text splits into its items one way only), and equal orjson text is
equal JSON for what a parsed body holds (finite numbers; a value orjson cannot write, an
integer past 64 bits or a lone surrogate, makes the call translate whole and be kept nowhere).

Lookup: entries are grouped by the first ``KEY_BYTES`` bytes of their text (a session's task,
which every call of it re-sends; a shorter history, cheap to translate, is not kept); a group
keeps its ``ENTRIES_PER_KEY`` latest entries, so the rollouts of one task (a GRPO group, the
same first message) each find their own last call. Every session of one agent may share a
group (Codex's first 512 bytes are its fixed instructions, Claude Code's first message a fixed
system reminder), so a group holds as many entries as sessions run at once against one
gateway process, up to 64: a lookup compares the body's text with each entry of its group, a
``memcmp`` that stops where the two differ (a sibling rollout's text differs from the first
sampled answer on), so 64 entries cost a few microseconds more than one. Entries leave in
least-recently-used order one by one (never a group at once: a memory full of one agent's
sessions would empty itself). Past 64 concurrent sessions sharing their head, or past the
bytes, sessions continued in turn each push out the entry the next one needs (LRU under a
cyclic load), and they all translate whole: correct, only as slow as without the memory.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import orjson

from gateway.dialects.wire import ChatMessage

KEY_BYTES = 512  # the text's head that groups entries: the task's first message, usually
ENTRIES_PER_KEY = 64  # sessions sharing a head (one agent's, one task's rollouts) side by side
# All entries, each counted as four times its text: the text, and its chat messages as Python
# objects (16 Codex-shaped sessions of 200 turns: 2.59 MB of text, 9.78 MB under tracemalloc,
# 3.8 times; counted as twice the text until 2026-12-07, the bound held about twice its figure).
MEMORY_BYTES = 64 * 2**20

# What a dialect's fold carries from one item to the next besides the chat messages so far.
Pending = TypeVar("Pending")


@dataclass(frozen=True, eq=False)  # compared by identity: never history against history
class Kept(Generic[Pending]):
    """One body's ``items`` history items as orjson wrote them (``text``), the chat messages
    the fold held after the last of them (``chat``, without the system message and before what
    a translation adds once its items end), and what it carried past the last item
    (``pending``)."""

    text: bytes
    chat: tuple[ChatMessage, ...]
    items: int
    pending: Pending

    @property
    def size_bytes(self) -> int:
        """What the entry holds, estimated (``MEMORY_BYTES``'s comment): four times its text."""
        return 4 * len(self.text)

    def shared_with(self, text: bytes) -> int:
        """How many leading items of a body whose items' text is ``text`` are this entry's, as
        the module docstring proves: all of them, or 0 (also when ``text`` adds none: a body
        equal to this one is no continuation of it)."""
        kept = len(self.text) - 1  # without the closing "]"
        if len(text) <= kept or text[kept] != 0x2C:  # ","
            return 0
        # a memcmp of the two buffers, no copy of either (a slice of bytes copies it)
        return self.items if text.startswith(memoryview(self.text)[:kept]) else 0


def items_text(items: Any) -> bytes | None:
    """``items`` as orjson writes them, or None when it cannot (the call is translated whole
    and kept nowhere)."""
    try:
        return orjson.dumps(items)
    except orjson.JSONEncodeError:
        return None


class TranslationMemory(Generic[Pending]):
    """Recent ``Kept`` entries of one dialect, at most ``max_bytes`` in all (``Kept.size_bytes``;
    the least recently used entry leaves first) and ``ENTRIES_PER_KEY`` a group."""

    def __init__(self, max_bytes: int = MEMORY_BYTES) -> None:
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self._groups: dict[bytes, list[Kept[Pending]]] = {}
        # every entry by identity, least recently used first
        self._recent: OrderedDict[int, Kept[Pending]] = OrderedDict()

    def longest(self, text: bytes) -> tuple[Kept[Pending] | None, int]:
        """The kept entry sharing the most leading items with a body whose items' text is
        ``text``, and how many (``None, 0`` when none does)."""
        best: Kept[Pending] | None = None
        shared = 0
        for kept in self._groups.get(text[:KEY_BYTES], ()):
            n = kept.shared_with(text)
            if n > shared:
                best, shared = kept, n
        if best is not None:
            self._recent.move_to_end(id(best))
        return best, shared

    def keep(self, kept: Kept[Pending], replaces: Kept[Pending] | None) -> None:
        """Keep ``kept`` as its group's latest, in place of ``replaces`` (the entry it
        extends, now outdated) when given and of an entry of the same text; an entry larger
        than ``max_bytes``, or whose text is no longer than ``KEY_BYTES``, is not kept."""
        if kept.size_bytes > self.max_bytes or len(kept.text) <= KEY_BYTES:
            return  # a text no longer than its key: a continuation's head would differ
        key = kept.text[:KEY_BYTES]
        # the entry it extends, and one of the same text (a retry)
        for entry in [e for e in self._groups.get(key, ()) if e is replaces or e.text == kept.text]:
            self._drop(entry)
        group = self._groups.setdefault(key, [])  # after the drops, which may empty it
        group.append(kept)
        self._recent[id(kept)] = kept
        self.held_bytes += kept.size_bytes
        if len(group) > ENTRIES_PER_KEY:
            self._drop(group[0])
        while self.held_bytes > self.max_bytes:
            self._drop(next(iter(self._recent.values())))

    def _drop(self, entry: Kept[Pending]) -> None:
        key = entry.text[:KEY_BYTES]
        group = self._groups[key]
        group[:] = [e for e in group if e is not entry]
        if not group:
            del self._groups[key]
        del self._recent[id(entry)]
        self.held_bytes -= entry.size_bytes
