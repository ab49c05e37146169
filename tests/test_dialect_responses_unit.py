"""The Responses dialect without a server: request translation, answer rendering, stream events.

Upstream answers are real vLLM 0.32 chat answers recorded from the tiny model
(tests/data/responses_chat.json: a text answer cut at max_tokens 6, a named-tool-choice answer
cut at 50, each streamed with ``return_token_ids``, ``logprobs`` and the usage chunk, and
unary); tests/data/codex_request.json is a real second-turn request of Codex CLI 0.169.0
(reasoning item, function call and its output). Every rendered response is parsed with the
official SDK's ``Response`` model and every event with its ``ResponseStreamEvent`` union.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.capture import TRUNCATED
from gateway.dialects.responses.request import ECHO_ONLY, EarlierResponse, translate_request
from gateway.dialects.responses.serving import Responses, ResponsesPrepared
from gateway.dialects.responses.stream import ResponsesEvents, frame
from gateway.dialects.responses.wire import Echo
from gateway.errors import InvalidRequestError
from gateway.proxy.sampling import constrained_by

DATA = Path(__file__).parent / "data"
RECORDED: dict[str, Any] = json.loads((DATA / "responses_chat.json").read_text())
EVENT = TypeAdapter(ResponseStreamEvent)
DIALECT = Responses()
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def chat_messages(body: dict[str, Any], earlier: EarlierResponse | None = None) -> list[Any]:
    messages: list[Any] = translate_request({"model": "tiny", **body}, earlier).chat_body[
        "messages"
    ]
    return messages


def refusal(body: dict[str, Any]) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        translate_request({"model": "tiny", **body})
    return caught.value


def replay(prepared: ResponsesPrepared, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Feed recorded chunks through the dialect's stream; return the events the client got."""
    stream = DIALECT.open_stream(prepared, None)
    framed = stream.opening()
    for chunk in chunks:
        framed += stream.feed(json.dumps(chunk).encode())
    framed += stream.closing()
    events = []
    for raw in framed:
        head, data = raw.decode().split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}" and raw.endswith(b"\n\n")
        EVENT.validate_python(event)
        events.append(event)
    return events


# -- request translation --------------------------------------------------------------------


def test_string_input_with_instructions_becomes_system_then_user() -> None:
    assert chat_messages({"input": "hi", "instructions": "Be terse."}) == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "hi"},
    ]


def test_message_parts_become_text_parts_and_developer_becomes_system() -> None:
    messages = chat_messages(
        {
            "input": [
                {
                    "type": "message",
                    "role": "developer",
                    "content": [{"type": "input_text", "text": "rules"}],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "a"},
                        {"type": "input_text", "text": "b"},
                    ],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "c"}],
                },
            ]
        }
    )
    assert messages == [
        {"role": "system", "content": [{"type": "text", "text": "rules"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "c"}]},
    ]


def test_function_calls_join_the_assistant_turn_before_them_and_outputs_are_tool_messages() -> None:
    messages = chat_messages(
        {
            "input": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "Checking."},
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "arguments": '{"city":"Paris"}',
                },
                {
                    "type": "function_call",
                    "call_id": "c2",
                    "name": "get_weather",
                    "arguments": '{"city":"Rome"}',
                },
                {"type": "function_call_output", "call_id": "c1", "output": "12"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "15"}],
                },
            ]
        }
    )
    assert messages[1] == {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
            },
        ],
    }
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "c1", "content": "12"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "15"}]},
    ]


def test_reasoning_items_become_the_reasoning_of_the_next_assistant_turn() -> None:
    reasoning = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "think"}],
    }
    summary_only = {
        "type": "reasoning",
        "id": "rs_2",
        "summary": [{"type": "summary_text", "text": "s1"}, {"type": "summary_text", "text": "s2"}],
    }
    messages = chat_messages(
        {
            "input": [
                {"role": "user", "content": "q"},
                reasoning,
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "r"},
                summary_only,
                {"role": "assistant", "content": "done"},
                {"type": "reasoning", "id": "rs_3", "summary": [], "encrypted_content": "opaque"},
            ]
        }
    )
    assert messages[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
        "reasoning": "think",
    }
    # summaries join with a blank line: "s1" + "\n\n" + "s2"; an encrypted-only item adds nothing
    assert messages[3] == {"role": "assistant", "content": "done", "reasoning": "s1\n\ns2"}
    assert len(messages) == 4


