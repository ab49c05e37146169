"""The trainer's side: lease batches from the pool over HTTP, turn their rows into tensors, run RL
updates of a Hugging Face causal LM, and publish the new weights through the gateway into vLLM.

Shape legend: ``B`` batch rows, ``T`` tokens per row.

- ``client``: ``PoolClient`` leases a batch, reads its rows, acks or nacks (``train_batch`` does
  one lease → update → ack; ``LeaseLostError``).
- ``leases``: ``LeaseKeeper`` renews a consumer's leases while it works and applies the rule for
  one lost anyway (every trainer path takes, acks and nacks leases through it).
- ``collate``: batch rows to padded tensors ``[B, T]`` (``Row``, ``row_from_step``, ``collate``).
- ``packing``: which rows go into each forward pass, padded or packed end to end into token
  budgets (``plan_micro_batches``, ``pack``, ``unpack``).
- ``logprobs``: per-token log-probabilities and entropies of a model over given sequences
  (``token_logprobs``).
- ``losses``: policy-gradient losses over sampled tokens (``LossConfig``, ``policy_loss``,
  ``aggregate``).
- ``trainer``: ``PolicyTrainer``, one RL update with LoRA (peft) or full weights, and saving
  weights vLLM can load (``TrainBatch``, ``UpdateMetrics``).
- ``sync``: ``WeightSync`` publishes new weights (LoRA or full) through the gateway, which loads
  them into every vLLM replica and activates them as the next policy version, and releases a
  run's adapters through it at the end (``release_adapters``); it never speaks to vLLM.
- ``loop``: the trainer against running services: lease → train → ack → publish (``run_loop``).
- ``sharding``: FSDP2 over the ranks (``shard_model``) and gathering sharded weights into the
  files vLLM loads (``save_full_safetensors``, ``gather_trainable``).
- ``checkpoint``: sharded model and optimizer checkpoints with the lineage of batches trained
  (``save``, ``load``, ``latest``, ``Lineage``).
- ``distributed``: the entry point under ``torchrun`` (``python -m trainer_bridge.distributed``):
  data-parallel updates, each rank on its share of one batch, replicated or FSDP2-sharded,
  resumed from checkpoints after a crash (``shard_rows``, ``run``, ``join_ranks``, ``main``).
- ``settings``: ``TrainerSettings`` and ``DistributedSettings`` (no torch import, so config
  checks run without it).

Never: reads or writes the pool's database (only the pool's HTTP API), computes advantages (they
come in the rows), or re-tokenizes: the rows carry the engine's exact token IDs.

Imports: torch, transformers and peft, and the ``trajgate.config`` leaf; never ``gateway`` or the
``trajgate`` CLI (layers: ``trajgate`` CLI → ``gateway`` / ``trainer_bridge`` → ``datapool``,
checked by ``lint-imports``). The layers would let it import ``datapool``; it does not need to.
This file imports nothing, so ``trainer_bridge.settings`` loads without torch.
"""
