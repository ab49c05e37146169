"""Reading IDs out of vLLM-shaped JSON and stripping what the client did not ask for.

The shapes are copied from vLLM 0.32 responses (see gateway/dialects/choices.py); the real-server
tests in test_capture_real_vllm.py check the same path end to end.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from datapool.steps.records import ChoiceRecord
from gateway.capture import (
    ABORTED,
    IDS_INCOMPLETE,
    IDS_MISSING,
    PROMPT_IDS_MISSING,
    TOOL_CALL_TRUNCATED,
    TRUNCATED,
    integrity_flags,
)
from gateway.dialects import DIALECTS, ClientAsked
from gateway.dialects.chat_completions.serving import ChatCompletions
from gateway.dialects.choices import strip_for_client
from gateway.dialects.completions.serving import Completions
from gateway.engine.wire import token_ids
from gateway.errors import UpstreamTimeoutError
from gateway.proxy.routes import dialect_router
from gateway.upstream.replicas import InFlight, Replica

CHAT = ChatCompletions()


def read_choices(
    body: dict[str, Any], response: dict[str, Any]
) -> tuple[list[int] | None, list[ChoiceRecord]]:
    """Prompt ids and choices of a unary chat answer, as the chat dialect reads them (``body``
    completed to one the dialect accepts)."""
    captured = CHAT.read_answer(CHAT.prepare({"messages": [{}], **body}), response)
    return captured.prompt_ids, captured.choices


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
    body = {"model": "m", "messages": [{}], "top_logprobs": 3, "vendor_field": {"a": 1}}
    prepared = CHAT.prepare(body)
    assert prepared.upstream_body == {**body, "return_token_ids": True, "logprobs": True}
    assert prepared.asked == ClientAsked(return_token_ids=False, logprobs=False, include_usage=True)
    assert "logprobs" not in body  # the client's body is not mutated


def test_read_choices_takes_ids_and_logprobs_verbatim() -> None:
    prompt, choices = read_choices({}, _response([5, 6], [-0.5, -0.25], completion=2))
    assert prompt == [1, 2, 3]
    assert choices[0].response_token_ids == [5, 6]
    assert choices[0].response_logprobs == [-0.5, -0.25]
    assert choices[0].flags == []


def test_null_ids_with_completion_tokens_are_flagged_missing_not_empty() -> None:
    _, choices = read_choices({}, _response(None, None, completion=4))
    assert choices[0].response_token_ids is None
    assert choices[0].response_logprobs is None
    assert choices[0].flags == [IDS_MISSING]


def test_ids_that_disagree_with_logprobs_or_usage_are_flagged_incomplete() -> None:
    # 2 ids but 1 logprob: lengths differ.
    _, choices = read_choices({}, _response([5, 6], [-0.5], completion=2))
    assert choices[0].flags == [IDS_INCOMPLETE]
    # 2 ids and 2 logprobs, but usage says 3 sampled tokens.
    _, choices = read_choices({}, _response([5, 6], [-0.5, -0.1], completion=3))
    assert choices[0].flags == [IDS_INCOMPLETE]


def test_finish_reason_length_is_recorded_as_truncated() -> None:
    response = _response([5], [-0.5], completion=1)
    response["choices"][0]["finish_reason"] = "length"
    _, choices = read_choices({}, response)
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

    from gateway.proxy.streaming import sse_data

    body = (
        b'data: {"a":1}\r\n\r\n: comment\n\ndata: x\r\ndata: y\r\n\r\n'
        b"event: e\rdata:z\r\rid: 1\n\ndata\n\ndata: [DONE]\n\n"
    )

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
            return [data async for data in sse_data(response, 1 << 20)]

    # CRLF, a comment, two data lines of one event joined by a newline (their CRLFs split
    # between reads when read byte by byte), CR endings, a field without data (no event), a
    # "data" line without a colon (an empty payload).
    expected = [b'{"a":1}', b"x\ny", b"z", b"", b"[DONE]"]
    for size in (1, 2, 3, 7, len(body)):
        assert asyncio.run(read(size)) == expected


def _chunk(delta: dict[str, Any], ids: list[int], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "token_ids": ids, "finish_reason": finish}
    choice["logprobs"] = {"content": [{"token": "x", "logprob": -0.5} for _ in ids]}
    return json.dumps({"id": "c", "model": "m", "choices": [choice]}).encode()


def test_a_chat_stream_flushes_each_chunk_and_holds_the_last_until_the_end() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    stream = CHAT.open_stream(CHAT.prepare(body), system_fingerprint="fp")
    first = _chunk({"role": "assistant", "content": "a"}, [7])
    held = _chunk({}, [8], finish="stop")  # a parser held its text back: ids count (C05)
    usage = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}}
    sent = stream.feed(first)
    assert len(sent) == 1 and sent[0].startswith(b"data: ") and sent[0].endswith(b"\n\n")
    assert b'"token_ids":null' in sent[0]  # the client did not ask for ids
    assert stream.feed(held) == []  # terminal chunk of the last choice: after the commit
    assert stream.feed(json.dumps(usage).encode()) == []  # usage the client did not ask for
    captured = stream.captured(None)
    # 1 id per chunk, 2 chunks: [7, 8], which agrees with completion_tokens = 2.
    assert captured.choices[0].response_token_ids == [7, 8]
    assert captured.choices[0].response_logprobs == [-0.5, -0.5]
    assert captured.choices[0].response_message == {"role": "assistant", "content": "a"}
    assert captured.choices[0].flags == [PROMPT_IDS_MISSING]  # chunks carried no prompt ids
    closing = stream.closing()
    assert closing[-1] == b"data: [DONE]\n\n"
    assert len(closing) == 2 and b'"system_fingerprint":"fp"' in closing[0]


def test_a_completions_stream_reads_prompt_ids_per_choice_and_joins_the_text() -> None:
    dialect = Completions()
    prepared = dialect.prepare({"prompt": "hi", "stream": True, "logprobs": 2})
    assert prepared.upstream_body["logprobs"] == 2 and prepared.asked.logprobs
    stream = dialect.open_stream(prepared, system_fingerprint=None)
    for text, ids, finish in (("a", [5], None), ("b", [6], "length")):
        choice = {
            "index": 0,
            "text": text,
            "token_ids": ids,
            "prompt_token_ids": [1, 2] if finish is None else None,
            "logprobs": {"token_logprobs": [-1.0]},
            "finish_reason": finish,
        }
        stream.feed(json.dumps({"model": "m", "choices": [choice]}).encode())
    captured = stream.captured(None)
    assert captured.prompt_ids == [1, 2] and captured.prompt_tokens == 2  # len([1, 2])
    assert captured.choices[0].response_message == {"text": "ab"}
    assert captured.choices[0].response_token_ids == [5, 6]
    assert captured.choices[0].flags == [TRUNCATED]


# The chunks vLLM's hermes parser streams when the tiny model, held to a "<tool_call>\n{...}"
# regex with a tool offered, is cut at max_tokens (token ids as the real server sent them).
_ROLE = {"role": "assistant", "content": ""}
_NAME = {"tool_calls": [{"id": "t", "type": "function", "index": 0, "function": {"name": "f"}}]}


def _args(text: str) -> dict[str, Any]:
    return {"content": None, "tool_calls": [{"index": 0, "function": {"arguments": text}}]}


_CUT_IN_THE_TAG = [(_ROLE, []), ({}, [27]), ({}, [83, 426]), ({}, [75]), ({}, [62])]
_CUT_IN_THE_ARGUMENTS = [(_ROLE, []), ({}, [27, 83, 426, 75]), (_NAME, [1]), (_args('{"c'), [9])]


def _streamed_flags(
    body: dict[str, Any], chunks: list[tuple[dict[str, Any], list[int]]]
) -> list[str]:
    """The flags of a chat stream's one choice; the last chunk finishes it with ``length``."""
    stream = CHAT.open_stream(CHAT.prepare({"messages": [{}], "stream": True, **body}), None)
    for position, (delta, ids) in enumerate(chunks):
        stream.feed(_chunk(delta, ids, "length" if position == len(chunks) - 1 else None))
    return stream.captured(None).choices[0].flags


