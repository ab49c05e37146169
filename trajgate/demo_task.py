"""The demo's task and its verifiable reward.

Each episode asks for the temperature in a city; the agent calls ``get_weather`` (a forced,
grammar-constrained call, kept out of training by a curation rule) and then answers. The system
prompt asks for the temperature as a number, and the reward ``numeric_answer`` is the share of
digits among the answer's non-space characters, in [0, 1].

Why this reward: the tiny model has random weights, so a reward it can move in minutes on two
CPU cores has to be dense. The demo's answers are one token long, so the reward is a per-decision
one: a digit share starts near 0.7 (most of the tiny vocabulary is number pieces) and rises under
GRPO within ten LoRA updates of 64 rollouts, while the shuffled-reward control stays flat. With
6-token answers the credit spreads over random tokens and 8 updates did not move it (measured).
It is a shaped format reward, not correctness.
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
