"""The Responses and Messages dialects through the real gateway: what each call stores, how
turns chain, previous_response_id, count_tokens, key attribution, sampling defaults and bad
input. Against the real vLLM (``TRAJGATE_TEST_VLLM_PORT`` reuses a running one),
except where a test says why it needs a fake upstream."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_helpers import chat_response, gateway_with, sse_body, sse_payloads, steps_of
from sqlalchemy import select
from tests_support import free_port

from datapool.db import make_engine
from datapool.models import Step
from datapool.settings import PoolSettings
from datapool.steps.records import CallRecord, ChoiceRecord
from datapool.steps.store import PoolStore, StoredStep
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings
from trajgate.vllm_server import VLLMServer

CAPTURE = {"return_token_ids": True, "logprobs": True}


@pytest.fixture
def gw(vllm: VLLMServer, sqlite_pool: PoolSettings) -> Iterator[BackgroundServer]:
    """Greedy unless a test's body says otherwise: the tiny model ends a sampled turn with
    probability ~0.003 per token, so a 6-token call may end early; greedy it never does, and the
    checks below expect every call to end at its token limit."""
    greedy = {"*": {"temperature": 0.0}}
    with gateway_with(
        sqlite_pool, free_port(), upstream_url=vllm.url, sampling_defaults=greedy
    ) as server:
        yield server


def _post(url: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(url, json=body, timeout=120, **kwargs)


def _rendered_prompt(vllm: VLLMServer, upstream: dict[str, Any]) -> list[int]:
    """vLLM's own tokenization of the chat body's rendered prompt."""
    body = {"model": upstream["model"], "messages": upstream["messages"]}
    body["add_generation_prompt"] = True
    if "tools" in upstream:
        body["tools"] = upstream["tools"]
    tokens: list[int] = _post(f"{vllm.url}/tokenize", body).json()["tokens"]
    return tokens


def _check_exact(vllm: VLLMServer, step: StoredStep, client_body: dict[str, Any]) -> None:
    """The step holds the client's body as sent, the chat body sent upstream, the prompt as
    vLLM tokenizes it (an exact continuation: the parent's ids, then the last ``suffix_tokens``
    of that rendering), one logprob per sampled id, and the answer in the common form."""
    assert step.request == client_body
    upstream = step.upstream_request
    assert upstream is not None and upstream["return_token_ids"] is True
    assert upstream["logprobs"] is True
    rendered = _rendered_prompt(vllm, upstream)
    if step.continuation == "exact":
        assert step.extends_parent is True and step.suffix_tokens
        assert step.prompt_token_ids[-step.suffix_tokens :] == rendered[-step.suffix_tokens :]
    else:
        assert step.prompt_token_ids == rendered
    assert step.response_token_ids is not None and step.response_logprobs is not None
    assert len(step.response_token_ids) == len(step.response_logprobs) == step.completion_tokens
    assert step.response_message is not None and "content" in step.response_message
    # max_tokens ended each call; a prefix break is the tokens' business, judged by lineage.
    assert step.finish_reason == "length"
    # The calls are greedy (the module's sampling defaults): a narrowed distribution.
    assert set(step.flags) - {"prefix_break"} == {"truncated", "narrowed"}


def _stored_bases(pool: PoolSettings, trajectory_id: str) -> list[int | None]:
    engine = make_engine(pool.resolved_database_url())
    try:
        with engine.connect() as connection:
            return list(
                connection.scalars(
                    select(Step.messages_base)
                    .where(Step.trajectory_id == trajectory_id)
                    .order_by(Step.step_index)
                )
            )
    finally:
        engine.dispose()


# ---- Messages ----------------------------------------------------------------------------------


def test_two_unary_messages_turns_store_exact_steps_and_the_second_is_a_delta_on_the_first(
    vllm: VLLMServer, gw: BackgroundServer, sqlite_pool: PoolSettings
) -> None:
    url = f"{gw.url}/t/msg-turns/v1/messages"
    first = {"model": "tiny", "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]}
    one = _post(url, first)
    assert one.status_code == 200, one.text
    answer = one.json()["content"]
    second = {
        "model": "tiny",
        "max_tokens": 6,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": answer},
            {
                "role": "user",
                "content": [{"type": "text", "text": "?", "cache_control": {"type": "ephemeral"}}],
            },
        ],
    }
    two = _post(url, second)
    assert two.status_code == 200, two.text
    steps = steps_of(sqlite_pool, "msg-turns")
    assert [s.endpoint for s in steps] == ["messages", "messages"]
    _check_exact(vllm, steps[0], first)
    _check_exact(vllm, steps[1], second)
    assert steps[1].response_message is not None
    assert steps[1].response_message["content"] == two.json()["content"][0]["text"]
    # Lineage ran on the tokens: the second step hangs on the first, extending it or not.
    assert steps[1].parent_step_id == steps[0].id and steps[1].extends_parent is not None
    # Stored: the first message is shared with the parent (b = 1); the Anthropic assistant
    # message differs from the stored common form, so it and what follows are stored.
    assert _stored_bases(sqlite_pool, "msg-turns") == [0, 1]


def test_a_streamed_messages_call_with_beta_true_is_recorded_like_a_unary_one(
    vllm: VLLMServer, gw: BackgroundServer, sqlite_pool: PoolSettings
) -> None:
    body = {
        "model": "tiny",
        "max_tokens": 5,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    response = _post(
        f"{gw.url}/v1/messages?beta=true", body, headers={"x-trajgate-trajectory": "msg-stream"}
    )
    assert response.status_code == 200
    events = [json.loads(p)["type"] for p in sse_payloads(response.text)]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    (step,) = steps_of(sqlite_pool, "msg-stream")
    _check_exact(vllm, step, body)
    assert step.upstream_request is not None
    assert step.upstream_request["stream_options"] == {"include_usage": True}


def test_count_tokens_answers_vllms_count_and_records_nothing(
    vllm: VLLMServer, gw: BackgroundServer, sqlite_pool: PoolSettings
) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "count me"}]}
    expected = _post(
        f"{vllm.url}/tokenize",
        {"model": "tiny", "messages": body["messages"], "add_generation_prompt": True},
    ).json()["count"]
    for url in (f"{gw.url}/v1/messages/count_tokens", f"{gw.url}/t/ct/v1/messages/count_tokens"):
        counted = _post(url, body)
        assert counted.status_code == 200 and counted.json() == {"input_tokens": expected}
    bad = _post(f"{gw.url}/t/ct/v1/messages/count_tokens", {"model": "tiny", "messages": "x"})
    assert bad.status_code == 400
    assert bad.json()["type"] == "error"
    assert bad.json()["error"]["type"] == "invalid_request_error"
    assert steps_of(sqlite_pool, "ct") == []


# ---- Responses ---------------------------------------------------------------------------------


def test_responses_input_lists_chain_as_deltas_and_previous_response_id_reads_the_pool(
    vllm: VLLMServer, gw: BackgroundServer, sqlite_pool: PoolSettings
) -> None:
    url = f"{gw.url}/t/resp-turns/v1/responses"
    user = {"role": "user", "content": "hi"}
    first = {"model": "tiny", "input": [user], "max_output_tokens": 6}
    one = _post(url, first)
    assert one.status_code == 200, one.text
    # The response id names the step: resp_<step id as hex>.
    assert one.json()["id"] == "resp_" + one.headers["x-trajgate-step-id"].replace("-", "")
    second = {
        "model": "tiny",
        "input": [user, *one.json()["output"], {"role": "user", "content": "more"}],
        "max_output_tokens": 6,
    }
    two = _post(url, second)
    assert two.status_code == 200, two.text
    third = {
        "model": "tiny",
        "previous_response_id": two.json()["id"],
        "input": "last one",
        "max_output_tokens": 6,
    }
    three = _post(url, third)
    assert three.status_code == 200, three.text
    steps = steps_of(sqlite_pool, "resp-turns")
    for step, body in zip(steps, (first, second, third), strict=True):
        _check_exact(vllm, step, body)
    # Call 3's prompt is call 2's conversation, its answer, then the new input.
    upstream_2, upstream_3 = steps[1].upstream_request, steps[2].upstream_request
    assert upstream_2 is not None and upstream_3 is not None and steps[1].response_message
    assert upstream_3["messages"] == [
        *upstream_2["messages"],
        {"role": "assistant", "content": steps[1].response_message["content"]},
        {"role": "user", "content": "last one"},
    ]
    # b = 1 for call 2 (the user item is shared); an input string is no list: stored whole.
    assert _stored_bases(sqlite_pool, "resp-turns") == [0, 1, None]
    assert all(s.parent_step_id == steps[i].id for i, s in enumerate(steps[1:]))


@pytest.mark.parametrize(
    "previous",
    ["resp_" + "0" * 32, "resp_not-hex", "chatcmpl-123"],
    ids=["unknown", "malformed", "foreign"],
)
def test_an_unknown_previous_response_id_is_400_and_nothing_is_recorded(
    gw: BackgroundServer, sqlite_pool: PoolSettings, previous: str
) -> None:
    body = {"model": "tiny", "input": "x", "previous_response_id": previous}
    refused = _post(f"{gw.url}/t/resp-unknown/v1/responses", body)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "previous_response_not_found"
    assert refused.json()["error"]["param"] == "previous_response_id"
    assert steps_of(sqlite_pool, "resp-unknown") == []


def test_previous_response_id_of_another_trajectory_is_not_found(
    gw: BackgroundServer, sqlite_pool: PoolSettings
) -> None:
    one = _post(
        f"{gw.url}/t/resp-a/v1/responses", {"model": "tiny", "input": "x", "max_output_tokens": 4}
    )
    assert one.status_code == 200
    body = {"model": "tiny", "input": "y", "previous_response_id": one.json()["id"]}
    other = _post(f"{gw.url}/t/resp-b/v1/responses", body)
    assert other.status_code == 400
    assert other.json()["error"]["code"] == "previous_response_not_found"
    assert steps_of(sqlite_pool, "resp-b") == []


def test_a_store_false_response_is_not_found_as_previous_response_before_vllm_is_asked(
    sqlite_pool: PoolSettings,
) -> None:
    """OpenAI keeps no ``store: false`` response, so chaining one is its 400 "Previous response
    with id '...' not found."; the gateway captured the call for training but refuses the chain
    the same way, before the upstream is asked and before anything is recorded. A fake
    upstream, because only it can tell that no request arrived."""
    posts: list[str] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        if request.method != "POST":  # the start-up probes
            return httpx.Response(200, json={"object": "list", "data": []})
        posts.append(request.url.path)
        return httpx.Response(200, json=chat_response([7, 8], [-0.5, -0.25], completion_tokens=2))

    url_of = "{}/t/resp-unstored/v1/responses".format
    with gateway_with(sqlite_pool, free_port(), transport=httpx.MockTransport(upstream)) as server:
        unstored = _post(url_of(server.url), {"model": "tiny", "input": "x", "store": False})
        stored = _post(url_of(server.url), {"model": "tiny", "input": "y"})
        assert unstored.status_code == stored.status_code == 200, (unstored.text, stored.text)
        assert unstored.json()["store"] is False and stored.json()["store"] is True
        asked = list(posts)  # the two calls and the start-up's exact-continuation probes
        for stream in (False, True):
            body = {"model": "tiny", "input": "z", "stream": stream}
            refused = _post(
                url_of(server.url), {**body, "previous_response_id": unstored.json()["id"]}
            )
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"] == {
                "message": f"Previous response with id '{unstored.json()['id']}' not found. (it "
                "was created with store: false, so it cannot be continued; send its "
                "conversation as input instead)",
                "type": "invalid_request_error",
                "param": "previous_response_id",
                "code": "previous_response_not_found",
            }
        assert posts == asked and len(steps_of(sqlite_pool, "resp-unstored")) == 2
        # A stored one (store left out: OpenAI's default is true) still continues.
        chained = {"model": "tiny", "input": "z", "previous_response_id": stored.json()["id"]}
        assert _post(url_of(server.url), chained).status_code == 200
    assert len(posts) > len(asked)


# ---- attribution -------------------------------------------------------------------------------


def test_a_key_bound_to_a_trajectory_works_from_x_api_key_and_from_bearer(
    vllm: VLLMServer, sqlite_pool: PoolSettings
) -> None:
    messages = {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "a"}]}
    responses = {"model": "tiny", "input": "a", "max_output_tokens": 3}
    with gateway_with(
        sqlite_pool,
        free_port(),
        upstream_url=vllm.url,
        admin_token="s3cret",
        require_api_key=True,
    ) as server:
        issued = _post(
            f"{server.url}/admin/api-keys",
            {"name": "claude", "trajectory_id": "keyed"},
            headers={"Authorization": "Bearer s3cret"},
        ).json()
        by_x_api_key = _post(
            f"{server.url}/v1/messages", messages, headers={"x-api-key": issued["key"]}
        )
        assert by_x_api_key.status_code == 200
        assert by_x_api_key.headers["x-trajgate-trajectory-id"] == "keyed"
        bearer = {"Authorization": f"Bearer {issued['key']}"}
        by_bearer = _post(f"{server.url}/v1/responses", responses, headers=bearer)
        assert by_bearer.headers["x-trajgate-trajectory-id"] == "keyed"
        wrong = _post(f"{server.url}/v1/messages", messages, headers={"x-api-key": "dummy"})
        assert wrong.status_code == 401 and wrong.json()["type"] == "error"
        assert wrong.json()["error"]["type"] == "authentication_error"
        elsewhere = _post(
            f"{server.url}/t/other/v1/messages", messages, headers={"x-api-key": issued["key"]}
        )
        assert elsewhere.status_code == 403
    assert [s.endpoint for s in steps_of(sqlite_pool, "keyed")] == ["messages", "responses"]
    assert steps_of(sqlite_pool, "other") == []


# ---- sampling defaults -------------------------------------------------------------------------


def test_sampling_defaults_fill_only_what_the_client_omitted_per_channel(
    vllm: VLLMServer, sqlite_pool: PoolSettings
) -> None:
    defaults = {"*": {"max_tokens": 4, "temperature": 0.0}, "eval": {"top_k": 1}}
    with gateway_with(
        sqlite_pool, free_port(), upstream_url=vllm.url, sampling_defaults=defaults
    ) as server:
        # Codex-like: no temperature, no token limit.
        codex = {"model": "tiny", "input": "go"}
        assert _post(f"{server.url}/t/sd-train/v1/responses", codex).status_code == 200
        claude = {
            "model": "tiny",
            "max_tokens": 3,
            "temperature": 0.5,
            "messages": [{"role": "user", "content": "go"}],
        }
        eval_header = {"x-trajgate-channel": "eval"}
        sent = _post(f"{server.url}/t/sd-eval/v1/messages", claude, headers=eval_header)
        assert sent.status_code == 200
    (train,) = steps_of(sqlite_pool, "sd-train")
    assert train.upstream_request is not None
    assert train.upstream_request["max_tokens"] == 4
    assert train.upstream_request["temperature"] == 0.0
    assert train.completion_tokens == 4 and "top_k" not in train.upstream_request
    (evaluated,) = steps_of(sqlite_pool, "sd-eval")
    assert evaluated.upstream_request is not None
    # The client's max_tokens 3 and temperature 0.5 stay; the eval channel adds top_k 1.
    assert evaluated.upstream_request["max_tokens"] == 3
    assert evaluated.upstream_request["temperature"] == 0.5
    assert evaluated.upstream_request["top_k"] == 1 and evaluated.completion_tokens == 3


@pytest.mark.parametrize(
    ("defaults", "message"),
    [
        ({"*": {"temperature": -0.5}}, "temperature must be >= 0"),
        ({"*": {"top_p": 0}}, "top_p must be > 0 and <= 1"),
        ({"*": {"max_tokens": 1.5}}, "max_tokens must be an integer"),
        ({"*": {"max_tokens": True}}, "max_tokens must be an integer"),
        ({"*": {"logprobs": 5}}, "unknown sampling field 'logprobs'"),
        ({"bad channel": {}}, "channel 'bad channel' must be"),
    ],
)
def test_sampling_defaults_vllm_would_refuse_are_refused_at_start(
    defaults: dict[str, dict[str, Any]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        GatewaySettings(sampling_defaults=defaults)


# ---- bad input ---------------------------------------------------------------------------------

BAD_MESSAGES = [
    {"model": "tiny", "max_tokens": 5, "messages": "hi"},
    {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "x"}]}]},
    {"model": "tiny", "max_tokens": "5", "messages": [{"role": "user", "content": "hi"}]},
    {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    {"model": "tiny", "max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]},
    # Out of Anthropic's bounds (these once reached vLLM).
    *(
        {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **bad}
        for bad in (
            {"metadata": 5},
            {"metadata": {"user_id": 5}},
            {"top_k": -5},
            {"temperature": 1.5},
            {"top_p": -0.1},
            {"service_tier": "fastest"},
        )
    ),
]
BAD_RESPONSES = [
    {"model": "tiny", "input": 5},
    {"model": "tiny", "input": [{"type": "no_such_item"}]},
    {"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_nope"}]}]},
    {"model": "tiny", "input": "hi", "max_output_tokens": "7"},
    {"model": "tiny", "input": "hi", "tools": [{"type": "function"}]},
    # Out of the Responses API's bounds (these once reached vLLM).
    {"model": "tiny", "input": []},
    *(
        {"model": "tiny", "input": "hi", **bad}
        for bad in (
            {"max_output_tokens": -1},
            {"truncation": 5},
            {"temperature": 3},
            {"top_p": 1.5},
            {"top_logprobs": -1},
            {"max_tool_calls": 0},
            {"service_tier": "fastest"},
            {"metadata": {"k": 5}},
            {"prompt_cache_retention": "forever"},
            {"stream_options": {"include_usage": True}},
        )
    ),
]


@pytest.mark.parametrize("body", BAD_MESSAGES, ids=lambda b: json.dumps(b)[:60])
def test_bad_messages_input_is_400_in_anthropics_envelope_and_not_recorded(
    gw: BackgroundServer, sqlite_pool: PoolSettings, body: dict[str, Any]
) -> None:
    refused = _post(f"{gw.url}/t/bad-msg/v1/messages", body)
    assert refused.status_code == 400, refused.text
    assert refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert steps_of(sqlite_pool, "bad-msg") == []


@pytest.mark.parametrize("body", BAD_RESPONSES, ids=lambda b: json.dumps(b)[:60])
def test_bad_responses_input_is_400_in_openais_envelope_and_not_recorded(
    gw: BackgroundServer, sqlite_pool: PoolSettings, body: dict[str, Any]
) -> None:
    refused = _post(f"{gw.url}/t/bad-resp/v1/responses", body)
    assert refused.status_code == 400, refused.text
    assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
    assert steps_of(sqlite_pool, "bad-resp") == []


def test_bad_input_in_either_dialect_never_reaches_the_upstream(sqlite_pool: PoolSettings) -> None:
    """A fake upstream here, because only it can tell that no request arrived."""
    seen: list[tuple[str, str]] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path))
        return httpx.Response(500)

    with gateway_with(sqlite_pool, free_port(), transport=httpx.MockTransport(upstream)) as server:
        for body in BAD_MESSAGES:
            assert _post(f"{server.url}/t/bad/v1/messages", body).status_code == 400
        for body in BAD_RESPONSES:
            assert _post(f"{server.url}/t/bad/v1/responses", body).status_code == 400
    # The start-up probes (GET /health, GET /v1/models) carry no client input; a call that
    # reached the upstream would be a POST.
    assert [call for call in seen if call[0] != "GET"] == []


# ---- request storage round trips ---------------------------------------------------------------


def _call(request: dict[str, Any], prompt: list[int], answer: dict[str, Any]) -> CallRecord:
    upstream = {"model": "tiny", "messages": [{"role": "user", "content": "rendered"}], **CAPTURE}
    return CallRecord(
        request=request,
        upstream_request=upstream,
        model="tiny",
        upstream="http://up",
        policy_version=0,
        latency_ms=1.0,
        prompt_token_ids=prompt,
        prompt_tokens=len(prompt),
        choices=[ChoiceRecord(0, [7, 8], [-0.5, -0.25], answer, "stop")],
        # As the dialect names it: the Responses API's ``input``, else ``messages``.
        history_field="input" if "input" in request else "messages",
    )


ANSWER = {"role": "assistant", "content": "ok", "tool_calls": None, "reasoning": None}


def test_responses_items_and_messages_blocks_read_back_exactly_after_delta_storage(
    pool_settings: PoolSettings,
) -> None:
    """Each dialect's history list is cut to what the parent lacks and read back whole; a
    chat parent serves a Responses child too (the items are compared as JSON)."""
    store = PoolStore(make_engine(pool_settings.resolved_database_url()), pool_settings)
    user = {"role": "user", "content": "hi"}
    call_item = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "42"}
    blocks = {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}
    tool_use = {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1.0}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text"}]}
    requests = [
        {"model": "tiny", "messages": [user]},  # chat
        {"model": "tiny", "input": [user, call_item, output]},  # b = 1 on the chat parent
        {"model": "tiny", "input": [user, call_item, output, call_item]},  # b = 3
        {"model": "tiny", "input": "a string is stored whole"},  # b = NULL
        {"model": "tiny", "max_tokens": 3, "messages": [blocks]},  # b = 0: blocks differ
        {
            "model": "tiny",
            "max_tokens": 3,
            "messages": [blocks, {"role": "assistant", "content": [tool_use]}],
        },  # b = 1
        {
            "model": "tiny",
            "max_tokens": 3,
            "messages": [
                blocks,
                {"role": "assistant", "content": [tool_use]},
                {"role": "user", "content": [result]},
            ],
        },  # b = 2
    ]
    prompt: list[int] = []
    for number, request in enumerate(requests):
        prompt = [*prompt, 7, 8, 100 + number]  # each prompt extends the previous sequence
        store.record_call("round-trip", _call(json.loads(json.dumps(request)), prompt, ANSWER))
    steps = store.steps_of("round-trip")
    assert [json.dumps(s.request) for s in steps] == [json.dumps(r) for r in requests]
    assert [s.extends_parent for s in steps] == [None, True, True, True, True, True, True]
    assert _stored_bases(pool_settings, "round-trip") == [0, 1, 3, None, 0, 1, 2]
    # A fresh store (no memory of the chain) reads the same back from the rows alone.
    fresh = PoolStore(make_engine(pool_settings.resolved_database_url()), pool_settings)
    assert [json.dumps(s.request) for s in fresh.steps_of("round-trip")] == [
        json.dumps(r) for r in requests
    ]


def test_trajectory_export_carries_the_chat_messages_the_engine_saw_for_every_dialect(
    gw: BackgroundServer, sqlite_pool: PoolSettings, tmp_path: Path
) -> None:
    """A Responses or Messages request has no chat ``messages``; the export's messages are the
    translated chat history the engine rendered (the stored upstream body's), as for chat."""
    calls = {
        "export-chat": ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        "export-resp": ("responses", {"instructions": "be brief", "input": "hi"}),
        "export-msg": (
            "messages",
            {"system": "be brief", "messages": [{"role": "user", "content": "hi"}]},
        ),
    }
    for trajectory_id, (path, body) in calls.items():
        limit = "max_output_tokens" if path == "responses" else "max_tokens"
        answer = _post(f"{gw.url}/t/{trajectory_id}/v1/{path}", {"model": "tiny", limit: 4, **body})
        assert answer.status_code == 200, answer.text
    from datapool.queries.export import export_trajectories

    engine = make_engine(sqlite_pool.resolved_database_url())
    out = tmp_path / "steps.jsonl"
    try:
        written = export_trajectories(PoolStore(engine, sqlite_pool), list(calls), out, "jsonl")
    finally:
        engine.dispose()
    assert written == 3
    exported = {row["trajectory_id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert json.loads(exported["export-chat"]["messages_json"]) == [
        {"role": "user", "content": "hi"}
    ]
    # instructions / system become the leading system message of the chat body sent upstream.
    for trajectory_id in ("export-resp", "export-msg"):
        messages = json.loads(exported[trajectory_id]["messages_json"])
        assert messages[0] == {"role": "system", "content": "be brief"}
        assert messages[1:] == [{"role": "user", "content": "hi"}]


def test_each_resent_responses_answer_has_its_own_id_and_a_chain_continues_from_that_answer(
    sqlite_pool: PoolSettings,
) -> None:
    """A re-send (the same body again: flagged ``resend``, the earlier call's ``call_id``) is
    another sample: its response id must differ from the first answer's, and chaining from the
    first answer must give the engine the first answer's text, not the latest sample of the
    call. Unary and streamed alike; an id of the older form (``resp_<call id>``) still reads
    the call's latest answer. A fake upstream, because only it answers every sample with a
    different text (sampled at temperature 1, the tiny model may well repeat itself)."""
    chat_bodies: list[dict[str, Any]] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        if request.method != "POST":  # the start-up probes
            return httpx.Response(200, json={"object": "list", "data": []})
        body = json.loads(request.content)
        chat_bodies.append(body)
        text = f"sample-{len(chat_bodies)}"
        answer = chat_response([7, 8], [-0.5, -0.25], completion_tokens=2, content=text)
        if not body.get("stream"):
            return httpx.Response(200, json=answer)
        choice = answer["choices"][0]
        delta = {"role": "assistant", "content": text}
        chunk = {
            **{k: answer[k] for k in ("id", "created", "model")},
            "object": "chat.completion.chunk",
            "choices": [{**choice, "delta": delta, "message": None}],
        }
        usage = {**chunk, "choices": [], "usage": answer["usage"]}
        first = {**chunk, "prompt_token_ids": answer["prompt_token_ids"]}
        content = sse_body([first, usage])
        return httpx.Response(200, content=content, headers={"content-type": "text/event-stream"})

    def answered(response: httpx.Response) -> tuple[str, str]:
        """(id, output text) of a unary or streamed Responses answer."""
        if response.headers["content-type"].startswith("application/json"):
            final = response.json()
        else:
            events = [json.loads(p) for p in sse_payloads(response.text) if p.startswith("{")]
            [final] = [e["response"] for e in events if e["type"] == "response.completed"]
        return final["id"], final["output"][0]["content"][0]["text"]

    with gateway_with(sqlite_pool, free_port(), transport=httpx.MockTransport(upstream)) as gw:
        for stream in (False, True):
            url = f"{gw.url}/t/resp-resent-{stream}/v1/responses"
            body = {"model": "tiny", "input": "hi", "temperature": 1.0, "stream": stream}
            one, two = _post(url, body), _post(url, body)
            assert one.status_code == two.status_code == 200, (one.text, two.text)
            assert one.headers["x-trajgate-call-id"] == two.headers["x-trajgate-call-id"]
            (id_one, text_one), (id_two, text_two) = answered(one), answered(two)
            assert text_one != text_two and id_one != id_two
            # Each id names its own step: resp_<step id as hex>.
            for response, response_id in ((one, id_one), (two, id_two)):
                assert response_id == "resp_" + response.headers["x-trajgate-step-id"].replace(
                    "-", ""
                )

            chained = _post(url, {"model": "tiny", "input": "on", "previous_response_id": id_one})
            assert chained.status_code == 200, chained.text
            assert chat_bodies[-1]["messages"] == [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": text_one},
                {"role": "user", "content": "on"},
            ]
            # An id handed out before ids named steps (resp_<call id>): the call's latest answer.
            older = "resp_" + one.headers["x-trajgate-call-id"].replace("-", "")
            again = _post(url, {"model": "tiny", "input": "on!", "previous_response_id": older})
            assert again.status_code == 200, again.text
            assert chat_bodies[-1]["messages"][1] == {"role": "assistant", "content": text_two}
            flags = [step.flags for step in steps_of(sqlite_pool, f"resp-resent-{stream}")]
            assert ["resend" in f for f in flags] == [False, True, False, False]