@pytest.mark.parametrize("chunks", [_CUT_IN_THE_TAG, _CUT_IN_THE_ARGUMENTS], ids=["tag", "args"])
def test_a_streamed_tool_call_cut_at_max_tokens_is_flagged_tool_call_truncated(
    chunks: list[tuple[dict[str, Any], list[int]]],
) -> None:
    # The parser held back "<tool_call>" (no text reached the message), or streamed the name
    # and part of the arguments: either way the call was cut, as the unary text would say.
    flags = _streamed_flags({"tools": [{"type": "function"}]}, chunks)
    assert flags == [PROMPT_IDS_MISSING, TRUNCATED, TOOL_CALL_TRUNCATED]


def test_a_streamed_text_cut_at_max_tokens_is_not_a_truncated_tool_call() -> None:
    tools = {"tools": [{"type": "function"}]}
    text = [(_ROLE, []), ({"content": "a"}, [7]), ({"content": "b"}, [8])]
    assert _streamed_flags(tools, text) == [PROMPT_IDS_MISSING, TRUNCATED]
    # Held-back ids with no tool offered: a reasoning parser's, not a tool call.
    assert _streamed_flags({}, _CUT_IN_THE_TAG) == [PROMPT_IDS_MISSING, TRUNCATED]


def test_a_stream_cut_short_is_flagged_aborted_with_the_reason_as_finish() -> None:
    stream = CHAT.open_stream(CHAT.prepare({"messages": [{}], "stream": True}), None)
    stream.feed(_chunk({"content": "a"}, [7]))
    choice = stream.captured("upstream_timeout").choices[0]
    assert choice.finish_reason == "upstream_timeout" and ABORTED in choice.flags


