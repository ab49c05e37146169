"""Reading IDs out of vLLM-shaped JSON and stripping what the client did not ask for.

The shapes are copied from vLLM 0.32 responses (see gateway/capture.py); the real-server tests
in test_capture_real_vllm.py check the same path end to end.
"""

from __future__ import annotations

from typing import Any

from gateway.capture import (
    IDS_INCOMPLETE,
    IDS_MISSING,
    TRUNCATED,
    ClientAsked,
    prepare_request,
    read_choices,
    strip_for_client,
)


def _response(
    ids: list[int] | None, logprobs: list[float] | None, completion: int
) -> dict[str, Any]:
    content = None if logprobs is None else [{"token": "x", "logprob": lp} for lp in logprobs]
    return {
        "id": "chatcmpl-1",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "xy"},
                "logprobs": None if content is None else {"content": content},
                "finish_reason": "stop",
                "token_ids": ids,
            }
        ],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": completion,
            "total_tokens": 3 + completion,
        },
        "prompt_token_ids": [1, 2, 3],
    }


def test_prepare_adds_ids_and_logprobs_and_remembers_what_the_client_asked() -> None:
    body = {"model": "m", "messages": [], "top_logprobs": 3, "vendor_field": {"a": 1}}
    upstream, asked = prepare_request("chat.completions", body)
    assert upstream == {**body, "return_token_ids": True, "logprobs": True}
    assert asked == ClientAsked(return_token_ids=False, logprobs=False, include_usage=True)
    assert "logprobs" not in body  # the client's body is not mutated


def test_read_choices_takes_ids_and_logprobs_verbatim() -> None:
    prompt, choices = read_choices(
        "chat.completions", {}, _response([5, 6], [-0.5, -0.25], completion=2)
    )
    assert prompt == [1, 2, 3]
    assert choices[0].response_token_ids == [5, 6]
    assert choices[0].response_logprobs == [-0.5, -0.25]
    assert choices[0].flags == []


def test_null_ids_with_completion_tokens_are_flagged_missing_not_empty() -> None:
    _, choices = read_choices("chat.completions", {}, _response(None, None, completion=4))
    assert choices[0].response_token_ids is None
    assert choices[0].response_logprobs is None
    assert choices[0].flags == [IDS_MISSING]


def test_ids_that_disagree_with_logprobs_or_usage_are_flagged_incomplete() -> None:
    # 2 ids but 1 logprob: lengths differ.
    _, choices = read_choices("chat.completions", {}, _response([5, 6], [-0.5], completion=2))
    assert choices[0].flags == [IDS_INCOMPLETE]
    # 2 ids and 2 logprobs, but usage says 3 sampled tokens.
    _, choices = read_choices("chat.completions", {}, _response([5, 6], [-0.5, -0.1], completion=3))
    assert choices[0].flags == [IDS_INCOMPLETE]


def test_finish_reason_length_is_recorded_as_truncated() -> None:
    response = _response([5], [-0.5], completion=1)
    response["choices"][0]["finish_reason"] = "length"
    _, choices = read_choices("chat.completions", {}, response)
    assert choices[0].flags == [TRUNCATED]


def test_strip_restores_nulls_the_client_would_have_seen() -> None:
    response = _response([5, 6], [-0.5, -0.25], completion=2)
    stripped = strip_for_client(response, ClientAsked(return_token_ids=False, logprobs=False))
    assert stripped["prompt_token_ids"] is None
    assert stripped["choices"][0]["token_ids"] is None
    assert stripped["choices"][0]["logprobs"] is None
    assert list(stripped) == list(response)
    assert response["choices"][0]["token_ids"] == [5, 6]  # the captured copy is untouched


def test_strip_keeps_what_the_client_asked_for() -> None:
    response = _response([5, 6], [-0.5, -0.25], completion=2)
    only_logprobs = strip_for_client(response, ClientAsked(return_token_ids=False, logprobs=True))
    assert only_logprobs["choices"][0]["logprobs"] == response["choices"][0]["logprobs"]
    assert only_logprobs["choices"][0]["token_ids"] is None
    both = strip_for_client(response, ClientAsked(return_token_ids=True, logprobs=True))
    assert both == response


def test_sse_payloads_follow_the_sse_rules_whatever_the_chunking() -> None:
    import asyncio
    from collections.abc import AsyncIterator

    import httpx

    from gateway.streaming import sse_data

    body = b'data: {"a":1}\r\n\r\n: comment\n\ndata: x\ndata: y\n\ndata: [DONE]\n\n'

    async def read(chunk_size: int) -> list[bytes]:
        async def chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(body), chunk_size):
                yield body[i : i + chunk_size]

        headers = {"content-type": "text/event-stream"}
        transport = httpx.MockTransport(
            lambda request: httpx.Response(200, content=chunks(), headers=headers)
        )
        async with (
            httpx.AsyncClient(transport=transport) as client,
            client.stream("GET", "http://upstream.test/") as response,
        ):
            return [data async for data in sse_data(response)]

    # CRLF, a comment, and two data lines of one event joined by a newline.
    expected = [b'{"a":1}', b"x\ny", b"[DONE]"]
    for size in (1, 3, 7, len(body)):
        assert asyncio.run(read(size)) == expected
