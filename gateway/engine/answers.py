"""The shape of vLLM's chat completion and completion answers and stream chunks, as the capture
and the dialects read them (``gateway.engine.wire.check_shape``).

Owns: ``CHAT_ANSWER`` (a unary chat answer) and ``CHAT_CHUNK`` (one stream chunk), the JSON
type of every field of vLLM 0.32's ``ChatCompletionResponse`` and
``ChatCompletionStreamResponse`` that a client of any dialect reads (the translated dialects
read vLLM's chat answers too); ``COMPLETION_ANSWER`` and ``COMPLETION_CHUNK`` (the same shape:
a completions chunk is a partial answer), of its ``CompletionResponse``. Fields absent or
``null`` pass; fields not listed pass unread (vendor fields, ``prompt_logprobs``,
``kv_transfer_params``). Token ids are checked apart (``gateway.engine.wire.token_ids``: int32
ids), as are choice indices (``choice_index``). Never: checks values beyond their type (an
unknown ``finish_reason`` string is vLLM's to send).

A second engine (``docs/architecture.md``) whose answers differ in shape gives its own here.
"""

from __future__ import annotations

from gateway.engine.wire import INTEGER, NUMBER, TEXT, Shape

_FUNCTION: Shape = {"name": TEXT, "arguments": TEXT}
_TOOL_CALL: Shape = {"id": TEXT, "type": TEXT, "index": INTEGER, "function": _FUNCTION}
_MESSAGE: Shape = {
    "role": TEXT,
    "content": TEXT,
    "reasoning": TEXT,
    "reasoning_content": TEXT,
    "refusal": TEXT,
    "tool_calls": [_TOOL_CALL],
}
_TOP_LOGPROB: Shape = {"token": TEXT, "logprob": NUMBER, "bytes": [INTEGER]}
_LOGPROBS: Shape = {
    "content": [
        {"token": TEXT, "logprob": NUMBER, "bytes": [INTEGER], "top_logprobs": [_TOP_LOGPROB]}
    ]
}
_USAGE: Shape = {
    "prompt_tokens": INTEGER,
    "completion_tokens": INTEGER,
    "total_tokens": INTEGER,
    "prompt_tokens_details": {"cached_tokens": INTEGER},
    "completion_tokens_details": {"reasoning_tokens": INTEGER},
}
# The top-level fields of an answer or chunk (completions answers share them).
TOP_FIELDS: dict[str, Shape] = {
    "id": TEXT,
    "object": TEXT,
    "created": INTEGER,
    "model": TEXT,
    "system_fingerprint": TEXT,
    "usage": _USAGE,
}
_CHOICE: dict[str, Shape] = {
    "index": INTEGER,
    "logprobs": _LOGPROBS,
    "finish_reason": TEXT,
    "stop_reason": (int, str),
}

CHAT_ANSWER: Shape = {**TOP_FIELDS, "choices": [{**_CHOICE, "message": _MESSAGE}]}
CHAT_CHUNK: Shape = {**TOP_FIELDS, "choices": [{**_CHOICE, "delta": _MESSAGE}]}

# vLLM's completions answers (``/v1/completions``).
_COMPLETION_LOGPROBS: Shape = {
    "tokens": [TEXT],
    "token_logprobs": [NUMBER],
    "text_offset": [INTEGER],
    "top_logprobs": [{}],
}
COMPLETION_ANSWER: Shape = {
    **TOP_FIELDS,
    "choices": [
        {
            "index": INTEGER,
            "text": TEXT,
            "logprobs": _COMPLETION_LOGPROBS,
            "finish_reason": TEXT,
            "stop_reason": (int, str),
        }
    ],
}
COMPLETION_CHUNK: Shape = COMPLETION_ANSWER
