"""The OpenAI Responses API wire shapes, as types: the input items the translation reads and
the output items a ``response`` holds.

Follows OpenAI's Responses API as the Open Responses specification writes it
(``tests/data/openresponses/openapi.json``: ``ItemParam`` and its members, ``FunctionTool``,
``ResponseResource``'s output items) and the official ``openai`` SDK's
``openai.types.responses`` models parse it. A field this gateway never reads is left out; the
client's body keeps it anyway (it is stored as sent).

Owns: the input items (``InputItem``: message, reasoning, function call, function call output,
and their content parts), the output items (``OutputItem``) with their parts and logprobs, the
``response`` object (``ResponseResource``, with the request fields it repeats: ``Echo``) and the
stream events (``StreamEvent``).

Never: checks anything at runtime. These are ``TypedDict``s, plain dicts at runtime: an item is
read through its type once ``gateway.dialects.responses.request`` has checked the fields read
(the assignment there names the check), so typing costs nothing.
"""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict

# -- the input ------------------------------------------------------------------------------

Role = Literal["user", "system", "developer", "assistant"]


class InputText(TypedDict):
    type: Literal["input_text", "output_text"]  # an earlier answer's text comes back as output
    text: str


class InputImage(TypedDict):
    type: Literal["input_image"]
    image_url: str  # a URL or a data URL
    detail: NotRequired[str | None]


InputContent = InputText | InputImage


class MessageItem(TypedDict):
    type: NotRequired[Literal["message"]]  # an item with a role and no type is a message
    role: Role
    content: str | list[InputContent]


class ReasoningPart(TypedDict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(TypedDict):
    type: Literal["reasoning"]
    summary: NotRequired[list[ReasoningPart] | None]
    content: NotRequired[list[ReasoningPart] | None]
    encrypted_content: NotRequired[str | None]  # none a local engine could read


class FunctionCallItem(TypedDict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


class FunctionCallOutputItem(TypedDict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputContent]


InputItem = MessageItem | ReasoningItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(TypedDict):
    """A ``tools`` entry of type ``function`` (hosted tools have other types: left out)."""

    type: Literal["function"]
    name: str
    # passed on unread (vLLM checks them)
    description: NotRequired[object]
    parameters: NotRequired[object]  # a JSON Schema
    strict: NotRequired[object]


class JSONSchemaFormat(TypedDict):
    """``text.format`` of type ``json_schema``."""

    type: Literal["json_schema"]
    name: str
    schema: dict[str, object]
    description: NotRequired[object]  # passed on unread, as ``strict``
    strict: NotRequired[object]


# -- the output -----------------------------------------------------------------------------

Status = Literal["in_progress", "completed", "incomplete"]


class TopLogprob(TypedDict):
    # vLLM's values unchanged: its shape check (``CHAT_ANSWER``, ``CHAT_CHUNK``) lets null pass
    token: str | None
    logprob: float | None
    bytes: list[int]


class Logprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class OutputText(TypedDict):
    type: Literal["output_text"]
    text: str
    annotations: list[object]
    logprobs: NotRequired[list[Logprob]]  # when ``include`` asks for them


class OutputMessage(TypedDict):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Status
    content: list[OutputText]


class ReasoningText(TypedDict):
    type: Literal["reasoning_text"]
    text: str


class OutputReasoning(TypedDict):
    id: str
    type: Literal["reasoning"]
    summary: list[object]
    content: list[ReasoningText]
    status: Status


class OutputFunctionCall(TypedDict):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: Status


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(TypedDict):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(TypedDict):
    reasoning_tokens: int


class ResponseUsage(TypedDict):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


# -- the response and its stream events -------------------------------------------------------

ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


class EchoedTool(TypedDict):
    """The spec's ``FunctionTool`` as a response lists it: ``null`` for a field not sent."""

    type: Literal["function"]
    name: str
    description: object
    parameters: object
    strict: object


class EchoedReasoning(TypedDict):
    effort: object
    summary: object


class Echo(TypedDict):
    """The request fields a response repeats (``render.echo_fields``): the client's values as
    sent (``object``: passed on unread), sampling as sent upstream."""

    instructions: object
    tools: list[EchoedTool]
    tool_choice: object
    parallel_tool_calls: object
    temperature: object
    top_p: object
    presence_penalty: object
    frequency_penalty: object
    top_logprobs: object
    max_output_tokens: object
    max_tool_calls: object
    previous_response_id: object
    reasoning: EchoedReasoning | None
    text: object
    store: object
    background: Literal[False]
    service_tier: Literal["default"]
    metadata: object
    truncation: object
    safety_identifier: object
    prompt_cache_key: object
    user: NotRequired[object]  # only when the client sent them
    prompt_cache_retention: NotRequired[object]


class IncompleteDetails(TypedDict):
    reason: str | None


class ResponseError(TypedDict):
    code: str
    message: str


class ResponseResource(Echo):
    """The ``response`` object (``ResponseResource``), unary and in the stream's events."""

    id: str
    object: Literal["response"]
    created_at: int  # Unix seconds
    completed_at: int | None
    status: ResponseStatus
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None


ResponseEventType = Literal[
    "response.created",
    "response.in_progress",
    "response.completed",
    "response.incomplete",
    "response.failed",
]


class ResponseEvent(TypedDict):
    type: ResponseEventType
    sequence_number: int
    response: ResponseResource


class OutputItemEvent(TypedDict):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ItemAt(TypedDict):
    """Where an event's item is: its id and place in ``output``."""

    item_id: str
    output_index: int


class PartAt(ItemAt):
    """Where an event's content part is (an item's one part: ``content_index`` 0)."""

    content_index: int


class ContentPartEvent(PartAt):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    part: OutputText | ReasoningText


class ReasoningTextDelta(PartAt):
    type: Literal["response.reasoning_text.delta"]
    sequence_number: int
    delta: str


class ReasoningTextDone(PartAt):
    type: Literal["response.reasoning_text.done"]
    sequence_number: int
    text: str


class OutputTextDelta(PartAt):
    type: Literal["response.output_text.delta"]
    sequence_number: int
    delta: str
    logprobs: list[Logprob]


class OutputTextDone(PartAt):
    type: Literal["response.output_text.done"]
    sequence_number: int
    text: str
    logprobs: list[Logprob]


class ArgumentsDelta(ItemAt):
    type: Literal["response.function_call_arguments.delta"]
    sequence_number: int
    delta: str


class ArgumentsDone(ItemAt):
    type: Literal["response.function_call_arguments.done"]
    sequence_number: int
    arguments: str


StreamEvent = (
    ResponseEvent
    | OutputItemEvent
    | ContentPartEvent
    | ReasoningTextDelta
    | ReasoningTextDone
    | OutputTextDelta
    | OutputTextDone
    | ArgumentsDelta
    | ArgumentsDone
)
