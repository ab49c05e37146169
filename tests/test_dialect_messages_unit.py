"""The Messages dialect without a server: request translation, answer rendering, stream events.

Upstream answers are real vLLM 0.32 chat answers recorded from the tiny model:
tests/data/responses_chat.json (a text answer cut at max_tokens 6, streamed and unary) and
tests/data/messages_chat.json (Messages bodies translated by this dialect and sent to vLLM: a
stream stopped by a stop sequence, a second turn with thinking, tool_use and tool_result with
vLLM's /tokenize count of the same translation, a ``tool_choice: any`` stream whose arguments
are digits). tests/data/claude_code_request.json is a real second-turn request of Claude Code
2.1.328 (its device id zeroed). Every rendered message is parsed with the official SDK's
``Message`` model, every event with its ``RawMessageStreamEvent`` union, and streams are fed
through the SDK's own stream accumulator.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from pydantic import TypeAdapter

from gateway.capture import PREFILL, TRUNCATED
from gateway.dialects.messages.render import signature
from gateway.dialects.messages.request import translate_request
from gateway.dialects.messages.serving import Messages, MessagesPrepared, count_tokens
from gateway.errors import (
    InvalidRequestError,
    ServiceUnavailableError,
    TrajgateError,
    UpstreamTimeoutError,
)
from gateway.proxy.sampling import constrained_by

DATA = Path(__file__).parent / "data"
CHAT: dict[str, Any] = json.loads((DATA / "responses_chat.json").read_text())
RECORDED: dict[str, Any] = json.loads((DATA / "messages_chat.json").read_text())
EVENT = TypeAdapter(RawMessageStreamEvent)
DIALECT = Messages()
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def translate(body: dict[str, Any]) -> dict[str, Any]:
    chat: dict[str, Any] = translate_request({"model": "tiny", "max_tokens": 16, **body}).chat_body
    return chat


def refusal(body: dict[str, Any]) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        translate_request({"model": "tiny", **body})
    return caught.value


def parse_frames(framed: list[bytes]) -> list[dict[str, Any]]:
    """Each SSE frame as its event; checks the framing and the SDK's event models."""
    events = []
    for raw in framed:
        head, data = raw.decode().split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}" and raw.endswith(b"\n\n")
        if event["type"] == "error":
            ErrorResponse.model_validate(event)
        elif event["type"] != "ping":  # the SDK skips pings; its union has none
            EVENT.validate_python(event)
        events.append(event)
    return events


def replay(prepared: MessagesPrepared, chunks: list[dict[str, Any]]) -> list[bytes]:
    """Feed recorded chunks through the dialect's stream; return the frames the client got."""
    stream = DIALECT.open_stream(prepared, None)
    framed = stream.opening()
    for chunk in chunks:
        framed += stream.feed(json.dumps(chunk).encode())
    return framed + stream.closing()


def sdk_message(framed: list[bytes]) -> Message:
    """The message the official SDK's ``messages.stream`` accumulates from these frames."""
    body = b"".join(framed)

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    client = anthropic.Anthropic(
        api_key="dummy", http_client=httpx2.Client(transport=httpx2.MockTransport(handler))
    )
    with client.messages.stream(
        model="tiny", max_tokens=16, messages=[{"role": "user", "content": "q"}]
    ) as stream:
        final = stream.get_final_message()
    return Message.model_validate(final.model_dump(exclude_none=True))


def chunk(delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, **extra}],
    }


# -- request translation --------------------------------------------------------------------


def test_system_string_and_string_content_become_system_then_user() -> None:
    chat = translate({"system": "Be terse.", "messages": [{"role": "user", "content": "hi"}]})
    assert chat["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "hi"},
    ]
    assert chat["max_tokens"] == 16 and "stream" not in chat


def test_system_blocks_become_text_parts_and_cache_control_is_ignored() -> None:
    chat = translate(
        {
            "system": [
                {"type": "text", "text": "a"},
                {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}},
            ],
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "c", "cache_control": {"type": "ephemeral"}}
                    ],
                }
            ],
        }
    )
    assert chat["messages"] == [
        {
            "role": "system",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        },
        {"role": "user", "content": [{"type": "text", "text": "c"}]},
    ]


