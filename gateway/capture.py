"""What the gateway asks vLLM for, what it reads back, and what it hides from the client.

Owns: turning a client's request into the upstream request (adding ``return_token_ids`` and
``logprobs``), reading the exact prompt IDs, sampled IDs and behaviour logprobs out of the raw
upstream JSON (chat and completions), and removing from the response what the client did not
ask for. Never: tokenizes or decodes; an ID or logprob vLLM did not send is recorded as missing.

Field facts (vLLM 0.32, checked against the real server):

- A non-streaming chat response always carries the keys ``prompt_token_ids`` (top level),
  ``choices[i].token_ids`` and ``choices[i].logprobs``, ``null`` unless asked for; a completions
  response has ``choices[i].prompt_token_ids`` and ``choices[i].token_ids`` instead.
- So "stripping" restores ``null``, which is what vLLM returns to a client that did not ask.
- ``token_ids`` holds every sampled token, the end token and a matched stop string included.

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from datapool.steps.records import ChoiceRecord

Endpoint = Literal["chat.completions", "completions"]

# Integrity flags: a step carrying one is kept for inspection, never exported for training.
IDS_MISSING = "ids_missing"
IDS_INCOMPLETE = "ids_incomplete"
PROMPT_IDS_MISSING = "prompt_ids_missing"
ABORTED = "aborted"
# Quality facts: recorded, left to curation.
TRUNCATED = "truncated"
TOOL_CALL_TRUNCATED = "tool_call_truncated"
THINKING_OFF = "thinking_off"
PREFILL = "prefill"
# Sampled under a grammar (forced tool call, JSON schema, regex): vLLM reports logprobs of the
# masked distribution (a forced token has logprob 0), not of the policy the trainer computes, so
# the importance ratio against them is meaningless. Curation usually keeps such steps out.
CONSTRAINED = "constrained"
_STRUCTURED_FIELDS = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


@dataclass(frozen=True)
class ClientAsked:
    """Which capture fields the client itself asked for (so they are not stripped).

    ``logprobs`` is True for chat ``logprobs: true`` and for completions ``logprobs: <int>``.
    """

    return_token_ids: bool
    logprobs: bool
    include_usage: bool = True


# An integer literal of 19 or more digits may not fit in 64 bits, where orjson would hand back a
# float instead of the exact int (not a float's digits: no '.' before, no '.', 'e' or digit after).
_LONG_INT = re.compile(rb"(?<![\d.])\d{19,}(?![\d.eE])")


def loads(data: bytes) -> Any:
    """Parse JSON exactly as ``json.loads`` does, with orjson where the result is the same.

    orjson is several times faster, but turns integers past 64 bits into floats and refuses what
    ``json.loads`` accepts beyond the standard (``NaN``, lone surrogates); those go to ``json``.
    Raises ``json.JSONDecodeError`` (a ``ValueError``) on invalid JSON.
    """
    if _LONG_INT.search(data) is None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)


def prepare_request(endpoint: Endpoint, body: dict[str, Any]) -> tuple[dict[str, Any], ClientAsked]:
    """Return the body to send upstream and what the client asked for.

    The upstream body is the client's body with ``return_token_ids: true``, logprobs on
    (chat: ``true``; completions: the client's count, at least 1) and, when streaming,
    ``stream_options.include_usage: true`` so sampled IDs can be checked against the usage
    count. Everything else (``top_logprobs``, tools, vendor fields) passes through untouched.
    """
    upstream = dict(body)
    upstream["return_token_ids"] = True
    if endpoint == "chat.completions":
        asked_logprobs = body.get("logprobs") is True
        upstream["logprobs"] = True
    elif endpoint == "completions":
        client_logprobs = body.get("logprobs")
        asked_logprobs = isinstance(client_logprobs, int) and not isinstance(client_logprobs, bool)
        upstream["logprobs"] = client_logprobs if asked_logprobs else 1
    else:
        raise ValueError(f"unknown endpoint {endpoint!r}; expected chat.completions or completions")
    stream_options = body.get("stream_options")
    include_usage = isinstance(stream_options, dict) and stream_options.get("include_usage") is True
    if body.get("stream") is True:
        upstream["stream_options"] = {
            **(stream_options if isinstance(stream_options, dict) else {}),
            "include_usage": True,
        }
    return upstream, ClientAsked(
        return_token_ids=body.get("return_token_ids") is True,
        logprobs=asked_logprobs,
        include_usage=include_usage or body.get("stream") is not True,
    )


def request_hash(endpoint: Endpoint, body: dict[str, Any]) -> str:
    """SHA-256 of the endpoint and the body as canonical JSON (sorted keys): re-send detection."""
    canonical = json.dumps([endpoint, body], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def choice_logprobs(endpoint: Endpoint, logprobs: dict[str, Any] | None) -> list[float] | None:
    """Per-token behaviour logprobs ``[T]`` of one choice (or chunk), or None when absent."""
    if not logprobs:
        return None
    if endpoint == "chat.completions":
        content = logprobs.get("content")
        return None if content is None else [float(entry["logprob"]) for entry in content]
    values = logprobs.get("token_logprobs")
    return None if values is None else [float(value) for value in values]


def quality_flags(
    body: dict[str, Any], finish_reason: str | None, message: dict[str, Any] | None
) -> list[str]:
    """Facts curation may act on: truncated at max_tokens, a tool call cut mid-call (C18),
    thinking turned off, an assistant prefill (C09), sampling under a grammar."""
    flags: list[str] = []
    if finish_reason == "length":
        flags.append(TRUNCATED)
        text = str((message or {}).get("content") or (message or {}).get("text") or "")
        if "<tool_call>" in text and "</tool_call>" not in text.split("<tool_call>")[-1]:
            flags.append(TOOL_CALL_TRUNCATED)
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False:
        flags.append(THINKING_OFF)
    if body.get("continue_final_message") is True:
        flags.append(PREFILL)
    if is_constrained(body):
        flags.append(CONSTRAINED)
    return flags


def is_constrained(body: dict[str, Any]) -> bool:
    """Whether vLLM samples this request under a grammar (see ``CONSTRAINED``)."""
    tool_choice = body.get("tool_choice")
    if body.get("tools") and (tool_choice == "required" or isinstance(tool_choice, dict)):
        return True
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return True
    return any(body.get(field) is not None for field in _STRUCTURED_FIELDS)


def integrity_flags(
    ids: list[int] | None, logprobs: list[float] | None, prompt_ids: list[int] | None
) -> list[str]:
    flags: list[str] = []
    if ids is None or logprobs is None:
        flags.append(IDS_MISSING)
    elif len(ids) != len(logprobs):
        flags.append(IDS_INCOMPLETE)
    if prompt_ids is None:
        flags.append(PROMPT_IDS_MISSING)
    return flags


def check_against_usage(choices: list[ChoiceRecord], completion_tokens: int | None) -> None:
    """Flag every choice ``ids_incomplete`` when the sampled IDs do not add up to
    ``usage.completion_tokens``; nothing is padded or shifted to make them agree (C05)."""
    total = sum(len(choice.response_token_ids or []) for choice in choices)
    if completion_tokens is None or total == completion_tokens:
        return
    for choice in choices:
        if IDS_MISSING not in choice.flags and IDS_INCOMPLETE not in choice.flags:
            choice.flags.append(IDS_INCOMPLETE)


def read_choices(
    endpoint: Endpoint, body: dict[str, Any], response: dict[str, Any]
) -> tuple[list[int] | None, list[ChoiceRecord]]:
    """Read prompt IDs ``[P]`` and, per choice, sampled IDs ``[T]`` and logprobs ``[T]``.

    A choice gets ``ids_missing`` when vLLM sent no IDs or logprobs (e.g. a reasoning parser
    with ``include_reasoning: false``, case C07), and ``ids_incomplete`` when
    ``len(ids) != len(logprobs)`` or all choices' IDs do not add up to ``usage.completion_tokens``.
    """
    if endpoint == "chat.completions":
        prompt_ids = response.get("prompt_token_ids")
    else:
        first = (response.get("choices") or [{}])[0]
        prompt_ids = first.get("prompt_token_ids")
    choices: list[ChoiceRecord] = []
    for position, choice in enumerate(response.get("choices") or []):
        ids = choice.get("token_ids")
        logprobs = choice_logprobs(endpoint, choice.get("logprobs"))
        message = (
            choice.get("message")
            if endpoint == "chat.completions"
            else {"text": choice.get("text")}
        )
        stop_reason = choice.get("stop_reason")
        choices.append(
            ChoiceRecord(
                choice_index=int(choice.get("index", position)),
                response_token_ids=ids,
                response_logprobs=logprobs,
                response_message=message,
                finish_reason=choice.get("finish_reason"),
                flags=integrity_flags(ids, logprobs, prompt_ids)
                + quality_flags(body, choice.get("finish_reason"), message),
                stop_reason=None if stop_reason is None else str(stop_reason),
            )
        )
    check_against_usage(choices, (response.get("usage") or {}).get("completion_tokens"))
    return prompt_ids, choices


def strip_for_client(response: dict[str, Any], asked: ClientAsked) -> dict[str, Any]:
    """The upstream response (or one stream chunk) as vLLM would have answered the client.

    Restores ``null`` for ``prompt_token_ids`` (top level and per choice), ``token_ids`` and
    ``logprobs`` the client did not ask for; keeps keys and their order.
    """
    if asked.return_token_ids and asked.logprobs:
        return response
    stripped = copy.copy(response)
    if not asked.return_token_ids and stripped.get("prompt_token_ids") is not None:
        stripped["prompt_token_ids"] = None
    if "choices" in stripped:
        new_choices = []
        for choice in stripped["choices"]:
            choice = dict(choice)
            if not asked.return_token_ids:
                for key in ("token_ids", "prompt_token_ids"):
                    if choice.get(key) is not None:
                        choice[key] = None
            if not asked.logprobs and choice.get("logprobs") is not None:
                choice["logprobs"] = None
            new_choices.append(choice)
        stripped["choices"] = new_choices
    return stripped
