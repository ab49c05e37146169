"""What a captured call is checked for, whatever its API dialect.

Owns: the step flags (integrity flags that keep a step out of training, quality facts left to
curation) and how they are derived from the sampled IDs, logprobs, usage and the request body;
the re-send hash. Reading the engine's answers (exact JSON, their shapes, token ids) is the
engine room's (``gateway.engine.wire``, ``gateway.engine.answers``). Where the IDs and logprobs
sit in an answer is each dialect's business (``gateway.dialects``). Never: tokenizes or
decodes; an ID or logprob vLLM did not send is recorded as missing, never made up.

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import orjson

from datapool.steps.records import ChoiceRecord

# Integrity flags: a step carrying one is kept for inspection, never exported for training.
IDS_MISSING = "ids_missing"
IDS_INCOMPLETE = "ids_incomplete"
PROMPT_IDS_MISSING = "prompt_ids_missing"
ABORTED = "aborted"
# The engine's answer ended without a finish reason for the choice (a stream cut off, or a
# unary ``finish_reason: null``): its tokens may be a prefix of what was sampled.
UNFINISHED = "unfinished"
# Quality facts: recorded, left to curation.
TRUNCATED = "truncated"
TOOL_CALL_TRUNCATED = "tool_call_truncated"
THINKING_OFF = "thinking_off"
PREFILL = "prefill"


def request_hash(dialect: str, body: dict[str, Any]) -> str:
    """SHA-256 of the dialect's name and the client's body as canonical JSON (sorted keys):
    re-send detection.

    The text hashed is ``json.dumps([dialect, body], sort_keys=True, separators=(",", ":"))``
    (stored hashes must not change). orjson writes it in a tenth of the time where its text
    is byte for byte that one (``_as_json_writes``), the stdlib otherwise."""
    try:
        text: bytes | None = orjson.dumps([dialect, body], option=orjson.OPT_SORT_KEYS)
    except TypeError:  # an integer past 64 bits, a lone surrogate
        text = None
    if text is None or not _as_json_writes(text):
        text = json.dumps([dialect, body], sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(text).hexdigest()


def _as_json_writes(text: bytes) -> bool:
    """Whether orjson's ``text`` (compact, keys sorted) is what ``json.dumps`` with
    ``ensure_ascii`` writes for the same value. Both sort keys by code point, write integers,
    ``true``, ``false``, ``null`` and the escapes of ``"``, ``\\`` and controls alike, and
    floats alike except below 1e-4 in magnitude, where orjson writes ``0.0000...`` or a
    negative exponent without its leading zero (``1e-6``; json ``1e-06``; checked on 150,000
    doubles by the test). So: only printable ASCII (json escapes the rest, DEL included), and
    neither ``0.0000`` nor a digit before ``e-`` anywhere (in a string too: such a body only
    takes the stdlib's path)."""
    if not text.isascii() or b"\x7f" in text or b"0.0000" in text:
        return False
    at = text.find(b"e-")
    while at != -1:
        if at and 0x30 <= text[at - 1] <= 0x39:
            return False
        at = text.find(b"e-", at + 2)
    return True


def quality_flags(
    body: dict[str, Any], finish_reason: str | None, message: dict[str, Any] | None
) -> list[str]:
    """Facts curation may act on: truncated at max_tokens, a tool call cut mid-call (C18),
    thinking turned off, an assistant prefill (C09). Sampling under a grammar (``constrained``)
    is the proxy's (``gateway.proxy.sampling``): it knows the replicas' tool strict level."""
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
    return flags


def integrity_flags(
    ids: list[int] | None, logprobs: list[float] | None, prompt_ids: list[int] | None
) -> list[str]:
    """``ids_missing`` when sampled IDs ``[T]`` or logprobs are absent, ``ids_incomplete`` when
    their lengths differ, ``prompt_ids_missing`` when the prompt IDs are absent or empty (no
    template renders an empty prompt, and vLLM refuses one it tokenizes itself: an empty list
    is a prompt the engine was handed, not the one it rendered)."""
    flags: list[str] = []
    if ids is None or logprobs is None:
        flags.append(IDS_MISSING)
    elif len(ids) != len(logprobs):
        flags.append(IDS_INCOMPLETE)
    if not prompt_ids:
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
