"""The trainers people already use, fed by the pool: TRL and verl (optional extras).

- ``rows``: a batch table's rows cut into the pieces both trainers take (``PoolRow``,
  ``pool_rows``): prompt ids, completion ids, the loss mask over the completion (0 on tool and
  environment tokens), the behaviour logprobs, reward, advantage, group and policy version.
- ``trl`` (``pip install 'trajgate[trl]'``): ``rollout_output``, what a TRL 1.16
  ``GRPOTrainer(rollout_func=...)`` returns, and ``pool_reward``, a TRL reward function that
  hands back the pool's reward of each row.
- ``verl`` (``pip install 'trajgate[verl]'``): ``agent_loop_outputs``, one verl 0.9
  ``AgentLoopOutput`` per merged row.

Never: re-tokenizes, or drops, pads or realigns a token: every id, mask bit and logprob is the
pool's. This file imports nothing, so the rest of ``trainer_bridge`` loads without TRL or verl
(and never imports this package: an import contract in ``.importlinter``).
"""
