"""Built-in reward functions: exact match of the final answer, tool-call format, a reward model,
and per step: tool-call format, a process reward model or judge.

Owns: three functions with the ``rewards.RewardFunction`` contract, registered as entry points of
the group ``trajgate.rewards`` (pyproject.toml), so
``TRAJGATE_REWARD_FUNCTIONS='["exact_match", "tool_call_format", "http_reward_model"]'`` runs
them on every completed trajectory; and two step reward functions
(``rewards.step_rewards.StepRewardFunction``) in the group ``trajgate.step_rewards``, run once
per ok step by ``TRAJGATE_STEP_REWARD_FUNCTIONS='["tool_call_format", "http_step_reward_model"]'``.
Never: writes to the pool (``rewards.run_reward_functions`` and
``rewards.step_rewards.run_step_reward_functions`` record what they return) or answers a number
for a trajectory or step it could not judge.

- ``exact_match``: 1.0 when the final answer equals ``metadata["answer"]`` (normalised), else 0.0.
- ``tool_call_format``: the share of generated tool calls that are well-formed, in [0, 1]; None
  when there is none.
- ``http_reward_model`` (async): what a reward model served over HTTP answers, any finite
  numbers, under its own name or the names the model returns.
- ``step_tool_call_format`` (entry point ``tool_call_format`` of ``trajgate.step_rewards``): the
  share of one step's tool calls that are well-formed; None when it made none.
- ``http_step_reward_model`` (async): what a process reward model or judge served over HTTP
  answers for one step.

Three outcomes, never confused (case C16): a number is the reward; None means nothing to judge
(no record: the trajectory stays unrewarded); an exception means the trajectory lacks an input
or the reward model failed, and ``run_reward_functions`` records it as a failed reward (``error``
set, ``value`` null), which never reads as 0.0. The exceptions::

    ValueError
     └── RewardInputError    the trajectory lacks an input (expected answer, final message, URL)
    RuntimeError
     └── RewardModelError    the reward model did not answer 2xx with a reward in time

The final step (``exact_match``, ``http_reward_model``) is ``RewardContext.final_step``: the last
step with outcome ``ok`` and a generated message. When that call sampled several choices
(``n > 1``) there is no one final answer, and both raise rather than pick a choice.

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import httpx

from datapool.rewards.step_rewards import StepRewardContext
from datapool.rewards.values import RewardContext
from datapool.steps.canonical import CanonicalCall, ToolCall, conversation
from datapool.steps.store import StoredStep

REWARD_MODEL_BODY = '{"reward": number} or {"rewards": {"name": number, ...}}'


class RewardInputError(ValueError):
    """The trajectory lacks an input the reward function needs."""


class RewardModelError(RuntimeError):
    """The reward model was unreachable, slow, failed, or answered without a reward."""


def normalize_answer(text: str) -> str:
    """``text`` stripped and casefolded, each run of whitespace one space: ``" Paris\\n FR "``
    becomes ``"paris fr"``. Punctuation and accents are kept."""
    return " ".join(text.casefold().split())


def exact_match(context: RewardContext) -> float:
    """1.0 when the final answer equals an expected one after ``normalize_answer``, else 0.0.

    Inputs: ``metadata["answer"]``, a string or a non-empty list of accepted strings (set it when
    registering the trajectory: ``POST /api/trajectories {"id", "metadata": {"answer": ...}}``),
    and the ``content`` string of the final step's generated message.

    Raises ``RewardInputError``: no ``answer`` or one of another type; no final step, or its
    call sampled several choices; a final message without text content (tool calls only).
    """
    answer = context.metadata.get("answer")
    accepted = [answer] if isinstance(answer, str) else answer
    if not (isinstance(accepted, list) and accepted and all(isinstance(a, str) for a in accepted)):
        got = repr(answer) if "answer" in context.metadata else "no 'answer' key"
        raise RewardInputError(
            f"exact_match: trajectory {context.trajectory_id!r} needs metadata['answer'], a "
            f"string or a non-empty list of strings, got {got} (set it with POST "
            "/api/trajectories {'id': ..., 'metadata': {'answer': ...}})"
        )
    content = _final_step(context, "exact_match").response_message.get("content")
    if not isinstance(content, str):
        raise RewardInputError(
            f"exact_match: the final message of trajectory {context.trajectory_id!r} has no text "
            f"content (expected a string, got {content!r}: only tool calls?)"
        )
    return 1.0 if normalize_answer(content) in {normalize_answer(a) for a in accepted} else 0.0


def tool_call_format(context: RewardContext) -> float | None:
    """The share of the trajectory's generated tool calls that are well-formed, in [0, 1].

    Counts every tool call of every ok step's generated message (``step.response``), whatever
    the dialect: it reads the canonical record (``datapool.steps.canonical``), so a Messages
    ``tool_use`` block and a Responses ``function_call`` count as a chat tool call does. A call
    is well-formed when (1) its name is one of the step's offered tools (``step.call.tools``) of
    type ``function``; (2) its ``arguments`` string parses as a JSON object; (3) that object has
    every key in the tool's ``parameters.required``. Not checked: value types, enums, nested
    schemas, ``additionalProperties``. A call cut at ``max_tokens`` (flag
    ``tool_call_truncated``) does not parse, so it counts as malformed.

    Returns None (unrewarded) for a trajectory that generated no tool call: 0.0 would punish a
    plain answer and 1.0 reward it. Raises nothing for any stored trajectory.
    """
    verdicts = [
        _well_formed(call, step.call)
        for step in context.steps
        if step.outcome == "ok" and step.response_message is not None
        for call in step.response.tool_calls
    ]
    if not verdicts:
        return None
    return sum(verdicts) / len(verdicts)


async def http_reward_model(context: RewardContext) -> float | dict[str, float]:
    """The reward a reward model served over HTTP gives the trajectory.

    POSTs ``{"trajectory_id", "group_id", "channel", "metadata", "messages"}`` as JSON to
    ``reward_model_url`` (``TRAJGATE_REWARD_MODEL_URL``); ``messages`` are the final step's
    canonical messages (every dialect's, the history of a Responses ``previous_response_id``
    included) followed by its generated message. Expects a 2xx JSON object with
    ``"reward": number`` (returned as a float, recorded as ``http_reward_model``) or
    ``"rewards": {name: number}`` (returned as a mapping, one record per name); other keys are
    ignored. Values are the model's, any finite number.

    Raises ``RewardModelError``: unreachable; no whole answer within ``reward_model_timeout_s``;
    a status other than 2xx; a body that is not such an object (not JSON, neither or both keys,
    an empty mapping, a value that is not a finite number). ``RewardInputError``: no
    ``reward_model_url`` in the context's settings; no final step, or several choices in it.
    """
    settings = context.settings
    if settings is None or settings.reward_model_url is None:
        raise RewardInputError(
            "http_reward_model: no reward model URL in the pool settings; set "
            "TRAJGATE_REWARD_MODEL_URL"
        )
    url, timeout_s = settings.reward_model_url, settings.reward_model_timeout_s
    step = _final_step(context, "http_reward_model")
    body = {
        "trajectory_id": context.trajectory_id,
        "group_id": context.group_id,
        "channel": context.channel,
        "metadata": context.metadata,
        "messages": _conversation(step),
    }
    return await _ask_reward_model(url, timeout_s, body)


def step_tool_call_format(context: StepRewardContext) -> float | None:
    """The share of the step's generated tool calls that are well-formed, in [0, 1] (the rules
    of ``tool_call_format``, on one step); None (unrewarded) when the step made no tool call."""
    step = context.step
    calls = step.response.tool_calls
    if not calls:
        return None
    return sum(_well_formed(call, step.call) for call in calls) / len(calls)


async def http_step_reward_model(context: StepRewardContext) -> float | dict[str, float]:
    """The reward a process reward model or judge served over HTTP gives one step.

    POSTs ``{"trajectory_id", "group_id", "channel", "metadata", "step_id", "step_index",
    "messages"}`` as JSON to ``step_reward_model_url`` (``TRAJGATE_STEP_REWARD_MODEL_URL``), one
    request per ok step; ``messages`` are the canonical messages the engine saw (every
    dialect's, as in exports) followed by its generated message (``{"role": "assistant",
    "content": null}`` when it generated none). Answers as for
    ``http_reward_model``: ``{"reward": number}`` or ``{"rewards": {name: number}}``, within
    ``reward_model_timeout_s``.

    Raises ``RewardModelError`` (unreachable, slow, not 2xx, no finite reward in the answer) and
    ``RewardInputError`` (no ``step_reward_model_url``): the step's reward is recorded as
    failed, never as 0.0.
    """
    trajectory, step = context.trajectory, context.step
    settings = trajectory.settings
    if settings is None or settings.step_reward_model_url is None:
        raise RewardInputError(
            "http_step_reward_model: no step reward model URL in the pool settings; set "
            "TRAJGATE_STEP_REWARD_MODEL_URL"
        )
    body = {
        "trajectory_id": trajectory.trajectory_id,
        "group_id": trajectory.group_id,
        "channel": trajectory.channel,
        "metadata": trajectory.metadata,
        "step_id": step.id,
        "step_index": step.step_index,
        "messages": _conversation(step),
    }
    return await _ask_reward_model(
        settings.step_reward_model_url, settings.reward_model_timeout_s, body
    )


async def _ask_reward_model(url: str, timeout_s: float, body: Any) -> float | dict[str, float]:
    """POST ``body`` to a reward model and read its reward; raises ``RewardModelError``."""
    try:
        # httpx's timeout bounds each read; asyncio's bounds the whole answer.
        async with asyncio.timeout(timeout_s), httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.post(url, json=body)
    except (TimeoutError, httpx.TimeoutException) as exc:
        raise RewardModelError(
            f"reward model {url} did not answer within {timeout_s:g} s (reward_model_timeout_s)"
        ) from exc
    except httpx.HTTPError as exc:
        raise RewardModelError(f"reward model {url} is unreachable: {exc!r}") from exc
    if not response.is_success:
        raise RewardModelError(
            f"reward model {url}: expected HTTP 2xx with {REWARD_MODEL_BODY}, got HTTP "
            f"{response.status_code}: {response.text[:200]}"
        )
    return _reward_of(url, response)


def _final_step(context: RewardContext, function: str) -> StoredStep:
    """The final step; raises when there is none, or when its call sampled several choices."""
    final = context.final_step
    if final is None:
        raise RewardInputError(
            f"{function}: trajectory {context.trajectory_id!r} has no ok step with a generated "
            "message (expected at least one)"
        )
    choices = sum(
        1
        for step in context.steps
        if step.step_index == final.step_index
        and step.outcome == "ok"
        and step.response_message is not None
    )
    if choices > 1:
        raise RewardInputError(
            f"{function}: the final call of trajectory {context.trajectory_id!r} (step_index "
            f"{final.step_index}) sampled {choices} choices; expected one final answer (n=1)"
        )
    return final


def _conversation(step: StoredStep) -> list[dict[str, Any]]:
    """The step's canonical messages then its generated message, as JSON."""
    return conversation(step.call or CanonicalCall(messages=None), step.row.response_message)


def _well_formed(call: ToolCall, asked: CanonicalCall | None) -> bool:
    """Whether ``call`` names a tool ``asked`` offered, with a JSON-object argument string that
    has the tool's required keys (see ``tool_call_format``)."""
    tool = None if asked is None else asked.tool_named(call.name)
    if tool is None:
        return False
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        return False
    if not isinstance(arguments, dict):
        return False
    parameters = tool.parameters or {}
    required = parameters.get("required")
    return all(key in arguments for key in required or [])


def _reward_of(url: str, response: httpx.Response) -> float | dict[str, float]:
    """The reward in a reward model's answer; raises ``RewardModelError`` naming what came."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and ("reward" in body) != ("rewards" in body):
        if _is_number(body.get("reward")):
            return float(body["reward"])
        rewards = body.get("rewards")
        if isinstance(rewards, dict) and rewards and all(map(_is_number, rewards.values())):
            return {str(name): float(value) for name, value in rewards.items()}
    raise RewardModelError(
        f"reward model {url}: expected a JSON object {REWARD_MODEL_BODY} with finite numbers, "
        f"got {response.text[:200]}"
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