def test_tools_tool_choice_sampling_and_text_format_map_to_chat_fields() -> None:
    translation = translate_request(
        {
            "model": "tiny",
            "input": "q",
            "tools": [WEATHER, {"type": "web_search"}, {"type": "custom", "name": "apply_patch"}],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False,
            "max_output_tokens": 64,
            "temperature": 0.5,
            "top_p": 0.9,
            "reasoning": {"effort": "low", "summary": "auto"},
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "w",
                    "schema": {"type": "object"},
                    "strict": True,
                }
            },
            "include": ["message.output_text.logprobs"],
            "store": False,
            "metadata": {"run": "1"},
        }
    )
    chat = translation.chat_body
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": WEATHER["parameters"],
                "strict": True,
            },
        }
    ]
    assert translation.omitted_tools == ["web_search", "apply_patch"]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert (
        chat["parallel_tool_calls"],
        chat["max_tokens"],
        chat["temperature"],
        chat["top_p"],
    ) == (False, 64, 0.5, 0.9)
    assert chat["reasoning_effort"] == "low"
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True},
    }
    assert translation.logprobs_asked
    assert "store" not in chat and "metadata" not in chat and "include" not in chat


def test_prepare_adds_the_capture_fields_and_asks_vllm_for_the_usage_chunk() -> None:
    prepared = DIALECT.prepare({"model": "tiny", "input": "q", "stream": True})
    assert prepared.upstream_body == {
        "model": "tiny",
        "messages": [{"role": "user", "content": "q"}],
        "stream": True,
        "return_token_ids": True,
        "logprobs": True,
        "stream_options": {"include_usage": True},
    }
    assert prepared.response_id.startswith("resp_") and prepared.stream


def test_previous_response_id_replays_the_earlier_conversation_without_its_instructions() -> None:
    earlier = EarlierResponse(
        request={"model": "tiny", "input": "first", "instructions": "old rules"},
        upstream_request={
            "messages": [
                {"role": "system", "content": "old rules"},
                {"role": "user", "content": "first"},
            ]
        },
        response_message={"role": "assistant", "content": "answer", "reasoning": "why"},
    )
    messages = chat_messages(
        {"input": "second", "instructions": "new rules", "previous_response_id": "resp_1"}, earlier
    )
    assert messages == [
        {"role": "system", "content": "new rules"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "answer", "reasoning": "why"},
        {"role": "user", "content": "second"},
    ]


def test_unknown_previous_response_id_is_a_400_naming_it() -> None:
    error = refusal({"input": "q", "previous_response_id": "resp_gone"})
    assert error.status_code == 400 and error.param == "previous_response_id"
    assert error.code == "previous_response_not_found"
    # OpenAI's message, then why.
    assert error.message.startswith("Previous response with id 'resp_gone' not found. (no call")


