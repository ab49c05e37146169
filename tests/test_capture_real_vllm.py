"""The walking skeleton's promise, against the real vLLM: a call made with the official
``openai`` client through the gateway is answered as vLLM answers it, and the pool holds the
exact prompt IDs, sampled IDs and behaviour logprobs vLLM reported."""

from __future__ import annotations

from typing import Any

import httpx
from gateway_helpers import gateway_with
from openai import OpenAI
from sqlalchemy import func, select
from tests_support import free_port

from datapool.db import make_engine
from datapool.models import Step
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore
from gateway.server import BackgroundServer
from trajgate.vllm_server import VLLMServer

REQUEST: dict[str, Any] = {
    "model": "tiny",
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 3?"},
    ],
    "max_tokens": 12,
    "temperature": 0,
    "seed": 7,
}

VOLATILE = {"id", "created"}


def _without_volatile(response: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in response.items() if key not in VOLATILE}


def _store(pool_settings: PoolSettings) -> PoolStore:
    return PoolStore(make_engine(pool_settings.resolved_database_url()))


def test_openai_client_call_stores_the_engines_exact_ids_and_logprobs(
    vllm: VLLMServer, gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    client = OpenAI(base_url=f"{gateway.url}/t/skeleton-1/v1", api_key="unused")
    raw = client.chat.completions.with_raw_response.create(**REQUEST)
    completion = raw.parse()
    step_id = raw.headers["x-trajgate-step-id"]

    direct = httpx.post(
        f"{vllm.url}/v1/chat/completions",
        json={**REQUEST, "return_token_ids": True, "logprobs": True},
        timeout=120,
    ).json()
    direct_ids = direct["choices"][0]["token_ids"]
    direct_logprobs = [entry["logprob"] for entry in direct["choices"][0]["logprobs"]["content"]]

    step = _store(pool_settings).get_step(step_id)
    assert step is not None
    assert step.trajectory_id == "skeleton-1"
    assert step.prompt_token_ids == direct["prompt_token_ids"]
    assert step.response_token_ids == direct_ids
    assert step.response_logprobs == direct_logprobs
    assert len(step.response_token_ids) == len(step.response_logprobs) == 12  # max_tokens
    assert step.completion_tokens == completion.usage.completion_tokens == 12  # type: ignore[union-attr]
    assert step.finish_reason == completion.choices[0].finish_reason == "length"
    assert step.response_message is not None
    assert step.response_message["content"] == completion.choices[0].message.content
    assert step.request == REQUEST
    assert step.upstream_request == {**REQUEST, "return_token_ids": True, "logprobs": True}
    assert step.latency_ms > 0
    assert step.policy_version == 0
    assert step.flags == ["truncated", "narrowed"]  # greedy: a narrowed distribution


def test_client_receives_what_vllm_returns_without_fields_it_did_not_ask_for(
    vllm: VLLMServer, gateway: BackgroundServer
) -> None:
    through_gateway = httpx.post(
        f"{gateway.url}/t/skeleton-2/v1/chat/completions", json=REQUEST, timeout=120
    )
    direct = httpx.post(f"{vllm.url}/v1/chat/completions", json=REQUEST, timeout=120)
    assert through_gateway.status_code == direct.status_code == 200
    gateway_json = through_gateway.json()
    assert gateway_json["prompt_token_ids"] is None
    assert gateway_json["choices"][0]["token_ids"] is None
    assert gateway_json["choices"][0]["logprobs"] is None
    assert _without_volatile(gateway_json) == _without_volatile(direct.json())
    assert list(gateway_json) == list(direct.json())  # same keys in the same order


def test_client_that_asks_for_logprobs_and_ids_gets_them_unchanged(
    vllm: VLLMServer, gateway: BackgroundServer
) -> None:
    asked = {**REQUEST, "logprobs": True, "top_logprobs": 2, "return_token_ids": True}
    through_gateway = httpx.post(
        f"{gateway.url}/t/skeleton-3/v1/chat/completions", json=asked, timeout=120
    ).json()
    direct = httpx.post(f"{vllm.url}/v1/chat/completions", json=asked, timeout=120).json()
    assert _without_volatile(through_gateway) == _without_volatile(direct)
    assert len(through_gateway["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2


def _two_turns(server: BackgroundServer, trajectory_id: str) -> None:
    client = OpenAI(base_url=f"{server.url}/t/{trajectory_id}/v1", api_key="unused")
    first = client.chat.completions.create(**REQUEST)
    history = [
        *REQUEST["messages"],
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And 3 + 4?"},
    ]
    client.chat.completions.create(**{**REQUEST, "messages": history})


def test_second_call_of_a_trajectory_is_numbered_and_linked_to_the_first(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    _two_turns(gateway, "skeleton-4")
    steps = _store(pool_settings).steps_of("skeleton-4")
    assert [step.step_index for step in steps] == [0, 1]
    assert steps[1].parent_step_id == steps[0].id
    # Exact continuation (the default): the second prompt is the first prompt + response, then
    # the template's rendering of the new user turn, whatever the text re-encodes to.
    first_sequence = [*steps[0].prompt_token_ids, *steps[0].response_token_ids]
    assert steps[1].continuation == "exact"
    assert steps[1].extends_parent is True and "prefix_break" not in steps[1].flags
    assert steps[1].prompt_token_ids[: len(first_sequence)] == first_sequence


def test_a_re_rendered_second_call_is_a_retokenised_break_in_template_mode(
    vllm: VLLMServer, pool_settings: PoolSettings
) -> None:
    with gateway_with(
        pool_settings, free_port(), upstream_url=vllm.url, continuation="template"
    ) as server:
        _two_turns(server, "skeleton-4t")
    steps = _store(pool_settings).steps_of("skeleton-4t")
    # The second prompt does NOT extend the first prompt + response (case C01, retokenisation):
    # the agent sends back only the text, and vLLM re-encodes it. The tiny model samples freely
    # from a vocabulary trained with GPT-2's pre-tokenizer (multi-digit tokens such as " 60"),
    # while the served Qwen2 tokenizer splits every number into single digits before encoding,
    # so a sampled number never comes back as the same IDs (measured: R_1 = ",", "Result",
    # " 60", "250", ...; P_2 continues ",", "Result", " ", "6", "0", ...). The system and user
    # turns render identically, so the break lies inside the echoed response, and the messages
    # match exactly, so it is classified as retokenised.
    first_sequence_length = len(steps[0].prompt_token_ids) + len(steps[0].response_token_ids)
    assert steps[1].continuation == "template"
    assert steps[1].extends_parent is False
    assert "prefix_break" in steps[1].flags
    assert steps[1].divergence_kind == "retokenised"
    assert steps[1].divergence_offset is not None
    assert len(steps[0].prompt_token_ids) <= steps[1].divergence_offset < first_sequence_length


def test_upstream_error_is_passed_through_and_recorded_as_a_failed_step(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    # above --max-model-len 131072, so vLLM answers 400; below the gateway's own bound
    # (TRAJGATE_MAX_OUTPUT_TOKENS, 262144), which would refuse it before vLLM is asked
    too_long = {**REQUEST, "max_tokens": 200_000}
    response = httpx.post(
        f"{gateway.url}/t/skeleton-5/v1/chat/completions", json=too_long, timeout=120
    )
    assert response.status_code == 400
    assert set(response.json()["error"]) >= {"message", "type", "code"}
    steps = _store(pool_settings).steps_of("skeleton-5")
    assert len(steps) == 1
    assert steps[0].outcome == "upstream_error"
    assert steps[0].response_token_ids is None
    assert steps[0].error is not None and "200000" in steps[0].error.replace(",", "")


def test_one_step_row_per_answered_call(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    client = OpenAI(base_url=f"{gateway.url}/t/skeleton-6/v1", api_key="unused")
    for _ in range(3):
        client.chat.completions.create(**REQUEST)
    engine = make_engine(pool_settings.resolved_database_url())
    with engine.connect() as conn:
        count = conn.execute(
            select(func.count()).select_from(Step).where(Step.trajectory_id == "skeleton-6")
        ).scalar_one()
    engine.dispose()
    assert count == 3
