"""The typed top level of a ``POST /v1/messages`` body, as Anthropic's Messages API bounds it.

Owns: the type, bounds and enum of every top-level field the Messages API defines, checked
before the translation (``gateway.dialects.translation.check_top_level``): a value the API
refuses (``metadata: 5``, ``top_k: -5``, ``temperature: 3``) is a 400 in Anthropic's envelope
and never reaches vLLM. ``null`` is unset. Other top-level fields (beta fields Claude Code adds)
are accepted and change nothing, as before. Never: walks the messages, system blocks or tools
(``gateway.dialects.messages.request`` does, naming the nested field).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints


class Metadata(BaseModel):
    """Anthropic's request metadata: an opaque end-user id (at most 256 characters)."""

    model_config = ConfigDict(strict=True, extra="allow")

    user_id: Annotated[str, StringConstraints(max_length=256)] | None = None


class MessagesRequest(BaseModel):
    """The top-level fields and their bounds (strict: ``"5"`` is no integer, ``true`` no
    number). ``max_tokens`` is required on a call, not on a count; the translation says so."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    messages: list[Any]
    system: str | list[Any] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    stream: bool | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
