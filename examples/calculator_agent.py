"""An ordinary OpenAI-SDK agent with a calculator tool it may call or not. Nothing in it knows
about trajgate except the ``base_url`` it is given: point it at
``http://GATEWAY/t/<trajectory_id>/v1`` and every call it makes is captured as a step of that
trajectory.

    python examples/calculator_agent.py --base-url http://127.0.0.1:8000/t/demo-1/v1 \
        --model smollm2 --question "What is 59 * 63?"

The tool loop: the model sees the question with a ``calculator`` tool offered (``tool_choice``
``auto``: nothing forces or constrains the call). When it calls the tool, the agent evaluates
the expression (numbers, ``+ - * /`` and parentheses only), sends the result back and asks for
the final answer; when it answers directly, that is the final answer. ``history`` (earlier
turns, e.g. worked examples) goes before the question.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
from collections.abc import Callable, Sequence
from typing import Any

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]

_OPERATORS: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def calculator(expression: str) -> str:
    """The expression's value (an integer when it is one), or ``error: ...``."""

    def value(node: ast.expr) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only numbers, + - * / and parentheses")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as exc:
        return f"error: {exc}"
    return str(int(result)) if result == int(result) else str(result)


def run(
    base_url: str,
    model: str,
    question: str,
    history: Sequence[dict[str, Any]] = (),
    system: str = "Use the calculator tool for arithmetic, then answer with its result.",
    max_tokens: int = 48,
    answer_max_tokens: int = 16,
    seed: int | None = None,
) -> str:
    """One episode at temperature 1: the model answers or calls the calculator; after a call,
    the tool's result and one more turn for the answer. Returns the final answer's text.
    ``seed``: the engine's sampling seed of the first turn (``seed + 1`` for the answer), so
    an episode run again under other weights draws the same random numbers; None: unseeded."""
    client = OpenAI(base_url=base_url, api_key="unused")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        *history,
        {"role": "user", "content": question},
    ]

    def turn(most_tokens: int, turn_seed: int | None) -> Any:
        """The model's next message, sampled at temperature 1 with the tool offered."""
        return (
            client.chat.completions.create(
                model=model,
                messages=messages,  # type: ignore[arg-type]
                tools=TOOLS,  # type: ignore[arg-type]
                max_tokens=most_tokens,
                temperature=1.0,
                **({} if turn_seed is None else {"seed": turn_seed}),
            )
            .choices[0]
            .message
        )

    message = turn(max_tokens, seed)
    if not message.tool_calls:
        return str(message.content or "")
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        try:
            arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
        except json.JSONDecodeError:
            arguments = {}
        expression = arguments.get("expression") if isinstance(arguments, dict) else None
        result = calculator(str(expression)) if expression is not None else "error: no expression"
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return str(turn(answer_max_tokens, None if seed is None else seed + 1).content or "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--question", default="What is 59 * 63?")
    args = parser.parse_args()
    print(json.dumps({"answer": run(args.base_url, args.model, args.question)}))


if __name__ == "__main__":
    main()