def test_an_assistant_turn_becomes_one_message_with_reasoning_and_tool_calls() -> None:
    chat = translate(
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "need ", "signature": "s1"},
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "thinking", "thinking": "the tool", "signature": "s2"},
                        {"type": "text", "text": "Check"},
                        {"type": "text", "text": "ing."},
                        {
                            "type": "tool_use",
                            "id": "toolu_chatcmpl-tool-1",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        },
                        {"type": "tool_use", "id": "toolu_01A", "name": "f", "input": {}},
                    ],
                },
            ]
        }
    )
    assert chat["messages"][1] == {
        "role": "assistant",
        "content": "Checking.",  # "Check" + "ing.": pieces of one generated text
        "tool_calls": [
            {
                "id": "chatcmpl-tool-1",  # the id vLLM gave, "toolu_" taken off again
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {"id": "01A", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        ],
        "reasoning": "need the tool",  # redacted_thinking adds nothing
    }
    assert "continue_final_message" not in chat  # a turn with tool calls is no prefill


def test_tool_results_are_split_out_of_the_user_turn_before_its_text() -> None:
    chat = translate(
        {
            "messages": [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}},
                        {"type": "tool_use", "id": "toolu_b", "name": "f", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "and now?"},
                        {"type": "tool_result", "tool_use_id": "toolu_a", "content": "12"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_b",
                            "is_error": True,
                            "content": [
                                {"type": "text", "text": "<tool_use_error>no</tool_use_error>"}
                            ],
                        },
                        {"type": "tool_result", "tool_use_id": "toolu_c"},
                    ],
                },
            ]
        }
    )
    assert chat["messages"][2:] == [
        {"role": "tool", "tool_call_id": "a", "content": "12"},
        {
            "role": "tool",
            "tool_call_id": "b",
            "content": [{"type": "text", "text": "<tool_use_error>no</tool_use_error>"}],
        },
        {"role": "tool", "tool_call_id": "c", "content": ""},
        {"role": "user", "content": [{"type": "text", "text": "and now?"}]},
    ]


def test_a_system_message_inside_messages_stays_a_system_message() -> None:
    # Claude Code 2.1.328 sends its environment as {"role": "system"} after the first user turn.
    chat = translate(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "system", "content": [{"type": "text", "text": "# Environment"}]},
            ]
        }
    )
    assert chat["messages"][1] == {
        "role": "system",
        "content": [{"type": "text", "text": "# Environment"}],
    }


def test_a_last_assistant_turn_is_a_prefill_the_answer_continues() -> None:
    chat = translate(
        {
            "messages": [
                {"role": "user", "content": "Greek name for Sun?"},
                {"role": "assistant", "content": "The answer is ("},
            ]
        }
    )
    assert chat["messages"][-1] == {"role": "assistant", "content": "The answer is ("}
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False


def test_custom_tools_become_functions_and_server_or_deferred_tools_are_left_out() -> None:
    translation = translate_request(
        {
            "model": "tiny",
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "q"}],
            "tools": [
                {**WEATHER, "cache_control": {"type": "ephemeral"}},
                {"type": "custom", "name": "g", "input_schema": {"type": "object"}},
                {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
                {"name": "Later", "input_schema": {"type": "object"}, "defer_loading": True},
            ],
        }
    )
    assert translation.chat_body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": "Weather in a city",
            },
        },
        {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}},
    ]
    assert translation.omitted_tools == ["web_search", "Later"]


