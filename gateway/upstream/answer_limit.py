"""The most bytes one upstream answer may have, for every transport (ours and httpx's).

Owns: ``AnswerLimit``, a transport wrapper that refuses an answer whose ``content-length``
exceeds the limit before reading its body, and counts the body as it is read (chunked, until
close, or mis-declared), raising ``AnswerTooLargeError`` at the first read past the limit. So a
unary read, a non-200 body and a stream are all bounded, whatever the replica sends: an endless
chunked body ends at the limit, not at the total time limit. The bytes counted are the framed
body's, before httpx would decode a ``content-encoding``: so an answer with any encoding but
``identity`` is refused (``EncodedAnswerError``): the gateway asks for ``identity``
(``gateway.app``), vLLM never compresses, and a gzip body of a few KiB could decode to far
past the limit. Each piece, before it is handed on, is charged to the call's share of the body
budget when the call reads its answer whole (``gateway.body_budget.answer_read``): it may wait
there for room. Never: buffers (a piece passes through as it came), or decides what the failure
is recorded as (``gateway.proxy.routes`` does: ``upstream_error``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from gateway.body_budget import answer_read


class AnswerTooLargeError(httpx.TransportError):
    """An upstream answer's body is longer than ``upstream_max_answer_bytes``."""


class EncodedAnswerError(httpx.DecodingError):
    """An upstream answer came with a ``content-encoding``: its decoded size is not bounded."""


class AnswerLimit(httpx.AsyncBaseTransport):
    """``inner`` with every answer's body limited to ``most_bytes``."""

    def __init__(self, inner: httpx.AsyncBaseTransport, most_bytes: int) -> None:
        self._inner = inner
        self._most_bytes = most_bytes

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":
            await response.aclose()
            raise EncodedAnswerError(
                f"the upstream answer is encoded ({encoding[:40]}) though identity was asked "
                "for: its decoded bytes could pass upstream_max_answer_bytes unseen",
                request=request,
            )
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._most_bytes:
            await response.aclose()
            raise AnswerTooLargeError(
                f"the upstream answer declares {declared} bytes, more than the "
                f"{self._most_bytes} of upstream_max_answer_bytes"
            )
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_Counted(response.stream, self._most_bytes),
            extensions=response.extensions,
            request=request,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


class _Counted(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream | httpx.SyncByteStream, most: int) -> None:
        if not isinstance(inner, httpx.AsyncByteStream):
            raise TypeError(f"expected an async byte stream, got {type(inner).__name__}")
        self._inner = inner
        self._most = most

    async def __aiter__(self) -> AsyncIterator[bytes]:
        read = 0
        async for piece in self._inner:
            read += len(piece)
            if read > self._most:
                raise AnswerTooLargeError(
                    f"the upstream answer passed the {self._most} bytes of "
                    "upstream_max_answer_bytes"
                )
            await answer_read(len(piece))
            yield piece

    async def aclose(self) -> None:
        await self._inner.aclose()
