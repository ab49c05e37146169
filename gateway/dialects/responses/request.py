"""A Responses API request, translated into the chat completions body sent to vLLM.

Owns: checking a ``POST /v1/responses`` body item by item, and writing the equivalent chat body
(``messages``, ``tools``, ``tool_choice``, sampling, ``response_format``), resolving
``previous_response_id`` from what the pool holds of the earlier call (``EarlierResponse``),
and resuming the translation of an ``input`` list a recent call's proves the same
(``ResponsesMemory``). Never: tokenizes, reads the pool itself, or sends anything; the capture
fields (``return_token_ids``, logprobs, the usage chunk) are added by
``gateway.dialects.responses.serving``.

How the items become chat messages (in order, one pass):

==========================  ===============================================================
``instructions``            a leading ``system`` message (not carried over from an earlier
                            response, as in OpenAI's API)
message, role ``user``      ``user``; parts ``input_text``/``output_text`` become ``text``
                            parts, ``input_image`` an ``image_url`` part
role ``system``/``developer``  ``system`` (chat templates know no ``developer`` role)
role ``assistant``          ``assistant``; joins a preceding assistant message that holds only
                            reasoning
``reasoning``               the ``reasoning`` of the next assistant message (vLLM hands it to
                            the chat template as ``reasoning``/``reasoning_content``); the
                            text is the item's ``reasoning_text`` content, else its summary
``function_call``           a ``tool_calls`` entry of the assistant message just before it (the
                            model's text and calls of one turn were one chat message), else
                            of a new assistant message; consecutive calls share one message
``function_call_output``    a ``tool`` message with ``tool_call_id``
==========================  ===============================================================

Tools that are not function tools (Codex also offers ``custom``, ``web_search``,
``local_shell``) cannot be called through chat completions: they are left out of the upstream
body and named in ``Translation.omitted_tools``; the echo lists only the function tools
(``render.echo_fields``). Anything else this module cannot translate (an unknown item or part
type, a wrong type) is a 400 naming the field, as in ``input[2].type``.

Codex re-sends its whole ``input`` on every call. The pass over the items is a left fold whose
state after an item is the chat messages so far and the reasoning text no message took yet
(``_add_item``); the reasoning-only assistant message a trailing ``reasoning`` item becomes is
added after the last item, outside the state. So a body whose leading items a recent body's
``input`` proves the same (``gateway.dialects.translation_memory``: the items' orjson text)
resumes from that body's state and translates only the items it added; the chat body is the
same as from scratch. A ``function_call`` that joins the assistant message before it replaces
that message with an extended copy: the message may be a kept one, shared by other calls'
bodies. The ``instructions`` system message and an earlier response's history are no part of
the state (they are put before the input's messages).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from gateway.dialects.base import EarlierCall
from gateway.dialects.responses.protocol import ResponsesRequest
from gateway.dialects.responses.wire import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputImage,
    InputText,
    JSONSchemaFormat,
    MessageItem,
)
from gateway.dialects.translation import (
    Field,
    FieldErrors,
    check_top_level,
    copy_fields,
    invalid_value,
    named_tool_choice,
    translate_tools,
)
from gateway.dialects.translation_memory import Kept, TranslationMemory, items_text
from gateway.dialects.wire import (
    ChatBody,
    ChatContentPart,
    ChatFunction,
    ChatImageURL,
    ChatJSONSchema,
    ChatMessage,
    ChatResponseFormat,
    ChatTool,
    ChatToolCall,
)
from gateway.errors import InvalidRequestError

ROLES = ("user", "system", "developer", "assistant")
TOOL_CHOICE_MODES = ("auto", "none", "required")
# Accepted and echoed, never sent upstream: they change nothing the engine does.
ECHO_ONLY = (
    "store",
    "metadata",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "client_metadata",
    "service_tier",
    "truncation",
    "max_tool_calls",
    "stream_options",
)
KNOWN_FIELDS = frozenset(
    (
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_output_tokens",
        "temperature",
        "top_p",
        "top_logprobs",
        "reasoning",
        "include",
        "text",
        "previous_response_id",
        "stream",
        *ECHO_ONLY,
    )
)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Every value of ``include`` the Responses API defines. Only the logprobs change what is served;
# the others name outputs of hosted tools (refused here) or encrypted reasoning (Codex asks for
# it; a local engine has none to give), so they are accepted and answer nothing extra. A value
# outside the list is a client's mistake, refused as OpenAI refuses it.
INCLUDE_VALUES = frozenset(
    (
        LOGPROBS_INCLUDE,
        "reasoning.encrypted_content",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
        "file_search_call.results",
        "web_search_call.action.sources",
        "web_search_call.results",
    )
)
# Sampling fields: the client's name → the chat field it becomes.
SAMPLING = {
    "max_output_tokens": Field("max_tokens", int, "an integer"),
    "temperature": Field("temperature", (int, float), "a number"),
    "top_p": Field("top_p", (int, float), "a number"),
    "top_logprobs": Field("top_logprobs", int, "an integer"),
}
# The chat fields the translation writes → the Responses field each came from, for naming the
# field of an upstream error in the client's terms (``messages`` is made of ``instructions``,
# the earlier response and ``input`` at once: no one field; the capture fields none).
CHAT_TO_CLIENT: dict[str, str | None] = {
    "model": "model",
    **{spec.chat_name: name for name, spec in SAMPLING.items()},
    "tools": "tools",
    "tool_choice": "tool_choice",
    "parallel_tool_calls": "parallel_tool_calls",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "stream": "stream",
}


# What the pool holds of the call an earlier response came from: ``request`` is that call's
# Responses body as the client sent it, ``upstream_request`` the chat body sent to vLLM (its
# ``messages`` are the whole conversation up to then) and ``response_message`` the answer in the
# common form (``content``, ``tool_calls``, ``reasoning``). A step stores exactly these three.
EarlierResponse = EarlierCall


@dataclass(frozen=True)
class Translation:
    """A Responses body as a chat body.

    ``chat_body`` has no capture fields yet; ``logprobs_asked`` is True when ``include`` has
    ``message.output_text.logprobs``; ``omitted_tools`` names the tools chat cannot offer;
    ``history_at`` is where an earlier response's history goes in ``chat_body["messages"]``
    (after the ``instructions`` system message).
    """

    chat_body: ChatBody
    logprobs_asked: bool
    omitted_tools: list[str] = field(default_factory=list)
    history_at: int = 0


# Recent ``input`` lists' translations; what the fold carries past an item is the reasoning
# text no message took yet (``Kept.pending``), None when there is none.
ResponsesMemory = TranslationMemory[str | None]


@dataclass(frozen=True)
class InputTranslation:
    """A Responses ``input`` as chat messages (``messages``), and the entry to keep in the
    memory once the whole body is translated (``entry``, in place of ``extends``, the entry it
    resumed from): None for a string ``input``, without a memory, or when orjson cannot write
    the items."""

    messages: list[ChatMessage]
    entry: Kept[str | None] | None = None
    extends: Kept[str | None] | None = None


# Responses errors quote the field first, as OpenAI's do: "'model' must be a string, got int".
_FIELDS = FieldErrors(lambda param: f"'{param}'")
_expect = _FIELDS.expect


def previous_response_id(body: dict[str, Any]) -> str | None:
    """The ``previous_response_id`` of ``body``, or None. Raises ``InvalidRequestError`` when it
    is not a string."""
    value = body.get("previous_response_id")
    if value is None:
        return None
    _expect(value, str, "previous_response_id", "a string")
    return str(value)


def history_messages(earlier: EarlierResponse) -> list[ChatMessage]:
    """The chat messages an earlier response leaves as history: its upstream messages without
    the ``instructions`` system message this module put first, then its answer."""
    # The pool holds the chat body this module wrote for that call: its messages are chat's.
    messages: list[ChatMessage] = list(earlier.upstream_request.get("messages") or [])
    if isinstance(earlier.request.get("instructions"), str) and messages:
        messages = messages[1:]
    answer: ChatMessage = {"role": "assistant", "content": earlier.response_message.get("content")}
    if earlier.response_message.get("tool_calls"):
        answer["tool_calls"] = earlier.response_message["tool_calls"]
    if earlier.response_message.get("reasoning"):
        answer["reasoning"] = earlier.response_message["reasoning"]
    return [*messages, answer]


def translate_request(body: dict[str, Any], earlier: EarlierResponse | None = None) -> Translation:
    """The chat body for a Responses ``body`` (never mutated): ``translate_body`` then
    ``continued`` with ``earlier``, what the pool holds for ``body["previous_response_id"]``
    (None when unknown). Raises ``InvalidRequestError`` as both do."""
    return continued(translate_body(body), body, earlier)


def continued(
    translation: Translation, body: dict[str, Any], earlier: EarlierResponse | None
) -> Translation:
    """``translation`` of ``body`` with the history of the earlier response its
    ``previous_response_id`` names put after the ``instructions`` (the same object when it
    names none). Raises ``InvalidRequestError`` (400 ``previous_response_not_found``, OpenAI's
    message first) when it names one and ``earlier`` is None, or ``earlier`` was created with
    ``store: false``: OpenAI keeps no such response to continue from, so a conversation that
    chains one here would fail there (the pool still captures it as training data)."""
    earlier_id = previous_response_id(body)
    if earlier_id is None:
        return translation
    if earlier is None or earlier.request.get("store") is False:
        why = (
            "it was created with store: false, so it cannot be continued; send its "
            "conversation as input instead"
            if earlier is not None
            else "no call of this trajectory answered with that id"
        )
        raise InvalidRequestError(
            f"Previous response with id '{earlier_id}' not found. ({why})",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    messages = translation.chat_body["messages"]
    at = translation.history_at
    spliced = [*messages[:at], *history_messages(earlier), *messages[at:]]
    return replace(translation, chat_body={**translation.chat_body, "messages": spliced})


def translate_body(body: dict[str, Any], memory: ResponsesMemory | None = None) -> Translation:
    """The chat body for a Responses ``body`` (never mutated) without the history of any
    ``previous_response_id`` (``continued`` adds it, once the pool was read): the call's one
    translation, so every check runs before any lookup. ``memory``: recent translations of
    ``input`` lists, of which the items a kept one proves the same are not translated again;
    the body's is kept in turn once every check passed (a body that raised is kept nowhere).
    The chat body is the same with or without it. Raises ``InvalidRequestError`` (400) naming
    the field for an unknown field, item or part type, a wrong type, or a value out of the
    field's bounds (``gateway.dialects.responses.protocol``).
    """
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise InvalidRequestError(
            f"unsupported parameter '{unknown[0]}' for the Responses API here; supported: "
            + ", ".join(sorted(KNOWN_FIELDS)),
            param=unknown[0],
            code="unknown_parameter",
        )
    _expect(body.get("model"), str, "model", "a string")
    messages: list[ChatMessage] = []
    instructions = body.get("instructions")
    if instructions is not None:
        _expect(instructions, str, "instructions", "a string")
        messages.append({"role": "system", "content": instructions})
    history_at = len(messages)
    previous_response_id(body)  # its type is checked here; the lookup comes later
    translated_input = input_messages(body.get("input"), memory)
    messages.extend(translated_input.messages)
    chat: ChatBody = {"model": body["model"], "messages": messages}
    copy_fields(body, SAMPLING, _FIELDS, chat)
    tools, omitted = translate_tools(
        body.get("tools"), lambda position: f"tools[{position}]", _FIELDS, _tool
    )
    if tools:
        chat["tools"] = tools
    if "tool_choice" in body:
        choice = _tool_choice(body["tool_choice"])
        if tools:
            chat["tool_choice"] = choice
        elif choice not in ("auto", "none"):
            raise InvalidRequestError(
                f"'tool_choice' {body['tool_choice']!r} needs a tool to call, but 'tools' "
                "offers none",
                param="tool_choice",
            )
        # else: with no tools, "auto" and "none" both mean plain text (OpenAI accepts such a
        # body: Codex's compaction sends tools [] with "auto"), while vLLM refuses a tool_choice
        # without tools; so the field is dropped.
    if "parallel_tool_calls" in body:
        _expect(body["parallel_tool_calls"], bool, "parallel_tool_calls", "a boolean")
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    effort = _reasoning_effort(body.get("reasoning"))
    if effort is not None:
        # vLLM passes it to the chat template, and turns thinking off for "none".
        chat["reasoning_effort"] = effort
    if "stream" in body:
        _expect(body["stream"], bool, "stream", "a boolean")
        chat["stream"] = body["stream"]
    logprobs_asked = LOGPROBS_INCLUDE in _include(body.get("include"))
    # Last: the walk above names a nested field's type error first; the protocol adds the
    # bounds and enums of every top-level field, the echo-only ones included.
    check_top_level(ResponsesRequest, body, _FIELDS)
    if memory is not None and translated_input.entry is not None:
        memory.keep(translated_input.entry, translated_input.extends)
    return Translation(chat, logprobs_asked, omitted, history_at=history_at)


def _include(include: Any) -> list[str]:
    if include is None:
        return []
    _expect(include, list, "include", "a list of strings")
    for position, entry in enumerate(include):
        _expect(entry, str, f"include[{position}]", "a string")
        if entry not in INCLUDE_VALUES:
            raise InvalidRequestError(
                f"'include[{position}]' must be one of {', '.join(sorted(INCLUDE_VALUES))}, "
                f"got {entry!r:.60}",
                param=f"include[{position}]",
            )
    return list(include)


def input_messages(value: Any, memory: ResponsesMemory | None = None) -> InputTranslation:
    """Chat messages for a Responses ``input``: a string (one user message) or a list of items
    (module docstring), those a kept translation in ``memory`` proves the same taken from it
    and the rest folded in one by one. Raises ``InvalidRequestError`` naming the item's
    field."""
    if isinstance(value, str):
        return InputTranslation([{"role": "user", "content": value}])
    _expect(value, list, "input", "a string or a list of items")
    items: list[Any] = value
    text = None if memory is None else items_text(items)
    earlier, shared = (None, 0) if memory is None or text is None else memory.longest(text)
    messages: list[ChatMessage] = [] if earlier is None else list(earlier.chat)
    reasoning = None if earlier is None else earlier.pending
    for position in range(shared, len(items)):
        reasoning = _add_item(messages, reasoning, items[position], f"input[{position}]")
    # The state after the last item: the trailing reasoning below is no message of it.
    entry = None if text is None else Kept(text, tuple(messages), len(items), reasoning)
    if reasoning is not None:
        messages.append({"role": "assistant", "content": None, "reasoning": reasoning})
    return InputTranslation(messages, entry, earlier)


def _add_item(
    messages: list[ChatMessage], reasoning: str | None, item: Any, param: str
) -> str | None:
    """Folds one input ``item`` into ``messages`` (appending, or replacing the last message
    with an extended copy: never changing a message in place), given the reasoning text no
    message took yet, and returns the reasoning text none has taken after it."""
    _expect(item, dict, param, "an object")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        message = _message(item, param)
        if reasoning is not None:
            if message["role"] != "assistant":
                messages.append({"role": "assistant", "content": None, "reasoning": reasoning})
            else:
                message["reasoning"] = reasoning
        messages.append(message)
        return None
    if kind == "reasoning":
        text = _reasoning_text(item, param)
        return (reasoning or "") + text if text else reasoning
    if kind == "function_call":
        call = _function_call(item, param)
        last = messages[-1] if messages and reasoning is None else None
        if last is not None and last["role"] == "assistant":
            # A copy: ``last`` may be a kept message, in other calls' bodies too.
            extended = last.copy()
            extended["tool_calls"] = [*last.get("tool_calls", ()), call]
            messages[-1] = extended
            return None
        turn: ChatMessage = {"role": "assistant", "content": None, "tool_calls": [call]}
        if reasoning is not None:
            turn["reasoning"] = reasoning
        messages.append(turn)
        return None
    if kind == "function_call_output":
        messages.append(_function_call_output(item, param))
        return reasoning
    raise invalid_value(
        f"unsupported input item type {kind!r} at {param}; supported: message, "
        "reasoning, function_call, function_call_output",
        f"{param}.type",
    )


# The walk below takes each item and part as it came (``Any``) and checks it before reading it;
# one whose checks have run is read through its type in ``wire`` (assigned, not cast: nothing
# runs, the annotation records what the check established).


def _message(raw: Any, param: str) -> ChatMessage:
    role = raw.get("role")
    if role not in ROLES:
        raise invalid_value(
            f"'{param}.role' must be one of {', '.join(ROLES)}, got {role!r}", param + ".role"
        )
    content = raw.get("content")
    if isinstance(content, str):
        chat_content: str | list[ChatContentPart] = content
    else:
        _expect(content, list, f"{param}.content", "a string or a list of content parts")
        parts: list[Any] = content
        chat_content = [
            _content_part(part, f"{param}.content[{index}]") for index, part in enumerate(parts)
        ]
    item: MessageItem = raw  # an object with a known role, checked above
    return {
        "role": "system" if item["role"] == "developer" else item["role"],
        "content": chat_content,
    }


def _content_part(raw: Any, param: str) -> ChatContentPart:
    _expect(raw, dict, param, "an object")
    kind = raw.get("type")
    if kind in ("input_text", "output_text"):
        _expect(raw.get("text"), str, f"{param}.text", "a string")
        text: InputText = raw  # a text part with a string text, checked above
        return {"type": "text", "text": text["text"]}
    if kind == "input_image":
        _expect(raw.get("image_url"), str, f"{param}.image_url", "a string (URL or data URL)")
        part: InputImage = raw  # an image part with a string URL, checked above
        image: ChatImageURL = {"url": part["image_url"]}
        detail = part.get("detail")
        if detail is not None:
            image["detail"] = detail
        return {"type": "image_url", "image_url": image}
    raise invalid_value(
        f"unsupported content part type {kind!r}; supported: input_text, output_text, input_image",
        param + ".type",
    )


def _reasoning_text(item: Any, param: str) -> str:
    """The reasoning text of a reasoning item: its ``reasoning_text`` parts joined, else its
    summary parts joined by blank lines (an item with only ``encrypted_content`` has none this
    gateway could read: "")."""
    content = _texts(item, "content", "reasoning_text", param)
    return (
        "".join(content) if content else "\n\n".join(_texts(item, "summary", "summary_text", param))
    )


def _texts(item: Any, key: str, part_type: str, param: str) -> list[str]:
    parts = item.get(key)
    if parts is None:
        return []
    _expect(parts, list, f"{param}.{key}", "a list")
    texts: list[str] = []
    for index, part in enumerate(parts):
        where = f"{param}.{key}[{index}]"
        _expect(part, dict, where, "an object")
        if part.get("type") != part_type:
            raise invalid_value(
                f"'{where}.type' must be {part_type!r}, got {part.get('type')!r}", where + ".type"
            )
        _expect(part.get("text"), str, where + ".text", "a string")
        texts.append(part["text"])
    return texts


def _function_call(raw: Any, param: str) -> ChatToolCall:
    for key in ("call_id", "name", "arguments"):
        _expect(raw.get(key), str, f"{param}.{key}", "a string")
    item: FunctionCallItem = raw  # its three strings checked just above
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def _function_call_output(raw: Any, param: str) -> ChatMessage:
    _expect(raw.get("call_id"), str, f"{param}.call_id", "a string")
    output = raw.get("output")
    if isinstance(output, str):
        content: str | list[ChatContentPart] = output
    else:
        _expect(output, list, f"{param}.output", "a string or a list of content parts")
        parts: list[Any] = output
        content = [_content_part(part, f"{param}.output[{i}]") for i, part in enumerate(parts)]
    item: FunctionCallOutputItem = raw  # its call id checked above, its output read above
    return {"role": "tool", "tool_call_id": item["call_id"], "content": content}


def _tool(raw: Any, param: str) -> ChatTool | str:
    """The chat tool for a function tool; the name of any other (hosted tools: left out)."""
    _expect(raw.get("type"), str, f"{param}.type", "a string")
    if raw["type"] != "function":
        return str(raw.get("name") or raw["type"])
    _expect(raw.get("name"), str, f"{param}.name", "a string")
    tool: FunctionTool = raw  # a function tool with a string name, checked above
    function: ChatFunction = {"name": tool["name"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    if tool.get("parameters") is not None:
        function["parameters"] = tool["parameters"]
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        if choice not in TOOL_CHOICE_MODES:
            raise invalid_value(
                f"'tool_choice' must be one of {', '.join(TOOL_CHOICE_MODES)} or "
                f'{{"type": "function", "name": ...}}, got {choice!r}',
                "tool_choice",
            )
        return choice
    _expect(choice, dict, "tool_choice", "a string or an object")
    if choice.get("type") != "function":
        raise invalid_value(
            f"'tool_choice.type' must be 'function' (hosted tools are not served), "
            f"got {choice.get('type')!r}",
            "tool_choice.type",
        )
    _expect(choice.get("name"), str, "tool_choice.name", "a string")
    return named_tool_choice(choice["name"])


def _response_format(text: Any) -> ChatResponseFormat | None:
    if text is None:
        return None
    _expect(text, dict, "text", "an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    _expect(fmt, dict, "text.format", "an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        _expect(fmt.get("name"), str, "text.format.name", "a string")
        _expect(fmt.get("schema"), dict, "text.format.schema", "an object")
        checked: JSONSchemaFormat = fmt  # its name and schema checked just above
        schema: ChatJSONSchema = {"name": checked["name"], "schema": checked["schema"]}
        if "description" in checked:
            schema["description"] = checked["description"]
        if "strict" in checked:
            schema["strict"] = checked["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise invalid_value(
        f"'text.format.type' must be text, json_object or json_schema, got {kind!r}",
        "text.format.type",
    )


def _reasoning_effort(reasoning: Any) -> str | None:
    if reasoning is None:
        return None
    _expect(reasoning, dict, "reasoning", "an object")
    effort = reasoning.get("effort")
    if effort is None:
        return None
    _expect(effort, str, "reasoning.effort", "a string")
    return str(effort)
