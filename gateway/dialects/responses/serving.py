"""The OpenAI Responses API dialect: ``POST /v1/responses``, translated to chat completions.

Owns: the dialect object the proxy runs (``Responses``): the client's Responses body becomes a
chat body for vLLM's ``/v1/chat/completions`` (``gateway.dialects.responses.request``) with the
capture fields added, the chat answer is captured like any chat answer
(``gateway.dialects.choices``) and rendered back as a ``response`` object
(``gateway.dialects.responses.render``), a chat stream as Responses events as they come
(``gateway.dialects.responses.stream``). Never: tokenizes or re-encodes text; the stored ids and
logprobs are the ones vLLM sent for the chat call.

Why translate instead of calling vLLM's own ``/v1/responses`` (vLLM 0.32):

- ``/v1/chat/completions`` gives exactly what the pool needs, also while streaming: the prompt
  ids (``prompt_token_ids``), the sampled ids per chunk (``token_ids``) and their behaviour
  logprobs, checked against the usage chunk. It is the path every other dialect's capture
  already trusts.
- vLLM's ``/v1/responses`` ignores ``return_token_ids``; its ids come only unstreamed, through
  ``enable_response_messages``; and its stream is reported to miss done events that Codex
  waits for. A translated stream is written here, so every event a client relies on is sent.
- Cost: the prompt is the chat template's rendering of the translated messages, so the
  translation must be faithful (module docstring of ``responses.request``: how each item maps),
  and Responses features with no chat equivalent (hosted tools, encrypted reasoning) are
  refused or left out, never emulated.

``previous_response_id`` resolves from the pool: a response's id is ``resp_<the id of the step
that records it, as 32 hex digits>`` (``response_id_of``), so ``earlier_call_id`` names that
step, the proxy reads it from the trajectory (client request, upstream request, response
message) and hands it to ``prepare_call``; an id that names no step of the trajectory is a 400
(``previous_response_not_found``), before anything is sent upstream or recorded. Per step, not
per call: a re-send shares its earlier call's id, and its answer, another sample, must be told
apart. Ids handed out before were ``resp_<call id>``; ``find_exchange`` still reads those as the
call's latest step.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from gateway.dialects.base import Prepared, frame, with_model
from gateway.dialects.responses.render import render_response
from gateway.dialects.responses.request import (
    CHAT_TO_CLIENT,
    EarlierResponse,
    ResponsesMemory,
    Translation,
    continued,
    previous_response_id,
    translate_body,
)
from gateway.dialects.responses.stream import ResponsesEvents
from gateway.dialects.responses.wire import ResponseEvent, StreamEvent
from gateway.dialects.translation import (
    TranslatedPrepared,
    TranslatedStream,
    TranslatingDialect,
    client_asked,
    client_param,
    with_capture_fields,
)
from gateway.dialects.wire import ChatChunk
from gateway.engine.wire import dumps
from gateway.errors import TrajgateError, read_upstream_error, upstream_envelope


@dataclass(frozen=True, kw_only=True)
class ResponsesPrepared(TranslatedPrepared):
    """A prepared Responses call: the translation, and the response's id and creation time
    (Unix seconds), fixed before the upstream call so a stream and the stored step agree."""

    translation: Translation
    response_id: str
    created_at: int


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def response_id_of(step_id: str) -> str:
    """``resp_<hex>`` for a step id (a UUID): the response id the client sees, and reads back
    into the step id with ``step_id_of``. A step id that is no UUID gets a fresh id."""
    try:
        return "resp_" + uuid.UUID(step_id).hex
    except ValueError:
        return new_response_id()


def step_id_of(response_id: str) -> str | None:
    """The id (canonical UUID text) a ``resp_<32 hex>`` id names: its step's, or, for an id
    handed out before ids named steps, its call's; None for any other string (no call of this
    gateway answered with it)."""
    suffix = response_id.removeprefix("resp_")
    if suffix == response_id or len(suffix) != 32:
        return None
    try:
        return str(uuid.UUID(hex=suffix))
    except ValueError:
        return None


class Responses(TranslatingDialect):
    name = "responses"
    client_paths = ("/responses",)

    history_field = "input"

    def __init__(self) -> None:
        # Recent translations (``dialects.translation_memory``): a call re-sending its
        # ``input`` translates only the items it added.
        self.translations = ResponsesMemory()

    def prepare(self, body: dict[str, Any]) -> ResponsesPrepared:
        """The chat body for ``body`` with ``return_token_ids``, ``logprobs`` and, when
        streaming, the usage chunk, and a fresh response id; without the history of a
        ``previous_response_id``, which ``prepare_call`` adds once the pool was read."""
        translation = translate_body(body, self.translations)
        return ResponsesPrepared(
            body,
            with_capture_fields(translation.chat_body),
            client_asked(logprobs=translation.logprobs_asked),
            translation=translation,
            response_id=new_response_id(),
            created_at=int(time.time()),
        )

    def earlier_call_id(self, body: dict[str, Any]) -> str | None:
        """The step (or, in an older id, the call) ``previous_response_id`` names; None
        without one, or when it names no call of this gateway (``prepare_call`` then refuses
        it as unknown)."""
        earlier = previous_response_id(body)
        return None if earlier is None else step_id_of(earlier)

    def prepare_call(
        self, prepared: Prepared, model: Any, step_id: str, earlier: EarlierResponse | None
    ) -> ResponsesPrepared:
        """``prepared`` answering as ``resp_<step id>``, with ``model``, and with the history
        of ``earlier`` when the body has a ``previous_response_id``; raises
        ``InvalidRequestError`` when it has one and ``earlier`` is None."""
        call = _responses(with_model(prepared, model))
        translation = continued(call.translation, call.client_body, earlier)
        upstream = call.upstream_body
        if translation is not call.translation:
            upstream = {**upstream, "messages": translation.chat_body["messages"]}
        return replace(
            call,
            upstream_body=upstream,
            translation=translation,
            response_id=response_id_of(step_id),
        )

    def client_answer(self, prepared: Prepared, answer: dict[str, Any]) -> dict[str, Any]:
        call = _responses(prepared)
        return render_response(
            answer,
            call.client_body,
            call.upstream_body,
            response_id=call.response_id,
            created_at=call.created_at,
            logprobs_asked=call.translation.logprobs_asked,
        )

    def client_field(self, upstream_field: str) -> str:
        return CHAT_TO_CLIENT.get(upstream_field) or upstream_field

    def upstream_error_body(self, status_code: int, content: bytes) -> bytes:
        """vLLM's error in OpenAI's envelope with our string ``code``; its ``param`` names the
        Responses field the chat field came from (``max_tokens`` → ``max_output_tokens``), or
        is null when no client field maps to it."""
        error = read_upstream_error(status_code, content)
        return dumps(upstream_envelope(error, client_param(error.param, CHAT_TO_CLIENT)))

    def open_stream(self, prepared: Prepared, system_fingerprint: str | None) -> ResponsesStream:
        return ResponsesStream(_responses(prepared))


def _responses(prepared: Prepared) -> ResponsesPrepared:
    if not isinstance(prepared, ResponsesPrepared):
        raise TypeError(f"expected ResponsesPrepared, got {type(prepared).__name__}")
    return prepared


class ResponsesStream(TranslatedStream):
    """One streamed Responses call: captures the upstream chat chunks (ids, logprobs, message)
    and sends each one's Responses events at once."""

    def __init__(self, prepared: ResponsesPrepared) -> None:
        super().__init__(prepared)
        self.events = ResponsesEvents(
            prepared.client_body,
            prepared.upstream_body,
            response_id=prepared.response_id,
            created_at=prepared.created_at,
            logprobs_asked=prepared.translation.logprobs_asked,
        )

    def opening(self) -> list[bytes]:
        return [frame(event) for event in self.events.opening()]

    def events_of(self, chunk: ChatChunk) -> Sequence[StreamEvent]:
        return self.events.feed(chunk)

    def closing_events(self) -> Sequence[StreamEvent]:
        return self.events.closing()

    def upstream_failed(self, error: dict[str, Any]) -> ResponseEvent:
        # An error inside vLLM's stream ends the response here (response.failed).
        code = error.get("code") or error.get("type") or "upstream_error"
        return self.events.failed(str(code), str(error.get("message") or error))

    def error_event(self, error: TrajgateError) -> bytes:
        return frame(self.events.failed(error.code or error.error_type, error.message))