@pytest.mark.parametrize(
    ("tool_choice", "expected"),
    [
        ({"type": "auto"}, {"tool_choice": "auto"}),
        (
            {"type": "auto", "disable_parallel_tool_use": True},
            {"tool_choice": "auto", "parallel_tool_calls": False},
        ),
        ({"type": "any"}, {"tool_choice": "required"}),
        (
            {"type": "tool", "name": "get_weather"},
            {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        ),
        ({"type": "none"}, {"tool_choice": "none"}),
    ],
)
def test_tool_choice_maps_to_the_chat_tool_choice(
    tool_choice: dict[str, Any], expected: dict[str, Any]
) -> None:
    chat = translate(
        {
            "messages": [{"role": "user", "content": "q"}],
            "tools": [WEATHER],
            "tool_choice": tool_choice,
        }
    )
    assert {key: chat[key] for key in expected} == expected
    assert ("parallel_tool_calls" in chat) == ("parallel_tool_calls" in expected)


def test_tool_choice_auto_without_a_tool_upstream_is_left_out() -> None:
    chat = translate(
        {"messages": [{"role": "user", "content": "q"}], "tool_choice": {"type": "auto"}}
    )
    assert "tool_choice" not in chat and "tools" not in chat


def test_sampling_thinking_and_output_format_map_and_the_rest_is_ignored() -> None:
    translation = translate_request(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "q"}],
            "max_tokens": 64,
            "stop_sequences": ["\n\nHuman:", "END"],
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 20,
            "stream": True,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "output_config": {"effort": "high", "format": {"type": "json_schema", "schema": {}}},
            "metadata": {"user_id": "u"},
            "context_management": {"edits": []},
        }
    )
    chat = translation.chat_body
    assert {k: v for k, v in chat.items() if k not in ("model", "messages")} == {
        "max_tokens": 64,
        "stop": ["\n\nHuman:", "END"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "stream": True,
        "chat_template_kwargs": {"enable_thinking": True},
        "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": {}}},
    }
    assert translation.ignored_fields == ["context_management", "metadata"]
    disabled = translate(
        {"messages": [{"role": "user", "content": "q"}], "thinking": {"type": "disabled"}}
    )
    assert disabled["chat_template_kwargs"] == {"enable_thinking": False}


def test_prepare_adds_the_capture_fields_and_asks_vllm_for_the_usage_chunk() -> None:
    prepared = DIALECT.prepare(
        {
            "model": "tiny",
            "max_tokens": 5,
            "stream": True,
            "messages": [{"role": "user", "content": "q"}],
        }
    )
    assert prepared.upstream_body == {
        "model": "tiny",
        "messages": [{"role": "user", "content": "q"}],
        "max_tokens": 5,
        "stream": True,
        "return_token_ids": True,
        "logprobs": True,
        "stream_options": {"include_usage": True},
    }
    assert prepared.message_id.startswith("msg_") and prepared.stream
    assert (prepared.asked.return_token_ids, prepared.asked.logprobs) == (False, False)


