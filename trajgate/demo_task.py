"""The demo's tasks and their verifiable rewards: one per model (``trajgate demo --model``).

``tiny`` (the random generated model): each episode asks for the temperature in a city; the
agent calls ``get_weather`` (a forced, grammar-constrained call, kept out of training by a
curation rule) and then answers. The system prompt asks for the temperature as a number, and the
reward ``numeric_answer`` is the share of digits among the answer's non-space characters, in
[0, 1].

Why this reward: it is the decision the random tiny model can learn in minutes on two CPU
cores. The answer is one token, so the decision is one sampled token and its advantage is not
spread over others; the tiny model has a number direction (``trajgate.tinymodel``), so raising
one number token raises them all. Untrained, 0.10 of the answer's mass is on numbers; GRPO
takes it near 1.0 within five LoRA updates of 64 rollouts while the shuffled-reward control
stays flat. A reward on the right value (the tool's 21) would be the better decision reward,
but the untrained model samples ``21`` with probability 9e-5: no rollout of the demo would ever
be rewarded (docs/demo.md). It is a format decision, not correctness.

``smollm2`` (SmolLM2-135M-Instruct, ``trajgate.smollm2``): each episode asks for a product of
two two-digit numbers, which the model gets wrong alone, with a ``calculator`` tool offered and
nothing forcing it (``examples/calculator_agent.py``). Two worked examples before the question
(``CALCULATOR_SHOTS``: question, call, result, answer, as earlier turns of the conversation)
show the call's exact form; without them the model never calls the tool (0 of 32 sampled first
turns, docs/demo.md), with them it calls in about a fifth of episodes and then answers right.
The reward ``correct_answer`` is 1.0 when the final answer states the product, else 0.0: it needs
the tool, so learning shows as more calls and more right answers. Every step is sampled freely
at temperature 1, so every step is trainable.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

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


CALCULATOR_SYSTEM_PROMPT = "Use the calculator tool for arithmetic, then answer with its result."
# (a, b) of the worked examples; no question of the task uses them.
_SHOT_FACTORS = ((12, 34), (27, 81))


def _call_turn(expression: str, call_id: str) -> dict[str, Any]:
    arguments = json.dumps({"expression": expression})
    function = {"name": "calculator", "arguments": arguments}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


def calculator_shots() -> list[dict[str, Any]]:
    """The worked examples, as the turns of a conversation the agent sends before the question:
    per example user, assistant tool call, tool result, assistant answer."""
    turns: list[dict[str, Any]] = []
    for index, (a, b) in enumerate(_SHOT_FACTORS):
        call_id = f"example-{index}"
        turns += [
            {"role": "user", "content": f"What is {a} * {b}?"},
            _call_turn(f"{a} * {b}", call_id),
            {"role": "tool", "tool_call_id": call_id, "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)},
        ]
    return turns


def product_question(round_index: int, group_index: int) -> tuple[str, int]:
    """The task of a group in a round, and its answer: a product of two numbers in 11..99,
    the same for both arms (a function of the round and the group only)."""
    rng = random.Random(f"product-{round_index}-{group_index}")
    while True:
        a, b = rng.randint(11, 99), rng.randint(11, 99)
        if (a, b) not in _SHOT_FACTORS:
            return f"What is {a} * {b}?", a * b


def states_number(text: str, number: int) -> bool:
    """Whether ``text`` states ``number`` as a whole number (``3717``, ``3,717`` or ``3717.0``;
    not inside a longer number like ``37170``)."""
    for match in re.finditer(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?![\d,])|(?<![\d.,])\d+", text):
        digits = match.group().replace(",", "")
        if int(digits) == number:
            return True
    return False


def correct_answer(context: RewardContext) -> float | None:
    """Reward function (``trajgate.demo_task:correct_answer``): 1.0 when the final answer states
    the trajectory's ``metadata["answer"]``, else 0.0 (a final message that is a tool call, or
    an answer without it). None (unrewarded, never 0.0) without an answer in the metadata or
    without any generated message (every step failed)."""
    expected = context.metadata.get("answer")
    message = context.final_message
    if not isinstance(expected, int) or message is None:
        return None
    if message.get("tool_calls"):
        return 0.0
    return 1.0 if states_number(str(message.get("content") or ""), expected) else 0.0
