"""verl (0.9.1) trains on the pool's rows: an agent loop registered as ``trajgate``.

verl's contract (``verl/experimental/agent_loop/agent_loop.py``, 0.9.1): an agent loop is an
``AgentLoopBase`` subclass registered by name (``@register(name)``, or an entry of the YAML file
at ``actor_rollout_ref.rollout.agent.agent_loop_config_path`` with ``name`` and ``_target_``,
whose other keys reach its constructor); ``AgentLoopWorker`` instantiates it once per sample whose
``agent_name`` is that name and awaits ``run(sampling_params, **dataset_fields)``, which returns
an ``AgentLoopOutput``: ``prompt_ids``, ``response_ids`` (model and tool tokens after the
prompt), ``response_mask`` (1 model, 0 tool; all-zero is refused), ``response_logprobs``,
``reward_score`` (placed on the last response token by ``AgentLoopWorker._postprocess``),
``num_turns``, ``metrics``, ``extra_fields``. ``AgentLoopWorker.generate_sequences`` pads them
(prompt left, response right) into a ``DataProto``. Only the TransferQueue trainer
(``verl/trainer/ppo/v1``, ``AgentLoopWorkerTQ``) accepts a list of outputs from one ``run``;
the classic ``ray_trainer`` takes exactly one.

Owns: ``PoolAgentLoop`` (one agent episode per sample through the gateway, then its pool rows)
and ``agent_loop_outputs`` (pool rows → outputs; a tree's leaves and the pieces of a prefix
break are separate outputs). Never: tokenizes, or changes a value. The pool's reward of the
trajectory is each row's ``reward_score``; ``extra_fields`` carry ``trajectory_id``,
``lineage_id``, ``group_id``, ``policy_version``, ``step_ids`` and an empty
``reward_extra_info`` (the TransferQueue trainer copies the last output's to the others).

Weights the other way: after verl syncs new weights into its rollout servers, tell the gateway
the new version with ``POST /admin/policy-versions {"version", "model_name", "activate": true}``
(``PoolEpisodes.register_policy_version``) before the next agent loops run (docs/deployment.md).
"""

from __future__ import annotations

import asyncio
import importlib
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)

from trainer_bridge.integrations.episodes import Agent, Episode, PoolEpisodes
from trainer_bridge.integrations.rows import PoolRow


def agent_loop_outputs(rows: Sequence[PoolRow]) -> list[AgentLoopOutput]:
    """One ``AgentLoopOutput`` per row, in order; ``num_turns``: 2 per step (user + assistant).
    Its ``extra_fields`` (verl's ``non_tensor_batch`` per sample): ``trajectory_id``,
    ``lineage_id`` (the row's conversation: a main agent's and a sub-agent's rows of one
    trajectory differ in it), ``group_id``, ``policy_version``, ``step_ids``.

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
                    "lineage_id": row.lineage_id,
                    "group_id": row.group_id,
                    "policy_version": row.policy_version,
                    "step_ids": row.step_ids,
                    "reward_extra_info": {},
                },
            )
        )
    return outputs


def _agent(agent: str | Agent) -> Agent:
    """A callable, or its ``"package.module:function"`` name (what a YAML config can hold)."""
    if callable(agent):
        return agent
    module, _, name = agent.partition(":")
    if not name:
        raise ValueError(f"agent {agent!r}: expected 'package.module:function'")
    found: Agent = getattr(importlib.import_module(module), name)
    return found


@register("trajgate")
class PoolAgentLoop(AgentLoopBase):
    """verl's agent loop ``trajgate``: runs ``agent(base_url, raw_prompt)`` as one episode
    through the gateway (a new trajectory ``verl-<hex>``; its group is the sample's ``uid``,
    verl's GRPO group), waits until the pool rewarded it, and returns its rows as outputs.

    Constructor keys (from the agent-loop YAML entry): ``gateway_url``, ``agent`` (a
    ``"package.module:function"``), ``outputs``: ``"one"`` (default; the classic trainer: a
    trajectory split into several rows raises ``ValueError``) or ``"all"`` (a list, for the
    TransferQueue trainer), and ``channel``, ``admin_token``, ``ready_timeout_s`` as in
    ``PoolEpisodes``. verl's ``sampling_params`` are not forwarded: the agent samples as it
    likes, the pool records it, and each row's behaviour logprobs are at its own temperature.
    """

    def __init__(
        self,
        *args: Any,
        agent: str | Agent,
        gateway_url: str = "http://127.0.0.1:8000",
        outputs: Literal["one", "all"] = "one",
        channel: str = "train",
        admin_token: str | None = None,
        ready_timeout_s: float = 300.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if outputs not in ("one", "all"):
            raise ValueError(f"outputs must be 'one' or 'all', got {outputs!r}")
        self.outputs = outputs
        self.episodes = PoolEpisodes(
            gateway_url,
            _agent(agent),
            channel=channel,
            consumer="verl",
            admin_token=admin_token,
            ready_timeout_s=ready_timeout_s,
        )

    # verl annotates one output; its TransferQueue worker (AgentLoopWorkerTQ) takes a list too
    async def run(  # type: ignore[override]
        self, sampling_params: dict[str, Any], **kwargs: Any
    ) -> AgentLoopOutput | list[AgentLoopOutput]:
        trajectory_id = f"verl-{uuid.uuid4().hex}"
        group_id = str(kwargs.get("uid") or kwargs.get("index") or trajectory_id)
        episode = Episode(trajectory_id, group_id, kwargs.get("raw_prompt"))
        try:
            rows = await asyncio.to_thread(self.episodes.run, [episode])
        finally:
            self.episodes.close()
        outputs = agent_loop_outputs(rows)
        if len(outputs) == 1:
            return outputs[0]
        if self.outputs == "all":
            return outputs
        raise ValueError(
            f"trajectory {trajectory_id!r} has {len(outputs)} rows (a prefix break or a tree): "
            "verl's classic trainer takes one output per sample; run the TransferQueue trainer "
            "(verl/trainer/ppo/v1) with outputs: all"
        )
