"""A chat completion from vLLM, rendered as an Anthropic ``Message``; errors in Anthropic's shape.

Owns: the ``message`` object the client reads (unary, and piecewise in the stream events of
``gateway.dialects.messages.stream``): its content blocks, ``stop_reason`` and
``stop_sequence``, usage; and Anthropic's error envelope
``{"type": "error", "error": {"type", "message"}}`` for the gateway's errors and for vLLM's
own error bodies. The shapes are those the official ``anthropic`` SDK's ``Message`` and
``ErrorResponse`` models parse (a test checks them). Never: changes the text or the reasoning
vLLM sent; counts tokens (usage is vLLM's).

Content blocks, in this order: a ``thinking`` block when the chat message has reasoning (its
``signature`` is ``sha256:<hex of the thinking text>``: Anthropic's signatures are opaque, a
client sends them back unread, and a digest lets a stream and an unstreamed answer agree), a
``text`` block when there is text, one ``tool_use`` block per tool call. An answer with none of
them is one empty ``text`` block (clients read ``content[0]``).

Tool calls whose ``arguments`` are not a JSON object (the tiny test model writes nonsense; an
answer cut at ``max_tokens`` holds half an object) get ``input: {}``; the arguments vLLM sent
are kept as they came in the step's response message (chat form), so nothing is lost. A stream
sends the arguments as ``input_json_delta`` pieces as they come when they begin with ``{``, and
none otherwise (so the client's input is ``{}`` there too); an object cut at ``max_tokens``
arrives as the prefix the client parses partially (the SDK's accumulator does), where the
unstreamed answer says ``{}``. Seen from vLLM 0.32 with the tiny model: a named or ``any``
``tool_choice`` streamed a run of digits as arguments.

``stop_reason`` from the chat ``finish_reason`` (and vLLM's ``stop_reason``, the matched stop
string): ``length`` → ``max_tokens``; a matched stop string → ``stop_sequence`` with it;
``tool_calls``, or any finish with tool calls (a named ``tool_choice`` finishes with ``stop``) →
``tool_use``; ``content_filter`` → ``refusal``; anything else (``stop``, an end token) →
``end_turn``.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any, cast

from gateway.dialects.messages.request import tool_use_id
from gateway.dialects.messages.wire import (
    ErrorBody,
    Message,
    OutputBlock,
    StopReason,
    ToolUseBlock,
    Usage,
)
from gateway.dialects.wire import AnswerMessage, AnswerToolCall, ChatAnswer
from gateway.errors import TrajgateError, read_upstream_error

# HTTP status → Anthropic error type (the SDK's ErrorObject union; the rest fall to the class).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def error_type(status_code: int) -> str:
    """Anthropic's error ``type`` for an HTTP status: the table above, else
    ``invalid_request_error`` below 500 and ``api_error`` from 500."""
    default = "invalid_request_error" if status_code < 500 else "api_error"
    return _ERROR_TYPES.get(status_code, default)


def error_body(kind: str, message: str) -> ErrorBody:
    """``{"type": "error", "error": {"type": kind, "message": message}}``."""
    return {"type": "error", "error": {"type": kind, "message": message}}


def as_json(value: ErrorBody | Message) -> dict[str, Any]:
    """A typed body handed on as the JSON object the dialect interface carries
    (``Dialect.client_answer``, ``upstream_error_body``); a cast: nothing is copied."""
    return cast("dict[str, Any]", value)


def anthropic_envelope(error: TrajgateError) -> ErrorBody:
    """A gateway error in Anthropic's envelope (an ``ErrorRenderer``). The message leads with
    the field (``param``) when it does not already; the gateway's ``code`` is kept in brackets
    since the envelope has no field for it."""
    message = error.message
    if error.param and not message.startswith(error.param):
        message = f"{error.param}: {message}"
    return error_body(error_type(error.status_code), f"{message} [{error.code}]")


def upstream_error(status_code: int, content: bytes) -> dict[str, Any]:
    """vLLM's error body (``gateway.errors.read_upstream_error``) in Anthropic's envelope, the
    message as vLLM wrote it; the type is Anthropic's for the status (the envelope has no
    field for a ``param`` or a ``code``)."""
    message = read_upstream_error(status_code, content).message
    return as_json(error_body(error_type(status_code), message))


def stop_of(
    finish_reason: str | None, stop_reason: object, has_tool_calls: bool
) -> tuple[StopReason, str | None]:
    """``(stop_reason, stop_sequence)`` for a chat finish (module docstring)."""
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    if finish_reason == "tool_calls" or has_tool_calls:
        return "tool_use", None
    if finish_reason == "content_filter":
        return "refusal", None
    return "end_turn", None


def usage_object(input_tokens: int, output_tokens: int) -> Usage:
    """Anthropic usage: every prompt token counts as input (the cache fields are 0: vLLM's
    prefix cache is not billed input)."""
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def signature(thinking: str) -> str:
    return "sha256:" + hashlib.sha256(thinking.encode()).hexdigest()


def tool_input(arguments: str) -> dict[str, object]:
    """A tool call's ``input``: its arguments parsed when they are a JSON object, else ``{}``
    (module docstring)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def tool_use_block(call: AnswerToolCall, position: int, message_id: str) -> ToolUseBlock:
    """The ``tool_use`` block of a chat tool call; a call without an id (never seen from vLLM)
    is named after the message and its position."""
    function = call.get("function") or {}
    chat_id = call.get("id") or f"{message_id.removeprefix('msg_')}_{position}"
    return {
        "type": "tool_use",
        "id": tool_use_id(chat_id),
        "name": function.get("name") or "",
        "input": tool_input(function.get("arguments") or ""),
    }


def content_blocks(message: AnswerMessage, message_id: str) -> list[OutputBlock]:
    """The content blocks of one chat message (``content``, ``reasoning`` or
    ``reasoning_content``, ``tool_calls``), in the order of the module docstring."""
    blocks: list[OutputBlock] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        blocks.append(
            {"type": "thinking", "thinking": reasoning, "signature": signature(reasoning)}
        )
    text = message.get("content")
    if text:
        blocks.append({"type": "text", "text": text})
    for position, call in enumerate(message.get("tool_calls") or []):
        blocks.append(tool_use_block(call, position, message_id))
    return blocks or [{"type": "text", "text": ""}]


def message_object(
    *,
    message_id: str,
    model: str,
    content: list[OutputBlock],
    stop: tuple[StopReason | None, str | None],
    usage: Usage,
) -> Message:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }


def render_message(unread: dict[str, Any], body: dict[str, Any], message_id: str) -> dict[str, Any]:
    """The ``message`` for a unary chat answer (vLLM's JSON; its first choice: the Messages
    API has no ``n``); ``body`` is the client's Messages body."""
    # Checked against ``CHAT_ANSWER`` by ``read_answer``, which the proxy runs first.
    answer = cast("ChatAnswer", unread)
    choice = (answer.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    usage = answer.get("usage") or {}
    return as_json(
        message_object(
            message_id=message_id,
            model=str(answer.get("model") or body.get("model")),
            content=content_blocks(message, message_id),
            stop=stop_of(
                choice.get("finish_reason"),
                choice.get("stop_reason"),
                bool(message.get("tool_calls")),
            ),
            usage=usage_object(
                usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
            ),
        )
    )
