"""What the translating dialects share: a client API re-told as a chat completions call.

Owns: the field checks their request translations raise with (``FieldErrors``: a 400
``invalid_value`` naming the field's path), the translation of the client's plain sampling
fields into chat's by a table (``copy_fields``), the tool list walk (``translate_tools``), the
prepared call (``TranslatedPrepared``: the chat body with the capture fields), the dialect half
that captures the chat answer (``TranslatingDialect``), the stream half that captures chat
chunks and hands them to the dialect's event writer (``TranslatedStream``), and vLLM's error
bodies with their ``param`` named in the client's vocabulary (``client_param``). Used by
``gateway.dialects.responses`` and ``gateway.dialects.messages``; each keeps its own vocabulary
(field names, item and block types, event shapes, error envelope) in its own modules.

Never: tokenizes, decodes or re-encodes text; the stored ids and logprobs are the ones vLLM sent
for the chat call.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from pydantic import BaseModel, ValidationError

from datapool.steps.canonical import CanonicalCall, Message
from gateway.dialects.base import (
    Captured,
    ClientAsked,
    Dialect,
    DialectStream,
    Prepared,
    frame,
)
from gateway.dialects.chat_completions.serving import ChatCompletions, canonical_of_chat
from gateway.dialects.choices import ChoicesCapture
from gateway.dialects.wire import (
    ChatBody,
    ChatChunk,
    ChatNamedToolChoice,
    ChatSampling,
    ChatTool,
    SamplingName,
)
from gateway.engine.paths import CHAT_PATH
from gateway.engine.wire import loads_object
from gateway.errors import InvalidRequestError

# Where the chat answers keep their fields: the capture reads the upstream chat answer.
CHAT = ChatCompletions()

Kind = type | tuple[type, ...]


def type_name(value: Any) -> str:
    """``null`` for None (the JSON word a client wrote), else the Python type's name."""
    return "null" if value is None else type(value).__name__


def invalid_value(message: str, param: str) -> InvalidRequestError:
    """The 400 a translation raises for a field it cannot translate (code ``invalid_value``)."""
    return InvalidRequestError(message, param=param, code="invalid_value")


@dataclass(frozen=True)
class FieldErrors:
    """How one dialect's 400s name a field: ``lead(param)`` starts the message, as the API's
    own errors do (OpenAI quotes the field, ``'model' must be ...``; Anthropic leads with the
    dotted path, ``model: must be ...``)."""

    lead: Callable[[str], str]

    def fail(self, param: str, problem: str) -> InvalidRequestError:
        return invalid_value(f"{self.lead(param)} {problem}", param)

    def expect(self, value: Any, kind: Kind, param: str, what: str) -> None:
        """Raise ``fail`` unless ``value`` is of ``kind`` (a bool is no int here unless
        ``kind`` names bool); ``what`` says what was expected (``a string``)."""
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise self.fail(param, f"must be {what}, got {type_name(value)}")


def check_top_level(protocol: type[BaseModel], body: dict[str, Any], errors: FieldErrors) -> None:
    """Validate ``body``'s top-level fields against the dialect's typed ``protocol`` (bounds,
    enums, non-empty lists, as its API specifies them), before anything is translated: a value
    the API refuses must not reach vLLM. Raises ``errors.fail`` (400 ``invalid_value``) naming
    the first field that fails, with every reason pydantic gave for it (a union field fails
    once per member)."""
    try:
        protocol.model_validate(body)
    except ValidationError as exc:
        problems = exc.errors(include_url=False)
        field_name = str(problems[0]["loc"][0])
        reasons = [p["msg"] for p in problems if p["loc"] and p["loc"][0] == field_name]
        # Named down to the nested field that failed (``metadata.user_id``) as far as the
        # location walks the body; a union member's name in it stops the walk.
        path, value = [field_name], body.get(field_name)
        for part in problems[0]["loc"][1:] if len(reasons) == 1 else ():
            in_object = isinstance(value, dict) and isinstance(part, str) and part in value
            in_list = isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value)
            if not (in_object or in_list):
                break
            value = value[part]  # type: ignore[index]
            path.append(str(part))
        got = json.dumps(value)
        got = got if len(got) <= 80 else got[:77] + "..."
        raise errors.fail(
            ".".join(path), f"is invalid: {' or '.join(dict.fromkeys(reasons))}; got {got}"
        ) from None


@dataclass(frozen=True)
class Field:
    """A client field copied into the chat body: its chat name, the type it must have and how
    a message names that type."""

    chat_name: SamplingName
    kind: Kind  # the kind ``ChatSampling`` gives the chat field
    what: str


def copy_fields(
    body: dict[str, Any], fields: Mapping[str, Field], errors: FieldErrors, chat: ChatSampling
) -> None:
    """Writes into ``chat`` the chat fields for the client fields of ``fields`` that ``body``
    sets (``null`` counts as unset), each checked with ``errors.expect``."""
    for name, spec in fields.items():
        if body.get(name) is not None:
            errors.expect(body[name], spec.kind, name, spec.what)
            chat[spec.chat_name] = body[name]


