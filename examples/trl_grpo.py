"""TRL's GRPOTrainer trained on agent episodes recorded by trajgate (TRL 1.16, ``trajgate[trl]``).

Each prompt of TRL's batch is one episode of an ordinary OpenAI-SDK agent pointed at the
gateway (``http://GATEWAY/t/<trajectory_id>/v1``); TRL's ``num_generations`` rollouts of a prompt
are one group. The ``rollout_func`` waits until the pool has rewarded the episodes, then hands
TRL the pool's rows: the exact prompt and completion token ids, the behaviour logprobs and the
mask that keeps tool tokens out of the loss. TRL computes its group advantages from the
rewards (``pool_reward``) and updates the model.

    # the gateway in front of vLLM, the tiny model on the CPU (see README)
    .venv/bin/trajgate vllm start && .venv/bin/trajgate serve --upstream http://127.0.0.1:8100 &
    python examples/trl_grpo.py --gateway-url http://127.0.0.1:8000 \\
        --model ~/.cache/trajgate/models/tiny --max-steps 2 --cpu

On a GPU host, run vLLM the way TRL pushes weights into it (``trl vllm-serve``), the gateway in
front of it, and add ``--use-vllm --served-model-name <name>``: each new step then registers the
new policy version with the gateway before its episodes run (docs/deployment.md, "TRL and
verl"). Without ``--use-vllm`` TRL trains but vLLM keeps serving the first weights.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from datasets import Dataset
from openai import OpenAI
from trl import GRPOConfig, GRPOTrainer

from trainer_bridge.integrations.episodes import PoolEpisodes
from trainer_bridge.integrations.trl import PoolRollout, pool_reward

QUESTIONS = ["What is 2 + 3?", "What is 7 - 4?", "What is 3 * 3?", "What is 8 / 2?"]


def agent(base_url: str, prompt: Any) -> float:
    """One episode: the question, the model's answer, a tool result, the final answer.

    Reward 1.0 when the final answer contains a digit (a format reward: the tiny model's
    weights are random), else 0.0. Return None instead to let the gateway's reward functions
    (``TRAJGATE_REWARD_FUNCTIONS``) score the trajectory when it completes.
    """
    client = OpenAI(base_url=base_url, api_key="unused")
    messages: list[Any] = [{"role": "user", "content": str(prompt)}]
    first = client.chat.completions.create(
        model=os.environ.get("TRL_GRPO_MODEL_NAME", "tiny"),
        messages=messages,
        max_tokens=8,
        temperature=1.0,
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "The calculator says: see above. Answer with a number."},
    ]
    final = client.chat.completions.create(
        model=os.environ.get("TRL_GRPO_MODEL_NAME", "tiny"),
        messages=messages,
        max_tokens=8,
        temperature=1.0,
    )
    answer = final.choices[0].message.content or ""
    return 1.0 if any(c.isdigit() for c in answer) else 0.0


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gateway-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="Hugging Face model dir or hub id")
    parser.add_argument("--output-dir", default="trl-grpo-out")
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4, help="rows per device and step")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--cpu", action="store_true", help="train on the CPU")
    parser.add_argument("--use-vllm", action="store_true", help="TRL pushes weights into vLLM")
    parser.add_argument("--served-model-name", default=None, help="vLLM's name for the policy")
    parser.add_argument("--admin-token", default=None, help="the gateway's admin token")
    return parser.parse_args(argv)


def build(
    args: argparse.Namespace,
    agent: Any = agent,
    trainer_class: type[GRPOTrainer] = GRPOTrainer,
) -> tuple[GRPOTrainer, PoolRollout]:
    """The trainer and its rollout function (a ``trainer_class`` subclass may record more)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental
    episodes = PoolEpisodes(args.gateway_url, agent, admin_token=args.admin_token)
    rollout = PoolRollout(
        episodes,
        run_id=f"trl-{os.path.basename(os.path.abspath(args.output_dir))}-{os.getpid()}",
        # the one call per new version (POST /admin/policy-versions), only when weights moved
        policy_model_name=args.served_model_name if args.use_vllm else None,
    )
    config = GRPOConfig(
        output_dir=args.output_dir,
        use_cpu=args.cpu,
        use_vllm=args.use_vllm,
        vllm_mode="server",
        per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        temperature=1.0,  # the agents' sampling temperature: the logprobs are at it
        beta=0.0,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
    )
    trainer = trainer_class(
        model=args.model,
        reward_funcs=pool_reward,  # TRL's advantages from the pool's rewards
        args=config,
        train_dataset=Dataset.from_dict({"prompt": QUESTIONS * 4}),
        rollout_func=rollout,
    )
    return trainer, rollout


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    trainer, rollout = build(args)
    try:
        result = trainer.train()
    finally:
        rollout.episodes.close()
    print(f"training loss {result.training_loss:.4f} after {result.global_step} steps")


if __name__ == "__main__":
    main()
