"""What each step added to its trajectory's conversation: the trajectory view in O(steps).

Owns: turning a trajectory's steps, read back whole (``datapool.steps.messages.expand_requests``),
into what each one added, and a step's full request and canonical record on demand
(``step_history``). Never: writes; never reads the pool's storage layout (the deltas here are
computed from the full records, so they hold whatever the store keeps).

An agent re-sends its whole history on every call, so a view that ships each step's messages
grows with the square of the turns (40 MB for a 200-turn coding session). Per step, with ``C``
its canonical messages and ``H_p = C_p + [R_p]`` its parent step's canonical messages and
response (``R_p`` left out when the parent has none; ``H_p`` empty without a parent):

- ``messages_base`` = b, the longest common prefix of ``C`` and ``H_p``, message by message as
  JSON text (``message_key``), so ``C == H_p[:b] + messages_added`` exactly; a history the
  agent rewrote (edited, truncated, thinking dropped) only stops the prefix earlier;
- ``messages_added`` = ``C[b:]`` (None, like ``messages_base``, for a call without messages:
  a completions ``prompt``, or a step recorded without a canonical record);
- ``messages_replaced`` = k, 0 but for a conversation whose first messages changed while the
  rest repeats the parent's (Claude Code's system message carries a billing line with a ``cch``
  that changes on every call): no message is then a common prefix, and rather than ship the
  whole history, b counts the messages of ``H_p`` the step covers, ``messages_added`` =
  ``C[b:]`` (what the step appended) and ``head_edits`` gives each of the first k messages as
  edits of a text in the view's ``head_texts`` (below): ``C == heads + H_p[k:b] +
  messages_added`` (k at most ``datapool.steps.bodies.HEAD_ITEMS``);
- ``head_edits``: per replaced message, ``{"text": key, "edits": [[start, end, insert], ...]}``:
  the message is ``json.loads(apply_edits(head_texts[key], edits))``
  (``datapool.queries.edits``), its exact JSON text; ``[]`` when k is 0. ``head_texts`` maps
  each key (``h0``, ``h1``, ... in order of first use) to a message's JSON text
  (``message_key``). A replaced message is edits of the text its predecessor at the same place
  in the parent's conversation was rebuilt from (the predecessor's own text the first time, so
  the first step's system message is shipped twice: in its ``messages_added`` and as a key),
  so a 6 KB system message whose ``cch`` changes ships as one ~5-character edit per step, never
  again whole; its text becomes a new key only when the edits would weigh more than
  a quarter of it (``REBASE_FRACTION``: the message really changed). Edits name no older key, so
  a message is rebuilt from one text, not along the chain of steps;
- ``tools_key``: the tool list offered, as a key of the view's ``tools`` table, where each
  distinct list appears once (``t0``, ``t1``, ... in order of first use); None when no tool
  was offered. Lists are told apart with Python's ``==`` (a C-speed deep comparison; the JSON
  text of a 28 KB list takes 0.4 ms to write, 80 ms over 200 steps): a list equal as a value
  to an earlier one (keys in another order, ``1`` for ``1.0``) is shown in the earlier one's
  form; ``step_history`` has each step's own, exactly.

Cost: the pool's reconstruction gives a step the very message objects of its parent's list for
the prefix it repeats, so the prefix compares by identity and JSON text is compared only where
the objects differ (the parent's response, and the first message that differs): work
proportional to what each step added, plus, per replaced message, its JSON text and one
comparison with its base text (about 30 µs for a 6 KB message changed in one place).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from datapool.db import Sessions
from datapool.models import Step
from datapool.queries.edits import edits_cost, text_edits
from datapool.steps.bodies import HEAD_ITEMS
from datapool.steps.messages import canonical_response_key, expand_requests, message_key

# A replaced message becomes a new ``head_texts`` entry when its edits would weigh more than this
# fraction of its text: it changed beyond a line, and its successors are better edits of it.
REBASE_FRACTION = 0.25


@dataclass
class HeadTexts:
    """The view's ``head_texts`` as it is built (``texts``: key to JSON text) and, per step
    seen, the key each of its first ``HEAD_ITEMS`` messages is rebuilt from (None: the message
    was shipped whole, in its step's or an ancestor's ``messages_added``)."""

    texts: dict[str, str] = field(default_factory=dict)
    bases: dict[str, list[str | None]] = field(default_factory=dict)

    def edits(self, message: Any, base: str | None, predecessor: Any) -> dict[str, Any]:
        """``{"text": key, "edits": [...]}`` for a replaced ``message`` whose predecessor (the
        message at its place in the parent's conversation) is rebuilt from key ``base``, or
        shipped whole (None): edits of ``base``'s text, or of the predecessor's own text, when
        they weigh at most ``REBASE_FRACTION`` of the message; else the message's own text as
        a new key. (A predecessor rebuilt from ``base`` is close to it: a message too far from
        ``base`` is too far from the predecessor as well.)"""
        text = message_key(message)
        known = self.texts[base] if base is not None else message_key(predecessor)
        edits = text_edits(known, text)
        if edits_cost(edits) > REBASE_FRACTION * len(text):
            return {"text": self._add(text), "edits": []}
        return {"text": base if base is not None else self._add(known), "edits": edits}

    def _add(self, text: str) -> str:
        key = f"h{len(self.texts)}"
        self.texts[key] = text
        return key


def common_prefix(messages: Sequence[Any], head: Sequence[Any]) -> int:
    """How many leading ``messages`` are the same JSON as ``head``'s (identical objects are)."""
    same = list(map(operator.is_, messages, head))  # identity in C: no Python loop per message
    base = same.index(False) if False in same else len(same)
    for message, known in zip(messages[base:], head[base:], strict=False):
        if message is not known and message_key(message) != message_key(known):
            break
        base += 1
    return base


def conversation_deltas(
    rows: Sequence[Step],
) -> tuple[dict[str, dict[str, Any]], dict[str, list[Any]], dict[str, str]]:
    """``(per step id: {messages_base, messages_added, messages_replaced, head_edits,
    tools_key, sampling, prompt}, tools, head_texts)``
    for expanded ``rows`` (``expand_requests``) of one trajectory, parents before children
    (call order). ``tools`` maps each ``tools_key`` to its list, ``head_texts`` each key of a
    ``head_edits`` entry to its JSON text (module docstring)."""
    by_id = {row.id: row for row in rows}
    heads: dict[str, list[Any]] = {}  # H of each step seen, built once when a child needs it
    deltas: dict[str, dict[str, Any]] = {}
    tools: dict[str, list[Any]] = {}
    texts = HeadTexts()
    for row in rows:
        record = row.canonical or {}
        messages = record.get("messages")
        base, added, replaced = None, None, 0
        edits: list[dict[str, Any]] = []
        bases: list[str | None] = [None] * HEAD_ITEMS
        if isinstance(messages, list):
            head = _head(by_id.get(row.parent_step_id or ""), heads)
            # The parent's messages keep their bases where this step repeats them.
            inherited = texts.bases.get(row.parent_step_id or "", bases)
            base = common_prefix(messages, head)
            added = messages[base:]
            if base == 0 and head:
                replaced, base = _head_replaced(messages, head)
                added = messages[base:] if replaced else added
                for i in range(replaced):
                    edits.append(texts.edits(messages[i], inherited[i], head[i]))
            bases = [
                edits[i]["text"] if i < replaced else inherited[i] if i < base else None
                for i in range(HEAD_ITEMS)
            ]
        texts.bases[row.id] = bases
        key = None
        offered = record.get("tools")
        if offered:
            # Most recent first: an agent's list rarely changes, so this is one comparison.
            key = next((k for k in reversed(tools) if tools[k] == offered), None)
            if key is None:
                key = f"t{len(tools)}"
                tools[key] = offered
        deltas[row.id] = {
            "messages_base": base,
            "messages_added": added,
            "messages_replaced": replaced,
            "head_edits": edits,
            "tools_key": key,
            "sampling": record.get("sampling"),
            "prompt": record.get("prompt"),
        }
    return deltas, tools, texts.texts


def _head_replaced(messages: Sequence[Any], head: Sequence[Any]) -> tuple[int, int]:
    """``(k, b)``: ``messages[k:b]`` are ``head[k:b]`` for the first k (1 to ``HEAD_ITEMS``)
    that starts such a run; ``(0, 0)`` when none does."""
    for k in range(1, min(HEAD_ITEMS, len(messages) - 1, len(head) - 1) + 1):
        run = common_prefix(messages[k:], head[k:])
        if run:
            return k, k + run
    return 0, 0


def _head(parent: Step | None, heads: dict[str, list[Any]]) -> list[Any]:
    """``H_p`` of ``parent`` (its canonical messages, then its response as a canonical message
    when it has one); empty for no parent or one without messages."""
    if parent is None:
        return []
    if parent.id not in heads:
        messages = (parent.canonical or {}).get("messages")
        head = list(messages) if isinstance(messages, list) else []
        if isinstance(messages, list) and parent.response_message is not None:
            head.append(canonical_response_key(parent.response_message))
        heads[parent.id] = head
    return heads[parent.id]


def step_history(sessions: Sessions, step_id: str) -> dict[str, Any] | None:
    """One step's full conversation on demand: ``request`` (the client's body exactly as sent)
    and ``canonical`` (its canonical record, every message and tool); None for an unknown id.
    Reads the step's trajectory's stored requests once (``expand_requests``)."""
    with sessions() as session:
        return _history(session, step_id)


def _history(session: Session, step_id: str) -> dict[str, Any] | None:
    row = session.get(Step, step_id)
    if row is None:
        return None
    expand_requests(session, [row])
    return {
        "step_id": row.id,
        "trajectory_id": row.trajectory_id,
        "request": row.request,
        "canonical": row.canonical,
    }
