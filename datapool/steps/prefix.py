"""Token-sequence lineage: does a step's prompt extend an earlier step's prompt + response?

Owns: the pure comparison of token ID sequences (case C01: a break is recorded, never repaired).
Never: tokenizes or decodes anything.

With ``P`` the new prompt IDs and ``S_k = P_k + R_k`` an earlier step's prompt and response IDs,
step k *extends* into the new one when ``P[:len(S_k)] == S_k``. The parent is the earlier step
with the longest such ``S_k`` (so retries and forks form a tree); when none extends, the parent is
the latest step and the first offset where ``P`` and its ``S`` differ is the divergence offset.

Two refinements keep a break from hiding or being invented (``tests/test_prefix.py``,
``tests/test_lineage_breaks.py``):

- A *hidden break*: ``P`` extends an earlier step but none of the latest call's steps (turn 1's
  reasoning, stripped from history by the template, leaves turn 2 extending turn 0). The parent
  is still the earlier step it extends, and the lineage also says which latest step it diverges
  from and where (``diverges_from``, ``divergence_offset``): a break, flagged like any other.
- A *fork at the same prompt*: ``P`` equals an earlier step's prompt (an identical re-send, a
  retry, another sample). It is that step's sibling (same parent, same lineage, ``fork_of``),
  never a break of its own.

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from datapool.steps.canonical import Message, as_rendered, first_turns


def first_divergence(sequence: Sequence[int], prompt: Sequence[int]) -> int | None:
    """Index of the first position where ``prompt`` stops continuing ``sequence``.

    Returns None when ``prompt[:len(sequence)] == sequence`` (prompt extends sequence), else the
    first index i with ``sequence[i] != prompt[i]`` or ``i == len(prompt)`` (prompt too short).
    """
    for i, token in enumerate(sequence):
        if i >= len(prompt) or prompt[i] != token:
            return i
    return None


@dataclass(frozen=True)
class Lineage:
    """Where a new step hangs: ``parent_step_id`` (None: a root), whether its prompt extends
    the parent's ``S`` (None: not compared), and at a prefix break the first offset where the
    prompt leaves the compared step's ``S``: the parent's, or at a hidden break (the prompt
    extends the parent but not the latest step) that of ``diverges_from``, the latest step.
    ``fork_of``: the earlier step with the very same prompt whose lineage this one repeats (a
    re-send or retry: never a break of its own)."""

    parent_step_id: str | None
    extends_parent: bool | None
    divergence_offset: int | None
    diverges_from: str | None = None
    fork_of: str | None = None

    @property
    def is_break(self) -> bool:
        """Whether this step starts a prefix break of its own (flag ``prefix_break``)."""
        return self.fork_of is None and (
            self.extends_parent is False or self.diverges_from is not None
        )


@dataclass(frozen=True)
class Candidate:
    """An earlier step: its id, its full sequence ``prompt_ids + response_ids``, how many of
    those are its prompt (None: unknown, never a fork's twin), the call it answered (choices of
    one call share it; None: a call of its own), its own lineage, and the side call whose tree
    it is in (``tree``: the root's step id; None: the trajectory's main tree)."""

    step_id: str
    sequence: Sequence[int]
    prompt_length: int | None = None
    call: int | None = None
    lineage: Lineage | None = None
    tree: str | None = None


def choose_parent(candidates: Sequence[Candidate], prompt: Sequence[int]) -> Lineage:
    """Pick the parent of a new step with ``prompt`` among ``candidates`` (oldest first).

    No candidates: a root step (parent None, extends None). Otherwise, with "the latest
    candidate" the latest of the longest extending candidate's tree, or of the main tree when
    none extends (a side call's steps never make a break of the main chain), in order:

    1. the longest extending candidate, when the prompt extends one of the latest call's
       candidates or of the candidates with the latest's very prompt (the usual next turn, or
       the next turn after a choice of ``n`` or after a re-send) → ``Lineage(k, True, None)``;
    2. the latest candidate whose prompt is exactly ``prompt`` → its lineage, ``fork_of`` it;
    3. the longest extending candidate, diverging from the latest candidate → a hidden break
       ``Lineage(k, True, offset, diverges_from=latest)``;
    4. none extends → ``Lineage(latest, False, offset)`` (the parent is the step compared).
    """
    if not candidates:
        return Lineage(None, None, None)
    best: Candidate | None = None
    for candidate in candidates:
        if first_divergence(candidate.sequence, prompt) is None and (
            best is None or len(candidate.sequence) >= len(best.sequence)
        ):
            best = candidate
    latest = latest_of_tree(candidates, None if best is None else best.tree)
    latest_call = [c for c in candidates if _same_call(c, latest) or _same_prompt(c, latest)]
    if best is not None and any(first_divergence(c.sequence, prompt) is None for c in latest_call):
        return Lineage(best.step_id, True, None)
    for candidate in reversed(candidates):
        if candidate.prompt_length is not None and list(
            candidate.sequence[: candidate.prompt_length]
        ) == list(prompt):
            return replace(
                candidate.lineage or Lineage(None, None, None), fork_of=candidate.step_id
            )
    offset = first_divergence(latest.sequence, prompt)
    if best is not None:
        return Lineage(best.step_id, True, offset, latest.step_id)
    return Lineage(latest.step_id, False, offset)


class _InTree(Protocol):
    @property
    def tree(self) -> str | None: ...


C = TypeVar("C", bound=_InTree)


def latest_of_tree(candidates: Sequence[C], tree: str | None) -> C:
    """The latest of ``candidates`` (oldest first, not empty) in ``tree`` (None: the main
    tree), or the latest of all when that tree has none."""
    return next((c for c in reversed(candidates) if c.tree == tree), candidates[-1])


def _same_call(candidate: Candidate, latest: Candidate) -> bool:
    if latest.call is None:
        return candidate is latest
    return candidate.call == latest.call


def _same_prompt(candidate: Candidate, latest: Candidate) -> bool:
    """Whether ``candidate`` answered ``latest``'s very prompt (a re-send's twin): continuing
    either is the same case as continuing one choice of ``n``, never a break."""
    n = latest.prompt_length
    return (
        n is not None
        and candidate.prompt_length == n
        and list(candidate.sequence[:n]) == list(latest.sequence[:n])
    )


# Kinds of prefix break, from the most to the least specific explanation.
THINKING_STRIPPED = "thinking_stripped"
TOOL_ARGUMENTS_CHANGED = "tool_arguments_changed"
SYSTEM_CHANGED = "system_changed"
HISTORY_REWRITTEN = "history_rewritten"
HISTORY_TRUNCATED = "history_truncated"
TOOL_CALL_RERENDERED = "tool_call_rerendered"
RETOKENISED = "retokenised"
# Not a break of the chain: a call sharing at most the first system/user turns (a title or
# summary call, a sub-agent) is a new root of the trajectory's tree.
SIDE_CALL = "side_call"
DIVERGENCE_WINDOW_TOKENS = 8


def classify_divergence(
    parent_messages: Sequence[Message],
    parent_response: Message | None,
    new_messages: Sequence[Message],
) -> str:
    """Explain a prefix break from the canonical conversations alone (never by re-tokenising),
    so the same change reads the same in every dialect.

    Compares the new call's messages with the parent's messages then the message it generated
    (``H_p``), and reads the kind from the first message that differs, field by field in the
    order a chat template renders a turn (reasoning, then content, then tool calls), so the
    kind names what the tokens diverge at:

    - ``side_call``: the new call shares no more than the parent's leading system messages and
      first user message, and is itself only a conversation's start (system messages and one
      user message: a title or summary call, a sub-agent's first call): a new root of the
      trajectory's tree, not a break of its chain;
    - ``history_truncated``: the new messages are the parent's with whole turns removed: a
      prefix of them (fewer turns), or from the first difference on more of the parent's
      messages in their order, whole ones dropped in between (a dropped middle turn), maybe
      followed by new turns; a message that is edited rather than dropped is not;
    - in an earlier turn: ``system_changed`` (a system message), ``thinking_stripped`` (its
      reasoning dropped or changed), ``tool_arguments_changed`` (a tool call's argument string
      differs, same call ids and names: case C04), else ``history_rewritten``;
    - at the echoed generated turn: ``thinking_stripped`` (its reasoning dropped, or a
      ``<think>`` block cut from its content: case C02), ``history_rewritten`` (the content
      edited), ``tool_arguments_changed`` (arguments re-serialised), ``history_rewritten``
      (other tool calls); when the echo equals the generated message, the template rendered it
      differently: ``thinking_stripped`` when it had reasoning (templates drop past
      reasoning), ``tool_call_rerendered`` when it had tool calls (the parsed call is rendered,
      not the sampled text), else ``retokenised`` (case C01).
    """
    # Compared as rendered: one text part and its string are the same turn (``as_rendered``).
    parent_messages = [as_rendered(m) for m in parent_messages]
    new_messages = [as_rendered(m) for m in new_messages]
    history = [*parent_messages, *([] if parent_response is None else [parent_response])]
    shared = 0
    for old, new in zip(history, new_messages, strict=False):
        if old != new:
            break
        shared += 1
    # Only a conversation's start, however long the parent's history is: a title call
    # ``[system, user]`` after a first turn ``[user] → answer`` is as long as that history, and
    # a sub-agent's ``[system, user, system]`` as long as ``[system, user] → answer``.
    starts_over = len(first_turns(new_messages)) == len(new_messages)
    if shared <= len(first_turns(parent_messages)) and starts_over:
        return SIDE_CALL
    if shared == len(new_messages) and len(new_messages) <= len(parent_messages):
        return HISTORY_TRUNCATED
    if shared < len(parent_messages):
        if shared >= len(new_messages) or _kept_after_a_gap(history, new_messages, shared):
            return HISTORY_TRUNCATED
        return _turn_changed(parent_messages[shared], new_messages[shared], generated=False)
    if parent_response is None or shared >= len(new_messages):
        return RETOKENISED
    echoed = new_messages[len(parent_messages)]
    if shared > len(parent_messages):  # the echo is the generated message itself
        if parent_response.reasoning or "</think>" in parent_response.text:
            return THINKING_STRIPPED
        if parent_response.tool_calls:
            return TOOL_CALL_RERENDERED
        return RETOKENISED
    return _turn_changed(parent_response, echoed, generated=True)


def _kept_after_a_gap(history: Sequence[Message], new: Sequence[Message], shared: int) -> bool:
    """Whether ``new`` goes on, after its first ``shared`` messages (``history``'s), with more
    of ``history``'s messages in order, some whole ones dropped in between: its kept messages
    are a subsequence of ``history`` (messages after them are new turns)."""
    at = shared
    kept = shared
    for message in new[shared:]:
        found = next((i for i in range(at, len(history)) if history[i] == message), None)
        if found is None:
            break
        at, kept = found + 1, kept + 1
    return kept > shared


def _turn_changed(old: Message, new: Message, *, generated: bool) -> str:
    """What differs first between two versions of one turn, in rendering order."""
    if old.role != new.role:
        return HISTORY_REWRITTEN
    if old.role in ("system", "developer"):
        return SYSTEM_CHANGED
    if old.reasoning != new.reasoning and old.reasoning:
        return THINKING_STRIPPED
    if old.content != new.content and old.text != new.text:
        if "</think>" in old.text and old.text.split("</think>", 1)[1].strip() == new.text.strip():
            return THINKING_STRIPPED
        return HISTORY_REWRITTEN
    if old.tool_calls != new.tool_calls:
        same_calls = len(old.tool_calls) == len(new.tool_calls) and all(
            (a.id, a.name) == (b.id, b.name)
            for a, b in zip(old.tool_calls, new.tool_calls, strict=True)
        )
        return TOOL_ARGUMENTS_CHANGED if same_calls else HISTORY_REWRITTEN
    return HISTORY_REWRITTEN if generated or old != new else RETOKENISED


def divergence_window(
    sequence: Sequence[int], prompt: Sequence[int], offset: int
) -> dict[str, Any]:
    """Both sides around ``offset``: ``DIVERGENCE_WINDOW_TOKENS`` tokens before and after."""
    start = max(0, offset - DIVERGENCE_WINDOW_TOKENS)
    end = offset + DIVERGENCE_WINDOW_TOKENS
    return {
        "offset": offset,
        "window_start": start,
        "parent_ids": list(sequence[start:end]),
        "prompt_ids": list(prompt[start:end]),
    }
