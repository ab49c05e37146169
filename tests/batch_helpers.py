"""Helpers for the curation and batch tests: trajectories written through ``PoolStore``."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from datapool.db import make_engine
from datapool.lifecycle import transitions as lifecycle
from datapool.models import TrajectoryStatus
from datapool.settings import PoolSettings
from datapool.steps.records import CallRecord, ChoiceRecord
from datapool.steps.store import PoolStore
from gateway.dialects.chat_completions import ChatCompletions


def make_store(pool_settings: PoolSettings) -> PoolStore:
    return PoolStore(make_engine(pool_settings.resolved_database_url()), pool_settings)


def logprobs_of(response: Sequence[int]) -> list[float]:
    # float32-exact values, like vLLM's
    return [-0.25 - (t % 7) / 8 for t in response]


def call(
    prompt: list[int] | None,
    response: list[int] | None,
    *,
    flags: Sequence[str] = (),
    outcome: str = "ok",
    policy_version: int = 0,
    finish_reason: str = "stop",
    later_messages: Sequence[dict[str, str]] = (),
) -> CallRecord:
    """A chat call whose conversation is one task message (named by the prompt's first ids),
    then ``later_messages``."""
    task = {"role": "user", "content": f"task {prompt[:3] if prompt else ''}"}
    request = {"messages": [task, *later_messages]}
    return CallRecord(
        request=request,
        upstream_request={},
        canonical=ChatCompletions().canonical(request),
        history_field="messages",
        model="tiny",
        upstream="http://up",
        policy_version=policy_version,
        latency_ms=1.0,
        prompt_token_ids=prompt,
        prompt_tokens=None if prompt is None else len(prompt),
        choices=[
            ChoiceRecord(
                0,
                response,
                None if response is None else logprobs_of(response),
                {"role": "assistant", "content": "ok"},
                finish_reason,
                flags=list(flags),
            )
        ],
        outcome=outcome,
        # what the gateway stores: a hash of the request body (here: of the prompt)
        request_hash=None if prompt is None else hashlib.sha256(str(prompt).encode()).hexdigest(),
    )


def agent_turns(seed: int, turns: int) -> list[tuple[list[int], list[int]]]:
    """``[(P_k, R_k)]``: each prompt extends the previous prompt + response by 3 tool tokens."""
    prompt = [seed * 100 + i for i in range(5)]
    result = []
    for k in range(turns):
        response = [1000 + seed * 10 + k, 1500 + k]
        result.append((prompt, response))
        prompt = [*prompt, *response, 7, 8, 9]
    return result


def write_trajectory(
    store: PoolStore,
    trajectory_id: str,
    turns: Sequence[tuple[list[int], list[int]]],
    *,
    group_id: str | None = None,
    reward: float | None = None,
    complete: bool = True,
) -> list[str]:
    """Record each turn as one call, then complete with ``reward`` (None: unrewarded)."""
    step_ids = []
    for prompt, response in turns:
        step_ids += store.record_call(trajectory_id, call(prompt, response), group_id=group_id)
    if complete:
        lifecycle.close_trajectory(
            store.sessions, trajectory_id, TrajectoryStatus.COMPLETE, final_reward=reward
        )
    return step_ids
