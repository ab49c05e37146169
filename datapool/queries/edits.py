"""A text as edits of another: how the trajectory view ships a message that changed a little.

Owns: the edits that turn one string into another (``text_edits``) and their application
(``apply_edits``, the rule the inspector's page follows too). Never: knows what the strings
mean; the caller passes JSON text (``datapool.steps.bodies.message_key``, ASCII only, so that
an offset counts the same characters in Python and in JavaScript, whose strings index UTF-16
code units).

Edits are ``[[start, end, insert], ...]`` against ``base``, sorted and not overlapping:
``base[start:end]`` is replaced by ``insert``; ``[]`` when the texts are equal. A text that
differs in one place (Claude Code's system message, whose attribution line carries a ``cch``
that changes on every call) is one edit, found by the texts' common prefix and suffix; one
that differs in several places is diffed chunk by chunk (chunks end after an escaped newline
or after ``. ``, ``, ``, ``; ``), each changed run then trimmed to the characters that differ.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from itertools import accumulate

Edit = list[int | str]  # [start, end, insert]

# A changed middle up to this many characters is shipped as one edit without a chunk diff.
ONE_EDIT_MAX_CHARS = 64
# The bytes one edit costs besides its inserted text (``[123, 130, ""], `` in the view's JSON).
EDIT_OVERHEAD_BYTES = 16

_CHUNK_END = re.compile(r"(?<=\\n)|(?<=[.,;] )")


def text_edits(base: str, text: str) -> list[Edit]:
    """The edits (module docstring) that turn ``base`` into ``text``: ``apply_edits(base,
    text_edits(base, text)) == text`` for any two strings. Costs O(n) C-speed comparisons for
    a text changed in one place; a chunk diff (``difflib``, chunks of a sentence or a line)
    otherwise, kept only when it ships fewer characters than the one edit spanning every
    change."""
    head = _common_prefix(base, text, 0)
    tail = _common_suffix(base, text, min(len(base), len(text)) - head)
    if head == len(base) == len(text):
        return []
    old, new = base[head : len(base) - tail], text[head : len(text) - tail]
    spanning: list[Edit] = [[head, len(base) - tail, new]]
    if len(new) <= ONE_EDIT_MAX_CHARS or not old:
        return spanning
    chunked = _chunk_edits(old, new, head)
    return chunked if edits_cost(chunked) < edits_cost(spanning) else spanning


def apply_edits(base: str, edits: Sequence[Sequence[int | str]]) -> str:
    """``base`` with each ``[start, end, insert]`` of ``edits`` (sorted, not overlapping)
    applied. Raises ``ValueError`` for an edit out of order or past the end of ``base``."""
    parts: list[str] = []
    at = 0
    for start, end, insert in edits:
        if not (isinstance(start, int) and isinstance(end, int) and isinstance(insert, str)):
            raise ValueError(f"an edit is [start, end, insert], got {[start, end, insert]!r}")
        if not at <= start <= end <= len(base):
            raise ValueError(f"edit [{start}, {end}] out of order or past {len(base)} characters")
        parts += [base[at:start], insert]
        at = end
    parts.append(base[at:])
    return "".join(parts)


def edits_cost(edits: Sequence[Sequence[int | str]]) -> int:
    """About how many bytes ``edits`` weigh in the view: each inserted text plus
    ``EDIT_OVERHEAD_BYTES`` an edit."""
    return sum(len(str(insert)) + EDIT_OVERHEAD_BYTES for _, _, insert in edits)


def _chunk_edits(old: str, new: str, offset: int) -> list[Edit]:
    """Edits of ``old`` into ``new`` from a diff of their chunks, positions shifted by
    ``offset`` (where ``old`` starts in the base)."""
    old_chunks, new_chunks = _CHUNK_END.split(old), _CHUNK_END.split(new)
    old_at = [0, *accumulate(map(len, old_chunks))]
    new_at = [0, *accumulate(map(len, new_chunks))]
    matcher = difflib.SequenceMatcher(None, old_chunks, new_chunks, autojunk=False)
    edits: list[Edit] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        removed, inserted = old[old_at[i1] : old_at[i2]], new[new_at[j1] : new_at[j2]]
        head = _common_prefix(removed, inserted, 0)
        tail = _common_suffix(removed, inserted, min(len(removed), len(inserted)) - head)
        start = offset + old_at[i1] + head
        edits.append([start, offset + old_at[i2] - tail, inserted[head : len(inserted) - tail]])
    return edits


def _common_prefix(a: str, b: str, known: int) -> int:
    """How many leading characters ``a`` and ``b`` share, given that the first ``known`` are
    shared: a binary search over slice comparisons (C speed, no loop per character)."""
    low, high = known, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _common_suffix(a: str, b: str, limit: int) -> int:
    """How many trailing characters ``a`` and ``b`` share, at most ``limit``."""
    low, high = 0, max(limit, 0)
    while low < high:
        middle = (low + high + 1) // 2
        if a[len(a) - middle : len(a) - low] == b[len(b) - middle : len(b) - low]:
            low = middle
        else:
            high = middle - 1
    return low
