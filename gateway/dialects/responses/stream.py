"""A chat completion stream from vLLM, re-told as Responses API stream events, chunk by chunk.

Owns: the order and shape of the events (``ResponsesEvents``), framed by
``gateway.dialects.base.frame`` (re-exported here). Each upstream chunk gives its events at once;
nothing is held back except ``response.completed``, which the proxy sends after the pool commit.

For one answer the client sees::

    response.created, response.in_progress
    [reasoning]  output_item.added, content_part.added (reasoning_text),
                 reasoning_text.delta ..., reasoning_text.done, content_part.done, output_item.done
    [text]       output_item.added (message), content_part.added (output_text),
                 output_text.delta ... (one per upstream text delta, its chunk's logprobs when
                 asked), output_text.done, content_part.done, output_item.done
    [each call]  output_item.added (function_call), function_call_arguments.delta ...,
                 function_call_arguments.done, output_item.done
    response.completed | response.incomplete (finish_reason length: max_output_tokens)

An item is closed (its done events) when the next one opens or the finishing chunk arrives.
Every event has ``type`` and ``sequence_number`` (0, 1, 2, ... in the order sent); the SSE frame
is ``event: <type>`` and ``data: <json>``, as OpenAI sends it. A stream that cannot end normally
ends in ``response.failed`` (``response.error``: ``{code: server_error, message}``). Never:
re-orders, merges or buffers upstream output; decodes or tokenizes.

What Codex CLI 0.169.0 needs (tried against a local server sending these events): it reads only
``data`` and ignores ``event:`` lines; ``response.completed`` alone ends a turn with exit 0 (no
``response.completed``: "stream closed before response.completed", 5 retries, exit 1);
``response.incomplete`` is an error ("Incomplete response returned, reason:
max_output_tokens", exit 1); the answer it keeps is the items of ``output_item.done`` (not
``response.completed``'s output); ``output_text.delta`` is what it shows while streaming; it sends
reasoning items back with their ``reasoning_text`` content, and function calls with our item ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.dialects.base import frame
from gateway.dialects.responses.render import (
    Ending,
    echo_fields,
    function_call_item,
    item_ids,
    message_item,
    output_text_part,
    reasoning_item,
    response_object,
    status_of,
    text_logprobs,
    usage_object,
)
from gateway.dialects.responses.wire import (
    Logprob,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    PartAt,
    ReasoningText,
    ResponseEvent,
    ResponseEventType,
    ResponseResource,
    ResponseStatus,
    Status,
    StreamEvent,
)
from gateway.dialects.wire import AnswerToolCall, ChatChunk, ChatLogprobs, ChatMessage, Usage

__all__ = ["ResponsesEvents", "frame"]

TextKind = Literal["reasoning", "message"]


@dataclass
class _Call:
    """One function call item being streamed (chat tool call ``index``)."""

    output_index: int
    item_id: str
    call_id: str
    name: str
    arguments: list[str] = field(default_factory=list)
    done: bool = False


class ResponsesEvents:
    """The events of one streamed response: ``opening``, ``feed`` per chat chunk, ``closing``.

    ``body`` is the client's Responses body, ``chat_body`` the chat body sent upstream,
    ``created_at`` Unix seconds. After the stream, ``message`` is the answer in the common form
    (``role``, ``content``, ``tool_calls``, ``reasoning``), ``finish_reason`` and ``usage`` (chat
    usage) what vLLM sent.
    """

    def __init__(
        self,
        body: dict[str, Any],
        chat_body: Mapping[str, object],
        *,
        response_id: str,
        created_at: int,
        logprobs_asked: bool,
    ) -> None:
        self.response_id = response_id
        self.created_at = created_at
        self.model = str(body.get("model"))
        self.echo = echo_fields(body, chat_body)
        self.logprobs_asked = logprobs_asked
        self.reasoning_id, self.message_id, self.call_prefix = item_ids(response_id)
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self._sequence = 0
        self._output: list[OutputItem] = []  # items in output order, final once done
        self._open: TextKind | None = None  # the open text item
        self._open_at: PartAt = {"item_id": "", "output_index": 0, "content_index": 0}  # its place
        self._opened = {"reasoning": 0, "message": 0}  # items opened so far, per kind
        # Where the open item's text starts in the parts below (a second item of a kind).
        self._reasoning_item_text = 0
        self._message_item_text = 0
        self._message_item_logprobs = 0
        self._reasoning: list[str] = []
        self._text: list[str] = []
        self._text_logprobs: list[Logprob] = []
        self._calls: dict[int, _Call] = {}

    # -- the three phases -------------------------------------------------------------------

    def opening(self) -> list[StreamEvent]:
        """``response.created`` and ``response.in_progress``."""
        snapshot = self._response("in_progress", None, with_usage=False)
        return [
            self._response_event("response.created", snapshot),
            self._response_event("response.in_progress", snapshot),
        ]

    def feed(self, chunk: ChatChunk) -> list[StreamEvent]:
        """The events one ``chat.completion.chunk`` gives (none for a usage-only chunk or a
        delta a parser held back); ``chunk`` checked against ``CHAT_CHUNK`` by the capture."""
        self.model = str(chunk.get("model") or self.model)
        usage = chunk.get("usage")
        if usage is not None and not chunk.get("choices"):
            self.usage = usage
        events: list[StreamEvent] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning") or delta.get("reasoning_content")
            if reasoning:
                events += self._reasoning_delta(reasoning)
            content = delta.get("content")
            if content:
                events += self._text_delta(content, choice.get("logprobs"))
            for call in delta.get("tool_calls") or []:
                events += self._call_delta(call)
            finish_reason = choice.get("finish_reason")
            if finish_reason is not None:
                self.finish_reason = finish_reason
                events += self._close_all()
        return events

    def closing(self) -> list[StreamEvent]:
        """Closes what is still open, then ``response.completed`` (or ``response.incomplete``)
        with the whole response and its usage."""
        events = self._close_all()
        status, reason = status_of(self.finish_reason)
        kind: ResponseEventType = (
            "response.completed" if status == "completed" else "response.incomplete"
        )
        return [*events, self._response_event(kind, self._response(status, reason))]

    def failed(self, code: str, message: str) -> ResponseEvent:
        """``response.failed``: the stream ends in an error after the status line said 200.

        ``response.error.code`` is ``server_error`` (the SDK accepts only OpenAI's fixed set of
        codes); the gateway's or vLLM's own ``code`` leads the message."""
        response = self._response("failed", None)
        response["error"] = {"code": "server_error", "message": f"{code}: {message}"}
        return self._response_event("response.failed", response)

    @property
    def message(self) -> ChatMessage:
        """The answer so far in the common form the pool stores."""
        message: ChatMessage = {"role": "assistant", "content": "".join(self._text) or None}
        if self._calls:
            message["tool_calls"] = [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": "".join(call.arguments)},
                }
                for _, call in sorted(self._calls.items())
            ]
        if self._reasoning:
            message["reasoning"] = "".join(self._reasoning)
        return message

    # -- items ------------------------------------------------------------------------------

    def _reasoning_delta(self, delta: str) -> list[StreamEvent]:
        events = [] if self._open == "reasoning" else self._open_item("reasoning")
        self._reasoning.append(delta)
        at = self._open_at
        return [
            *events,
            {
                "type": "response.reasoning_text.delta",
                "sequence_number": self._next(),
                **at,
                "delta": delta,
            },
        ]

    def _text_delta(self, delta: str, logprobs: ChatLogprobs | None) -> list[StreamEvent]:
        events = [] if self._open == "message" else self._open_item("message")
        entries = text_logprobs(logprobs) if self.logprobs_asked else []
        self._text.append(delta)
        self._text_logprobs += entries
        at = self._open_at
        return [
            *events,
            {
                "type": "response.output_text.delta",
                "sequence_number": self._next(),
                **at,
                "delta": delta,
                "logprobs": entries,
            },
        ]

    def _call_delta(self, call_delta: AnswerToolCall) -> list[StreamEvent]:
        # An integer or absent (``CHAT_CHUNK``); a null index made the capture's add, run on
        # the chunk first, refuse it as unreadable.
        index = call_delta.get("index") or 0
        function = call_delta.get("function") or {}
        events: list[StreamEvent] = []
        call = self._calls.get(index)
        if call is None:
            events += self._close_all()
            item_id = f"{self.call_prefix}_{len(self._calls)}"
            call = _Call(
                len(self._output),
                item_id,
                call_delta.get("id") or item_id,
                function.get("name") or "",
            )
            self._calls[index] = call
            item = self._call_item(call, "in_progress")
            self._output.append(item)
            events.append(self._item_event("response.output_item.added", call.output_index, item))
        else:
            name = function.get("name")
            if name:
                call.name += name
        arguments = function.get("arguments")
        if arguments:
            call.arguments.append(arguments)
            events.append(
                {
                    "type": "response.function_call_arguments.delta",
                    "sequence_number": self._next(),
                    "item_id": call.item_id,
                    "output_index": call.output_index,
                    "delta": arguments,
                }
            )
        return events

    def _open_item(self, kind: TextKind) -> list[StreamEvent]:
        """Close what is open, then open a reasoning or message item with its one part."""
        events = self._close_all()
        prefix = self.reasoning_id if kind == "reasoning" else self.message_id
        count = self._opened[kind]
        self._opened[kind] += 1
        item_id = prefix if count == 0 else f"{prefix}_{count}"  # a second one: interleaved
        item: OutputItem
        part: ReasoningText | OutputText
        if kind == "reasoning":
            reasoning = reasoning_item(item_id, "", "in_progress")
            reasoning["content"] = []
            item, part = reasoning, {"type": "reasoning_text", "text": ""}
            self._reasoning_item_text = len(self._reasoning)
        else:
            item = message_item(item_id, [], "in_progress")
            part = output_text_part("", [] if self.logprobs_asked else None)
            self._message_item_text = len(self._text)
            self._message_item_logprobs = len(self._text_logprobs)
        self._open = kind
        at: PartAt = {"item_id": item_id, "output_index": len(self._output), "content_index": 0}
        self._open_at = at
        self._output.append(item)
        return [
            *events,
            self._item_event("response.output_item.added", len(self._output) - 1, item),
            {
                "type": "response.content_part.added",
                "sequence_number": self._next(),
                **at,
                "part": part,
            },
        ]

    def _close_all(self) -> list[StreamEvent]:
        """The done events of every open item, in output order. An item closed by the finishing
        chunk takes the response's status (``incomplete`` at ``length``), else ``completed``."""
        finished = self.finish_reason is not None
        incomplete = finished and status_of(self.finish_reason)[0] == "incomplete"
        status: Ending = "incomplete" if incomplete else "completed"
        events: list[StreamEvent] = []
        at = self._open_at
        item: OutputReasoning | OutputMessage | None = None
        if self._open == "reasoning":
            text = "".join(self._reasoning[self._reasoning_item_text :])
            item = reasoning_item(at["item_id"], text, status)
            events += [
                {
                    "type": "response.reasoning_text.done",
                    "sequence_number": self._next(),
                    **at,
                    "text": text,
                },
                {
                    "type": "response.content_part.done",
                    "sequence_number": self._next(),
                    **at,
                    "part": item["content"][0],
                },
            ]
        elif self._open == "message":
            text = "".join(self._text[self._message_item_text :])
            entries = self._text_logprobs[self._message_item_logprobs :]
            part = output_text_part(text, entries if self.logprobs_asked else None)
            item = message_item(at["item_id"], [part], status)
            events += [
                {
                    "type": "response.output_text.done",
                    "sequence_number": self._next(),
                    **at,
                    "text": text,
                    "logprobs": entries,
                },
                {
                    "type": "response.content_part.done",
                    "sequence_number": self._next(),
                    **at,
                    "part": part,
                },
            ]
        if item is not None:
            self._output[at["output_index"]] = item
            events.append(self._item_event("response.output_item.done", at["output_index"], item))
        self._open = None
        for call in self._calls.values():
            if call.done:
                continue
            call.done = True
            call_item = self._call_item(call, status)
            self._output[call.output_index] = call_item
            events += [
                {
                    "type": "response.function_call_arguments.done",
                    "sequence_number": self._next(),
                    "item_id": call.item_id,
                    "output_index": call.output_index,
                    "arguments": call_item["arguments"],
                },
                self._item_event("response.output_item.done", call.output_index, call_item),
            ]
        return events

    def _call_item(self, call: _Call, status: Status) -> OutputFunctionCall:
        chat_call: AnswerToolCall = {
            "id": call.call_id,
            "function": {"name": call.name, "arguments": "".join(call.arguments)},
        }
        return function_call_item(call.item_id, chat_call, status)

    # -- framing ------------------------------------------------------------------------------

    def _response(
        self, status: ResponseStatus, reason: str | None, *, with_usage: bool = True
    ) -> ResponseResource:
        return response_object(
            response_id=self.response_id,
            created_at=self.created_at,
            model=self.model,
            echo=self.echo,
            status=status,
            output=list(self._output) if status != "in_progress" else [],
            usage=usage_object(self.usage) if with_usage else None,
            incomplete_reason=reason,
        )

    def _next(self) -> int:
        """The next event's ``sequence_number`` (0, 1, 2, ... in the order built)."""
        sequence = self._sequence
        self._sequence += 1
        return sequence

    def _response_event(self, kind: ResponseEventType, response: ResponseResource) -> ResponseEvent:
        return {"type": kind, "sequence_number": self._next(), "response": response}

    def _item_event(
        self,
        kind: Literal["response.output_item.added", "response.output_item.done"],
        output_index: int,
        item: OutputItem,
    ) -> StreamEvent:
        return {
            "type": kind,
            "sequence_number": self._next(),
            "output_index": output_index,
            "item": item,
        }
