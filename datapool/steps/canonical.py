"""The canonical call record: what the engine was asked, in one form whatever the client's API.

Owns: the typed shapes (``CanonicalCall``, ``Message``, ``ToolCall``, ``Tool``), their JSON form
as ``steps.canonical`` stores it, and reading a stored record or response message back into
them. Every reader of a step's conversation (reward functions, curation, lineage break kinds,
exports, the inspector) reads this record, never the client's body: a reward function written
once serves chat completions, Responses, Messages and any dialect added later. Never: knows a
client API; each dialect writes its calls into this form (``gateway.dialects.base.Dialect
.canonical``), once per call, from the body it sent the engine.

The form is the engine's conversation, the chat template's input:

==================  ==========================================================================
``messages``        the conversation in order (None for a call with a raw ``prompt``);
                    ``role`` is ``system``, ``developer``, ``user``, ``assistant`` or ``tool``
``Message.content`` a string, a list of content parts as sent (``{"type": "text", "text"}``,
                    images, ...), or None (an assistant turn with tool calls only: an empty
                    string beside tool calls reads as None, since a chat client echoes the
                    ``""`` vLLM answered where a Responses or Messages client has no text)
``reasoning``       an assistant turn's reasoning text, however the client named it
``tool_calls``      ``ToolCall(id, name, arguments)``; ``arguments`` is the string exactly as
                    sent (a re-serialised string is a different string)
``tool_call_id``    on a ``tool`` message: the call it answers
``tools``           ``Tool(name, description, parameters)`` offered to the model (type
                    ``function`` unless named otherwise)
``sampling``        every other field of the engine's body as sent (temperature, max_tokens,
                    stop, tool_choice, ...), the channel's sampling defaults included; the
                    fields the gateway adds to capture (ids, logprobs, usage) are not in it
``prompt``          a completions call's prompt (a string or token ids), else None
==================  ==========================================================================

JSON (``to_json``/``from_json``), the form a chat template reads: a message is ``{"role",
"content"}`` plus ``reasoning``, ``tool_calls`` (``[{"id", "type": "function", "function":
{"name", "arguments"}}]``), ``tool_call_id`` and ``name`` when set, the same shape as a step's
``response_message``, so a step's whole conversation is ``messages + [response]`` in one form
(``conversation``); a tool is ``{"type": "function", "function": {"name", "description",
"parameters"}}``.
``steps.canonical`` holds ``{"messages", "tools", "sampling", "prompt"}`` with ``messages`` cut
to those after ``steps.canonical_base`` (a delta on the parent's, ``datapool.steps.messages``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")

Content = str | list[Any] | None


@dataclass(frozen=True)
class ToolCall:
    """One tool call of an assistant turn; ``arguments`` exactly as sent or sampled."""

    id: str | None
    name: str
    arguments: str

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class Message:
    """One turn of the conversation (see the module docstring for each field)."""

    role: str
    content: Content = None
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        """The content as text: a string as is, the ``text`` of each text part joined, else
        ``""``."""
        if isinstance(self.content, str):
            return self.content
        if isinstance(self.content, list):
            return "".join(
                str(part.get("text", ""))
                for part in self.content
                if isinstance(part, Mapping) and part.get("type") == "text"
            )
        return ""

    def to_json(self) -> dict[str, Any]:
        value: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning is not None:
            value["reasoning"] = self.reasoning
        if self.tool_calls:
            value["tool_calls"] = [call.to_json() for call in self.tool_calls]
        if self.tool_call_id is not None:
            value["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            value["name"] = self.name
        return value

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Message:
        """A message from its JSON form (a stored canonical message or ``response_message``);
        a field of the wrong type reads as unset, an empty ``content`` beside tool calls as None;
        a tool call's ``arguments`` that is no
        string (some clients send an object, which vLLM serialises) is its ``json.dumps``
        text, a missing one ``""``, a missing name ``""`` (a reward function then sees the
        call, and judges it malformed)."""
        reasoning = value.get("reasoning")
        tool_calls = tuple(
            _tool_call(call) for call in value.get("tool_calls") or () if isinstance(call, dict)
        )
        content = _content(value.get("content"))
        return cls(
            role=str(value.get("role") or "assistant"),
            content=None if content == "" and tool_calls else content,
            reasoning=reasoning if isinstance(reasoning, str) else None,
            tool_calls=tool_calls,
            tool_call_id=_string(value.get("tool_call_id")),
            name=_string(value.get("name")),
        )


@dataclass(frozen=True)
class Tool:
    """One tool offered to the model: its name, description and JSON Schema ``parameters``."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    type: str = "function"

    def to_json(self) -> dict[str, Any]:
        if self.type != "function":
            return {"type": self.type, "name": self.name}
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Tool:
        kind = str(value.get("type") or "function")
        function = value.get("function")
        if kind != "function" or not isinstance(function, Mapping):
            return cls(name=str(value.get("name") or ""), type=kind)
        parameters = function.get("parameters")
        return cls(
            name=str(function.get("name") or ""),
            description=_string(function.get("description")),
            parameters=parameters if isinstance(parameters, dict) else None,
        )


