"""The chat completions dialect: ``POST /v1/chat/completions``, passed through to vLLM's own.

Owns: where chat answers keep their fields (prompt IDs at the top level, logprobs under
``logprobs.content``, the message under ``message`` or its ``delta`` parts) and reassembling a
streamed message (content, reasoning, tool calls by index). Never: changes what the client
receives beyond hiding the capture fields it did not ask for (``gateway.dialects.choices``).
"""

from __future__ import annotations

from typing import Any

from gateway.dialects.choices import ChoicesDialect, ChoiceState
from gateway.errors import InvalidRequestError


class ChatCompletions(ChoicesDialect):
    name = "chat.completions"
    client_paths = ("/chat/completions",)
    upstream_path = "/v1/chat/completions"

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

    def prompt_ids(self, answer: dict[str, Any]) -> list[int] | None:
        ids: list[int] | None = answer.get("prompt_token_ids")
        return ids

    def choice_logprobs(self, logprobs: dict[str, Any] | None) -> list[float] | None:
        if not logprobs:
            return None
        content = logprobs.get("content")
        return None if content is None else [float(entry["logprob"]) for entry in content]

    def answer_message(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        message: dict[str, Any] | None = choice.get("message")
        return message

    def delta_text(self, choice: dict[str, Any]) -> str:
        return str((choice.get("delta") or {}).get("content") or "")

    def add_delta(self, state: ChoiceState, choice: dict[str, Any]) -> None:
        delta = choice.get("delta") or {}
        state.role = delta.get("role", state.role)
        if delta.get("content"):
            state.text_parts.append(delta["content"])
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        if reasoning:
            state.reasoning_parts.append(reasoning)
        for call_delta in delta.get("tool_calls") or []:
            slot = state.tool_calls.setdefault(
                int(call_delta.get("index", 0)),
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if call_delta.get("id"):
                slot["id"] = call_delta["id"]
            if call_delta.get("type"):
                slot["type"] = call_delta["type"]
            function = call_delta.get("function") or {}
            if function.get("name"):
                slot["function"]["name"] += function["name"]
            if function.get("arguments"):
                slot["function"]["arguments"] += function["arguments"]

    def stream_message(self, state: ChoiceState) -> dict[str, Any]:
        text = "".join(state.text_parts)
        message: dict[str, Any] = {"role": state.role or "assistant", "content": text or None}
        if state.tool_calls:
            message["tool_calls"] = [state.tool_calls[i] for i in sorted(state.tool_calls)]
        if state.reasoning_parts:
            message["reasoning"] = "".join(state.reasoning_parts)
        return message