USER_Q = {"role": "user", "content": "q"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [USER_Q]}, "max_tokens"),
        ({"messages": [USER_Q], "max_tokens": "8"}, "max_tokens"),
        ({"messages": [USER_Q], "max_tokens": 0}, "max_tokens"),
        ({"messages": [], "max_tokens": 8}, "messages"),
        ({"messages": "hi", "max_tokens": 8}, "messages"),
        ({"messages": [USER_Q], "max_tokens": 8, "model": 3}, "model"),
        ({"messages": [{"role": "tool", "content": "x"}], "max_tokens": 8}, "messages.0.role"),
        (
            {
                "messages": [USER_Q, {"role": "user", "content": [{"type": "video"}]}],
                "max_tokens": 8,
            },
            "messages.1.content.0.type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                    }
                ],
                "max_tokens": 8,
            },
            "messages.0.content.0.type",
        ),
        (
            {
                "messages": [
                    USER_Q,
                    {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
                ],
                "max_tokens": 8,
            },
            "messages.1.content.0.type",
        ),
        (
            {
                "messages": [
                    USER_Q,
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "{}"}],
                    },
                ],
                "max_tokens": 8,
            },
            "messages.1.content.0.input",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": "no"}],
                    }
                ],
                "max_tokens": 8,
            },
            "messages.0.content.0.is_error",
        ),
        ({"messages": [{"role": "user", "content": []}], "max_tokens": 8}, "messages.0.content"),
        (
            {"messages": [{"role": "user", "content": ["hi"]}], "max_tokens": 8},
            "messages.0.content.0",
        ),
        ({"messages": [USER_Q], "max_tokens": 8, "system": 1}, "system"),
        ({"messages": [USER_Q], "max_tokens": 8, "system": [{"type": "image"}]}, "system.0.type"),
        ({"messages": [USER_Q], "max_tokens": 8, "stop_sequences": ["a", 1]}, "stop_sequences.1"),
        ({"messages": [USER_Q], "max_tokens": 8, "temperature": True}, "temperature"),
        ({"messages": [USER_Q], "max_tokens": 8, "top_k": 2.5}, "top_k"),
        ({"messages": [USER_Q], "max_tokens": 8, "stream": "yes"}, "stream"),
        ({"messages": [USER_Q], "max_tokens": 8, "tools": [{"name": "f"}]}, "tools.0.input_schema"),
        (
            {"messages": [USER_Q], "max_tokens": 8, "tool_choice": {"type": "all"}},
            "tool_choice.type",
        ),
        (
            {"messages": [USER_Q], "max_tokens": 8, "tool_choice": {"type": "any"}},
            "tool_choice.type",
        ),
        ({"messages": [USER_Q], "max_tokens": 8, "thinking": {"type": "on"}}, "thinking.type"),
        (
            {
                "messages": [USER_Q],
                "max_tokens": 8,
                "thinking": {"type": "enabled", "budget_tokens": "x"},
            },
            "thinking.budget_tokens",
        ),
        (
            {
                "messages": [USER_Q],
                "max_tokens": 8,
                "thinking": {"type": "enabled", "budget_tokens": 0},
            },
            "thinking.budget_tokens",
        ),
        # Top-level bounds (gateway.dialects.messages.protocol).
        ({"messages": [USER_Q], "max_tokens": 8, "metadata": 5}, "metadata"),
        ({"messages": [USER_Q], "max_tokens": 8, "metadata": {"user_id": 5}}, "metadata.user_id"),
        ({"messages": [USER_Q], "max_tokens": 8, "top_k": -5}, "top_k"),
        # main sent both upstream: metadata allows user_id only, top_k must fit vLLM's int32
        ({"messages": [USER_Q], "max_tokens": 8, "metadata": {"other": "x"}}, "metadata.other"),
        ({"messages": [USER_Q], "max_tokens": 8, "top_k": 2**31}, "top_k"),
        ({"messages": [USER_Q], "max_tokens": 8, "temperature": 1.01}, "temperature"),
        ({"messages": [USER_Q], "max_tokens": 8, "top_p": 2}, "top_p"),
        ({"messages": [USER_Q], "max_tokens": 8, "service_tier": "priority"}, "service_tier"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    error = refusal(body)
    assert (error.status_code, error.error_type, error.param) == (
        400,
        "invalid_request_error",
        param,
    )
    assert error.message.startswith(f"{param}: ")


def test_an_out_of_bounds_field_is_refused_with_its_bound_and_the_value_sent() -> None:
    error = refusal({"messages": [USER_Q], "max_tokens": 8, "top_k": -5})
    assert error.code == "invalid_value"
    assert error.message == (
        "top_k: is invalid: Input should be greater than or equal to 0; got -5"
    )


def test_an_image_block_is_refused_saying_the_model_takes_text_only() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    error = refusal({"max_tokens": 8, "messages": [{"role": "user", "content": [image]}]})
    assert error.param == "messages.0.content.0.type" and "text only" in error.message
    nested = refusal(
        {
            "max_tokens": 8,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "content": [image]}],
                }
            ],
        }
    )
    assert nested.param == "messages.0.content.0.content.0.type"


def test_errors_render_in_anthropics_envelope_with_a_type_per_status() -> None:
    error = refusal(
        {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "video"}]}]}
    )
    body = DIALECT.render_error(error)
    ErrorResponse.model_validate(body)
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("messages.0.content.0.type: unsupported block type")
    assert body["error"]["message"].endswith("[invalid_value]")
    kinds = [
        DIALECT.render_error(e)["error"]["type"]
        for e in (
            ServiceUnavailableError("pool down"),
            UpstreamTimeoutError("slow"),
            TrajgateError("bug"),
        )
    ]
    assert kinds == ["overloaded_error", "timeout_error", "api_error"]


