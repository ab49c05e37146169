"""The Anthropic Messages API wire shapes, as types: the request the translation reads and the
message and stream events the client reads.

Follows Anthropic's Messages API (``anthropic-version: 2023-06-01``; the shapes of the official
``anthropic`` SDK's ``MessageParam``, content block params, ``ToolParam``, ``ToolChoiceParam``,
``ThinkingConfigParam``, and its ``Message`` and ``RawMessageStreamEvent`` models). A field this
gateway never reads is left out; a request keeps it anyway (the client's body is stored as
sent).

Owns: the request (``MessagesBody``: its messages, every content block kind, tools, tool
choice, thinking, output config, system blocks) and what the dialect writes for the client
(``Message``, its content blocks, ``StreamEvent``, ``ErrorBody``).

Never: checks anything at runtime. These are ``TypedDict``s, plain dicts at runtime: a body is
read as a ``MessagesBody`` part by part, each part once ``gateway.dialects.messages.request``
has checked it (a ``cast`` there names the check), so typing costs nothing.
"""

from __future__ import annotations

from typing import Literal, NotRequired, Required, TypedDict

# -- the request ------------------------------------------------------------------------------

Role = Literal["user", "assistant", "system"]  # "system": Claude Code's environment turn


class TextBlock(TypedDict):
    type: Literal["text"]
    text: str


class ImageBlock(TypedDict):  # refused: the gateway serves text models
    type: Literal["image"]
    source: object


class DocumentBlock(TypedDict):  # refused, as images are
    type: Literal["document"]
    source: object


class ToolUseBlock(TypedDict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, object]


class ToolResultBlock(TypedDict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: NotRequired[str | list[TextBlock] | None]
    is_error: NotRequired[bool | None]


class ThinkingBlock(TypedDict):
    type: Literal["thinking"]
    thinking: str
    signature: str


class RedactedThinkingBlock(TypedDict):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
)
UserBlock = TextBlock | ToolResultBlock
AssistantBlock = TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock


class MessageParam(TypedDict):
    role: Role
    content: str | list[ContentBlock]


class ToolParam(TypedDict, total=False):
    """A tool: ``custom`` (no ``type``, or ``"custom"``) with a schema, or a server tool."""

    name: Required[str]
    type: str | None  # "custom", or a server tool's ("web_search_20250305", ...)
    input_schema: dict[str, object]
    description: str | None
    strict: bool | None
    defer_loading: bool | None


class ToolChoiceParam(TypedDict):
    type: Literal["auto", "any", "tool", "none"]
    name: NotRequired[str]  # type "tool"
    disable_parallel_tool_use: NotRequired[bool | None]


class ThinkingParam(TypedDict):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: NotRequired[int | None]


class OutputFormat(TypedDict):
    type: Literal["json_schema"]
    schema: dict[str, object]


class OutputConfig(TypedDict, total=False):
    format: OutputFormat | None
    effort: str | None


class MessagesBody(TypedDict, total=False):
    """The top level of a ``POST /v1/messages`` body (bounds: ``messages.protocol``)."""

    model: Required[str]
    messages: Required[list[MessageParam]]
    system: str | list[TextBlock] | None
    max_tokens: int | None
    stop_sequences: list[str] | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    tools: list[ToolParam] | None
    tool_choice: ToolChoiceParam | None
    thinking: ThinkingParam | None
    output_config: OutputConfig | None
    stream: bool | None


# -- what the client reads --------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"]


class Usage(TypedDict):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


OutputBlock = TextBlock | ThinkingBlock | ToolUseBlock


class Message(TypedDict):
    """The answer: ``Message`` in the SDK (``stop_reason`` null only in ``message_start``)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[OutputBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: Usage


class ErrorObject(TypedDict):
    type: str  # an Anthropic error type (``render.error_type``)
    message: str


class ErrorBody(TypedDict):
    """Anthropic's error envelope, and the ``error`` event that ends a stream."""

    type: Literal["error"]
    error: ErrorObject


class MessageStart(TypedDict):
    type: Literal["message_start"]
    message: Message


class Ping(TypedDict):
    type: Literal["ping"]


class ContentBlockStart(TypedDict):
    type: Literal["content_block_start"]
    index: int
    content_block: OutputBlock


class TextDelta(TypedDict):
    type: Literal["text_delta"]
    text: str


class ThinkingDelta(TypedDict):
    type: Literal["thinking_delta"]
    thinking: str


class SignatureDelta(TypedDict):
    type: Literal["signature_delta"]
    signature: str


class InputJSONDelta(TypedDict):
    type: Literal["input_json_delta"]
    partial_json: str


BlockDelta = TextDelta | ThinkingDelta | SignatureDelta | InputJSONDelta


class ContentBlockDelta(TypedDict):
    type: Literal["content_block_delta"]
    index: int
    delta: BlockDelta


class ContentBlockStop(TypedDict):
    type: Literal["content_block_stop"]
    index: int


class StopDelta(TypedDict):
    stop_reason: StopReason
    stop_sequence: str | None


class MessageDelta(TypedDict):
    type: Literal["message_delta"]
    delta: StopDelta
    usage: Usage


class MessageStop(TypedDict):
    type: Literal["message_stop"]


StreamEvent = (
    MessageStart
    | Ping
    | ContentBlockStart
    | ContentBlockDelta
    | ContentBlockStop
    | MessageDelta
    | MessageStop
    | ErrorBody
)
