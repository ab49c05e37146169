"""The delta chain: the one walk that reads back a value a step stores as a delta on its parent.

Owns: ``walk`` (from a step up its parents to the first step stored whole) and ``resolve`` (the
walk, then the deltas applied forward, each step computed once). Every reader of a delta-stored
field goes through them: prompt token IDs (``datapool.steps.payloads``: a step's prompt is its
parent's ``P + R`` cut to b tokens, plus a delta), request messages (``datapool.steps.messages``:
the parent's ``M + [R]`` cut to b messages, plus ``M[b:]``), and the step rows a payload needs
(``datapool.steps.store``). Never: knows what a delta holds or reads SQL; the caller says which
parent a stored entry builds on and how to apply it.

Iterative, not recursive: a long trajectory is a long chain (one link per turn).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping
from typing import TypeVar

E = TypeVar("E")  # a step's stored entry (its delta and what it builds on)
V = TypeVar("V")  # the full value the chain reconstructs


def walk(
    step_id: str,
    stored: Mapping[str, E],
    based_on: Callable[[E], str | None],
    done: Container[str] = (),
) -> tuple[list[tuple[str, E]], str | None]:
    """``(chain, absent)``: the ``(step id, entry)`` links from ``step_id`` (first) up to the
    first step that is stored whole (``based_on`` gives None) or is in ``done``, and the id of a
    parent the chain needed that is not in ``stored`` (then the chain stops below it), else None.

    ``based_on(entry)`` is the id of the step ``entry`` is a delta on, None when it is whole.
    """
    chain: list[tuple[str, E]] = []
    current: str | None = step_id
    while current is not None and current not in done:
        entry = stored.get(current)
        if entry is None:
            return chain, current
        chain.append((current, entry))
        current = based_on(entry)
    return chain, None


def resolve(
    step_ids: Iterable[str],
    stored: Mapping[str, E],
    based_on: Callable[[E], str | None],
    apply: Callable[[E, Mapping[str, V]], V],
    missing: Callable[[str], Exception],
    known: Mapping[str, V] | None = None,
) -> dict[str, V]:
    """Full values of ``step_ids`` and of every ancestor they needed, by id.

    ``apply(entry, full)`` computes a step's value from its entry; ``full`` already holds the
    value of the step it is based on. ``known`` gives full values already at hand (their chains
    are not walked). Raises ``missing(step_id)`` for the first ancestor absent from ``stored``.
    """
    full: dict[str, V] = dict(known or {})
    for step_id in step_ids:
        chain, absent = walk(step_id, stored, based_on, full)
        if absent is not None:
            raise missing(absent)
        for link_id, entry in reversed(chain):
            full[link_id] = apply(entry, full)
    return full
