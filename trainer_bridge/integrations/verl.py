"""verl (0.9) trains on the pool's rows: one ``AgentLoopOutput`` per merged row.

verl's contract (``verl/experimental/agent_loop/agent_loop.py``, 0.9.1): an agent loop's
``run`` returns an ``AgentLoopOutput`` (or, in the TransferQueue trainer
``verl/trainer/ppo/v1``, a list of them): ``prompt_ids``, ``response_ids`` (model and tool tokens
after the prompt), ``response_mask`` (1 model, 0 tool), ``response_logprobs``, ``reward_score``
(placed on the last response token by ``AgentLoopWorker._postprocess``), ``num_turns``,
``metrics``, ``extra_fields``. ``AgentLoopWorker`` pads them (prompt left, response right) into a
``DataProto``.

Owns: ``agent_loop_outputs`` (pool rows → outputs; a tree's leaves and the pieces of a prefix
break are separate outputs). Never: tokenizes, or changes a value. The pool's reward of the
trajectory is each row's ``reward_score``; ``extra_fields`` carry ``trajectory_id``,
``group_id``, ``policy_version`` and ``step_ids``.

Weights the other way: after verl syncs new weights into its rollout servers, tell the gateway
the new version with ``POST /admin/policy-versions {"version", "model_name", "activate": true}``
(``trainer_bridge.sync.WeightSync.register``) before the next agent loops run (docs/deployment.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

from trainer_bridge.integrations.rows import PoolRow


def agent_loop_outputs(rows: Sequence[PoolRow]) -> list[AgentLoopOutput]:
    """One ``AgentLoopOutput`` per row, in order; ``num_turns``: 2 per step (user + assistant).

    Raises:
        ValueError: a row is unrewarded (verl would score it 0 or not at all; missing is not 0).
    """
    outputs = []
    for row in rows:
        if row.reward is None:
            raise ValueError(
                f"trajectory {row.trajectory_id!r} has no reward in the pool; reward it first"
            )
        outputs.append(
            AgentLoopOutput(
                prompt_ids=row.prompt_ids,
                response_ids=row.completion_ids,
                response_mask=row.completion_mask,
                response_logprobs=row.completion_logprobs,
                reward_score=row.reward,
                num_turns=2 * len(row.step_ids),
                metrics=AgentLoopMetrics(),
                extra_fields={
                    "trajectory_id": row.trajectory_id,
                    "group_id": row.group_id,
                    "policy_version": row.policy_version,
                    "step_ids": row.step_ids,
                },
            )
        )
    return outputs
