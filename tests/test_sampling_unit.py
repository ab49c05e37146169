"""The effective sampling of a call, what narrows it, and the channel's sampling policy
(gateway.proxy.sampling), on upstream bodies written by hand; the real vLLM checks are in
test_sampling_logprobs.py."""

from __future__ import annotations

import re
from typing import Any

import pytest

from gateway.dialects import DIALECTS, Prepared
from gateway.dialects.base import ClientAsked
from gateway.errors import InvalidRequestError
from gateway.proxy.sampling import (
    SamplingSettingsError,
    apply_policy,
    check_defaults_against_policy,
    constrained_by,
    narrowing,
    sampling_flags,
    sampling_record,
)
from gateway.settings import GatewaySettings

CHAT = next(d for d in DIALECTS if d.name == "chat.completions")
RESPONSES = next(d for d in DIALECTS if d.name == "responses")
MESSAGES = next(d for d in DIALECTS if d.name == "messages")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _tool(name: str, **extra: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": SCHEMA, **extra}}


def _record(body: dict[str, Any], mode: str = "processed_logprobs") -> dict[str, Any]:
    return sampling_record(body, mode, "flag", {}, tool_strict_level="auto")


def _prepared(upstream: dict[str, Any]) -> Prepared:
    return Prepared(
        client_body=dict(upstream),
        upstream_body=dict(upstream),
        asked=ClientAsked(return_token_ids=False, logprobs=False),
    )


@pytest.mark.parametrize(
    ("body", "narrowed"),
    [
        ({"temperature": 0.6}, []),
        ({}, []),
        ({"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}, []),
        ({"top_p": 0.8}, ["top_p"]),
        ({"temperature": 0, "top_k": 5}, ["temperature", "top_k"]),
        ({"presence_penalty": 0.5, "min_tokens": 3}, ["presence_penalty", "min_tokens"]),
        ({"logit_bias": {"7": 5}, "bad_words": []}, ["logit_bias"]),
    ],
)
def test_narrowing_names_every_field_that_changes_the_distribution_beyond_temperature(
    body: dict[str, Any], narrowed: list[str]
) -> None:
    assert narrowing(body) == narrowed


def test_processed_logprobs_are_at_the_sampling_temperature_and_raw_ones_at_one() -> None:
    processed = _record({"temperature": 0.6})
    raw = _record({"temperature": 0.6}, "raw_logprobs")
    greedy = _record({"temperature": 0})
    assert processed["logprobs_temperature"] == 0.6 and sampling_flags(processed) == []
    # Raw logprobs of a row sampled at 0.6 are not of its distribution: kept out of training.
    assert raw["logprobs_temperature"] == 1.0
    assert sampling_flags(raw) == ["raw_logprobs"]
    # vLLM keeps a greedy row's logprobs at temperature 1; greedy is a narrowed distribution.
    assert greedy["logprobs_temperature"] == 1.0 and sampling_flags(greedy) == ["narrowed"]


def test_override_resets_narrowing_fields_and_records_what_the_client_sent() -> None:
    body = {"temperature": 0.6, "top_p": 0.8, "top_k": 20, "logit_bias": {"5": 1}}
    prepared, replaced = apply_policy(CHAT, _prepared(body), "override", {}, "auto")
    assert replaced == {"top_p": 0.8, "top_k": 20, "logit_bias": {"5": 1}}
    assert prepared.upstream_body == {"temperature": 0.6, "top_p": 1.0, "top_k": 0}
    assert narrowing(prepared.upstream_body) == []


def test_enforce_makes_the_channel_defaults_win_over_the_client() -> None:
    body = {"temperature": 0.3, "max_tokens": 5}
    prepared, replaced = apply_policy(
        CHAT, _prepared(body), "enforce", {"temperature": 1.0}, "auto"
    )
    assert prepared.upstream_body == {"temperature": 1.0, "max_tokens": 5}
    assert replaced == {"temperature": 0.3}


def test_refuse_answers_400_naming_the_first_narrowing_field() -> None:
    with pytest.raises(InvalidRequestError) as raised:
        apply_policy(CHAT, _prepared({"temperature": 0.6, "min_p": 0.1}), "refuse", {}, "auto")
    assert raised.value.param == "min_p" and raised.value.code == "sampling_refused"
    untouched = _prepared({"temperature": 0.6})
    assert apply_policy(CHAT, untouched, "refuse", {}, "auto") == (untouched, {})


def test_a_channel_policy_falls_back_to_the_star_entry_then_flag() -> None:
    settings = GatewaySettings(sampling_policy={"*": "override", "eval": "flag"})
    assert settings.sampling_policy_for("eval") == "flag"
    assert settings.sampling_policy_for(None) == "override"
    assert GatewaySettings().sampling_policy_for("train") == "flag"
    with pytest.raises(ValueError, match="sampling_policy"):
        GatewaySettings(sampling_policy={"train": "ignore"})


@pytest.mark.parametrize(
    ("policy", "defaults", "refused"),
    [
        # Greedy defaults on a refusing channel: every call leaving temperature out refused.
        ({"eval": "refuse"}, {"eval": {"temperature": 0}}, "'eval'"),
        # Through the '*' entries: the default channel 'train' inherits both.
        ({"*": "refuse"}, {"*": {"top_p": 0.9}}, "'*'"),
        ({"*": "refuse"}, {"train": {"top_k": 20}}, "'train'"),
        # Neutral or temperature-only defaults, or another channel's: accepted.
        ({"eval": "refuse"}, {"eval": {"temperature": 0.7, "top_p": 1.0}}, None),
        ({"eval": "refuse"}, {"train": {"temperature": 0}}, None),
        ({"eval": "enforce"}, {"eval": {"temperature": 0}}, None),
    ],
)
def test_a_refusing_channel_whose_own_defaults_narrow_is_refused_at_start(
    policy: dict[str, Any], defaults: dict[str, Any], refused: str | None
) -> None:
    settings = GatewaySettings(sampling_policy=policy, sampling_defaults=defaults)
    if refused is None:
        check_defaults_against_policy(settings)
        return
    with pytest.raises(
        SamplingSettingsError, match=re.escape(f"channel {refused}: its sampling policy")
    ):
        check_defaults_against_policy(settings)


@pytest.mark.parametrize(
    ("body", "level", "expected"),
    [
        # vLLM makes a missing tool_choice 'auto' when tools are offered: a strict tool then
        # puts the answer under a structural tag (the OpenAI Agents SDK's default).
        ({"tools": [_tool("w", strict=True)]}, "auto", ["tools.strict"]),
        ({"tools": [_tool("w", strict="true")]}, "auto", ["tools.strict"]),
        ({"tools": [_tool("w", strict=False), _tool("v")]}, "auto", []),
        ({"tools": [_tool("w")], "tool_choice": "auto"}, "auto", []),
        # An explicit null stays null in vLLM (no grammar), as does 'none'.
        ({"tools": [_tool("w", strict=True)], "tool_choice": None}, "auto", []),
        ({"tools": [_tool("w", strict=True)], "tool_choice": "none"}, "auto", []),
        ({"tools": [], "tool_choice": "required"}, "auto", []),
        # One call at most: vLLM raises its level to 'function' to limit calls in the grammar.
        ({"tools": [_tool("w")], "parallel_tool_calls": False}, "auto", ["parallel_tool_calls"]),
        ({"tools": [_tool("w")]}, "function", ["tool_strict_level"]),
        ({"tools": [_tool("w")], "tool_choice": "required"}, "auto", ["tool_choice"]),
        (
            {"tools": [_tool("w")], "tool_choice": {"type": "function", "function": {"name": "w"}}},
            "auto",
            ["tool_choice"],
        ),
        (
            {"tools": [_tool("w", strict=True)], "response_format": {"type": "json_object"}},
            "auto",
            ["tools.strict", "response_format"],
        ),
        ({"response_format": {"type": "text"}}, "auto", []),
        ({"guided_regex": "a+"}, "auto", ["guided_regex"]),
    ],
)
def test_constrained_by_names_what_puts_a_call_under_a_grammar_in_vllm(
    body: dict[str, Any], level: str, expected: list[str]
) -> None:
    assert constrained_by(body, level) == expected


def test_a_call_under_a_grammar_records_why_and_is_flagged_constrained() -> None:
    record = _record({"temperature": 1.0, "tools": [_tool("w", strict=True)]})
    assert record["constrained_by"] == ["tools.strict"]
    assert sampling_flags(record) == ["constrained"]
    free = _record({"temperature": 1.0, "tools": [_tool("w")]})
    assert free["constrained_by"] == [] and sampling_flags(free) == []


@pytest.mark.parametrize(
    ("dialect", "client_body"),
    [
        (
            CHAT,
            {
                "model": "m",
                "messages": [{"role": "user", "content": "q"}],
                "tools": [_tool("w", strict=True)],
            },
        ),
        (
            RESPONSES,
            {
                "model": "m",
                "input": "q",
                "tools": [{"type": "function", "name": "w", "parameters": SCHEMA, "strict": True}],
            },
        ),
        (
            MESSAGES,
            {
                "model": "m",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "q"}],
                "tools": [{"name": "w", "input_schema": SCHEMA, "strict": True}],
            },
        ),
    ],
    ids=["chat", "responses", "messages"],
)
def test_every_dialect_sends_strict_tools_that_override_strips_and_refuse_refuses(
    dialect: Any, client_body: dict[str, Any]
) -> None:
    prepared = dialect.prepare(client_body)
    assert constrained_by(prepared.upstream_body, "auto") == ["tools.strict"]
    stripped, replaced = apply_policy(dialect, prepared, "override", {}, "auto")
    assert replaced == {"tools.strict": {"w": True}}
    (tool,) = stripped.upstream_body["tools"]
    assert tool["function"]["name"] == "w" and "strict" not in tool["function"]
    assert constrained_by(stripped.upstream_body, "auto") == []
    with pytest.raises(InvalidRequestError) as raised:
        apply_policy(dialect, prepared, "refuse", {}, "auto")
    assert raised.value.param == "tools" and raised.value.code == "sampling_refused"
    assert "strict tools (w)" in str(raised.value)


def test_override_keeps_strict_where_something_else_puts_calls_under_a_grammar() -> None:
    # A forced call is under the call's grammar anyway; strict keeps its arguments valid.
    forced = _prepared({"tools": [_tool("w", strict=True)], "tool_choice": "required"})
    assert apply_policy(CHAT, forced, "override", {}, "auto") == (forced, {})
    assert apply_policy(CHAT, forced, "refuse", {}, "auto") == (forced, {})
    # At the server's 'function' level every tool call is, strict or not.
    free = _prepared({"tools": [_tool("w", strict=True)]})
    assert apply_policy(CHAT, free, "override", {}, "function") == (free, {})
