"""An Anthropic Messages API request, translated into the chat completions body sent to vLLM.

Owns: checking a ``POST /v1/messages`` (or ``/v1/messages/count_tokens``) body block by block,
and writing the equivalent chat body (``messages``, ``tools``, ``tool_choice``, sampling,
``chat_template_kwargs``), and the mapping between Anthropic ``tool_use`` ids and the chat tool
call ids vLLM made (``tool_use_id``, ``chat_call_id``). Never: tokenizes, reads the pool, or
sends anything; the capture fields (``return_token_ids``, logprobs, the usage chunk) are added
by ``gateway.dialects.messages.serving``.

How the body becomes chat messages (in order, one pass):

========================  =================================================================
``system`` (string or     a leading ``system`` message (a string stays a string, text blocks
text blocks)              become text parts)
role ``user``             text blocks become a ``user`` message of text parts; its
                          ``tool_result`` blocks become ``tool`` messages (``tool_call_id``),
                          put before the text, as chat wants tool answers right after the call
role ``assistant``        one ``assistant`` message: text blocks joined into one string (the
                          pieces of one generated text), ``thinking`` blocks joined into its
                          ``reasoning`` (vLLM hands it to the chat template), ``tool_use``
                          blocks into ``tool_calls`` (``input`` as JSON text)
role ``system``           (Claude Code puts its environment there) a ``system`` message
last message assistant    a prefill: ``continue_final_message`` true, no generation prompt
========================  =================================================================

``redacted_thinking`` carries only encrypted data no template can read: accepted, adds nothing.
``tool_result.is_error`` has no chat field: the text goes as it is (Claude Code writes the error
into it). ``image`` (and ``document``) blocks are refused: the gateway serves text models (the
tiny test model has no vision input), so an image is a 400 rather than silently dropped.

Tools with a ``type`` other than ``custom`` are Anthropic's server or built-in tools
(``web_search_20250305``, ``bash_20250124``, ...) with no schema the model could be shown; tools
with ``defer_loading: true`` are, in Anthropic's tool search, not in the model's context until
found. Both are left out of the upstream body and named in ``Translation.omitted_tools``.

``tool_choice``: ``auto`` → ``auto`` (``disable_parallel_tool_use`` → ``parallel_tool_calls``
false), ``any`` → ``required``, ``tool`` → the named function, ``none`` → ``none``.
``thinking`` → ``chat_template_kwargs.enable_thinking`` (true for ``enabled``/``adaptive``, false
for ``disabled``: the switch Qwen3-family templates read, ignored by templates without it);
its ``budget_tokens`` (an integer >= 1 when sent) is recorded only. ``output_config.format``
(structured output) → ``response_format``. ``metadata``, ``cache_control`` (anywhere),
``context_management``, ``output_config.effort`` and any other top-level field are accepted and
change nothing: the client's body is stored as sent, and Claude Code adds beta fields often. Every
top-level field Anthropic defines is checked against its type and bounds
(``gateway.dialects.messages.protocol``: ``metadata`` an object, ``top_k`` at least 0,
``temperature`` 0 to 1, ...) before anything goes upstream.

Errors: a wrong type, a missing field, an unknown block type, a block in the wrong role is an
``InvalidRequestError`` (400) whose ``param`` is the field's path in Anthropic's dotted form
(``messages.2.content.0.type``) and whose message starts with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.dialects.messages.protocol import MessagesRequest
from gateway.dialects.messages.wire import (
    ContentBlock,
    OutputFormat,
    TextBlock,
    ToolChoiceParam,
    ToolParam,
    ToolResultBlock,
    ToolUseBlock,
)
from gateway.dialects.translation import (
    Field,
    FieldErrors,
    check_top_level,
    copy_fields,
    named_tool_choice,
    translate_tools,
)
from gateway.dialects.translation_memory import Kept, TranslationMemory, items_text
from gateway.dialects.wire import (
    ChatBody,
    ChatContentPart,
    ChatFunction,
    ChatMessage,
    ChatNamedToolChoice,
    ChatResponseFormat,
    ChatSampling,
    ChatTextPart,
    ChatTool,
    ChatToolCall,
    ChatToolChoice,
)

# Fields translated into the chat body; every other top-level field is accepted and ignored.
TRANSLATED_FIELDS = frozenset(
    (
        "model",
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "thinking",
        "output_config",
        "stream",
    )
)
MESSAGE_ROLES = ("user", "assistant", "system")
USER_BLOCKS = ("text", "tool_result")
ASSISTANT_BLOCKS = ("text", "thinking", "redacted_thinking", "tool_use")
TOOL_CHOICE_TYPES = ("auto", "any", "tool", "none")
# A tool choice type but ``tool`` → the chat ``tool_choice`` it becomes.
_CHAT_TOOL_CHOICES: dict[str, Literal["auto", "required", "none"]] = {
    "auto": "auto",
    "any": "required",
    "none": "none",
}
THINKING_TYPES = ("enabled", "adaptive", "disabled")
# Blocks a text model cannot take: refused with a reason, not as unknown.
_NOT_SERVED = {
    "image": "image blocks are not served: the model behind this gateway takes text only",
    "document": "document blocks are not served: the model behind this gateway takes text only",
}
TOOL_USE_PREFIX = "toolu_"
# Sampling fields copied as they are (``max_tokens`` and ``stop_sequences`` have own checks).
SAMPLING = {
    "temperature": Field("temperature", (int, float), "a number"),
    "top_p": Field("top_p", (int, float), "a number"),
    "top_k": Field("top_k", int, "an integer"),
}


@dataclass(frozen=True)
class Translation:
    """A Messages body as a chat body.

    ``chat_body`` has no capture fields yet; ``omitted_tools`` names the tools chat cannot offer
    (server tools, deferred tools); ``ignored_fields`` the top-level fields that changed nothing.
    """

    chat_body: ChatBody
    omitted_tools: list[str] = field(default_factory=list)
    ignored_fields: list[str] = field(default_factory=list)


def tool_use_id(chat_call_id: str) -> str:
    """The ``tool_use`` id the client sees for a chat tool call id: ``toolu_<chat id>``."""
    return TOOL_USE_PREFIX + chat_call_id


def chat_call_id(anthropic_id: str) -> str:
    """The chat tool call id for a ``tool_use`` id the client sends back (``tool_use_id``
    undone), so the upstream messages name each call as vLLM did and the pool's prefix-break
    check matches calls across turns. An id without the prefix is passed unchanged."""
    return anthropic_id.removeprefix(TOOL_USE_PREFIX)


# Messages errors lead with the field's dotted path, as the message does: "model: must be ...".
_FIELDS = FieldErrors(lambda param: f"{param}:")
_fail = _FIELDS.fail
_expect = _FIELDS.expect


# A Messages message becomes its chat messages alone: the fold carries nothing (``Kept.pending``).
MessagesMemory = TranslationMemory[None]


def translate_request(
    body: dict[str, Any], *, counting: bool = False, memory: MessagesMemory | None = None
) -> Translation:
    """The chat body for a Messages ``body`` (never mutated).

    ``counting`` is True for ``/v1/messages/count_tokens``: ``max_tokens`` is not required and
    no sampling field is written. ``memory``: recent translations, of which the messages a
    kept one proves the same are reused and the body's kept in turn
    (``gateway.dialects.translation_memory``); the chat body is the same with or without it.
    Raises ``InvalidRequestError`` (400) naming the field (module docstring).
    """
    _expect(body.get("model"), str, "model", "a string")
    messages: list[ChatMessage] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _system(body["system"])})
    raw_messages = body.get("messages")
    _expect(raw_messages, list, "messages", "a list of messages")
    if not raw_messages:
        raise _fail("messages", "must hold at least one message")
    messages += _translated_messages(raw_messages, memory)
    chat: ChatBody = {"model": body["model"], "messages": messages}
    last = messages[-1]
    if last["role"] == "assistant" and last.get("content") and not last.get("tool_calls"):
        # A prefill: the answer continues the last assistant text (Anthropic's semantics).
        chat["continue_final_message"] = True
        chat["add_generation_prompt"] = False
    if not counting:
        _sampling(body, chat)
    tools, omitted = translate_tools(
        body.get("tools"), lambda position: f"tools.{position}", _FIELDS, _tool
    )
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], bool(tools), chat)
    enable_thinking = _thinking(body.get("thinking"))
    if enable_thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": enable_thinking}
    response_format = _response_format(body.get("output_config"))
    if response_format is not None and not counting:
        chat["response_format"] = response_format
    if "stream" in body and not counting:
        _expect(body["stream"], bool, "stream", "a boolean")
        chat["stream"] = body["stream"]
    ignored = sorted(set(body) - TRANSLATED_FIELDS)
    # Last: the walk above names a nested field's type error first; the protocol adds the
    # bounds and enums of every top-level field, the ignored ones (metadata) included.
    check_top_level(MessagesRequest, body, _FIELDS)
    return Translation(chat, omitted, ignored)


def _translated_messages(
    raw_messages: list[Any], memory: MessagesMemory | None
) -> list[ChatMessage]:
    """The chat messages of the body's ``messages`` (a non-empty list), those a kept
    translation proves the same taken from it, the rest translated one by one; the result kept
    in ``memory`` (when given and orjson can write the messages). A message's chat messages are
    ``_message``'s of it alone (it reads nothing else, and returns new messages), so
    proved-equal messages have equal translations."""
    text = None if memory is None else items_text(raw_messages)
    earlier, shared = (None, 0) if memory is None or text is None else memory.longest(text)
    messages: list[ChatMessage] = [] if earlier is None else list(earlier.chat)
    for position in range(shared, len(raw_messages)):
        messages += _message(raw_messages[position], f"messages.{position}")
    if memory is not None and text is not None:
        memory.keep(Kept(text, tuple(messages), len(raw_messages), None), earlier)
    return messages


def _sampling(body: dict[str, Any], chat: ChatSampling) -> None:
    """Writes the chat sampling fields into ``chat``: ``max_tokens`` (required), ``SAMPLING``,
    ``stop`` for ``stop_sequences``."""
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise _fail("max_tokens", "is required by the Messages API")
    _expect(max_tokens, int, "max_tokens", "an integer")
    if max_tokens < 1:
        raise _fail("max_tokens", f"must be at least 1, got {max_tokens}")
    chat["max_tokens"] = max_tokens
    copy_fields(body, SAMPLING, _FIELDS, chat)
    stops = body.get("stop_sequences")
    if stops is not None:
        _expect(stops, list, "stop_sequences", "a list of strings")
        for position, stop in enumerate(stops):
            _expect(stop, str, f"stop_sequences.{position}", "a string")
        if stops:
            chat["stop"] = list(stops)


# The walk below takes each part of the body as it came (``Any``) and checks it before reading
# it; a part whose checks have run is read through its type in ``wire`` (assigned, not cast:
# nothing runs, the annotation records what the check established).


def _system(system: Any) -> str | list[ChatContentPart]:
    if isinstance(system, str):
        return system
    _expect(system, list, "system", "a string or a list of text blocks")
    return [_text_part(block, f"system.{position}") for position, block in enumerate(system)]


def _text_part(block: Any, param: str) -> ChatTextPart:
    """A chat text part for a ``text`` block (the only block type allowed where it is read)."""
    _expect(block, dict, param, "an object")
    if block.get("type") != "text":
        raise _fail(f"{param}.type", f"must be 'text', got {block.get('type')!r}")
    _expect(block.get("text"), str, f"{param}.text", "a string")
    text: TextBlock = block  # its type and text checked just above
    return {"type": "text", "text": text["text"]}


def _blocks(message: Any, param: str, allowed: tuple[str, ...]) -> list[ContentBlock]:
    """The message's content as blocks (a string is one text block), each block's ``type``
    checked against ``allowed``: its own fields are checked by the reader of that kind."""
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    _expect(content, list, f"{param}.content", "a string or a list of content blocks")
    blocks: list[Any] = message["content"]
    if not blocks:
        raise _fail(f"{param}.content", "must hold at least one content block")
    for index, block in enumerate(blocks):
        where = f"{param}.content.{index}"
        _expect(block, dict, where, "an object")
        kind = block.get("type")
        if kind in _NOT_SERVED:
            raise _fail(f"{where}.type", _NOT_SERVED[kind])
        if kind not in allowed:
            raise _fail(
                f"{where}.type",
                f"unsupported block type {kind!r} in a {message['role']} message; "
                f"supported: {', '.join(allowed)}",
            )
    return blocks


def _message(message: Any, param: str) -> list[ChatMessage]:
    """The chat messages one Messages message becomes (tool results split out of user turns)."""
    _expect(message, dict, param, "an object")
    role = message.get("role")
    if role not in MESSAGE_ROLES:
        raise _fail(f"{param}.role", f"must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}")
    if role == "assistant":
        return [_assistant(_blocks(message, param, ASSISTANT_BLOCKS), param)]
    if isinstance(message.get("content"), str):
        return [{"role": role, "content": message["content"]}]
    blocks = _blocks(message, param, USER_BLOCKS if role == "user" else ("text",))
    results: list[ChatMessage] = []
    texts: list[ChatContentPart] = []
    for index, block in enumerate(blocks):
        where = f"{param}.content.{index}"
        if block["type"] == "tool_result":
            results.append(_tool_result(block, where))
        else:
            texts.append(_text_part(block, where))
    return results + ([{"role": role, "content": texts}] if texts else [])


def _assistant(blocks: list[ContentBlock], param: str) -> ChatMessage:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[ChatToolCall] = []
    for index, block in enumerate(blocks):
        where = f"{param}.content.{index}"
        if block["type"] == "text":
            _expect(block.get("text"), str, f"{where}.text", "a string")
            texts.append(block["text"])
        elif block["type"] == "thinking":
            _expect(block.get("thinking"), str, f"{where}.thinking", "a string")
            reasoning.append(block["thinking"])
        elif block["type"] == "tool_use":
            calls.append(_tool_use(block, where))
        # redacted_thinking: encrypted, nothing a template can read (module docstring)
    message: ChatMessage = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    return message


def _tool_use(block: ToolUseBlock, param: str) -> ChatToolCall:
    _expect(block.get("id"), str, f"{param}.id", "a string")
    _expect(block.get("name"), str, f"{param}.name", "a string")
    _expect(block.get("input"), dict, f"{param}.input", "an object")
    return {
        "id": chat_call_id(block["id"]),
        "type": "function",
        "function": {"name": block["name"], "arguments": json.dumps(block["input"])},
    }


def _tool_result(block: ToolResultBlock, param: str) -> ChatMessage:
    _expect(block.get("tool_use_id"), str, f"{param}.tool_use_id", "a string")
    if block.get("is_error") is not None:
        _expect(block.get("is_error"), bool, f"{param}.is_error", "a boolean")
    content = block.get("content")
    if content is None:
        text: str | list[ChatContentPart] = ""
    elif isinstance(content, str):
        text = content
    else:
        _expect(content, list, f"{param}.content", "a string or a list of text blocks")
        parts: list[Any] = content
        for index, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _NOT_SERVED:
                raise _fail(f"{param}.content.{index}.type", _NOT_SERVED[kind])
        text = [_text_part(part, f"{param}.content.{index}") for index, part in enumerate(parts)]
    return {"role": "tool", "tool_call_id": chat_call_id(block["tool_use_id"]), "content": text}


def _tool(raw: Any, param: str) -> ChatTool | str:
    """The chat tool for a custom tool; the name of a server or deferred tool (left out)."""
    _expect(raw.get("name"), str, f"{param}.name", "a string")
    tool: ToolParam = raw  # an object (``translate_tools``) with a string name, checked above
    if tool.get("type") not in (None, "custom") or tool.get("defer_loading") is True:
        return str(tool["name"])
    _expect(tool.get("input_schema"), dict, f"{param}.input_schema", "an object")
    function: ChatFunction = {"name": tool["name"], "parameters": tool["input_schema"]}
    description = tool.get("description")
    if description is not None:
        _expect(description, str, f"{param}.description", "a string")
        function["description"] = description
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _tool_choice(raw: Any, has_tools: bool, chat: ChatToolChoice) -> None:
    """Writes the chat ``tool_choice`` (and ``parallel_tool_calls``) into ``chat``; none when no
    tool is offered upstream and the choice allows no call anyway (``auto``, ``none``)."""
    _expect(raw, dict, "tool_choice", "an object")
    kind = raw.get("type")
    if kind not in TOOL_CHOICE_TYPES:
        raise _fail(
            "tool_choice.type", f"must be one of {', '.join(TOOL_CHOICE_TYPES)}, got {kind!r}"
        )
    choice: ToolChoiceParam = raw  # an object with a known type, checked above
    tool_choice: ChatNamedToolChoice | Literal["auto", "required", "none"]
    if choice["type"] == "tool":
        _expect(choice.get("name"), str, "tool_choice.name", "a string")
        tool_choice = named_tool_choice(choice["name"])
    else:
        tool_choice = _CHAT_TOOL_CHOICES[choice["type"]]
    if not has_tools:
        if choice["type"] in ("any", "tool"):
            raise _fail("tool_choice.type", f"{kind!r} needs at least one custom tool in 'tools'")
        return
    disable_parallel = choice.get("disable_parallel_tool_use")
    if disable_parallel is not None:
        _expect(disable_parallel, bool, "tool_choice.disable_parallel_tool_use", "a boolean")
    chat["tool_choice"] = tool_choice
    if disable_parallel is not None:
        chat["parallel_tool_calls"] = not disable_parallel


def _thinking(thinking: Any) -> bool | None:
    if thinking is None:
        return None
    _expect(thinking, dict, "thinking", "an object")
    kind = thinking.get("type")
    if kind not in THINKING_TYPES:
        raise _fail("thinking.type", f"must be one of {', '.join(THINKING_TYPES)}, got {kind!r}")
    budget = thinking.get("budget_tokens")
    if budget is not None:
        # Recorded only (no template reads it), but a value Anthropic refuses is refused here too.
        _expect(budget, int, "thinking.budget_tokens", "an integer")
        if budget < 1:
            raise _fail("thinking.budget_tokens", f"must be at least 1, got {budget}")
    return bool(kind != "disabled")


def _response_format(output_config: Any) -> ChatResponseFormat | None:
    if output_config is None:
        return None
    _expect(output_config, dict, "output_config", "an object")
    fmt = output_config.get("format")
    if fmt is None:
        return None
    _expect(fmt, dict, "output_config.format", "an object")
    if fmt.get("type") != "json_schema":
        raise _fail("output_config.format.type", f"must be 'json_schema', got {fmt.get('type')!r}")
    _expect(fmt.get("schema"), dict, "output_config.format.schema", "an object")
    checked: OutputFormat = fmt  # an object of type json_schema with an object schema, above
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": checked["schema"]}}
