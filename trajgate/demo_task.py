"""The demo's task and its verifiable reward.

Each episode asks for the temperature in a city; the agent calls ``get_weather`` (a forced,
grammar-constrained call, kept out of training by a curation rule) and then answers. The system
prompt asks for the temperature as a number, and the reward ``numeric_answer`` is the share of
digits among the answer's non-space characters, in [0, 1].

Why this reward: it is the decision the random tiny model can learn in minutes on two CPU
cores. The answer is one token, so the decision is one sampled token and its advantage is not
spread over others; the tiny model has a number direction (``trajgate.tinymodel``), so raising
one number token raises them all. Untrained, 0.10 of the answer's mass is on numbers; GRPO
takes it near 1.0 within five LoRA updates of 64 rollouts while the shuffled-reward control
stays flat. A reward on the right value (the tool's 21) would be the better decision reward,
but the untrained model samples ``21`` with probability 9e-5: no rollout of the demo would ever
be rewarded (docs/demo.md). It is a format decision, not correctness.
"""

from __future__ import annotations

from datapool.rewards.values import RewardContext

CITIES = ("Paris", "London", "Tokyo", "Berlin", "Rome", "Madrid", "Oslo", "Lima")
SYSTEM_PROMPT = "Answer with the temperature as a number."


def question(group_index: int) -> str:
    """The task of a group: every rollout of the group gets the same question."""
    return f"What is the temperature in {CITIES[group_index % len(CITIES)]}?"


def digit_share(text: str) -> float:
    """Digits among the non-space characters of ``text``; 0.0 for an empty answer."""
    characters = [c for c in text if not c.isspace()]
    if not characters:
        return 0.0
    return sum(c.isdigit() for c in characters) / len(characters)


def numeric_answer(context: RewardContext) -> float | None:
    """Reward function (``trajgate.demo_task:numeric_answer``): the final answer's digit share.

    None (unrewarded, never 0.0) when the trajectory has no answer message.
    """
    message = context.final_message
    if message is None or message.get("tool_calls"):
        return None
    return digit_share(str(message.get("content") or ""))
