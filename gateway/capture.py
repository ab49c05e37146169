"""What the gateway asks vLLM for, what it reads back, and what it hides from the client.

Owns: turning a client's chat request into the upstream request (adding ``return_token_ids`` and
``logprobs``), reading the exact prompt IDs, sampled IDs and behaviour logprobs out of the raw
upstream JSON, and removing from the response what the client did not ask for.
Never: tokenizes or decodes; an ID or logprob that vLLM did not send is recorded as missing.

Field facts (vLLM 0.32, checked against the real server): a non-streaming chat response always
carries the keys ``prompt_token_ids`` (top level), ``choices[i].token_ids`` and
``choices[i].logprobs``; they are ``null`` unless asked for. So "stripping" restores ``null``,
which is byte-for-byte what vLLM returns to a client that did not ask.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from datapool.records import ChoiceRecord

# Integrity flags: a step carrying one is kept for inspection, never exported for training.
IDS_MISSING = "ids_missing"
IDS_INCOMPLETE = "ids_incomplete"
PROMPT_IDS_MISSING = "prompt_ids_missing"
# Quality facts: recorded, left to curation.
TRUNCATED = "truncated"


@dataclass(frozen=True)
class ClientAsked:
    """Which capture fields the client itself asked for (so they are not stripped)."""

    return_token_ids: bool
    logprobs: bool


def prepare_chat_request(body: dict[str, Any]) -> tuple[dict[str, Any], ClientAsked]:
    """Return the body to send upstream and what the client asked for.

    The upstream body is the client's body with ``return_token_ids: true`` and ``logprobs: true``
    set; everything else (``top_logprobs``, tools, vendor fields) passes through untouched.
    """
    asked = ClientAsked(
        return_token_ids=body.get("return_token_ids") is True,
        logprobs=body.get("logprobs") is True,
    )
    upstream = dict(body)
    upstream["return_token_ids"] = True
    upstream["logprobs"] = True
    return upstream, asked


def read_chat_choices(
    response: dict[str, Any],
) -> tuple[list[int] | None, list[ChoiceRecord]]:
    """Read prompt IDs ``[P]`` and, per choice, sampled IDs ``[T]`` and logprobs ``[T]``.

    A choice gets ``ids_missing`` when vLLM sent no IDs or logprobs, and ``ids_incomplete`` when
    ``len(ids) != len(logprobs)`` or the IDs of all choices do not add up to
    ``usage.completion_tokens``. Nothing is padded or shifted to make lengths agree.
    """
    prompt_ids = response.get("prompt_token_ids")
    choices: list[ChoiceRecord] = []
    total_sampled = 0
    for position, choice in enumerate(response.get("choices") or []):
        ids = choice.get("token_ids")
        content = (choice.get("logprobs") or {}).get("content")
        logprobs = [entry["logprob"] for entry in content] if content is not None else None
        flags: list[str] = []
        if ids is None or logprobs is None:
            flags.append(IDS_MISSING)
        elif len(ids) != len(logprobs):
            flags.append(IDS_INCOMPLETE)
        if prompt_ids is None:
            flags.append(PROMPT_IDS_MISSING)
        if choice.get("finish_reason") == "length":
            flags.append(TRUNCATED)
        total_sampled += len(ids or [])
        choices.append(
            ChoiceRecord(
                choice_index=int(choice.get("index", position)),
                response_token_ids=ids,
                response_logprobs=logprobs,
                response_message=choice.get("message"),
                finish_reason=choice.get("finish_reason"),
                flags=flags,
            )
        )
    completion_tokens = (response.get("usage") or {}).get("completion_tokens")
    if completion_tokens is not None and total_sampled != completion_tokens:
        for record in choices:
            if IDS_MISSING not in record.flags and IDS_INCOMPLETE not in record.flags:
                record.flags.append(IDS_INCOMPLETE)
    return prompt_ids, choices


def strip_for_client(response: dict[str, Any], asked: ClientAsked) -> dict[str, Any]:
    """The upstream response as vLLM would have answered the client's own request."""
    if asked.return_token_ids and asked.logprobs:
        return response
    stripped = copy.copy(response)
    if not asked.return_token_ids and "prompt_token_ids" in stripped:
        stripped["prompt_token_ids"] = None
    new_choices = []
    for choice in stripped.get("choices") or []:
        choice = dict(choice)
        if not asked.return_token_ids and "token_ids" in choice:
            choice["token_ids"] = None
        if not asked.logprobs and "logprobs" in choice:
            choice["logprobs"] = None
        new_choices.append(choice)
    if "choices" in stripped:
        stripped["choices"] = new_choices
    return stripped