def test_a_vllm_error_body_is_passed_on_in_anthropics_envelope() -> None:
    vllm = (
        b'{"error":{"message":"max_tokens=32000 cannot be greater than max_model_len=2048.",'
        b'"type":"BadRequestError","param":"max_tokens","code":400}}'
    )
    body = json.loads(DIALECT.upstream_error_body(400, vllm))
    ErrorResponse.model_validate(body)
    assert body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "max_tokens=32000 cannot be greater than max_model_len=2048.",
        },
    }


def test_a_real_claude_code_request_translates_with_its_tools_and_tool_turn() -> None:
    body = json.loads((DATA / "claude_code_request.json").read_text())
    translation = translate_request(body)
    chat = translation.chat_body
    # system blocks; the user turn; Claude Code's environment; the tool call turn; its result
    assert [m["role"] for m in chat["messages"]] == [
        "system",
        "user",
        "system",
        "assistant",
        "tool",
    ]
    turn = chat["messages"][3]
    assert turn["reasoning"] == "I should run echo." and turn["content"] == "Running it."
    assert turn["tool_calls"] == [
        {
            "id": "chatcmpl-tool-abc",
            "type": "function",
            "function": {
                "name": "Bash",
                "arguments": '{"command": "echo hi", "description": "say hi"}',
            },
        }
    ]
    assert chat["messages"][4] == {
        "role": "tool",
        "tool_call_id": "chatcmpl-tool-abc",
        "content": "hi",
    }
    assert translation.omitted_tools == ["DeferredToolPlaceholder"]
    assert len(chat["tools"]) == len(body["tools"]) - 1
    assert translation.ignored_fields == ["context_management", "metadata"]
    # thinking {"type": "adaptive"} → the template's thinking switch on
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}


# -- answer rendering -----------------------------------------------------------------------


def test_a_text_answer_cut_at_max_tokens_renders_with_stop_reason_max_tokens() -> None:
    answer = CHAT["text_unary"]["answer"]
    prepared = DIALECT.prepare(
        {"model": "tiny", "max_tokens": 6, "messages": [{"role": "user", "content": "say hi"}]}
    )
    rendered = DIALECT.client_answer(prepared, answer)
    message = Message.model_validate(rendered)
    assert message.id == prepared.message_id and message.stop_reason == "max_tokens"
    assert rendered["content"] == [
        {"type": "text", "text": answer["choices"][0]["message"]["content"]}
    ]
    assert rendered["usage"] == {
        "input_tokens": answer["usage"]["prompt_tokens"],
        "output_tokens": 6,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


TOOL_ANSWER = {
    "id": "chatcmpl-1",
    "model": "tiny",
    "choices": [
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "message": {
                "role": "assistant",
                "content": "Checking.",
                "reasoning": "need weather",
                "tool_calls": [
                    {
                        "id": "chatcmpl-tool-a",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                    },
                    {
                        "id": "chatcmpl-tool-b",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": "201745711"},
                    },
                ],
            },
            "logprobs": None,
        }
    ],
    "usage": {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29},
}


def test_tool_calls_render_as_tool_use_blocks_after_thinking_and_text() -> None:
    prepared = DIALECT.prepare(
        {"model": "tiny", "max_tokens": 9, "messages": [USER_Q], "tools": [WEATHER]}
    )
    rendered = DIALECT.client_answer(prepared, TOOL_ANSWER)
    Message.model_validate(rendered)
    assert rendered["content"] == [
        {"type": "thinking", "thinking": "need weather", "signature": signature("need weather")},
        {"type": "text", "text": "Checking."},
        {
            "type": "tool_use",
            "id": "toolu_chatcmpl-tool-a",
            "name": "get_weather",
            "input": {"city": "Paris"},
        },
        # arguments that are no JSON object (the tiny model's digits) give input {}
        {"type": "tool_use", "id": "toolu_chatcmpl-tool-b", "name": "get_weather", "input": {}},
    ]
    assert (rendered["stop_reason"], rendered["stop_sequence"]) == ("tool_use", None)


