"""A chat completion stream from vLLM, re-told as Anthropic Messages stream events, chunk by chunk.

Owns: the order and shape of the events (``MessagesEvents``), framed as Anthropic sends them
(``gateway.dialects.base.frame``: ``event: <type>`` then ``data: <json>``). Each upstream chunk
gives its events at once; only ``message_delta`` and ``message_stop`` wait for the end (the
usage chunk brings ``output_tokens``, and the proxy sends them after the pool commit). Never:
re-orders, merges or buffers upstream output; decodes or tokenizes.

For one answer the client sees::

    message_start (content [], usage.input_tokens = the prompt ids vLLM sent), ping
    [thinking]  content_block_start (thinking), thinking_delta ..., signature_delta,
                content_block_stop
    [text]      content_block_start (text), text_delta ... (one per upstream text delta),
                content_block_stop
    [each call] content_block_start (tool_use: id, name, input {}), input_json_delta ...
                (vLLM's argument pieces as they come, when they form a JSON object: see
                ``MessagesEvents._forwarded_piece``), content_block_stop
    message_delta (stop_reason, stop_sequence, usage), message_stop

``message_start`` goes with vLLM's first chunk, which carries the prompt ids. Block indexes
count 0, 1, 2, ... in the order blocks open; a block closes when the next one opens or the
finishing chunk arrives (vLLM streams one tool call after another, so a call is never reopened).
A stream with no block gets one empty text block before ``message_delta``, as an unstreamed
answer does (``gateway.dialects.messages.render``). A stream that cannot end normally ends in an
``error`` event, ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

from typing import Any, Literal

from gateway.dialects.messages.render import (
    error_body,
    message_object,
    signature,
    stop_of,
    usage_object,
)
from gateway.dialects.messages.request import tool_use_id
from gateway.dialects.messages.wire import (
    BlockDelta,
    ErrorBody,
    OutputBlock,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
    ToolUseBlock,
)
from gateway.dialects.wire import AnswerToolCall, ChatChunk, Usage

BlockKind = Literal["thinking", "text", "tool_use"]


class MessagesEvents:
    """The events of one streamed message: ``feed`` per chat chunk, then ``closing``.

    ``body`` is the client's Messages body, ``message_id`` the message's (``msg_...``).
    """

    def __init__(self, body: dict[str, Any], *, message_id: str) -> None:
        self.message_id = message_id
        self.model = str(body.get("model"))
        self.started = False
        self.input_tokens = 0
        self.output_tokens = 0  # sampled ids counted; the usage chunk's count replaces it
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # vLLM's: the matched stop string or token id
        self._blocks = 0  # blocks opened so far: the next block's index
        self._open: BlockKind | None = None
        self._thinking: list[str] = []  # the open thinking block's text (for its signature)
        self._calls: dict[int, int] = {}  # chat tool call index → block index
        self._arguments: dict[int, str] = {}  # chat tool call index → its arguments so far

    def feed(self, chunk: ChatChunk) -> list[StreamEvent]:
        """The events one ``chat.completion.chunk`` gives (none for a delta a parser held
        back; ``message_start`` and ``ping`` first with the first chunk). ``chunk`` was checked
        against ``CHAT_CHUNK`` (and its ids read) by the capture, which ``TranslatedStream.feed``
        runs on the chunk first."""
        self.model = str(chunk.get("model") or self.model)
        events = [] if self.started else self._start(chunk.get("prompt_token_ids"))
        usage = chunk.get("usage")
        if usage is not None and not chunk.get("choices"):
            self.usage = usage
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue  # the Messages API has no n: only the first choice is asked for
            self.output_tokens += len(choice.get("token_ids") or [])
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning") or delta.get("reasoning_content")
            if reasoning:
                events += self._delta("thinking", {"type": "thinking_delta", "thinking": reasoning})
                self._thinking.append(reasoning)
            text = delta.get("content")
            if text:
                events += self._delta("text", {"type": "text_delta", "text": text})
            for call in delta.get("tool_calls") or []:
                events += self._call_delta(call)
            finish_reason = choice.get("finish_reason")
            if finish_reason is not None:
                self.finish_reason = finish_reason
                self.stop_reason = choice.get("stop_reason")
                events += self._close()
        return events

    def closing(self) -> list[StreamEvent]:
        """Closes what is open (an empty text block when none was), then ``message_delta``
        with the stop reason and usage, and ``message_stop``."""
        events = [] if self.started else self._start(None)
        events += self._close()
        if self._blocks == 0:
            events += self._open_block("text", {"type": "text", "text": ""}) + self._close()
        usage = self.usage or {}
        prompt_tokens = usage.get("prompt_tokens")
        if isinstance(prompt_tokens, int):
            self.input_tokens = prompt_tokens
        completion_tokens = usage.get("completion_tokens")
        if isinstance(completion_tokens, int):
            self.output_tokens = completion_tokens
        stop_reason, stop_sequence = stop_of(
            self.finish_reason, self.stop_reason, bool(self._calls)
        )
        events += [
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": usage_object(self.input_tokens, self.output_tokens),
            },
            {"type": "message_stop"},
        ]
        return events

    def error(self, kind: str, message: str) -> ErrorBody:
        """The ``error`` event that ends a stream (``kind``: an Anthropic error type)."""
        return error_body(kind, message)

    # -- blocks -----------------------------------------------------------------------------

    def _start(self, prompt_ids: list[int] | None) -> list[StreamEvent]:
        self.started = True
        self.input_tokens = len(prompt_ids) if isinstance(prompt_ids, list) else 0
        message = message_object(
            message_id=self.message_id,
            model=self.model,
            content=[],
            stop=(None, None),
            usage=usage_object(self.input_tokens, 0),
        )
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _delta(
        self, kind: Literal["text", "thinking"], delta: TextDelta | ThinkingDelta
    ) -> list[StreamEvent]:
        """A text or thinking delta, opening its block when another kind is open."""
        events: list[StreamEvent] = []
        if self._open != kind:
            block: OutputBlock = (
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
            events = self._close() + self._open_block(kind, block)
        index = self._blocks - 1
        return [*events, {"type": "content_block_delta", "index": index, "delta": delta}]

    def _call_delta(self, call: AnswerToolCall) -> list[StreamEvent]:
        # An integer or absent (``CHAT_CHUNK``); a null index made the capture's add, run on
        # the chunk first, refuse it as unreadable.
        position = call.get("index") or 0
        function = call.get("function") or {}
        events: list[StreamEvent] = []
        if position not in self._calls:
            suffix = self.message_id.removeprefix("msg_")
            block: ToolUseBlock = {
                "type": "tool_use",
                "id": tool_use_id(call.get("id") or f"{suffix}_{len(self._calls)}"),
                "name": function.get("name") or "",
                "input": {},
            }
            events = self._close() + self._open_block("tool_use", block)
            self._calls[position] = self._blocks - 1
            self._arguments[position] = ""
        arguments = function.get("arguments")
        if arguments:
            piece = self._forwarded_piece(position, arguments)
            if piece:
                delta: BlockDelta = {"type": "input_json_delta", "partial_json": piece}
                events.append(
                    {"type": "content_block_delta", "index": self._calls[position], "delta": delta}
                )
        return events

    def _forwarded_piece(self, position: int, piece: str) -> str:
        """The part of an argument piece the client gets: everything once the call's arguments
        begin with ``{`` (a JSON object, as a ``tool_use`` input must be), nothing when they
        begin with anything else (the input stays ``{}``, as unstreamed), and leading
        whitespace held until that is known (a client parsing partial JSON cannot parse it
        alone)."""
        before = self._arguments[position]
        text = before + piece
        self._arguments[position] = text
        start = text.lstrip()
        if not start or start[0] != "{":
            return ""
        if before.strip():
            return piece  # already forwarding
        return text

    def _open_block(self, kind: BlockKind, block: OutputBlock) -> list[StreamEvent]:
        self._open = kind
        self._blocks += 1
        self._thinking = []
        return [{"type": "content_block_start", "index": self._blocks - 1, "content_block": block}]

    def _close(self) -> list[StreamEvent]:
        """The stop of the open block (a thinking block's ``signature_delta`` first)."""
        if self._open is None:
            return []
        index = self._blocks - 1
        events: list[StreamEvent] = []
        if self._open == "thinking":
            thinking = "".join(self._thinking)
            delta: BlockDelta = {"type": "signature_delta", "signature": signature(thinking)}
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
        self._open = None
        return [*events, {"type": "content_block_stop", "index": index}]