def test_a_response_created_with_store_false_cannot_be_continued() -> None:
    """OpenAI keeps no ``store: false`` response, so naming one is its 400 not found; the
    gateway holds the call (captured for training) but refuses it the same way."""
    earlier = EarlierResponse(
        request={"model": "tiny", "input": "first", "store": False},
        upstream_request={"messages": [{"role": "user", "content": "first"}]},
        response_message={"role": "assistant", "content": "answer"},
    )
    body = {"model": "tiny", "input": "second", "previous_response_id": "resp_1"}
    with pytest.raises(InvalidRequestError) as caught:
        translate_request(body, earlier)
    error = caught.value
    assert (error.status_code, error.param, error.code) == (
        400,
        "previous_response_id",
        "previous_response_not_found",
    )
    assert error.message.startswith("Previous response with id 'resp_1' not found. (it was")
    assert "store: false" in error.message
    # store: true or left out (OpenAI's default is true) continues as before.
    for store in ({"store": True}, {}):
        stored = replace(earlier, request={"model": "tiny", "input": "first", **store})
        assert (
            len(chat_messages({"input": "second", "previous_response_id": "resp_1"}, stored)) == 3
        )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"input": [{"role": "user", "content": "a"}, {"type": "item_reference", "id": "x"}]},
            "input[1].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "tool", "content": "a"}]}, "input[0].role"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
            "input[0].arguments",
        ),
        ({"input": [{"type": "function_call_output", "output": "r"}]}, "input[0].call_id"),
        ({"input": ["not an item"]}, "input[0]"),
        ({"input": 3}, "input"),
        ({"input": "q", "model": 7}, "model"),
        ({"input": "q", "tool_choice": "always"}, "tool_choice"),
        ({"input": "q", "tool_choice": {"type": "web_search"}}, "tool_choice.type"),
        ({"input": "q", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "q", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "q", "max_output_tokens": "10"}, "max_output_tokens"),
        ({"input": "q", "temperature": True}, "temperature"),
        ({"input": "q", "include": "all"}, "include"),
        ({"input": "q", "include": ["message.output_text.logprobs", "zzz"]}, "include[1]"),
        ({"input": "q", "tools": [], "tool_choice": "required"}, "tool_choice"),
        (
            {"input": "q", "tools": [], "tool_choice": {"type": "function", "name": "f"}},
            "tool_choice",
        ),
        ({"input": "q", "conversation": "conv_1"}, "conversation"),
        # Top-level bounds (gateway.dialects.responses.protocol).
        ({"input": []}, "input"),
        ({"input": "q", "max_output_tokens": -1}, "max_output_tokens"),
        ({"input": "q", "truncation": 5}, "truncation"),
        ({"input": "q", "temperature": 2.5}, "temperature"),
        ({"input": "q", "top_p": -1}, "top_p"),
        ({"input": "q", "top_logprobs": -1}, "top_logprobs"),
        ({"input": "q", "max_tool_calls": 0}, "max_tool_calls"),
        ({"input": "q", "store": "yes"}, "store"),
        ({"input": "q", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"input": "q", "safety_identifier": "x" * 65}, "safety_identifier"),
        ({"input": "q", "service_tier": "fastest"}, "service_tier"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    error = refusal(body)
    assert (error.status_code, error.error_type, error.param) == (
        400,
        "invalid_request_error",
        param,
    )


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_a_tool_choice_without_tools_is_dropped_as_openai_does(tool_choice: str) -> None:
    # Codex's compaction request: tools [] with "auto"; vLLM would refuse the field alone.
    body = {"model": "m", "input": "summarise", "tools": [], "tool_choice": tool_choice}
    chat = translate_request(body).chat_body
    assert "tool_choice" not in chat and "tools" not in chat


def test_an_out_of_bounds_field_is_refused_with_its_bound_and_the_value_sent() -> None:
    error = refusal({"input": "q", "truncation": 5})
    assert error.code == "invalid_value"
    assert error.message == ("'truncation' is invalid: Input should be 'auto' or 'disabled'; got 5")
    empty = refusal({"input": []})
    assert empty.message == (
        "'input' is invalid: Input should be a valid string or List should have at least 1 "
        "item after validation, not 0; got []"
    )


def test_a_real_codex_request_translates_with_its_function_tools() -> None:
    body = json.loads((DATA / "codex_request.json").read_text())
    translation = translate_request(body)
    chat = translation.chat_body
    roles = [message["role"] for message in chat["messages"]]
    # two developer messages, environment context, "say hi", the call turn, its output
    assert roles == ["system", "system", "user", "user", "assistant", "tool"]
    turn = chat["messages"][4]
    assert turn["reasoning"] == "I should run echo."
    assert turn["tool_calls"][0]["function"] == {
        "name": "exec_command",
        "arguments": '{"cmd": "echo hi"}',
    }
    assert chat["messages"][5]["tool_call_id"] == "call_1"
    assert translation.omitted_tools == ["multi_agent_v1", "web_search"]
    assert len(chat["tools"]) == len(body["tools"]) - 2
    assert not translation.logprobs_asked  # Codex includes only reasoning.encrypted_content


# -- answer rendering -----------------------------------------------------------------------


def test_a_text_answer_cut_at_max_tokens_renders_as_an_incomplete_response() -> None:
    answer = RECORDED["text_unary"]["answer"]
    prepared = DIALECT.prepare(
        {
            "model": "tiny",
            "input": "say hi",
            "max_output_tokens": 6,
            "include": ["message.output_text.logprobs"],
        }
    )
    response = DIALECT.client_answer(prepared, answer)
    parsed = Response.model_validate(response)
    assert parsed.status == "incomplete"
    assert (
        parsed.incomplete_details is not None
        and parsed.incomplete_details.reason == "max_output_tokens"
    )
    assert parsed.output_text == answer["choices"][0]["message"]["content"]
    (item,) = response["output"]
    logprobs = item["content"][0]["logprobs"]
    assert [entry["logprob"] for entry in logprobs] == [
        entry["logprob"] for entry in answer["choices"][0]["logprobs"]["content"]
    ]
    usage = answer["usage"]
    assert response["usage"]["input_tokens"] == usage["prompt_tokens"]
    assert response["usage"]["output_tokens"] == usage["completion_tokens"] == 6
    assert response["max_output_tokens"] == 6 and response["id"] == prepared.response_id


def test_a_response_repeats_the_echo_only_fields_it_lists_and_only_when_sent() -> None:
    # Every ``ECHO_ONLY`` field but ``client_metadata`` and ``stream_options`` is a field of the
    # typed ``Echo``; ``user`` and ``prompt_cache_retention`` are repeated only when sent.
    echoed = Echo.__required_keys__ | Echo.__optional_keys__
    assert set(ECHO_ONLY) - echoed == {"client_metadata", "stream_options"}
    answer = RECORDED["text_unary"]["answer"]
    sent = {"user": "u-1", "prompt_cache_retention": "24h", "client_metadata": {"a": "b"}}
    response = DIALECT.client_answer(
        DIALECT.prepare({"model": "tiny", "input": "say hi", **sent}), answer
    )
    assert (response["user"], response["prompt_cache_retention"]) == ("u-1", "24h")
    assert "client_metadata" not in response
    bare = DIALECT.client_answer(DIALECT.prepare({"model": "tiny", "input": "say hi"}), answer)
    assert "user" not in bare and "prompt_cache_retention" not in bare


def test_tool_calls_render_as_function_call_items_without_an_empty_message() -> None:
    answer = {
        "id": "chatcmpl-1",
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": None,
                    "reasoning": "need weather",
                    "tool_calls": [
                        {
                            "id": "call_a",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                        },
                        {
                            "id": "call_b",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
                        },
                    ],
                },
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": 20,
            "completion_tokens": 9,
            "total_tokens": 29,
            "prompt_tokens_details": {"cached_tokens": 16},
        },
    }
    prepared = DIALECT.prepare({"model": "tiny", "input": "q", "tools": [WEATHER]})
    response = DIALECT.client_answer(prepared, answer)
    Response.model_validate(response)
    assert response["status"] == "completed" and response["incomplete_details"] is None
    kinds = [(item["type"], item.get("call_id")) for item in response["output"]]
    assert kinds == [("reasoning", None), ("function_call", "call_a"), ("function_call", "call_b")]
    assert response["output"][0]["content"] == [{"type": "reasoning_text", "text": "need weather"}]
    assert response["output"][2]["arguments"] == '{"city":"Rome"}'
    assert response["usage"] == {
        "input_tokens": 20,
        "input_tokens_details": {"cached_tokens": 16, "cache_write_tokens": 0},
        "output_tokens": 9,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 29,
    }
    assert response["tools"] == [WEATHER] and response["tool_choice"] == "auto"


