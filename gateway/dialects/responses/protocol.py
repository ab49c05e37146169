"""The typed top level of a ``POST /v1/responses`` body, as the Open Responses specification
(``CreateResponseBody``) and OpenAI's API bound it.

Owns: the type, bounds and enum of every top-level field the Responses API here knows, checked
before the translation (``gateway.dialects.translation.check_top_level``): a value the API
refuses (``max_output_tokens: -1``, ``input: []``, ``truncation: 5``) is a 400 in the
Responses envelope and never reaches vLLM. ``null`` is unset, as in the translation. Never:
walks the items, tools or text format (``gateway.dialects.responses.request`` does, naming the
nested field); unknown fields are refused there too (``unknown_parameter``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

# Open Responses / OpenAI: at most 16 metadata pairs, keys up to 64 and values up to 512
# characters; a safety identifier up to 64 characters.
Key = Annotated[str, StringConstraints(max_length=64)]
Value = Annotated[str, StringConstraints(max_length=512)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_obfuscation: bool | None = None


class ResponsesRequest(BaseModel):
    """The top-level fields and their bounds (strict: ``"5"`` is no integer, ``true`` no
    number)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    input: str | Annotated[list[Any], Field(min_length=1)] | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    # The upper bound is TRAJGATE_MAX_TOP_LOGPROBS (checked on what goes upstream), not 20.
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    store: bool | None = None
    metadata: Annotated[dict[Key, Value], Field(max_length=16)] | None = None
    user: str | None = None
    safety_identifier: Annotated[str, StringConstraints(max_length=64)] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None
    client_metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