def test_a_streamed_timeout_carries_the_same_string_code_as_an_unstreamed_one() -> None:
    stream = CHAT.open_stream(CHAT.prepare({"messages": [{}], "stream": True}), None)
    event = stream.error_event(UpstreamTimeoutError("upstream stopped sending within 1 s"))
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    error = json.loads(event[len(b"data: ") :])["error"]
    assert error["type"] == "upstream_timeout" and error["code"] == "upstream_timeout"


def test_in_flight_is_given_back_once_however_the_block_ends() -> None:
    replica = Replica("http://upstream.test")
    with pytest.raises(RuntimeError), InFlight(replica):
        assert replica.in_flight == 1
        raise RuntimeError("the send failed")
    assert replica.in_flight == 0
    with InFlight(replica):
        assert replica.in_flight == 1
    assert replica.in_flight == 0  # a retry: the block ends without handing the count on
    with InFlight(replica) as held:
        held.keep()  # handed to the open response's holder
    assert replica.in_flight == 1
    held.release()
    held.release()  # a second release is a no-op
    assert replica.in_flight == 0


def test_every_dialect_path_is_served_by_url_and_by_header() -> None:
    routes = dialect_router(DIALECTS).routes
    served = {(route.path, tuple(sorted(route.methods))) for route in routes}  # type: ignore[attr-defined]
    for dialect in DIALECTS:
        for path in dialect.client_paths:
            assert (f"/v1{path}", ("POST",)) in served
            assert (f"/t/{{trajectory_id}}/v1{path}", ("POST",)) in served


@pytest.mark.parametrize(
    "text",
    [
        b"[9223372036854775807, -9223372036854775808]",  # 64-bit limits: orjson is exact
        b"[18446744073709551616, -9223372036854775809]",  # past them: orjson would give floats
        b'{"ids": [123456789012345678901234]}',
        b"[0.12345678901234567890123, 1234567890123456789.5, 1234567890123456789e2]",
        b'{"content": "12345678901234567890", "n": 1}',  # a digit run inside a string
        b"[NaN, 1.5]",  # json's extension beyond the standard
    ],
)
def test_loads_gives_what_json_loads_gives(text: bytes) -> None:
    from gateway.engine.wire import loads

    parsed, expected = loads(text), json.loads(text)
    assert repr(parsed) == repr(expected)  # repr: an int and an equal float differ, NaN != NaN


def test_an_empty_prompt_is_flagged_as_missing_prompt_ids() -> None:
    # No template renders an empty prompt: an empty list is ids the engine was handed.
    assert integrity_flags([5], [-0.1], []) == [PROMPT_IDS_MISSING]
    assert integrity_flags([5], [-0.1], None) == [PROMPT_IDS_MISSING]
    assert integrity_flags([5], [-0.1], [1, 2]) == []


@pytest.mark.parametrize(
    "ids",
    [[5, True], [5, 1.0], [5, -1], [5, 2**31], [5, "6"], [5, None], (5, 6), [5, [6]]],
)
def test_token_ids_refuses_anything_but_a_list_of_int32_ids(ids: Any) -> None:
    with pytest.raises(ValueError, match="int32 token ids"):
        token_ids(ids)


def test_token_ids_checks_a_long_prompt_without_a_python_step_per_id() -> None:
    # The prompt of turn 200 of a coding-agent session has ~20k ids, checked on the event loop
    # per call. Python-level calls (a generator resuming counts one) while checking 20,000 ids:
    # before, the generator over the ids resumed once per id (20,001 calls); now none.
    ids = [0, 2**31 - 1, *range(19_998)]
    calls = 0

    def profiler(_frame: Any, event: str, _arg: Any) -> None:
        nonlocal calls
        calls += event == "call"

    sys.setprofile(profiler)
    try:
        checked = token_ids(ids)
    finally:
        sys.setprofile(None)
    assert checked is ids and token_ids([]) == [] and token_ids(None) is None
    assert calls <= 1  # token_ids itself
