"""A chat completion from vLLM, rendered as a Responses API ``response`` object.

Owns: the ``response`` object the client reads (unary, and in ``response.created`` /
``response.in_progress`` / ``response.completed`` when streaming): its output items (a
``reasoning`` item, a ``message`` item with one ``output_text`` part, one ``function_call`` item
per tool call), its status, usage,
and the request fields a Response echoes. The shape is the Open Responses specification's
``ResponseResource`` (tests validate every object and event against its ``openapi.json``, kept
in tests/data/openresponses/) and the one the official ``openai`` SDK's
``openai.types.responses.Response`` model parses. Never: changes the text, the
tool call arguments or the logprobs vLLM sent; counts tokens (usage is vLLM's).

Ids: the response's id is the caller's (``resp_...``); its items take the same suffix
(``rs_<suffix>``, ``msg_<suffix>``, ``fc_<suffix>_<n>``), so a streamed and a rendered answer
name the same items.

Logprobs of ``output_text`` (when the client asked ``include: ["message.output_text.logprobs"]``)
are vLLM's per-token entries of the text's tokens. Unary answers hold one list for every sampled
token, so text logprobs are given only when the answer is text alone; a stream gives each text
delta its own chunk's entries.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Literal, cast

from gateway.dialects.responses.wire import (
    Echo,
    EchoedReasoning,
    EchoedTool,
    FunctionTool,
    Logprob,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ResponseResource,
    ResponseStatus,
    ResponseUsage,
    Status,
)
from gateway.dialects.wire import AnswerMessage, AnswerToolCall, ChatAnswer, ChatLogprobs, Usage

Ending = Literal["completed", "incomplete"]
# The ``request.ECHO_ONLY`` fields a response repeats only when the client sent them (the others are
# always in ``Echo``; ``client_metadata`` and ``stream_options`` are not repeated).
_ECHOED_IF_SENT: tuple[Literal["user", "prompt_cache_retention"], ...] = (
    "user",
    "prompt_cache_retention",
)

# finish_reason → (response status, incomplete_details.reason)
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def item_ids(response_id: str) -> tuple[str, str, str]:
    """The reasoning, message and function call id prefixes of one response's items."""
    suffix = response_id.removeprefix("resp_")
    return f"rs_{suffix}", f"msg_{suffix}", f"fc_{suffix}"


def status_of(finish_reason: str | None) -> tuple[Ending, str | None]:
    """The response status and incomplete reason for a chat ``finish_reason``: ``length`` is
    ``incomplete``/``max_output_tokens``, ``content_filter`` ``incomplete``/``content_filter``,
    None (the stream ended without one) ``incomplete``; any other ``completed``."""
    if finish_reason is None:
        return "incomplete", None
    reason = _INCOMPLETE.get(finish_reason)
    return ("incomplete", reason) if reason else ("completed", None)


# What the echo says of a sampling field that neither the client nor a gateway default set
# (nothing was sent upstream): the Responses API's defaults. The Open Responses schema wants a
# number there, not null; vLLM itself may apply the model's generation config instead.
API_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "top_logprobs": 0,
}


def echo_fields(body: dict[str, Any], chat_body: Mapping[str, object]) -> Echo:
    """The request fields a Response repeats, every one the Open Responses ``ResponseResource``
    requires: the client's, except sampling, which is what was sent upstream (so a gateway
    default the client omitted shows; ``API_DEFAULTS`` when nothing was). ``tools`` are the
    function tools offered to the model, each with ``description``, ``parameters`` and
    ``strict`` (``null`` when not sent); the tools chat cannot offer were not available to the
    model and are not listed. ``background`` is false and ``service_tier`` ``default``: the
    gateway has neither."""

    def sampled(name: str) -> object:
        return chat_body.get(name, API_DEFAULTS[name])

    echo: Echo = {
        "instructions": body.get("instructions"),
        "tools": [echoed_tool(tool) for tool in body.get("tools") or [] if _is_function(tool)],
        "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": sampled("temperature"),
        "top_p": sampled("top_p"),
        "presence_penalty": sampled("presence_penalty"),
        "frequency_penalty": sampled("frequency_penalty"),
        "top_logprobs": sampled("top_logprobs"),
        "max_output_tokens": chat_body.get("max_tokens"),
        "max_tool_calls": body.get("max_tool_calls"),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": _echoed_reasoning(body.get("reasoning")),
        "text": body.get("text") or {"format": {"type": "text"}},
        "store": body.get("store", True),
        "background": False,
        "service_tier": "default",
        "metadata": body.get("metadata") or {},
        "truncation": body.get("truncation", "disabled"),
        "safety_identifier": body.get("safety_identifier"),
        "prompt_cache_key": body.get("prompt_cache_key"),
    }
    for name in _ECHOED_IF_SENT:
        if name in body:
            echo[name] = body[name]
    return echo


def _is_function(tool: Any) -> bool:
    return isinstance(tool, dict) and tool.get("type") == "function"


def echoed_tool(tool: FunctionTool) -> EchoedTool:
    """A function tool as a Response lists it (the spec's ``FunctionTool``: every field
    present, ``null`` for one the client did not send); ``tool`` is one the translation
    checked (``request._tool``: a string name)."""
    return {
        "type": "function",
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
    }