@pytest.mark.parametrize(
    ("finish_reason", "stop_reason", "expected"),
    [
        ("stop", " nine", ("stop_sequence", " nine")),
        ("stop", None, ("end_turn", None)),
        ("stop", 151645, ("end_turn", None)),  # an end token id is no stop sequence
        ("length", None, ("max_tokens", None)),
        ("content_filter", None, ("refusal", None)),
    ],
)
def test_finish_reasons_map_to_stop_reasons(
    finish_reason: str, stop_reason: Any, expected: tuple[str, str | None]
) -> None:
    answer = {
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
                "message": {"role": "assistant", "content": "x"},
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1},
    }
    rendered = DIALECT.client_answer(
        DIALECT.prepare({"model": "tiny", "max_tokens": 1, "messages": [USER_Q]}), answer
    )
    assert (rendered["stop_reason"], rendered["stop_sequence"]) == expected


def test_an_empty_answer_is_one_empty_text_block() -> None:
    answer = {
        "model": "tiny",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"content": None}}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1},
    }
    prepared = DIALECT.prepare({"model": "tiny", "max_tokens": 1, "messages": [USER_Q]})
    rendered = DIALECT.client_answer(prepared, answer)
    assert Message.model_validate(rendered).content[0].type == "text"
    assert rendered["content"] == [{"type": "text", "text": ""}]


def test_unary_capture_holds_the_prompt_vllm_rendered_which_count_tokens_also_counts() -> None:
    recorded = RECORDED["tool_turn_unary"]
    prepared = DIALECT.prepare(recorded["body"])
    assert prepared.upstream_body == recorded["request"]
    captured = DIALECT.read_answer(prepared, recorded["answer"])
    (choice,) = captured.choices
    assert captured.prompt_ids == recorded["answer"]["prompt_token_ids"]
    # /tokenize of the same translation counted exactly the prompt the chat call got
    assert len(captured.prompt_ids) == recorded["tokenize_count"] == captured.prompt_tokens
    assert choice.response_token_ids == recorded["answer"]["choices"][0]["token_ids"]
    assert choice.response_message is not None
    assert (
        choice.response_message["content"] == recorded["answer"]["choices"][0]["message"]["content"]
    )
    assert TRUNCATED in choice.flags  # max_tokens 8 reached


def test_a_prefill_is_flagged_on_the_step() -> None:
    prepared = DIALECT.prepare(
        {
            "model": "tiny",
            "max_tokens": 4,
            "messages": [USER_Q, {"role": "assistant", "content": "A"}],
        }
    )
    answer = {
        "model": "tiny",
        "prompt_token_ids": [1, 2],
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "B"},
                "token_ids": [3],
                "logprobs": {"content": [{"token": "B", "logprob": -0.5}]},
            }
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1},
    }
    (choice,) = DIALECT.read_answer(prepared, answer).choices
    assert PREFILL in choice.flags and choice.response_logprobs == [-0.5]


def test_count_tokens_asks_tokenize_for_the_translated_prompt() -> None:
    sent: list[dict[str, Any]] = []

    class Tokenizer:  # the engine's /tokenize (the proxy's ``Engine``), recording what it got
        async def tokenize(self, request: dict[str, Any]) -> dict[str, Any]:
            sent.append(request)
            return {"count": 42, "max_model_len": 2048, "tokens": list(range(42))}

    tokenize = Tokenizer()

    body = {
        "model": "tiny",
        "system": "s",
        "messages": [USER_Q],
        "tools": [WEATHER],
        "thinking": {"type": "disabled"},
    }
    assert asyncio.run(count_tokens(body, tokenize)) == {"input_tokens": 42}
    assert sent == [
        {
            "model": "tiny",
            "messages": [{"role": "system", "content": "s"}, USER_Q],
            "add_generation_prompt": True,
            "continue_final_message": False,
            "tools": translate({"messages": [USER_Q], "tools": [WEATHER]})["tools"],
            "chat_template_kwargs": {"enable_thinking": False},
        }
    ]
    with pytest.raises(InvalidRequestError):
        asyncio.run(count_tokens({"model": "tiny", "messages": []}, tokenize))


