"""The chat completions dialect: ``POST /v1/chat/completions``, passed through to vLLM's own.

Owns: where chat answers keep their fields (prompt IDs at the top level, logprobs under
``logprobs.content``, the message under ``message`` or its ``delta`` parts), reassembling a
streamed message (content, reasoning, tool calls by index), and the canonical record of a chat
body (``canonical_of_chat``: also the record of every dialect translated to chat). Never:
changes what the client receives beyond hiding the capture fields it did not ask for
(``gateway.dialects.choices``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, cast

from datapool.steps.canonical import CanonicalCall, Message, Tool
from gateway.dialects.choices import ChoicesDialect, ChoiceState
from gateway.dialects.wire import AnswerChoice, ChatAnswer, ChatChunk, ChunkChoice
from gateway.engine import answers
from gateway.engine.paths import CHAT_PATH
from gateway.engine.wire import token_ids
from gateway.errors import InvalidRequestError

# The engine body's fields that are no sampling parameter: the conversation, the tools, the
# model, and what the capture adds (``logprobs``: always asked for) or the transport reads.
NOT_SAMPLING = frozenset(
    (
        "model",
        "messages",
        "prompt",
        "tools",
        "stream",
        "stream_options",
        "return_token_ids",
        "logprobs",
    )
)


def sampling_of(body: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling parameters of an engine body as sent (``CanonicalCall.sampling``)."""
    return {name: value for name, value in body.items() if name not in NOT_SAMPLING}


def canonical_of_chat(body: Mapping[str, Any], known: tuple[Message, ...] = ()) -> CanonicalCall:
    """The canonical record of a chat completions body (``datapool.steps.canonical``).

    A chat message's ``reasoning_content`` (the older name) is its ``reasoning``; a tool call
    whose ``arguments`` is not a string keeps its JSON text, a tool that is no function tool
    its type and name (``Message.from_json``, ``Tool.from_json``). ``known``: the canonical
    messages of the body's first ``len(known)`` messages (all objects), already made from the
    same JSON (``gateway.proxy.continuation.walk``); only the messages after them are read.
    """
    messages = body.get("messages")
    return CanonicalCall(
        messages=known
        + tuple(_message(m) for m in messages[len(known) :] if isinstance(m, Mapping))
        if isinstance(messages, list)
        else None,
        tools=tuple(Tool.from_json(t) for t in body.get("tools") or () if isinstance(t, Mapping)),
        sampling=sampling_of(body),
    )


def _message(message: Mapping[str, Any]) -> Message:
    parsed = Message.from_json(message)
    older = message.get("reasoning_content")
    if parsed.reasoning is None and isinstance(older, str):
        return replace(parsed, reasoning=older)
    return parsed


class ChatCompletions(ChoicesDialect[AnswerChoice, ChunkChoice]):
    name = "chat.completions"
    answer_shape = answers.CHAT_ANSWER
    chunk_shape = answers.CHAT_CHUNK
    client_paths = ("/chat/completions",)
    upstream_path = CHAT_PATH
    history_field = "messages"

    def canonical(self, upstream_body: Mapping[str, Any]) -> CanonicalCall:
        return canonical_of_chat(upstream_body)

    def canonical_continuing(
        self, upstream_body: Mapping[str, Any], known: tuple[Message, ...]
    ) -> CanonicalCall:
        return canonical_of_chat(upstream_body, known)

    def check_input(self, body: dict[str, Any]) -> None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError(
                f"'messages' must be a non-empty list, got {type(messages).__name__}",
                param="messages",
            )
        if not all(isinstance(message, dict) for message in messages):
            raise InvalidRequestError(
                "every item of 'messages' must be an object", param="messages"
            )

    def upstream_logprobs(self, body: dict[str, Any]) -> tuple[bool, Any]:
        return body.get("logprobs") is True, True

    def prompt_ids(self, answer: ChatAnswer | ChatChunk) -> list[int] | None:
        return token_ids(answer.get("prompt_token_ids"))

    def choice_logprobs(self, choice: AnswerChoice | ChunkChoice) -> list[float] | None:
        logprobs = choice.get("logprobs")
        if not logprobs:
            return None
        content = logprobs.get("content")
        if content is None:
            return None
        # A null logprob (the shape lets it pass) raises TypeError: the answer is unreadable.
        return [float(entry["logprob"]) for entry in content]  # type: ignore[arg-type]

    def answer_message(self, choice: AnswerChoice) -> dict[str, Any] | None:
        # The message as vLLM sent it, every field: the step stores it as a JSON object.
        return cast("dict[str, Any] | None", choice.get("message"))

    def delta_text(self, choice: ChunkChoice) -> str:
        return str((choice.get("delta") or {}).get("content") or "")

    def add_delta(self, state: ChoiceState, choice: ChunkChoice) -> None:
        delta = choice.get("delta")
        if not delta:
            # Sampled tokens the client was not shown: a parser is holding their text back.
            if choice.get("token_ids"):
                state.held_back = True
            return
        state.held_back = False
        state.role = delta.get("role", state.role)
        content = delta.get("content")
        if content:
            state.text_parts.append(content)
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        if reasoning:
            state.reasoning_parts.append(reasoning)
        for call_delta in delta.get("tool_calls") or []:
            slot = state.tool_calls.setdefault(
                # A null index (the shape lets it pass) raises TypeError: the chunk is unreadable.
                int(call_delta.get("index", 0)),  # type: ignore[arg-type]
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            call_id, kind = call_delta.get("id"), call_delta.get("type")
            if call_id:
                slot["id"] = call_id
            if kind:
                slot["type"] = kind
            function = call_delta.get("function") or {}
            name, arguments = function.get("name"), function.get("arguments")
            if name:
                slot["function"]["name"] += name
            if arguments:
                slot["function"]["arguments"] += arguments

    def stream_message(self, state: ChoiceState) -> dict[str, Any]:
        text = "".join(state.text_parts)
        message: dict[str, Any] = {"role": state.role or "assistant", "content": text or None}
        if state.tool_calls:
            message["tool_calls"] = [state.tool_calls[i] for i in sorted(state.tool_calls)]
        if state.reasoning_parts:
            message["reasoning"] = "".join(state.reasoning_parts)
        return message
