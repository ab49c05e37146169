"""Token-sequence lineage: does a step's prompt extend an earlier step's prompt + response?

Owns: the pure comparison of token ID sequences (case C01: a break is recorded, never repaired).
Never: tokenizes or decodes anything.

With ``P`` the new prompt IDs and ``S_k = P_k + R_k`` an earlier step's prompt and response IDs,
step k *extends* into the new one when ``P[:len(S_k)] == S_k``. The parent is the earlier step
with the longest such ``S_k`` (so retries and forks form a tree); when none extends, the parent is
the latest step and the first offset where ``P`` and its ``S`` differ is the divergence offset.

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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
class Candidate:
    """An earlier step's id and its full sequence ``prompt_ids + response_ids``."""

    step_id: str
    sequence: Sequence[int]


@dataclass(frozen=True)
class Lineage:
    parent_step_id: str | None
    extends_parent: bool | None
    divergence_offset: int | None


def choose_parent(candidates: Sequence[Candidate], prompt: Sequence[int]) -> Lineage:
    """Pick the parent of a new step with ``prompt`` among ``candidates`` (oldest first).

    No candidates: a root step (parent None, extends None). Otherwise the longest extending
    candidate, or, if none extends, the latest candidate with the divergence offset.
    """
    if not candidates:
        return Lineage(None, None, None)
    best: Candidate | None = None
    for candidate in candidates:
        if first_divergence(candidate.sequence, prompt) is None and (
            best is None or len(candidate.sequence) >= len(best.sequence)
        ):
            best = candidate
    if best is not None:
        return Lineage(best.step_id, True, None)
    latest = candidates[-1]
    return Lineage(latest.step_id, False, first_divergence(latest.sequence, prompt))


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
