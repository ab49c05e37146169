"""Counting a chat body's prompt tokens with the engine's own template and tokenizer.

Owns: the ``POST /tokenize`` exchange (``tokenize``), which side routes reach through the
dialects' ``Engine`` (the Messages API's ``count_tokens``: ``gateway.proxy.routes.ReplicaEngine``
adapts this to it). Never: records anything, or tokenizes in the gateway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from gateway.engine.errors import answer_object
from gateway.engine.paths import TOKENIZE_PATH
from gateway.engine.wire import dumps

JSON_HEADERS = {"content-type": "application/json"}


@dataclass(frozen=True)
class Refused:
    """The engine answered ``status_code`` (not 200) with ``content``, passed on as it came."""

    status_code: int
    content: bytes


async def tokenize(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any]
) -> dict[str, Any] | Refused:
    """vLLM's ``/tokenize`` answer (``{"count", "max_model_len", "tokens"}``) for ``payload``
    on the replica at ``url``, under the client's limits; ``Refused`` for an error status.
    Raises ``UnreadableAnswerError`` for a 200 that is no JSON object, ``httpx.HTTPError`` as
    the client does."""
    response = await client.post(
        f"{url}{TOKENIZE_PATH}", content=dumps(payload), headers=JSON_HEADERS
    )
    if response.status_code != 200:
        return Refused(response.status_code, response.content)
    return answer_object(response, TOKENIZE_PATH)
