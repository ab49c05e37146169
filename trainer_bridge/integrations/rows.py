"""A batch table's rows, cut where the trainers cut them: prompt | completion.

Owns: splitting each merged row of ``datapool.batches`` (``input_ids``, ``loss_mask``,
``behaviour_logprobs``, ``prompt_tokens``; docs/batches.md) into the first prompt ``[P]`` and
everything after it ``[C]`` (model tokens and the tool/environment tokens between turns), with
the mask and the logprobs over ``[C]``. Never: imports a trainer library, or changes a value.

Shape legend: ``P`` prompt tokens of the row's first step, ``C`` tokens after them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyarrow as pa

ROW_COLUMNS = (
    "input_ids",
    "loss_mask",
    "behaviour_logprobs",
    "prompt_tokens",
    "trajectory_id",
    "group_id",
    "segment_index",
    "policy_version",
    "reward",
    "advantage",
    "step_ids",
)


@dataclass(frozen=True)
class PoolRow:
    """One merged row of a trajectory, exactly as the pool materialised it.

    ``completion_mask`` ``[C]``: 1 on tokens the policy sampled, 0 on tool/environment tokens;
    ``completion_logprobs`` ``[C]``: the engine's behaviour logprob of each sampled token (0.0
    where the mask is 0). ``policy_version``: the oldest version among the row's steps (None
    when the gateway had none registered). ``reward`` / ``advantage``: None when unrewarded or
    without a baseline (missing is never 0). ``temperature``: the temperature the behaviour
    logprobs are at (a trainer must divide its logits by it; 1.0 in batches made before the
    column existed). ``lineage_id``: the conversation of the trajectory the row is (a main
    agent, a sub-agent, a side call; docs/gateway.md "Lineages"): a row never crosses
    lineages, and a trajectory with a sub-agent is several rows, told apart by it (None in
    batches made before the column existed).
    """

    trajectory_id: str
    group_id: str | None
    segment_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[int]
    completion_logprobs: list[float]
    policy_version: int | None
    reward: float | None
    advantage: float | None
    step_ids: list[str]
    temperature: float = 1.0
    lineage_id: str | None = None


def _finite_or_none(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else float(value)


def pool_rows(table: pa.Table) -> list[PoolRow]:
    """The rows of a batch table (``/api/batches/{id}/rows``), in the table's order.

    Raises:
        ValueError: a row has no sampled token after its prompt (nothing to train; verl
            refuses an all-zero response mask), or a column is missing.
    """
    missing = [name for name in ROW_COLUMNS if name not in table.column_names]
    if missing:
        raise ValueError(f"the batch table lacks columns {missing}; expected {list(ROW_COLUMNS)}")
    columns = {name: table[name].to_pylist() for name in ROW_COLUMNS}
    temperatures = (
        table["temperature"].to_pylist()
        if "temperature" in table.column_names
        else [1.0] * table.num_rows
    )
    lineages = (
        table["lineage_id"].to_pylist()
        if "lineage_id" in table.column_names
        else [None] * table.num_rows
    )
    rows: list[PoolRow] = []
    for i in range(table.num_rows):
        cut = columns["prompt_tokens"][i]
        ids, mask, logprobs = (
            columns["input_ids"][i],
            columns["loss_mask"][i],
            columns["behaviour_logprobs"][i],
        )
        if not any(mask[cut:]):
            raise ValueError(
                f"row {i} (trajectory {columns['trajectory_id'][i]!r}) has no sampled token "
                f"after its {cut}-token prompt"
            )
        rows.append(
            PoolRow(
                trajectory_id=columns["trajectory_id"][i],
                group_id=columns["group_id"][i],
                segment_index=columns["segment_index"][i],
                prompt_ids=ids[:cut],
                completion_ids=ids[cut:],
                completion_mask=mask[cut:],
                completion_logprobs=logprobs[cut:],
                policy_version=columns["policy_version"][i],
                reward=_finite_or_none(columns["reward"][i]),
                advantage=_finite_or_none(columns["advantage"][i]),
                step_ids=columns["step_ids"][i],
                temperature=float(temperatures[i]),
                lineage_id=lineages[i],
            )
        )
    return rows
