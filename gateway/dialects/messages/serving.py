"""The Anthropic Messages API dialect: ``POST /v1/messages``, translated to chat completions.

Owns: the dialect object the proxy runs (``Messages``): the client's Messages body becomes a
chat body for vLLM's ``/v1/chat/completions`` (``gateway.dialects.messages.request``) with the
capture fields added, the chat answer is captured like any chat answer
(``gateway.dialects.choices``) and rendered back as an Anthropic ``message``
(``gateway.dialects.messages.render``), a chat stream as Messages events as they come
(``gateway.dialects.messages.stream``); errors in Anthropic's envelope; and
``count_tokens`` for ``POST /v1/messages/count_tokens``. Never: tokenizes or re-encodes text;
the stored ids and logprobs are the ones vLLM sent for the chat call.

Why translate instead of calling vLLM's own ``/v1/messages`` (vLLM 0.32):

- vLLM's ``/v1/messages`` answers text and usage only: no token ids and no logprobs, whatever
  the request asks, streamed or not. A step without the engine's ids cannot be trained on.
- ``/v1/chat/completions`` gives exactly what the pool needs, also while streaming: the prompt
  ids (``prompt_token_ids``), the sampled ids per chunk (``token_ids``) and their behaviour
  logprobs, checked against the usage chunk; every other dialect's capture already trusts it.
  vLLM's own Messages endpoint is itself a translation onto the same chat path, so nothing the
  engine does is lost by translating here.
- Cost: the prompt is the chat template's rendering of the translated messages, so the
  translation must be faithful (``messages.request``: how each block maps), and Messages
  features with no chat equivalent (server tools, images on a text model) are refused or left
  out, never emulated. The Messages API has no logprobs: the client never sees them.

``count_tokens`` asks vLLM's ``/tokenize`` with the translated messages and tools, so the count
is the chat template's rendering, the very prompt a call with the same body would get.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.dialects.base import Engine, Prepared, SideRoute, frame
from gateway.dialects.messages.render import (
    anthropic_envelope,
    error_type,
    new_message_id,
    render_message,
    upstream_error,
)
from gateway.dialects.messages.request import MessagesMemory, Translation, translate_request
from gateway.dialects.messages.stream import MessagesEvents
from gateway.dialects.messages.wire import ErrorBody, StreamEvent
from gateway.dialects.translation import (
    TranslatedPrepared,
    TranslatedStream,
    TranslatingDialect,
    client_asked,
    with_capture_fields,
)
from gateway.dialects.wire import ChatChunk
from gateway.engine.wire import dumps
from gateway.errors import TrajgateError, UpstreamError, stream_error_status


async def count_tokens(body: dict[str, Any], engine: Engine) -> dict[str, Any]:
    """``{"input_tokens": N}`` for a ``/v1/messages/count_tokens`` body: the body translated
    (``max_tokens`` not needed) and rendered by vLLM's ``POST /tokenize``
    (``engine.tokenize``, answering ``{"count", "max_model_len", "tokens"}``).

    Raises ``InvalidRequestError`` for a body the translation refuses, ``UpstreamError`` when
    the answer has no ``count``, and lets ``EngineRefused`` through (vLLM's error, rendered in
    Anthropic's envelope with its status by the proxy through ``upstream_error_body``).
    """
    chat = translate_request(body, counting=True).chat_body
    request: dict[str, Any] = {
        "model": chat["model"],
        "messages": chat["messages"],
        "add_generation_prompt": not chat.get("continue_final_message", False),
        "continue_final_message": chat.get("continue_final_message", False),
    }
    for name in ("tools", "chat_template_kwargs"):
        if name in chat:
            request[name] = chat[name]
    answer = await engine.tokenize(request)
    count = answer.get("count")
    if not isinstance(count, int):
        raise UpstreamError(f"vLLM's /tokenize answered without a count: {answer!r:.200}")
    return {"input_tokens": count}


@dataclass(frozen=True, kw_only=True)
class MessagesPrepared(TranslatedPrepared):
    """A prepared Messages call: the translation, and the message's id, fixed before the
    upstream call so a stream and the stored step agree."""

    translation: Translation
    message_id: str


class Messages(TranslatingDialect):
    name = "messages"
    client_paths = ("/messages",)
    history_field = "messages"
    side_routes = (SideRoute("/messages/count_tokens", count_tokens),)

    def __init__(self) -> None:
        # Recent translations (``dialects.translation_memory``): a call re-sending its history
        # translates only the messages it added.
        self.translations = MessagesMemory()

    def prepare(self, body: dict[str, Any]) -> MessagesPrepared:
        """The chat body for ``body`` with ``return_token_ids``, ``logprobs`` and, when
        streaming, the usage chunk. Raises ``InvalidRequestError`` (``messages.request``)."""
        translation = translate_request(body, memory=self.translations)
        return MessagesPrepared(
            body,
            with_capture_fields(translation.chat_body),
            client_asked(logprobs=False),
            translation=translation,
            message_id=new_message_id(),
        )

    def client_answer(self, prepared: Prepared, answer: dict[str, Any]) -> dict[str, Any]:
        call = _messages(prepared)
        return render_message(answer, call.client_body, call.message_id)

    def upstream_error_body(self, status_code: int, content: bytes) -> bytes:
        return dumps(upstream_error(status_code, content))

    def open_stream(self, prepared: Prepared, system_fingerprint: str | None) -> MessagesStream:
        return MessagesStream(_messages(prepared))

    def render_error(self, error: TrajgateError) -> ErrorBody:
        return anthropic_envelope(error)


def _messages(prepared: Prepared) -> MessagesPrepared:
    if not isinstance(prepared, MessagesPrepared):
        raise TypeError(f"expected MessagesPrepared, got {type(prepared).__name__}")
    return prepared


class MessagesStream(TranslatedStream):
    """One streamed Messages call: captures the upstream chat chunks (ids, logprobs, message)
    and sends each one's Messages events at once."""

    def __init__(self, prepared: MessagesPrepared) -> None:
        super().__init__(prepared)
        self.events = MessagesEvents(prepared.client_body, message_id=prepared.message_id)

    def events_of(self, chunk: ChatChunk) -> Sequence[StreamEvent]:
        return self.events.feed(chunk)

    def closing_events(self) -> Sequence[StreamEvent]:
        return self.events.closing()

    def upstream_failed(self, error: dict[str, Any]) -> ErrorBody:
        # An error inside vLLM's stream ends the message here (an ``error`` event); vLLM's
        # ``code`` is the HTTP status.
        status = stream_error_status(error)
        return self.events.error(error_type(status), str(error.get("message") or error))

    def error_event(self, error: TrajgateError) -> bytes:
        return frame(anthropic_envelope(error))