def translate_tools(
    tools: Any,
    param_of: Callable[[int], str],
    errors: FieldErrors,
    translate: Callable[[Any, str], ChatTool | str],
) -> tuple[list[ChatTool], list[str]]:
    """The chat tools for a client ``tools`` list, and the names of the tools chat cannot offer.

    ``param_of(position)`` is the path of one tool in the client's notation; ``translate(tool,
    param)`` returns the chat tool for a tool checked to be an object, or the tool's name when
    chat cannot offer it (it is then left out of the upstream body). Raises
    ``InvalidRequestError`` for a list or tool of the wrong type.
    """
    if tools is None:
        return [], []
    errors.expect(tools, list, "tools", "a list")
    chat_tools: list[ChatTool] = []
    omitted: list[str] = []
    for position, tool in enumerate(tools):
        param = param_of(position)
        errors.expect(tool, dict, param, "an object")
        translated = translate(tool, param)
        if isinstance(translated, str):
            omitted.append(translated)
        else:
            chat_tools.append(translated)
    return chat_tools, omitted


def named_tool_choice(name: str) -> ChatNamedToolChoice:
    """The chat ``tool_choice`` that forces the function ``name``."""
    return {"type": "function", "function": {"name": name}}


def client_param(param: Any, client_names: Mapping[str, str | None]) -> str | None:
    """An upstream error's ``param`` (vLLM names the chat body's field, ``max_tokens`` or
    ``body.max_tokens``) as the client's field: its first path segment looked up in
    ``client_names`` (chat field → the client field it came from, None when the client sent no
    such field). An unknown field, or anything but a string, is None: the client never sent a
    field by the chat name."""
    if not isinstance(param, str) or not param:
        return None
    field_name = param.removeprefix("body.").split(".", 1)[0].split("[", 1)[0]
    return client_names.get(field_name)


@dataclass(frozen=True, kw_only=True)
class TranslatedPrepared(Prepared):
    """A call whose upstream body is a chat translation of the client's body."""

    def chat_prepared(self) -> Prepared:
        """The same call as a chat call: the capture's quality flags read the chat body
        (chat_template_kwargs, continue_final_message)."""
        return Prepared(self.upstream_body, self.upstream_body, self.asked)


def with_capture_fields(chat_body: ChatBody) -> dict[str, Any]:
    """A copy of a translated ``chat_body`` asking vLLM for ``return_token_ids``, ``logprobs``
    and, when streaming, the usage chunk (the client's API has no such fields)."""
    upstream = dict(chat_body)
    upstream["return_token_ids"] = True
    upstream["logprobs"] = True
    if upstream.get("stream") is True:
        upstream["stream_options"] = {"include_usage": True}
    return upstream


def client_asked(logprobs: bool) -> ClientAsked:
    """What a translated call's client asked of the capture fields: never the ids."""
    return ClientAsked(return_token_ids=False, logprobs=logprobs)


class TranslatingDialect(Dialect):
    """A dialect whose upstream is vLLM's chat completions: the capture reads the chat answer."""

    upstream_path = CHAT_PATH

    def canonical(self, upstream_body: Mapping[str, Any]) -> CanonicalCall:
        """The record of the chat body sent: the engine's conversation, whatever the client's
        API called its turns."""
        return canonical_of_chat(upstream_body)

    def canonical_continuing(
        self, upstream_body: Mapping[str, Any], known: tuple[Message, ...]
    ) -> CanonicalCall:
        return canonical_of_chat(upstream_body, known)

    def read_answer(self, prepared: Prepared, answer: dict[str, Any]) -> Captured:
        return CHAT.read_answer(translated(prepared).chat_prepared(), answer)


def translated(prepared: Prepared) -> TranslatedPrepared:
    if not isinstance(prepared, TranslatedPrepared):
        raise TypeError(f"expected TranslatedPrepared, got {type(prepared).__name__}")
    return prepared


class TranslatedStream(DialectStream):
    """One streamed translated call: captures the upstream chat chunks (ids, logprobs, message)
    and sends each one's events in the client's API at once (``events_of``). An error object
    inside vLLM's stream ends it with the dialect's error event (``upstream_failed``); events
    after it are ignored. The events are the dialect's typed events (read-only mappings here:
    ``frame`` only serializes them)."""

    def __init__(self, prepared: TranslatedPrepared) -> None:
        self.capture = ChoicesCapture(CHAT, prepared.upstream_body, 1)
        self.error: dict[str, Any] | None = None

    @abstractmethod
    def events_of(self, chunk: ChatChunk) -> Sequence[Mapping[str, object]]:
        """The client's events for one chat chunk (its shape checked by the capture)."""

    @abstractmethod
    def closing_events(self) -> Sequence[Mapping[str, object]]:
        """The client's events that end a complete stream."""

    @abstractmethod
    def upstream_failed(self, error: dict[str, Any]) -> Mapping[str, object]:
        """The client's event that ends the stream at vLLM's in-stream ``error`` object."""

    def feed(self, data: bytes) -> list[bytes]:
        if self.error is not None:
            return []
        chunk = loads_object(data)  # raises UNREADABLE: the proxy ends the stream in error
        if "error" in chunk and "choices" not in chunk:
            error = chunk["error"]
            self.error = error if isinstance(error, dict) else {"message": str(error)}
            return [frame(self.upstream_failed(self.error))]
        self.capture.add(chunk)  # checks the chunk against ``CHAT_CHUNK`` first
        self.first_token_seen = self.capture.first_token_seen
        return [frame(event) for event in self.events_of(cast("ChatChunk", chunk))]

    def closing(self) -> list[bytes]:
        if self.error is not None:
            return []  # the error event was the last one
        return [frame(event) for event in self.closing_events()]

    def sampled_counts(self) -> dict[int, int]:
        return self.capture.sampled_counts()

    def captured(self, abort_reason: str | None) -> Captured:
        return self.capture.captured(abort_reason, error=self.error)