# -- streaming ------------------------------------------------------------------------------


def test_a_recorded_text_stream_becomes_messages_events_one_delta_per_chunk() -> None:
    chunks = CHAT["text_stream"]["chunks"]
    prepared = DIALECT.prepare(
        {
            "model": "tiny",
            "max_tokens": 6,
            "stream": True,
            "messages": [{"role": "user", "content": "say hi"}],
        }
    )
    events = parse_frames(replay(prepared, chunks))
    text_chunks = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert [event["type"] for event in events] == [
        "message_start",
        "ping",
        "content_block_start",
        *["content_block_delta"] * len(text_chunks),
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0]["message"]
    assert start["content"] == [] and start["id"] == prepared.message_id
    assert start["usage"]["input_tokens"] == len(chunks[0]["prompt_token_ids"]) == 37
    deltas = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"]
    assert deltas == [c["choices"][0]["delta"]["content"] for c in text_chunks]
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == chunks[-1]["usage"]["completion_tokens"] == 6


def test_the_sdk_accumulates_a_text_stream_into_the_unary_rendering() -> None:
    prepared = DIALECT.prepare(
        {"model": "tiny", "max_tokens": 6, "messages": [{"role": "user", "content": "say hi"}]}
    )
    streamed = sdk_message(replay(prepared, CHAT["text_stream"]["chunks"]))
    unary = Message.model_validate(DIALECT.client_answer(prepared, CHAT["text_unary"]["answer"]))
    assert streamed == unary


def test_the_sdk_accumulates_thinking_text_and_tool_use_into_the_unary_rendering() -> None:
    prepared = DIALECT.prepare(
        {"model": "tiny", "max_tokens": 9, "messages": [USER_Q], "stream": True}
    )
    first = chunk({"role": "assistant", "content": ""})
    first["prompt_token_ids"] = list(range(20))
    chunks = [
        first,
        chunk({"reasoning": "need "}, token_ids=[1]),
        chunk({"reasoning": "weather"}, token_ids=[2]),
        chunk({"content": "Checking."}, token_ids=[3]),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "chatcmpl-tool-a",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": ""},
                    }
                ]
            },
            token_ids=[4],
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}, token_ids=[5]),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, token_ids=[6]),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "chatcmpl-tool-b",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": "201"},
                    }
                ]
            },
            token_ids=[7],
        ),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": "745711"}}]}, token_ids=[8]),
        chunk({}, "tool_calls", token_ids=[9]),
        {"model": "tiny", "choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 9}},
    ]
    framed = replay(prepared, chunks)
    events = parse_frames(framed)
    blocks = [
        (e["index"], e["content_block"]["type"])
        for e in events
        if e["type"] == "content_block_start"
    ]
    assert blocks == [(0, "thinking"), (1, "text"), (2, "tool_use"), (3, "tool_use")]
    # the digits of the second call are no JSON object: no input_json_delta for block 3
    partial = [
        e["delta"]["partial_json"]
        for e in events
        if e.get("delta", {}).get("type") == "input_json_delta"
    ]
    assert partial == ['{"city":', '"Paris"}']
    assert sdk_message(framed) == Message.model_validate(
        DIALECT.client_answer(prepared, TOOL_ANSWER)
    )


def test_leading_whitespace_of_arguments_waits_for_the_first_character() -> None:
    prepared = DIALECT.prepare(
        {"model": "tiny", "max_tokens": 9, "messages": [USER_Q], "stream": True}
    )
    stream = DIALECT.open_stream(prepared, None)
    call = {
        "index": 0,
        "id": "c",
        "type": "function",
        "function": {"name": "f", "arguments": " \n"},
    }
    events = parse_frames(stream.feed(json.dumps(chunk({"tool_calls": [call]})).encode()))
    assert [e["type"] for e in events] == ["message_start", "ping", "content_block_start"]
    more = {"index": 0, "function": {"arguments": '{"a": 1}'}}
    (delta,) = parse_frames(stream.feed(json.dumps(chunk({"tool_calls": [more]})).encode()))
    assert delta["delta"] == {"type": "input_json_delta", "partial_json": ' \n{"a": 1}'}


