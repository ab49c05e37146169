"""Token-sequence lineage: does a step's prompt extend an earlier step's prompt + response?

Owns: the pure comparison of token ID sequences (case C01: a break is recorded, never repaired).
Never: tokenizes or decodes anything.

With ``P`` the new prompt IDs and ``S_k = P_k + R_k`` an earlier step's prompt and response IDs,
step k *extends* into the new one when ``P[:len(S_k)] == S_k``. The parent is the earlier step
with the longest such ``S_k`` (so retries and forks form a tree); when none extends, the parent is
the latest step and the first offset where ``P`` and its ``S`` differ is the divergence offset.

Two refinements keep a break from hiding or being invented (issue 17):

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
from typing import Any


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
    one call share it; None: a call of its own) and its own lineage."""

    step_id: str
    sequence: Sequence[int]
    prompt_length: int | None = None
    call: int | None = None
    lineage: Lineage | None = None


def choose_parent(candidates: Sequence[Candidate], prompt: Sequence[int]) -> Lineage:
    """Pick the parent of a new step with ``prompt`` among ``candidates`` (oldest first).

    No candidates: a root step (parent None, extends None). Otherwise, in order:

    1. the longest extending candidate, when the prompt extends one of the latest call's
       candidates (the usual next turn) → ``Lineage(k, True, None)``;
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
    latest = candidates[-1]
    latest_call = [c for c in candidates if _same_call(c, latest)]
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


def _same_call(candidate: Candidate, latest: Candidate) -> bool:
    if latest.call is None:
        return candidate is latest
    return candidate.call == latest.call


# Kinds of prefix break, from the most to the least specific explanation.
THINKING_STRIPPED = "thinking_stripped"
TOOL_ARGUMENTS_CHANGED = "tool_arguments_changed"
HISTORY_REWRITTEN = "history_rewritten"
HISTORY_TRUNCATED = "history_truncated"
TOOL_CALL_RERENDERED = "tool_call_rerendered"
RETOKENISED = "retokenised"
DIVERGENCE_WINDOW_TOKENS = 8


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def _tool_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """``{tool_call_id: arguments}`` exactly as the message carries them (string or object)."""
    calls = message.get("tool_calls") or []
    return {
        str(call.get("id")): (call.get("function") or {}).get("arguments")
        for call in calls
        if isinstance(call, dict)
    }


def classify_divergence(
    parent_messages: Sequence[dict[str, Any]],
    parent_response: dict[str, Any] | None,
    new_messages: Sequence[dict[str, Any]],
) -> str:
    """Explain a prefix break from the messages alone (never by re-tokenising).

    Compares the new request's messages with the parent's messages plus the message the parent
    generated. Returns one of: ``history_truncated`` (fewer messages than the parent saw),
    ``history_rewritten`` (an earlier message changed, or the generated content was edited),
    ``tool_arguments_changed`` (an echoed tool call's arguments differ from the generated string,
    matched by tool_call id: case C04), ``thinking_stripped`` (the generated turn had reasoning
    that the template or the agent dropped: case C02), ``tool_call_rerendered`` (every message
    matches, but the template renders the parsed tool call, not the sampled text: spacing and
    argument formatting differ), ``retokenised`` (every message matches, so the same text was
    rendered into other IDs: case C01).
    """
    if len(new_messages) <= len(parent_messages):
        return HISTORY_TRUNCATED
    for old, new in zip(parent_messages, new_messages, strict=False):
        if old != new:
            return HISTORY_REWRITTEN
    if parent_response is None:
        return RETOKENISED
    echoed = new_messages[len(parent_messages)]
    generated_args = _tool_arguments(parent_response)
    echoed_args = _tool_arguments(echoed)
    if any(echoed_args.get(call_id) != args for call_id, args in generated_args.items()):
        return TOOL_ARGUMENTS_CHANGED
    generated_text = _text(parent_response.get("content"))
    had_thinking = "</think>" in generated_text or bool(
        parent_response.get("reasoning") or parent_response.get("reasoning_content")
    )
    if had_thinking:
        return THINKING_STRIPPED
    if _text(echoed.get("content")) != generated_text:
        return HISTORY_REWRITTEN
    if generated_args:
        return TOOL_CALL_RERENDERED
    return RETOKENISED


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
