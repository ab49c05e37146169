"""The effective sampling of a call, what narrows it, and the channel's sampling policy
(gateway.proxy.sampling), on upstream bodies written by hand; the real vLLM checks are in
test_sampling_logprobs.py."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.dialects import DIALECTS, Prepared
from gateway.dialects.base import ClientAsked
from gateway.errors import InvalidRequestError
from gateway.proxy.sampling import apply_policy, narrowing, sampling_flags, sampling_record
from gateway.settings import GatewaySettings

CHAT = next(d for d in DIALECTS if d.name == "chat.completions")


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
    processed = sampling_record({"temperature": 0.6}, "processed_logprobs", "flag", {})
    raw = sampling_record({"temperature": 0.6}, "raw_logprobs", "flag", {})
    greedy = sampling_record({"temperature": 0}, "processed_logprobs", "flag", {})
    assert processed["logprobs_temperature"] == 0.6 and sampling_flags(processed) == []
    # Raw logprobs of a row sampled at 0.6 are not of its distribution: kept out of training.
    assert raw["logprobs_temperature"] == 1.0 and sampling_flags(raw) == ["raw_logprobs"]
    # vLLM keeps a greedy row's logprobs at temperature 1; greedy is a narrowed distribution.
    assert greedy["logprobs_temperature"] == 1.0 and sampling_flags(greedy) == ["narrowed"]


def test_override_resets_narrowing_fields_and_records_what_the_client_sent() -> None:
    body = {"temperature": 0.6, "top_p": 0.8, "top_k": 20, "logit_bias": {"5": 1}}
    prepared, replaced = apply_policy(CHAT, _prepared(body), "override", {})
    assert replaced == {"top_p": 0.8, "top_k": 20, "logit_bias": {"5": 1}}
    assert prepared.upstream_body == {"temperature": 0.6, "top_p": 1.0, "top_k": 0}
    assert narrowing(prepared.upstream_body) == []


def test_enforce_makes_the_channel_defaults_win_over_the_client() -> None:
    body = {"temperature": 0.3, "max_tokens": 5}
    prepared, replaced = apply_policy(CHAT, _prepared(body), "enforce", {"temperature": 1.0})
    assert prepared.upstream_body == {"temperature": 1.0, "max_tokens": 5}
    assert replaced == {"temperature": 0.3}


def test_refuse_answers_400_naming_the_first_narrowing_field() -> None:
    with pytest.raises(InvalidRequestError) as raised:
        apply_policy(CHAT, _prepared({"temperature": 0.6, "min_p": 0.1}), "refuse", {})
    assert raised.value.param == "min_p" and raised.value.code == "sampling_refused"
    untouched = _prepared({"temperature": 0.6})
    assert apply_policy(CHAT, untouched, "refuse", {}) == (untouched, {})


def test_a_channel_policy_falls_back_to_the_star_entry_then_flag() -> None:
    settings = GatewaySettings(sampling_policy={"*": "override", "eval": "flag"})
    assert settings.sampling_policy_for("eval") == "flag"
    assert settings.sampling_policy_for(None) == "override"
    assert GatewaySettings().sampling_policy_for("train") == "flag"
    with pytest.raises(ValueError, match="sampling_policy"):
        GatewaySettings(sampling_policy={"train": "ignore"})
