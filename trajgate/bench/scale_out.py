"""The emulator's token-in, token-out endpoints, in vLLM 0.32's ``--enable-scale-out`` shapes.

Owns: the bodies of ``POST /v1/chat/completions/render`` (a chat body in, a ``GenerateRequest``
out: the prompt's ``token_ids`` as ``ResponseBook.prompt_of`` renders them and the
``sampling_params`` derived from the body), ``POST /inference/v1/generate`` (token ids and
sampling parameters in, the sampled ``token_ids`` and per-token ``logprobs.content[k]``
(``token_id``, ``logprob``, ``rank``, ``top_logprobs``) out, one JSON body or one SSE event per
token and choice) and ``POST /v1/chat/completions/derender`` (a whole generate answer in, the
chat completion out; for the gateway's exact streams the emulator's chat endpoint takes
forwarded prompt ids, ``ResponseBook.chat_prompt_of``). Never: tokenizes or parses tool calls;
a response's text is the emulator's own ``" t<id>"`` per token (``book._text``), so a
derendered answer echoed back is rendered to exactly its ids again, as a faithful chat
template would.

Shapes follow vLLM 0.32's ``entrypoints/scale_out`` protocol (``GenerateRequest``,
``GenerateTokensResponse``, ``GenerateTokensStreamResponse``, ``DerenderChatRequest``), read
in its source. Deliberately simpler: ``sampling_params`` holds only the fields the emulator
reads (``n``, ``max_tokens``, ``logprobs``, ``temperature``, ``seed``); ``weight_versions``
is one span over a unary answer's tokens labelled with the engine's label when the request
came (``trajgate.bench.weight_endpoints``: the emulator samples a whole answer at once), null
on streamed chunks; no streamed derender; the sampled ids are the book's seeded ids whatever
the prompt.
Served only with ``prompt_ids="messages"`` (a fixed prompt has no turns to continue), else
404 like a vLLM started without ``--enable-scale-out``.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.engine.paths import DERENDER_PATH as DERENDER_PATH
from gateway.engine.paths import GENERATE_PATH as GENERATE_PATH
from gateway.engine.paths import RENDER_PATH as RENDER_PATH
from trajgate.bench.book import SYSTEM_FINGERPRINT, ResponseBook, _dumps, _Shape, _text

# The paths it serves: the gateway's own constants, so the emulator answers where it asks.
PATHS = (RENDER_PATH, GENERATE_PATH, DERENDER_PATH)


def render(book: ResponseBook, body: dict[str, Any], request_id: str) -> dict[str, Any]:
    """The ``GenerateRequest`` of a chat body. Raises ``ValueError`` on a body the chat
    endpoint refuses (no messages, a bad ``max_tokens`` or ``n``)."""
    if not isinstance(body.get("messages"), list):
        raise ValueError("messages must be a list of objects")
    shape = book.shape_of(body)
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    stream = shape.stream
    return {
        "request_id": request_id,
        "token_ids": book.prompt_of(body),
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": {
            "n": shape.n,
            "temperature": body.get("temperature", 1.0),
            "seed": body.get("seed"),
            "max_tokens": limit,
            "logprobs": 0 if shape.logprobs else None,
        },
        "model": body.get("model"),
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": stream,
        "stream_options": body.get("stream_options") if stream else None,
        "cache_salt": None,
        "priority": 0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def generate_shape(book: ResponseBook, body: dict[str, Any]) -> _Shape:
    """What a ``GenerateRequest`` asks for. Raises ``ValueError`` without ``token_ids`` (at
    least one non-negative int) or ``sampling_params``."""
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError("token_ids must be a non-empty list of non-negative ints")
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        raise ValueError("sampling_params must be an object")
    options = body.get("stream_options")
    chat_like = {
        "max_tokens": params.get("max_tokens"),
        "n": params.get("n"),
        "stream": body.get("stream") is True,
        "stream_options": options,
        "logprobs": params.get("logprobs") is not None,
        "return_token_ids": True,
    }
    return book.shape_of(chat_like)


def _logprobs(ids: list[int], logprobs: list[float]) -> dict[str, Any]:
    entries = [
        {"token_id": i, "logprob": lp, "rank": 1, "top_logprobs": []}
        for i, lp in zip(ids, logprobs, strict=True)
    ]
    return {"content": entries}


def _generate_choice(shape: _Shape, index: int, ids: list[int], lps: list[float]) -> dict[str, Any]:
    return {
        "index": index,
        "token_ids": ids,
        "routed_experts": None,
        "sampling_mask": None,
        "weight_versions": None,
        "logprobs": _logprobs(ids, lps) if shape.logprobs else None,
    }


def generate_parts(
    book: ResponseBook, shape: _Shape, request_id: str, prompt_tokens: int
) -> list[bytes]:
    """The generate answer: one JSON body, or one ``data: ...\\n\\n`` event per token per
    choice (round robin), a usage event when asked, then ``[DONE]``."""
    completion = shape.completion_tokens
    usage = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion * shape.n,
        "completion_tokens": completion * shape.n,
        "prompt_tokens_details": None,
    }
    head: dict[str, Any] = {"request_id": request_id}
    if not shape.stream:
        choices = []
        for index in range(shape.n):
            ids, lps = book.choice_tokens(index)
            choice = _generate_choice(shape, index, ids[:completion], lps[:completion])
            choice["weight_versions"] = [
                {"version": book.weights.label, "start": 0, "end": len(ids[:completion])}
            ]
            choices.append({**choice, "finish_reason": shape.finish_reason, "stop_reason": None})
        answer = {
            **head,
            "model": book.settings.model,
            "created": int(time.time()),
            "usage": usage,
            "prompt_logprobs": None,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": None,
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "output_mode": "tokens",
            "choices": choices,
        }
        return [_dumps(answer)]
    events: list[bytes] = []
    for position in range(completion):
        last = position == completion - 1
        for index in range(shape.n):
            ids, lps = book.choice_tokens(index)
            choice = _generate_choice(
                shape, index, ids[position : position + 1], lps[position : position + 1]
            )
            choice["finish_reason"] = shape.finish_reason if last else None
            choice["stop_reason"] = None
            chunk = {**head, "usage": None, "prompt_token_ids": None, "mm_placeholders": None}
            chunk.update(metrics=None, output_mode="tokens", choices=[choice])
            events.append(_dumps(chunk))
    if shape.include_usage:
        events.append(_dumps({**head, "usage": usage, "output_mode": "tokens", "choices": []}))
    return [b"data: " + event + b"\n\n" for event in [*events, b"[DONE]"]]


def _chat_logprobs(logprobs: list[dict[str, Any]] | None) -> Any:
    """The chat logprobs of generate's entries, one per entry, each read by its own
    ``token_id``: as vLLM's derender, which keeps the stop token's logprob when the gateway
    leaves that token out of the ids to decode (``_as_detokenized``)."""
    if logprobs is None:
        return None
    return {
        "content": [
            {
                "token": _text(entry["token_id"]),
                "logprob": entry["logprob"],
                "bytes": list(_text(entry["token_id"]).encode()),
                "top_logprobs": [],
            }
            for entry in logprobs
        ]
    }


def derender(book: ResponseBook, body: dict[str, Any], request_id: str) -> dict[str, Any]:
    """The chat completion of a generate answer (``generate_response``). Raises
    ``ValueError`` on a body without one, or a streamed derender (``stream``: the gateway's
    exact streams go to the chat endpoint with forwarded ids instead)."""
    model = body.get("model") or book.settings.model
    head = {"id": request_id, "created": int(time.time()), "model": model}
    if body.get("stream") is True:
        raise ValueError("the emulator derenders whole generate answers only")
    generated = body.get("generate_response")
    if not isinstance(generated, dict) or not isinstance(generated.get("choices"), list):
        raise ValueError("generate_response must be a generate answer with choices")
    choices = []
    completion = 0
    for choice in generated["choices"]:
        ids = list(choice.get("token_ids") or [])
        completion += len(ids)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(_text(i) for i in ids),
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [],
            "reasoning": None,
        }
        content = (choice.get("logprobs") or {}).get("content")
        choices.append(
            {
                "index": choice.get("index", 0),
                "message": message,
                "logprobs": _chat_logprobs(content),
                "finish_reason": choice.get("finish_reason"),
                "stop_reason": choice.get("stop_reason"),
                "token_ids": None,
                "routed_experts": None,
            }
        )
    prompt = int(body.get("prompt_tokens") or 0)
    return {
        **head,
        "object": "chat.completion",
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
        },
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "kv_transfer_params": None,
    }