def test_a_recorded_stop_sequence_stream_ends_with_stop_sequence() -> None:
    recorded = RECORDED["stop_stream"]
    prepared = DIALECT.prepare(recorded["body"])
    assert prepared.upstream_body == recorded["request"]
    events = parse_frames(replay(prepared, recorded["chunks"]))
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": " nine"}
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == "667\x1c946 699 55"  # vLLM cut the text before " nine"
    assert (
        events[-2]["usage"]["output_tokens"] == recorded["chunks"][-1]["usage"]["completion_tokens"]
    )


def test_a_recorded_digit_tool_stream_gives_an_empty_input_and_keeps_the_engine_output() -> None:
    recorded = RECORDED["any_tool_stream"]
    chunks = recorded["chunks"]
    prepared = DIALECT.prepare(recorded["body"])
    assert prepared.upstream_body == recorded["request"]
    stream = DIALECT.open_stream(prepared, None)
    framed: list[bytes] = []
    for piece in chunks:
        framed += stream.feed(json.dumps(piece).encode())
    framed += stream.closing()
    events = parse_frames(framed)
    start = next(e for e in events if e["type"] == "content_block_start")
    assert start["content_block"]["name"] == "get_weather"
    assert not [e for e in events if e["type"] == "content_block_delta"]
    message = sdk_message(framed)
    assert message.stop_reason == "max_tokens" and message.content[0].type == "tool_use"
    assert message.content[0].input == {}
    (choice,) = stream.captured(None).choices
    sampled = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids") or []]
    assert choice.response_token_ids == sampled and len(sampled) == 40
    assert choice.response_message is not None
    arguments = choice.response_message["tool_calls"][0]["function"]["arguments"]
    assert arguments.startswith("201745711")  # the engine's text, kept in the common form
    assert TRUNCATED in choice.flags
    # 'any' is chat's required: the answer is sampled under the call's grammar.
    assert constrained_by(prepared.upstream_body, "auto") == ["tool_choice"]


def test_an_error_inside_the_upstream_stream_ends_it_with_an_error_event() -> None:
    prepared = DIALECT.prepare(
        {"model": "tiny", "max_tokens": 9, "messages": [USER_Q], "stream": True}
    )
    stream = DIALECT.open_stream(prepared, None)
    stream.feed(json.dumps(chunk({"content": "a"})).encode())
    sent = stream.feed(
        json.dumps(
            {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
        ).encode()
    )
    (event,) = parse_frames(sent)
    assert event == {"type": "error", "error": {"type": "api_error", "message": "engine died"}}
    assert stream.closing() == []
    assert stream.captured(None).error == {
        "message": "engine died",
        "type": "InternalServerError",
        "code": 500,
    }


def test_the_gateway_ends_a_failed_stream_with_an_error_event() -> None:
    prepared = DIALECT.prepare(
        {"model": "tiny", "max_tokens": 9, "messages": [USER_Q], "stream": True}
    )
    stream = DIALECT.open_stream(prepared, None)
    raw = stream.error_event(UpstreamTimeoutError("no token in 30 s"))
    assert raw == (
        b'event: error\ndata: {"type":"error","error":{"type":"timeout_error",'
        b'"message":"no token in 30 s [upstream_timeout]"}}\n\n'
    )


def test_a_stream_without_output_still_gives_one_empty_text_block() -> None:
    prepared = DIALECT.prepare(
        {"model": "tiny", "max_tokens": 9, "messages": [USER_Q], "stream": True}
    )
    first = chunk({"role": "assistant", "content": ""})
    first["prompt_token_ids"] = [1, 2, 3]
    framed = replay(prepared, [first, chunk({}, "stop", token_ids=[0])])
    events = parse_frames(framed)
    assert [e["type"] for e in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    # no usage chunk: output_tokens is the sampled ids counted (1)
    assert events[-2]["usage"]["output_tokens"] == 1
    assert sdk_message(framed).content[0].type == "text"
