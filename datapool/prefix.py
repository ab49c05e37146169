"""Token-sequence lineage: does a step's prompt extend an earlier step's prompt + response?

Owns: the pure comparison of token ID sequences (case C01: a break is recorded, never repaired).
Never: tokenizes or decodes anything.

With ``P`` the new prompt IDs and ``S_k = P_k + R_k`` an earlier step's prompt and response IDs,
step k *extends* into the new one when ``P[:len(S_k)] == S_k``. The parent is the earlier step
with the longest such ``S_k`` (so retries and forks form a tree); when none extends, the parent is
the latest step and the first offset where ``P`` and its ``S`` differ is the divergence offset.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
