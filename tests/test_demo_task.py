"""The demo's SmolLM2 task (trajgate/demo_task.py, examples/calculator_agent.py): the
correctness reward, the number reading it rests on, and the agent's calculator."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from datapool.models import Step
from datapool.rewards.values import RewardContext
from datapool.steps.store import StoredStep
from trajgate import demo_task

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _agent() -> Any:
    spec = importlib.util.spec_from_file_location(
        "calculator_agent", EXAMPLES / "calculator_agent.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("text", "stated"),
    [
        ("3717", True),
        ("The answer is 3,717.", True),
        ("59 * 63 = 3717.0", True),  # a whole number written with a decimal
        ("59 * 63 is equivalent to 3156.5.", False),  # the model's own answer alone
        ("37170", False),  # inside a longer number
        ("13717", False),
        ("0.3717", False),
        ("3717 and 3156", True),
        ("", False),
    ],
)
def test_states_number_reads_whole_numbers_only(text: str, stated: bool) -> None:
    assert demo_task.states_number(text, 3717) is stated


def _context(metadata: dict[str, Any], messages: list[dict[str, Any] | None]) -> RewardContext:
    steps = [
        StoredStep(
            Step(outcome="ok" if m is not None else "upstream_error", response_message=m),
            None,
            None,
            None,
        )
        for m in messages
    ]
    return RewardContext("t", "g", "train", metadata, steps)


def test_correct_answer_is_one_for_the_product_zero_otherwise_none_without_an_answer() -> None:
    call = {"role": "assistant", "tool_calls": [{"function": {"name": "calculator"}}]}
    answer = {"role": "assistant", "content": "3717"}
    wrong = {"role": "assistant", "content": "59 * 63 = 3156.5"}
    rewarded = demo_task.correct_answer
    assert rewarded(_context({"answer": 3717}, [call, answer])) == 1.0  # called, then right
    assert rewarded(_context({"answer": 3717}, [answer])) == 1.0  # right without the tool
    assert rewarded(_context({"answer": 3717}, [wrong])) == 0.0
    assert rewarded(_context({"answer": 3717}, [answer, call])) == 0.0  # ends on a call
    assert rewarded(_context({"answer": 3717}, [None])) is None  # no generated message
    assert rewarded(_context({}, [answer])) is None  # no answer to check against


def test_product_questions_are_fixed_per_round_and_group_and_never_the_examples() -> None:
    questions = [demo_task.product_question(r, g) for r in range(20) for g in range(16)]
    assert demo_task.product_question(3, 5) == questions[3 * 16 + 5]
    for text, answer in questions:
        a, b = (int(x) for x in text.removeprefix("What is ").removesuffix("?").split(" * "))
        assert 11 <= a <= 99 and 11 <= b <= 99 and answer == a * b
        assert (a, b) not in ((12, 34), (27, 81))
    assert len({q for q, _ in questions}) > 300  # 320 draws from 89 * 89 pairs


def test_the_worked_examples_are_call_result_answer_turns() -> None:
    shots = demo_task.calculator_shots()
    assert [m["role"] for m in shots] == ["user", "assistant", "tool", "assistant"] * 2
    call = shots[1]["tool_calls"][0]
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "12 * 34"}'}
    assert shots[2] == {"role": "tool", "tool_call_id": call["id"], "content": "408"}  # 12*34
    assert shots[3]["content"] == "408"


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("59 * 63", "3717"),
        ("(2 + 3) * 4", "20"),
        ("7 / 2", "3.5"),
        ("-4 * 2", "-8"),
    ],
)
def test_calculator_evaluates_arithmetic(expression: str, value: str) -> None:
    assert _agent().calculator(expression) == value


@pytest.mark.parametrize("expression", ["2 ** 10", "__import__('os')", "59 x 63", "1 / 0", ""])
def test_calculator_refuses_anything_else_with_an_error(expression: str) -> None:
    assert _agent().calculator(expression).startswith("error: ")
