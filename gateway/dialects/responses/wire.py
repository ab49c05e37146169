"""The OpenAI Responses API wire shapes, as types: the input items the translation reads and
the output items a ``response`` holds.

Follows OpenAI's Responses API as the Open Responses specification writes it
(``tests/data/openresponses/openapi.json``: ``ItemParam`` and its members, ``FunctionTool``,
``ResponseResource``'s output items) and the official ``openai`` SDK's
``openai.types.responses`` models parse it. A field this gateway never reads is left out; the
client's body keeps it anyway (it is stored as sent).

Owns: the input items (``InputItem``: message, reasoning, function call, function call output,
and their content parts) and the output items (``OutputItem``) with their parts and logprobs.

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
    token: str
    logprob: float
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
