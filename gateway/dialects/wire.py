"""The OpenAI Chat Completions wire shapes the dialects write to vLLM and read back, as types.

Follows OpenAI's Chat Completions API as vLLM 0.32 serves it (``ChatCompletionRequest``,
``ChatCompletionResponse``, ``ChatCompletionStreamResponse``), with vLLM's additions the gateway
uses: a message's ``reasoning``, ``token_ids`` and ``prompt_token_ids`` on answers and chunks.

Owns: the chat body a translation writes (``ChatBody``: its messages, content parts, tool calls,
tools and sampling fields), and the answer and chunk fields the dialects
read from vLLM (``ChatAnswer``, ``ChatChunk``): the same fields, with the same JSON types, as
``gateway.engine.answers.CHAT_ANSWER`` and ``CHAT_CHUNK``, whose runtime check
(``gateway.engine.wire.check_shape``) is what makes reading an answer as ``ChatAnswer`` honest.

Never: checks anything at runtime. These are ``TypedDict``s: plain dicts at runtime, types for
mypy only, so reading through them costs nothing; a value becomes one where it has just been
checked (a ``cast`` there says which check ran).
"""

from __future__ import annotations

from typing import Generic, Literal, NotRequired, Required, TypedDict, TypeVar

ChatRole = Literal["system", "user", "assistant", "tool"]


class ChatTextPart(TypedDict):
    type: Literal["text"]
    text: str


class ChatImageURL(TypedDict):
    url: str
    detail: NotRequired[str]


class ChatImagePart(TypedDict):
    type: Literal["image_url"]
    image_url: ChatImageURL


ChatContentPart = ChatTextPart | ChatImagePart


class ChatFunctionCall(TypedDict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ChatToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: ChatFunctionCall


class ChatMessage(TypedDict):
    """One message of a chat body's ``messages``, as a translation writes it."""

    role: ChatRole
    content: str | list[ChatContentPart] | None
    tool_calls: NotRequired[list[ChatToolCall]]
    tool_call_id: NotRequired[str]  # role "tool": the call it answers
    reasoning: NotRequired[str]  # role "assistant": vLLM hands it to the chat template


class ChatFunction(TypedDict):
    name: str
    parameters: NotRequired[object]  # a JSON Schema, passed on unread
    description: NotRequired[object]  # a string from Messages (checked); Responses' unread
    strict: NotRequired[object]


class ChatTool(TypedDict):
    type: Literal["function"]
    function: ChatFunction


class ChatNamedFunction(TypedDict):
    name: str


class ChatNamedToolChoice(TypedDict):
    type: Literal["function"]
    function: ChatNamedFunction


class ChatToolChoice(TypedDict, total=False):
    """The chat fields a client's tool choice becomes."""

    tool_choice: Literal["auto", "required", "none"] | ChatNamedToolChoice
    parallel_tool_calls: bool


class ChatJSONSchema(TypedDict):
    name: str
    schema: NotRequired[object]
    description: NotRequired[object]
    strict: NotRequired[object]


class ChatResponseFormat(TypedDict):
    type: Literal["json_schema", "json_object"]
    json_schema: NotRequired[ChatJSONSchema]


SamplingName = Literal["max_tokens", "temperature", "top_p", "top_k", "top_logprobs"]


class ChatSampling(TypedDict, total=False):
    """The sampling fields a translation copies from the client's (``SamplingName``: by a
    table, ``translation.copy_fields``, which checks each value's kind), and ``stop``."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    top_logprobs: int
    stop: list[str]


class ChatTemplateKwargs(TypedDict, total=False):
    enable_thinking: bool


class ChatBody(ChatSampling, ChatToolChoice, total=False):
    """The chat body a translation writes (``Translation.chat_body``), before the capture
    fields (``translation.with_capture_fields``) and the channel's sampling defaults."""

    model: Required[str]
    messages: Required[list[ChatMessage]]
    tools: list[ChatTool]
    response_format: ChatResponseFormat
    reasoning_effort: str  # vLLM hands it to the chat template
    chat_template_kwargs: ChatTemplateKwargs
    continue_final_message: bool  # a prefill: the answer continues the last assistant turn
    add_generation_prompt: bool
    stream: bool


# -- what vLLM answers (every field may be absent or null: ``check_shape`` lets both pass) ----


class AnswerFunctionCall(TypedDict, total=False):
    name: str | None
    arguments: str | None


class AnswerToolCall(TypedDict, total=False):
    """A tool call of an answer's message, or a piece of one in a chunk's delta (by ``index``)."""

    id: str | None
    type: str | None
    index: int | None
    function: AnswerFunctionCall | None


class AnswerMessage(TypedDict, total=False):
    """An answer choice's ``message``, or a chunk choice's ``delta``."""

    role: str | None
    content: str | None
    reasoning: str | None
    reasoning_content: str | None  # the older name of ``reasoning``
    refusal: str | None
    tool_calls: list[AnswerToolCall] | None


class TopLogprob(TypedDict, total=False):
    token: str | None
    logprob: float | None
    bytes: list[int] | None


class TokenLogprob(TopLogprob, total=False):
    top_logprobs: list[TopLogprob] | None


class ChatLogprobs(TypedDict, total=False):
    content: list[TokenLogprob] | None


ChoiceT = TypeVar("ChoiceT")


class PromptTokensDetails(TypedDict, total=False):
    cached_tokens: int | None


class CompletionTokensDetails(TypedDict, total=False):
    reasoning_tokens: int | None


class Usage(TypedDict, total=False):
    prompt_tokens: int | None
    completion_tokens: int | None
    total_tokens: int | None
    prompt_tokens_details: PromptTokensDetails | None
    completion_tokens_details: CompletionTokensDetails | None


class ChoiceFields(TypedDict, total=False):
    """What every choice of a chat or completions answer or chunk carries."""

    index: int | None
    finish_reason: str | None
    stop_reason: int | str | None  # the matched stop string, or the stop token's id
    token_ids: list[int] | None  # checked apart (``gateway.engine.wire.token_ids``)


class AnswerChoice(ChoiceFields, total=False):
    logprobs: ChatLogprobs | None
    message: AnswerMessage | None


class ChunkChoice(ChoiceFields, total=False):
    logprobs: ChatLogprobs | None
    delta: AnswerMessage | None


class CompletionLogprobs(TypedDict, total=False):
    tokens: list[str] | None
    token_logprobs: list[float] | None
    text_offset: list[int] | None
    top_logprobs: list[object] | None


class CompletionChoice(ChoiceFields, total=False):
    """A choice of vLLM's completions answer, or of a chunk (the same shape)."""

    text: str | None
    logprobs: CompletionLogprobs | None
    prompt_token_ids: list[int] | None  # checked apart, as ``token_ids``


class Answer(TypedDict, Generic[ChoiceT], total=False):
    """vLLM's unary answer or one stream chunk, of chat (``ChatAnswer``, ``ChatChunk``) or
    completions (``CompletionAnswer``: an answer and a chunk have one shape); a usage chunk
    has ``usage`` and no choices."""

    id: str | None
    object: str | None
    created: int | None
    model: str | None
    system_fingerprint: str | None
    usage: Usage | None
    prompt_token_ids: list[int] | None  # chat only (checked apart, as ``token_ids``)
    choices: list[ChoiceT] | None


ChatAnswer = Answer[AnswerChoice]
ChatChunk = Answer[ChunkChoice]
CompletionAnswer = Answer[CompletionChoice]


class StreamedToolCall(TypedDict):
    """A tool call of a streamed message as its pieces are joined (by the call's ``index``)."""

    id: str | None
    type: str
    function: ChatFunctionCall
