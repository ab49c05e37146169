"""The typed top level of a ``POST /v1/messages`` body, as Anthropic's Messages API bounds it.

Owns: the type, bounds and enum of every top-level field the Messages API defines, checked
before the translation (``gateway.dialects.translation.check_top_level``): a value the API
refuses (``metadata: 5`` or ``{"other": "x"}``, ``top_k: -5``, ``temperature: 3``; and a
``top_k`` past int32, which vLLM cannot hold) is a 400 in Anthropic's envelope and never
reaches vLLM. ``null`` is unset. Other top-level fields (beta fields Claude Code adds)
are accepted and change nothing, as before. Never: walks the messages, system blocks or tools
(``gateway.dialects.messages.request`` does, naming the nested field).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

# The Messages API gives ``top_k`` no upper bound; vLLM's sampler holds it as a 32-bit integer
# (and a top_k past the vocabulary keeps every token anyway), so past int32 it is refused here
# rather than failing, or wrapping, in the engine.
TOP_K_MAX = 2**31 - 1


class Metadata(BaseModel):
    """Anthropic's request metadata: an opaque end-user id (at most 256 characters), and
    nothing else (Anthropic's API refuses any other field: ``extra inputs are not
    permitted``)."""

    model_config = ConfigDict(strict=True, extra="forbid")

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
    top_k: Annotated[int, Field(ge=0, le=TOP_K_MAX)] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    stream: bool | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