def test_unary_capture_reads_the_chat_answer_of_a_named_tool_choice_sampled_under_a_grammar() -> (
    None
):
    recorded = RECORDED["tool_unary"]
    prepared = DIALECT.prepare(
        {
            "model": "tiny",
            "input": "q",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
        }
    )
    captured = DIALECT.read_answer(prepared, recorded["answer"])
    (choice,) = captured.choices
    assert captured.prompt_ids == recorded["answer"]["prompt_token_ids"]
    assert choice.response_token_ids == recorded["answer"]["choices"][0]["token_ids"]
    assert TRUNCATED in choice.flags
    assert constrained_by(prepared.upstream_body, "auto") == ["tool_choice"]


# -- streaming ------------------------------------------------------------------------------


def test_a_recorded_text_stream_becomes_responses_events_one_delta_per_chunk() -> None:
    chunks = RECORDED["text_stream"]["chunks"]
    prepared = DIALECT.prepare(
        {
            "model": "tiny",
            "input": "say hi",
            "stream": True,
            "include": ["message.output_text.logprobs"],
        }
    )
    events = replay(prepared, chunks)
    text_chunks = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert [event["type"] for event in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(text_chunks),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    deltas = [event for event in events if event["type"] == "response.output_text.delta"]
    for delta, chunk in zip(deltas, text_chunks, strict=True):
        assert delta["delta"] == chunk["choices"][0]["delta"]["content"]
        assert [e["logprob"] for e in delta["logprobs"]] == [
            e["logprob"] for e in chunk["choices"][0]["logprobs"]["content"]
        ]
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "".join(d["delta"] for d in deltas)
    assert (
        final.usage is not None
        and final.usage.output_tokens == chunks[-1]["usage"]["completion_tokens"]
    )


def test_stream_capture_holds_the_engine_ids_and_the_common_message() -> None:
    chunks = RECORDED["tool_stream"]["chunks"]
    prepared = DIALECT.prepare(
        {
            "model": "tiny",
            "input": "What is the weather in paris?",
            "stream": True,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
        }
    )
    stream = DIALECT.open_stream(prepared, None)
    for chunk in chunks:
        stream.feed(json.dumps(chunk).encode())
    captured = stream.captured(None)
    (choice,) = captured.choices
    sampled = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids") or []]
    assert captured.prompt_ids == chunks[0]["prompt_token_ids"]
    assert choice.response_token_ids == sampled and len(sampled) == 50
    assert choice.response_message is not None
    assert choice.response_message["tool_calls"][0]["function"]["arguments"] == '{"city":"London"'


def test_a_recorded_tool_call_stream_becomes_function_call_events() -> None:
    chunks = RECORDED["tool_stream"]["chunks"]
    prepared = DIALECT.prepare({"model": "tiny", "input": "q", "stream": True, "tools": [WEATHER]})
    events = replay(prepared, chunks)
    types = [event["type"] for event in events]
    argument_chunks = [
        call["function"]["arguments"]
        for c in chunks
        for ch in c["choices"]
        for call in ch["delta"].get("tool_calls") or []
        if call["function"].get("arguments")
    ]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * len(argument_chunks),
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    added, done = events[2]["item"], events[-2]["item"]
    assert (added["type"], added["name"], added["status"]) == (
        "function_call",
        "get_weather",
        "in_progress",
    )
    # '{"' + 'c' + 'i' + 't' + 'y' + '":"' + 'London' + '"'
    assert done["arguments"] == "".join(argument_chunks) == '{"city":"London"'
    assert done["status"] == "incomplete" and done["call_id"].startswith("chatcmpl-tool-")


def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "model": "tiny",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


def test_reasoning_then_text_are_two_items_closed_in_order() -> None:
    events = ResponsesEvents(
        {"model": "tiny"}, {}, response_id="resp_x", created_at=0, logprobs_asked=False
    )
    sent = events.opening()
    for piece in (
        chunk({"reasoning": "let me "}),
        chunk({"reasoning": "see"}),
        chunk({"content": "Hi"}),
    ):
        sent += events.feed(piece)
    sent += events.feed(chunk({}, "stop"))
    sent += events.feed(
        {
            "model": "tiny",
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        }
    )
    sent += events.closing()
    for event in sent:
        EVENT.validate_python(event)
    assert [(e["type"], e.get("output_index")) for e in sent[2:]] == [
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.content_part.added", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.done", 1),
        ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.completed", None),
    ]
    assert sent[6]["text"] == "let me see"
    final = sent[-1]["response"]
    assert [item["id"] for item in final["output"]] == ["rs_x", "msg_x"]
    assert final["usage"]["total_tokens"] == 7
    assert events.message == {"role": "assistant", "content": "Hi", "reasoning": "let me see"}


def test_an_error_inside_the_upstream_stream_ends_it_with_response_failed() -> None:
    prepared = DIALECT.prepare({"model": "tiny", "input": "q", "stream": True})
    stream = DIALECT.open_stream(prepared, None)
    stream.opening()
    stream.feed(json.dumps(chunk({"content": "a"})).encode())
    sent = stream.feed(
        json.dumps(
            {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
        ).encode()
    )
    event = json.loads(sent[0].decode().split("data: ", 1)[1])
    EVENT.validate_python(event)
    assert event["type"] == "response.failed"
    assert event["response"]["error"] == {"code": "server_error", "message": "500: engine died"}
    assert stream.closing() == []


def test_frame_is_an_sse_event_named_by_its_type() -> None:
    assert frame({"type": "response.created", "sequence_number": 0}) == (
        b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n'
    )
