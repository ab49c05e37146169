"""Anchor states: the state key of each step row, and the report of the sub-groups they form.

Owns: what makes two steps' states identical for GiGPO's anchor-state grouping
(``BatchSpec.anchor_key``; the estimator is ``step_advantages.anchor_state_advantages``) and the
manifest's ``step_credit.anchor``. Never: reads the pool, tokenizes, or compares states across
groups (a sub-group is a key within one group).

Shape legend: ``B`` step rows, ``N`` trajectories' first rows.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from datapool.batches.rows import StepTokens
from datapool.batches.spec import ANCHOR_KEYS
from datapool.errors import InvalidPoolRequestError
from datapool.steps.messages import engine_chat

MANIFEST_SUBGROUPS = 1000  # sub-groups listed with their steps in the manifest (all are counted)


def anchor_keys(
    steps: Sequence[StepTokens],
    first_steps: Sequence[StepTokens],
    group: npt.NDArray[np.integer[Any]],
    first_group: npt.NDArray[np.integer[Any]],
    anchor_key: str,
) -> list[str | None]:
    """The state key ``[B]`` of each row's step ``steps`` in group ``group`` ``[B]`` (16 hex
    digits of a BLAKE2b hash):

    - ``prompt_after_task_prefix``: the exact prompt token ids after the group's *task prefix*,
      the longest common prefix of the prompts of its members' first rows (``first_steps`` in
      groups ``first_group`` ``[N]``). A prompt that does not start with it (a rewritten
      history) is hashed whole, marked apart.
    - ``last_observation``: the role and content of the last message of the step's request
      that the agent did not write (not ``assistant``, not ``system``); None (a sub-group of
      its own) when there is none. Needs the steps' full requests (``expand_requests``).

    Raises ``InvalidPoolRequestError`` for any other ``anchor_key``.
    """
    if anchor_key == "prompt_after_task_prefix":
        prefix: dict[int, npt.NDArray[np.int32]] = {}
        for step, g in zip(first_steps, first_group.tolist(), strict=True):
            prefix[g] = step.prompt if g not in prefix else _common_prefix(prefix[g], step.prompt)
        keys: list[str | None] = []
        for step, g in zip(steps, group.tolist(), strict=True):
            head = prefix.get(g, np.zeros(0, np.int32))
            prompt = step.prompt
            if len(prompt) >= len(head) and np.array_equal(prompt[: len(head)], head):
                keys.append(_digest(b"after:" + prompt[len(head) :].astype(np.int32).tobytes()))
            else:
                keys.append(_digest(b"whole:" + prompt.astype(np.int32).tobytes()))
        return keys
    if anchor_key == "last_observation":
        result: list[str | None] = []
        for step in steps:
            messages, _tools = engine_chat(step.row)
            observed = [
                m
                for m in messages or []
                if isinstance(m, dict) and m.get("role") not in ("assistant", "system")
            ]
            last = observed[-1] if observed else None
            text = None if last is None else json.dumps([last.get("role"), last.get("content")])
            result.append(None if text is None else _digest(text.encode()))
        return result
    raise InvalidPoolRequestError(f"anchor_key must be one of {ANCHOR_KEYS}, got {anchor_key!r}")


def _common_prefix(a: npt.NDArray[np.int32], b: npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return a[: int(differ[0]) if len(differ) else n]


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def anchor_report(
    step_ids: Sequence[str],
    positions: Sequence[int],
    group_ids: Sequence[str | None],
    trajectory_ids: Sequence[str],
    keys: Sequence[str | None],
    sizes: npt.NDArray[np.int32],
) -> dict[str, Any]:
    """The manifest's ``step_credit.anchor`` from the rows ``[B]`` (step id, position in its
    trajectory, group id, trajectory id, state key, sub-group size): how many steps found a
    sub-group (shared their state with another step of the group), the sub-groups by size, and
    the first ``MANIFEST_SUBGROUPS`` sub-groups of two or more steps with their steps."""
    shared: dict[tuple[str | None, str], list[dict[str, Any]]] = {}
    for i, key in enumerate(keys):
        if key is None or sizes[i] < 2:
            continue
        shared.setdefault((group_ids[i], key), []).append(
            {"trajectory_id": trajectory_ids[i], "position": positions[i], "step_id": step_ids[i]}
        )
    steps_by_size = Counter(int(s) for s in sizes)  # {size: steps}
    return {
        "steps_in_subgroups": int((sizes >= 2).sum()),
        "steps_alone": int((sizes < 2).sum()),
        "subgroups": len(shared),
        "subgroup_sizes": {str(k): v // k for k, v in sorted(steps_by_size.items()) if k >= 2},
        "subgroups_listed": [
            {"group_id": g, "anchor_key": key, "steps": steps}
            for (g, key), steps in list(shared.items())[:MANIFEST_SUBGROUPS]
        ],
    }