@dataclass(frozen=True)
class CanonicalCall:
    """What the engine was asked for one call (module docstring)."""

    messages: tuple[Message, ...] | None
    tools: tuple[Tool, ...] = ()
    sampling: dict[str, Any] = field(default_factory=dict)
    prompt: str | list[int] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "messages": None if self.messages is None else [m.to_json() for m in self.messages],
            "tools": [tool.to_json() for tool in self.tools],
            "sampling": self.sampling,
            "prompt": self.prompt,
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> CanonicalCall:
        messages = value.get("messages")
        prompt = value.get("prompt")
        sampling = value.get("sampling")
        return cls(
            messages=None
            if not isinstance(messages, list)
            else tuple(Message.from_json(m) for m in messages if isinstance(m, dict)),
            tools=tuple(Tool.from_json(t) for t in value.get("tools") or () if isinstance(t, dict)),
            sampling=sampling if isinstance(sampling, dict) else {},
            prompt=prompt if isinstance(prompt, str | list) else None,
        )

    def tool_named(self, name: str) -> Tool | None:
        """The offered tool called ``name`` (of type ``function``), or None."""
        return next((t for t in self.tools if t.name == name and t.type == "function"), None)


def conversation(call: CanonicalCall, response: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """A step's messages then its generated message, as JSON (``{"role": "assistant"}`` with no
    content when it generated none): what a reward model is shown."""
    head = [m.to_json() for m in call.messages or ()]
    return [*head, response_of(response).to_json()]


def response_of(response: Mapping[str, Any] | None) -> Message:
    """A step's ``response_message`` as a canonical assistant message (empty when None)."""
    return Message("assistant") if response is None else Message.from_json(response)


# Claude Code's attribution line, the first line of its first system block: its ``cch`` value
# changes on every request. vLLM (0.32, ``_strip_claude_code_billing_header``) drops that line
# from every system text part before rendering, and the part too when nothing else is in it.
BILLING_HEADER = "x-anthropic-billing-header"


def as_rendered(message: Message) -> Message:
    """``message`` as vLLM's template reads it, for comparing histories: a system message
    without Claude Code's billing line (``BILLING_HEADER``: vLLM strips it, so a ``cch`` that
    changes on every call changes no prompt), and a content of exactly one text part (holding
    nothing but its type and text) as that text: the chat template, as vLLM renders it, reads
    both the same (it joins text parts with a newline, so one part is its text). Claude Code
    sends a message as one text block while it carries the conversation's cache breakpoint and
    as a string on later calls; compared through this, the history is unchanged. Lists of
    several parts stay as sent (a template that reads the parts may render them otherwise)."""
    content = message.content
    if message.role == "system" and content:
        content = _without_billing_header(content)
    if (
        isinstance(content, list)
        and len(content) == 1
        and isinstance(content[0], Mapping)
        and set(content[0]) == {"type", "text"}
        and content[0]["type"] == "text"
        and isinstance(content[0]["text"], str)
    ):
        content = content[0]["text"]
    return message if content is message.content else replace(message, content=content)


def _without_billing_header(content: str | list[Any]) -> str | list[Any]:
    """``content`` as vLLM renders a system message's parts: a text part that starts with the
    billing header loses its first line, and is gone when that was all of it; ``content`` itself
    when no part starts with it."""
    if isinstance(content, str):
        if not content.startswith(BILLING_HEADER):
            return content
        rest = content.partition("\n")[2]
        return rest or []
    stripped = False
    kept: list[Any] = []
    for part in content:
        text = part if isinstance(part, str) else None
        if isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text")
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            kept.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            kept.append(rest if isinstance(part, str) else {**part, "text": rest})
        stripped = True
    return kept if stripped else content


def first_turns(messages: Sequence[Message]) -> tuple[Message, ...]:
    """A conversation's start: its ``system``/``developer`` messages and its first message of
    another role (the first ``user`` message), wherever the system messages sit among those:
    what a side call (a title or summary call, a sub-agent) shares with the main chain at most.

    ``[system, user]`` and Claude Code's first call ``[system, user, system]`` (an environment
    block or a reminder after the task) are both whole starts; the start ends before the second
    message that is not a system message.
    """
    head: list[Message] = []
    seen_other = False
    for message in messages:
        if message.role not in ("system", "developer"):
            if seen_other:
                break
            seen_other = True
        head.append(message)
    return tuple(head)


def _content(value: Any) -> Content:
    if isinstance(value, str | list):
        return value
    return None


def _string(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _tool_call(call: Mapping[str, Any]) -> ToolCall:
    function = call.get("function")
    function = function if isinstance(function, Mapping) else {}
    arguments = function.get("arguments")
    return ToolCall(
        id=_string(call.get("id")),
        name=str(function.get("name") or ""),
        arguments=arguments
        if isinstance(arguments, str)
        else ("" if arguments is None else json.dumps(arguments)),
    )