def _echoed_reasoning(reasoning: Any) -> EchoedReasoning | None:
    """The spec's ``Reasoning``: both ``effort`` and ``summary`` (``null`` when not sent)."""
    if not isinstance(reasoning, dict):
        return None
    return {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")}


def response_object(
    *,
    response_id: str,
    created_at: int,
    model: str,
    echo: Echo,
    status: ResponseStatus,
    output: list[OutputItem],
    usage: ResponseUsage | None,
    incomplete_reason: str | None = None,
) -> ResponseResource:
    """One ``response`` object (``created_at``, ``completed_at`` in Unix seconds;
    ``completed_at`` is now for a ``completed`` response, null for any other status)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status,
        "error": None,
        "incomplete_details": None if status != "incomplete" else {"reason": incomplete_reason},
        "model": model,
        "output": output,
        "usage": usage,
        **echo,
    }


def usage_object(usage: Usage | None) -> ResponseUsage | None:
    """Responses usage from chat usage: input/output/total tokens, cached prompt tokens and
    reasoning tokens as vLLM reported them (0 when it did not)."""
    if not usage:
        return None
    prompt_details = usage.get("prompt_tokens_details") or {}
    completion_details = usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": usage.get("prompt_tokens") or 0,
        "input_tokens_details": {
            "cached_tokens": prompt_details.get("cached_tokens") or 0,
            "cache_write_tokens": 0,
        },
        "output_tokens": usage.get("completion_tokens") or 0,
        "output_tokens_details": {
            "reasoning_tokens": completion_details.get("reasoning_tokens") or 0
        },
        "total_tokens": usage.get("total_tokens") or 0,
    }


def text_logprobs(logprobs: ChatLogprobs | None) -> list[Logprob]:
    """Responses logprob entries ``[T]`` from a chat ``logprobs`` object (``content`` entries:
    token, logprob, bytes, top_logprobs), values unchanged."""
    entries = (logprobs or {}).get("content") or []
    return [
        {
            "token": entry["token"],
            "logprob": entry["logprob"],
            "bytes": entry.get("bytes") or [],
            "top_logprobs": [
                {"token": top["token"], "logprob": top["logprob"], "bytes": top.get("bytes") or []}
                for top in entry.get("top_logprobs") or []
            ],
        }
        for entry in entries
    ]


def reasoning_item(item_id: str, text: str, status: Status) -> OutputReasoning:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def output_text_part(text: str, logprobs: list[Logprob] | None) -> OutputText:
    part: OutputText = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def message_item(item_id: str, parts: list[OutputText], status: Status) -> OutputMessage:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": parts,
    }


def function_call_item(item_id: str, call: AnswerToolCall, status: Status) -> OutputFunctionCall:
    """A ``function_call`` item from a chat tool call (``id``, ``function.name/arguments``)."""
    function = call.get("function") or {}
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call.get("id") or item_id,
        "name": function.get("name") or "",
        "arguments": function.get("arguments") or "",
        "status": status,
    }


def output_items(
    message: AnswerMessage,
    finish_reason: str | None,
    logprobs: ChatLogprobs | None,
    *,
    response_id: str,
    logprobs_asked: bool,
) -> list[OutputItem]:
    """The output items of one chat message (``content``, ``reasoning`` or
    ``reasoning_content``, ``tool_calls``): reasoning, then the message, then the calls. A
    message item is given when there is text, or when there is nothing else."""
    status = status_of(finish_reason)[0]
    reasoning_id, message_id, call_prefix = item_ids(response_id)
    items: list[OutputItem] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        items.append(reasoning_item(reasoning_id, reasoning, status))
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    if content or not calls:
        text_only = not reasoning and not calls
        entries = text_logprobs(logprobs) if logprobs_asked and text_only else None
        if logprobs_asked and entries is None:
            entries = []
        items.append(message_item(message_id, [output_text_part(content, entries)], status))
    for index, call in enumerate(calls):
        items.append(function_call_item(f"{call_prefix}_{index}", call, status))
    return items


def render_response(
    unread: dict[str, Any],
    body: dict[str, Any],
    chat_body: Mapping[str, object],
    *,
    response_id: str,
    created_at: int,
    logprobs_asked: bool,
) -> dict[str, Any]:
    """The ``response`` object for a unary chat ``answer`` (vLLM's JSON; its first choice: the
    Responses API has no ``n``). ``body`` is the client's Responses body, ``chat_body`` the chat
    body sent upstream."""
    # Checked against ``CHAT_ANSWER`` by ``read_answer``, which the proxy runs first.
    answer = cast("ChatAnswer", unread)
    choice = (answer.get("choices") or [{}])[0]
    finish_reason = choice.get("finish_reason")
    status, reason = status_of(finish_reason)
    response = response_object(
        response_id=response_id,
        created_at=created_at,
        model=str(answer.get("model") or body.get("model")),
        echo=echo_fields(body, chat_body),
        status=status,
        output=output_items(
            choice.get("message") or {},
            finish_reason,
            choice.get("logprobs"),
            response_id=response_id,
            logprobs_asked=logprobs_asked,
        ),
        usage=usage_object(answer.get("usage")),
        incomplete_reason=reason,
    )
    # Handed on as the JSON object the proxy sends (a cast: nothing copied).
    return cast("dict[str, Any]", response)
