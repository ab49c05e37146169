"""Reading a vLLM server-sent event stream.

Owns: the ``data`` payloads of an upstream SSE response, in order, as bytes. Never: interprets
them; what a payload means is its dialect's business (``gateway.dialects``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from httpx_sse import EventSource


async def sse_data(response: httpx.Response) -> AsyncIterator[bytes]:
    """The ``data`` payload of each server-sent event of ``response``, in order, as UTF-8 bytes.

    Parsing is httpx-sse's (the SSE rules: line endings, multi-line data, comments); a silence
    longer than the client's read timeout raises ``httpx.ReadTimeout`` from here.
    """
    async for event in EventSource(response).aiter_sse():
        yield event.data.encode()
