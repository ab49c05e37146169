"""Every Responses ``response`` object and stream event validates against the Open Responses
specification's schema, loaded from its ``openapi.json``
(tests/data/openresponses/, with where it came from) and checked with ``jsonschema``.

Main's objects lacked ``completed_at``, ``presence_penalty``, ``frequency_penalty``,
``max_tool_calls``, ``background``, ``service_tier``, ``safety_identifier`` and
``prompt_cache_key``, had ``null`` ``temperature``/``top_p``/``top_logprobs`` where the spec
wants numbers, and echoed function tools without ``strict`` (and ``description`` when not
sent): every schema-validating client refused every response. The answers are vLLM's own,
recorded from the real server (tests/data/responses_chat.json), rendered by the dialect.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_helpers import gateway_with, sse_payloads
from jsonschema import Draft202012Validator
from tests_support import free_port

from datapool.settings import PoolSettings
from gateway.dialects.responses.serving import Responses
from gateway.dialects.responses.stream import ResponsesEvents
from trajgate.vllm_server import VLLMServer

DATA = Path(__file__).parent / "data"
SPEC: dict[str, Any] = json.loads((DATA / "openresponses" / "openapi.json").read_text())
RECORDED: dict[str, Any] = json.loads((DATA / "responses_chat.json").read_text())
# The response object, and the union of every stream event (the spec's text/event-stream 200).
RESPONSE = Draft202012Validator({**SPEC, "$ref": "#/components/schemas/ResponseResource"})
EVENTS = "#/paths/~1responses/post/responses/200/content/text~1event-stream/schema"
EVENT = Draft202012Validator({**SPEC, "$ref": EVENTS})
# OpenAI names the reasoning text events response.reasoning_text.delta/.done (the openai SDK's
# ResponseStreamEvent union, which test_dialect_responses_unit pins); the Open Responses spec
# names them response.reasoning.delta/.done with the same fields. Kept as OpenAI's: the only
# events here the spec's union does not list.
OPENAI_NAMED = {"response.reasoning_text.delta", "response.reasoning_text.done"}
DIALECT = Responses()
# A function tool as a client may send it: no description, no strict.
BARE_TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def errors_of(validator: Draft202012Validator, instance: dict[str, Any]) -> list[str]:
    return [
        f"{'/'.join(map(str, error.absolute_path))}: {error.message}"
        for error in validator.iter_errors(instance)
    ]


def check_events(events: list[dict[str, Any]]) -> None:
    for event in events:
        if event["type"] in OPENAI_NAMED:
            continue
        assert errors_of(EVENT, event) == [], event["type"]
        if "response" in event:  # the oneOf says "matches none" for any field: name the field
            assert errors_of(RESPONSE, event["response"]) == [], event["type"]


def replay(body: dict[str, Any], chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    stream = DIALECT.open_stream(DIALECT.prepare(body), None)
    framed = stream.opening()
    for chunk in chunks:
        framed += stream.feed(json.dumps(chunk).encode())
    framed += stream.closing()
    return [json.loads(raw.decode().split("data: ", 1)[1]) for raw in framed]


@pytest.mark.parametrize(
    "body",
    [
        {"model": "tiny", "input": "say hi", "max_output_tokens": 6},
        {
            "model": "tiny",
            "input": "say hi",
            "include": ["message.output_text.logprobs"],
            "tools": [BARE_TOOL],
            "reasoning": {"effort": "low"},
            "metadata": {"run": "7"},
            "temperature": 0.5,
            "safety_identifier": "user-1",
            "prompt_cache_key": "k",
            "max_tool_calls": 3,
        },
    ],
    ids=["plain", "every-echoed-field"],
)
def test_a_unary_text_response_validates_against_the_spec(body: dict[str, Any]) -> None:
    response = DIALECT.client_answer(DIALECT.prepare(body), RECORDED["text_unary"]["answer"])
    assert errors_of(RESPONSE, response) == []


def test_a_unary_tool_call_response_validates_and_lists_the_tool_whole() -> None:
    body = {"model": "tiny", "input": "What is the weather in paris?", "tools": [BARE_TOOL]}
    response = DIALECT.client_answer(DIALECT.prepare(body), RECORDED["tool_unary"]["answer"])
    assert errors_of(RESPONSE, response) == []
    assert response["tools"] == [{**BARE_TOOL, "description": None, "strict": None}]


def test_a_completed_response_says_when_it_completed_and_an_incomplete_one_does_not() -> None:
    prepared = DIALECT.prepare({"model": "tiny", "input": "say hi"})
    answer = RECORDED["text_unary"]["answer"]
    stopped = {**answer, "choices": [{**answer["choices"][0], "finish_reason": "stop"}]}
    completed = DIALECT.client_answer(prepared, stopped)
    assert completed["status"] == "completed" and completed["completed_at"] >= 0
    cut = DIALECT.client_answer(prepared, {**answer, "choices": [{**answer["choices"][0]}]})
    assert (cut["status"], cut["completed_at"]) == ("incomplete", None)


@pytest.mark.parametrize("recorded", ["text_stream", "tool_stream"])
def test_every_event_of_a_recorded_stream_validates_against_the_spec(recorded: str) -> None:
    body = {
        "model": "tiny",
        "input": "say hi",
        "stream": True,
        "include": ["message.output_text.logprobs"],
        "tools": [BARE_TOOL],
    }
    events = replay(body, RECORDED[recorded]["chunks"])
    assert {e["type"] for e in events} >= {"response.created", "response.in_progress"}
    check_events(events)


def test_a_reasoning_stream_validates_but_for_openais_two_reasoning_event_names() -> None:
    events = ResponsesEvents(
        {"model": "tiny"}, {}, response_id="resp_x", created_at=0, logprobs_asked=False
    )
    sent = events.opening()
    for delta in ({"reasoning": "let me see"}, {"content": "Hi"}):
        sent += events.feed({"model": "tiny", "choices": [{"index": 0, "delta": delta}]})
    sent += events.feed(
        {"model": "tiny", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    )
    sent += events.closing()
    check_events(sent)
    assert {e["type"] for e in sent if errors_of(EVENT, e)} == OPENAI_NAMED
    assert sent[-1]["type"] == "response.completed"
    assert isinstance(sent[-1]["response"]["completed_at"], int)


def test_a_failed_stream_ends_with_an_event_that_validates() -> None:
    stream = DIALECT.open_stream(
        DIALECT.prepare({"model": "tiny", "input": "q", "stream": True}), None
    )
    stream.opening()
    failed = stream.feed(json.dumps({"error": {"message": "engine died", "code": 500}}).encode())
    event = json.loads(failed[0].decode().split("data: ", 1)[1])
    assert event["type"] == "response.failed"
    assert errors_of(EVENT, event) == [] and errors_of(RESPONSE, event["response"]) == []


def test_the_real_gateway_in_front_of_vllm_answers_spec_valid_objects_and_events(
    vllm: VLLMServer, pool_settings: PoolSettings
) -> None:
    """The same through ``trajgate``'s gateway and the real vLLM: a unary call and a stream,
    with a bare function tool, each object and event validated."""
    body = {
        "model": "tiny",
        "input": "What is the weather in Paris?",
        "max_output_tokens": 8,
        "tools": [BARE_TOOL],
        "reasoning": {"effort": "low"},
    }
    with gateway_with(pool_settings, free_port(), upstream_url=vllm.url) as gateway:
        url = f"{gateway.url}/t/spec/v1/responses"
        unary = httpx.post(url, json=body, timeout=120)
        assert unary.status_code == 200, unary.text
        assert errors_of(RESPONSE, unary.json()) == []
        streamed = httpx.post(url, json={**body, "stream": True}, timeout=120)
        assert streamed.status_code == 200, streamed.text
    events = [json.loads(payload) for payload in sse_payloads(streamed.text)]
    assert events[0]["type"] == "response.created" and len(events) > 3
    check_events(events)
