"""A trajectory as its lineages: each conversation, where it came from, and its training rows.

Owns: ``lineage_view``, what the inspector's trajectory view shows of a trajectory's lineages
(``steps.lineage_*``, docs/gateway.md "Lineages"): one entry per lineage in order of its first
step, with its kind, parent lineage, the step that spawned it, and the merged rows a batch cuts
from it; and each step's ``segment_index`` (the row it trains in). Never: reads SQL or token
payloads; it works on the step rows the view already holds, in one pass (O(steps)).

**The spawning step** of a lineage ``L`` whose parent lineage is ``P`` (every kind but ``main``):
the latest ok call of ``P``'s thread that came before ``L``'s first step (by ``step_index``;
a call's first choice), where ``P``'s thread is ``P`` and the compactions that continue it
(a compaction lineage whose parent is in the thread: after a compaction the parent's calls go
on there). For a sub-agent that is the call whose answer asked for it (Claude Code's Task or
Agent tool call: the parent's next call carries its result); for a side call or a compaction,
the call it followed. None when ``P`` has no call before ``L`` (a parent the trajectory does not
hold, or a lineage without a parent).

**Rows** are a ``merged`` batch's (``datapool.batches.rows.conversation_rows``, the rule a batch
uses): the trainable steps (readiness's ``excluded_steps`` left out: failed calls,
integrity flags, curation) grow the row that ends with their parent when they extend it
(``extends_parent``, same temperature). Rows are numbered as ``segment_index`` in a batch, by
first step; a batch spec's own limits (stale versions, ``max_tokens_per_row``) can still cut or
drop a row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from datapool.batches.rows import continues, conversation_rows
from datapool.models import Step, StepOutcome

# Lineage kinds that continue their parent's conversation rather than branch off it.
CONTINUING_KINDS = ("compaction",)


def lineage_view(
    steps: Sequence[Step], excluded_steps: Mapping[str, str]
) -> tuple[list[dict[str, Any]], dict[str, int | None]]:
    """``(lineages, segment_index by step id)`` of one trajectory's ``steps`` (step then choice
    order); ``excluded_steps`` are the steps readiness keeps out of training (id to reason).

    Each lineage: ``id``, ``parent_id``, ``kind``, ``source``, ``first_step_id``,
    ``spawning_step_id`` (see the module docstring), ``steps`` (its step count) and ``rows``
    (``[{"segment_index": k, "step_ids": [...]}]``, its merged rows in order). A step without a
    lineage (none recorded) is in no lineage; a step in no row maps to None.
    """
    lineages: dict[str, dict[str, Any]] = {}
    # The latest ok call of each thread (a lineage and the compactions continuing it), by the
    # thread's root lineage id; and each lineage's thread root.
    thread_of: dict[str, str] = {}
    latest_call: dict[str, str] = {}
    for step in steps:
        lineage_id = step.lineage_id
        if lineage_id is None:
            continue
        entry = lineages.get(lineage_id)
        if entry is None:
            parent = step.lineage_parent_id
            continuing = step.lineage_kind in CONTINUING_KINDS and parent in thread_of
            thread_of[lineage_id] = thread_of[parent] if continuing and parent else lineage_id
            spawning = None
            if parent is not None and parent in thread_of:
                spawning = latest_call.get(thread_of[parent])
            entry = lineages[lineage_id] = {
                "id": lineage_id,
                "parent_id": parent,
                "kind": step.lineage_kind,
                "source": step.lineage_source,
                "first_step_id": step.id,
                "spawning_step_id": spawning,
                "steps": 0,
                "rows": [],
            }
        entry["steps"] += 1
        if step.outcome == StepOutcome.OK and step.choice_index == 0:
            latest_call[thread_of[lineage_id]] = step.id
    trainable = [s for s in steps if s.id not in excluded_steps]
    segment_index: dict[str, int | None] = {s.id: None for s in steps}
    for k, row in enumerate(conversation_rows(trainable, _itself, continues)):
        for step in row:
            segment_index[step.id] = k
        if row[0].lineage_id is not None:
            lineages[row[0].lineage_id]["rows"].append(
                {"segment_index": k, "step_ids": [s.id for s in row]}
            )
    return list(lineages.values()), segment_index


def _itself(step: Step) -> Step:
    return step
