"""One step as the pool API and the inspector's token view show it.

Owns: a stored step with its current rewards and, when a tokenizer is configured, its decoded
text (``GET /api/steps/{id}``), and the token view (``GET /api/steps/{id}/tokens``, whole or one
window of positions at a time: IDs, their text with the tokenizer the caller chose for the
step's model, behaviour logprobs, loss mask, where the prompt stops repeating the parent).
Never: encodes text into token IDs; IDs are the stored ones (see ``datapool.queries.token_text``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datapool.queries.token_text import decode, decode_each, special_ids
from datapool.rewards.values import current_rewards
from datapool.steps.store import PoolStore, StoredStep


@dataclass(frozen=True)
class StepView:
    """A step, its current reward per name, and its decoded text (None without a tokenizer or
    without IDs)."""

    step: StoredStep
    rewards: dict[str, float]
    prompt_text: str | None
    response_text: str | None


def step_view(store: PoolStore, step_id: str) -> StepView | None:
    """The step with its token payload, rewards and decoded text; None for an unknown id."""
    step = store.get_step(step_id)
    if step is None:
        return None
    with store.sessions() as session:
        rewards = current_rewards(session, "step", [step_id]).get(step_id, {})
    prompt_text = response_text = None
    tokenizer_dir = store.settings.tokenizer_dir
    if tokenizer_dir is not None:
        if step.prompt_token_ids is not None:
            prompt_text = decode(tokenizer_dir, step.prompt_token_ids)
        if step.response_token_ids is not None:
            response_text = decode(tokenizer_dir, step.response_token_ids)
    return StepView(step, rewards, prompt_text, response_text)


def step_tokens(
    store: PoolStore,
    step_id: str,
    choose: Callable[[str | None], tuple[Path, str] | None] | None = None,
    *,
    offset: int = 0,
    limit: int | None = None,
) -> dict[str, Any] | None:
    """The token view of a step, or of the window ``[offset, offset + limit)`` of its positions
    (prompt tokens first, then response tokens; ``limit`` None: to the end); None for an unknown
    id.

    Of the window: ``prompt_token_ids`` and ``response_token_ids`` (the part of each inside it;
    None when the engine reported none), behaviour ``response_logprobs`` (non-finite ones as
    None, which JSON can carry), ``loss_mask`` (0 per prompt token, 1 per sampled token), and
    with a tokenizer ``token_texts`` (each ID decoded alone), ``special_token_ids`` (the added
    tokens among them) and ``tokenizer`` (``{path, source}``). Of the whole step:
    ``prompt_token_count``, ``response_token_count``, ``prompt_base_tokens``,
    ``divergence_offset``; ``next_offset`` is where the next window starts (None at the end).
    Only the window is decoded, so a page of a long step costs what a short step does.
    ``choose`` maps the step's ``model`` to ``(directory, source)``; without it,
    ``TRAJGATE_TOKENIZER_DIR`` is the only tokenizer. Raises ``ValueError`` when ``offset`` is
    past the step's last position."""
    step = store.get_step(step_id)
    if step is None:
        return None
    prompt = step.prompt_token_ids or []
    response = step.response_token_ids or []
    total = len(prompt) + len(response)
    if offset > total:
        raise ValueError(f"offset {offset} is past the step's {total} tokens (expected <= {total})")
    end = total if limit is None else min(total, offset + limit)
    # The window's parts, as positions in each list (a response position is offset by P).
    prompt_part = slice(min(offset, len(prompt)), min(end, len(prompt)))
    response_part = slice(max(0, offset - len(prompt)), max(0, end - len(prompt)))
    window_prompt, window_response = prompt[prompt_part], response[response_part]
    if choose is not None:
        chosen = choose(step.model)
    elif store.settings.tokenizer_dir is not None:
        chosen = (store.settings.tokenizer_dir, "TRAJGATE_TOKENIZER_DIR")
    else:
        chosen = None
    texts: list[str] | None = None
    special: list[int] = []
    if chosen is not None:
        ids = [*window_prompt, *window_response]
        texts = decode_each(chosen[0], ids)
        special = sorted(special_ids(chosen[0]) & set(ids))
    logprobs = step.response_logprobs
    return {
        "step_id": step.id,
        "trajectory_id": step.trajectory_id,
        "step_index": step.step_index,
        "policy_version": step.policy_version,
        "model": step.model,
        "flags": list(step.flags or []),
        "offset": offset,
        "next_offset": end if end < total else None,
        "prompt_token_count": len(prompt),
        "response_token_count": len(response),
        "prompt_token_ids": None if step.prompt_token_ids is None else window_prompt,
        "response_token_ids": None if step.response_token_ids is None else window_response,
        "response_logprobs": [None if not math.isfinite(x) else x for x in logprobs[response_part]]
        if logprobs is not None
        else None,
        "loss_mask": [0] * len(window_prompt) + [1] * len(window_response),
        "prompt_base_tokens": step.prompt_base_tokens or 0,
        "divergence_offset": step.divergence_offset,
        "token_texts": texts,
        "special_token_ids": special,
        "tokenizer": None if chosen is None else {"path": str(chosen[0]), "source": chosen[1]},
    }
