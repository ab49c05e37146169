"""Exact continuation on the real vLLM: the suffix the gateway splices, the calls it
serves from a turn's own tokens, the fallbacks it records as breaks, and the proof that the
engine saw exactly the merged sequence the trainer scores.

The vLLM fixture starts the server with ``trajgate vllm start``'s flags (``--enable-scale-out``
among them). Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from gateway_helpers import (
    WEATHER_TOOL,
    assert_renders_ended,
    gateway_with,
    steps_of,
    wait_for_exact_probes,
)
from tests_support import free_port

from datapool.batches.build import build_rows
from datapool.batches.rows import StepTokens, segments
from datapool.batches.spec import BatchSpec
from datapool.db import make_engine
from datapool.lifecycle.transitions import close_trajectory
from datapool.models import TrajectoryStatus
from datapool.settings import PoolSettings
from datapool.steps.canonical import Message, as_rendered
from datapool.steps.payloads import pack_ids
from datapool.steps.store import PoolStore
from gateway.dialects.chat_completions.serving import canonical_of_chat
from gateway.engine.paths import RENDER_PATH
from gateway.proxy.continuation.history import (
    Turn,
    candidate_keys,
    echoes,
    find_extension,
    render_key,
    turn_key,
)
from gateway.proxy.continuation.prompt import exact_prompt
from gateway.server import BackgroundServer
from gateway.upstream.replicas import Replica, probe_exact
from trajgate import vllm_server


@pytest.fixture
def empty_database_url(tmp_path: Path) -> str:
    """SQLite only: the continuation is the gateway's; the pool's backends are tested apart."""
    return f"sqlite:///{tmp_path / 'pool.sqlite3'}"


MODEL = vllm_server.SERVED_MODEL_NAME
WEATHER = WEATHER_TOOL
FORCED = {"type": "function", "function": {"name": "get_weather"}}
SYSTEM = {"role": "system", "content": "Answer with the temperature as a number."}
USER = {"role": "user", "content": "What is the temperature in Paris?"}


def render(vllm: vllm_server.VLLMServer, messages: list[Any], **body: Any) -> list[int]:
    """The template's ids for ``messages`` (vLLM's render endpoint)."""
    answer = httpx.post(
        f"{vllm.url}{RENDER_PATH}",
        json={"model": MODEL, "messages": messages, **body},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    ids: list[int] = answer.json()["token_ids"]
    return ids


@pytest.fixture(scope="module")
def probed(vllm: vllm_server.VLLMServer) -> Replica:
    """The real vLLM as the gateway's probe finds it."""
    replica = Replica(vllm.url)

    async def probe() -> bool | None:
        async with httpx.AsyncClient() as client:
            return await probe_exact(client, replica, 60)

    import asyncio

    assert asyncio.run(probe()) is True
    return replica


@pytest.fixture(scope="module")
def end_token(probed: Replica) -> int:
    assert probed.end_token is not None
    return probed.end_token


def test_probe_finds_the_chat_endpoint_samples_from_forwarded_prompt_ids(probed: Replica) -> None:
    # vLLM 0.32's decode-side reuse (kv_transfer_params.prompt_token_ids): exact streams need it.
    assert probed.forwards_prompt_ids is True


def test_probe_finds_that_vllm_renders_the_tools_under_tool_choice_none(probed: Replica) -> None:
    # ``trajgate vllm start`` runs vLLM without --exclude-tools-when-tool-choice-none.
    assert probed.excludes_tools_for_none is False


def test_probe_finds_the_templates_end_of_turn_token(end_token: int, tiny_model_dir: Path) -> None:
    # The tiny model's template closes each turn with <|im_end|>, its eos (generation_config).
    config = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert end_token == config["eos_token_id"]


def tool_call(i: int, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }


def assistant_turn(
    vllm: vllm_server.VLLMServer, history: list[Any], message: dict[str, Any], end_token: int
) -> list[int]:
    """``R`` as the template renders ``message`` after ``history``: the tokens between the
    history's generation prompt and the message's end-of-turn token (included), as if the model
    had sampled exactly the template's text."""
    prompt = render(vllm, history, tools=[WEATHER], add_generation_prompt=True)
    closed = render(vllm, [*history, message], tools=[WEATHER], add_generation_prompt=False)
    assert closed[: len(prompt)] == prompt
    end = len(closed) - 1 - closed[::-1].index(end_token)
    return closed[len(prompt) : end + 1]


@pytest.mark.parametrize("tool_turns", [1, 2, 5])
def test_exact_prompt_equals_the_templates_rendering_over_tool_turns(
    vllm: vllm_server.VLLMServer, end_token: int, tool_turns: int
) -> None:
    # C03: when the model samples exactly what the template renders, the spliced prompt of
    # every turn is the template's full rendering token for token: the separator after each
    # end-of-turn token and the tool results come from the template's own rendering.
    history: list[Any] = [SYSTEM, USER]
    sequence = render(vllm, history, tools=[WEATHER], add_generation_prompt=True)
    for i in range(tool_turns):
        message = {"role": "assistant", "content": "", "tool_calls": [tool_call(i, '{"a": 1}')]}
        sequence = sequence + assistant_turn(vllm, history, message, end_token)
        history = [
            *history,
            message,
            {"role": "tool", "tool_call_id": f"call_{i}", "content": "21"},
        ]
        full = render(vllm, history, tools=[WEATHER], add_generation_prompt=True)
        built = exact_prompt(pack_ids(sequence), end_token, full)
        assert built is not None
        assert built.token_ids == full
        sequence = built.token_ids


@pytest.mark.parametrize(
    "new_messages",
    [
        [{"role": "user", "content": "And in Rome?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Rome?"}],
        [
            {"role": "tool", "tool_call_id": "call_0", "content": "21"},
            {"role": "tool", "tool_call_id": "call_1", "content": "22"},
        ],
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "too"}],
            }
        ],
    ],
    ids=["user", "system_mid_history", "two_tool_results", "content_parts"],
)
def test_exact_prompt_equals_the_templates_rendering_for_every_message_kind(
    vllm: vllm_server.VLLMServer, end_token: int, new_messages: list[Any]
) -> None:
    history: list[Any] = [SYSTEM, USER]
    message = {"role": "assistant", "content": "It is 21."}
    sequence = render(vllm, history, tools=[WEATHER], add_generation_prompt=True)
    sequence += assistant_turn(vllm, history, message, end_token)
    full = render(
        vllm, [*history, message, *new_messages], tools=[WEATHER], add_generation_prompt=True
    )
    built = exact_prompt(pack_ids(sequence), end_token, full)
    assert built is not None and built.token_ids == full
    # The suffix is everything after the response's end-of-turn token: len(full) - len(S).
    assert built.suffix_tokens == len(full) - len(sequence)


def test_exact_prompt_keeps_reasoning_the_thinking_template_strips(
    vllm: vllm_server.VLLMServer, end_token: int
) -> None:
    # The tiny model's template drops an earlier assistant turn's <think>...</think> once a
    # later user turn follows; exact continuation keeps the tokens the model sampled, so the
    # prompt differs from the template's exactly by that reasoning, and the suffix is still
    # the template's (what follows the turn's end token in its rendering).
    history: list[Any] = [SYSTEM, USER]
    message = {"role": "assistant", "content": "<think>\nhot\n</think>\n\nIt is 21."}
    sequence = render(vllm, history, tools=[WEATHER], add_generation_prompt=True)
    sequence += assistant_turn(vllm, history, message, end_token)
    # A tool result: no user turn after it, nothing stripped: the template agrees.
    tool_result = {"role": "tool", "tool_call_id": "call_0", "content": "21"}
    with_tool = render(
        vllm, [*history, message, tool_result], tools=[WEATHER], add_generation_prompt=True
    )
    built = exact_prompt(pack_ids(sequence), end_token, with_tool)
    assert built is not None and built.token_ids == with_tool
    # A user turn: the template strips the reasoning; the exact prompt keeps it.
    user = {"role": "user", "content": "And in Rome?"}
    stripped = render(vllm, [*history, message, user], tools=[WEATHER], add_generation_prompt=True)
    built = exact_prompt(pack_ids(sequence), end_token, stripped)
    assert built is not None
    assert built.token_ids[: len(sequence)] == sequence
    suffix = built.token_ids[len(sequence) :]
    assert stripped[-len(suffix) :] == suffix
    assert len(stripped) < len(built.token_ids)  # the template's version lost the reasoning


def canonical(*messages: dict[str, Any]) -> tuple[Message, ...]:
    """Chat messages as the chat dialect writes them into the canonical record."""
    found = canonical_of_chat({"messages": list(messages)}).messages
    assert found is not None
    return found


def test_a_client_echo_matches_despite_empty_fields_and_reserialised_arguments() -> None:
    [returned] = canonical(
        {"role": "assistant", "content": None, "tool_calls": [tool_call(0, '{"city":"Paris" }')]}
    )
    echoed = {
        "role": "assistant",
        "content": "",
        "refusal": None,
        "tool_calls": [tool_call(0, '{"city": "Paris"}')],
    }
    assert echoes(returned, *canonical(echoed))
    as_object = {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert echoes(returned, *canonical({**echoed, "tool_calls": [{"function": as_object}]}))
    rome = [tool_call(0, '{"city": "Rome"}')]
    assert not echoes(returned, *canonical({**echoed, "tool_calls": rome}))
    other_id = [tool_call(1, '{"city": "Paris"}')]
    assert not echoes(returned, *canonical({**echoed, "tool_calls": other_id}))
    [thought] = canonical({"role": "assistant", "content": "21", "reasoning": "hot"})
    older_name = {"role": "assistant", "content": "21", "reasoning_content": "hot"}
    assert echoes(thought, *canonical(older_name))
    assert not echoes(thought, *canonical({"role": "assistant", "content": "21"}))  # dropped


def test_find_extension_needs_the_same_history_an_echo_and_a_new_message() -> None:
    history = canonical(SYSTEM, USER)
    response = {"role": "assistant", "content": "21"}
    key = render_key({"model": MODEL, "tools": [WEATHER]})
    turn_id = turn_key(key, history, *canonical(response))
    assert turn_id is not None
    turn = Turn(turn_id, *canonical(response), pack_ids([1, 2, 3]))
    memory = {turn.key: turn}.get

    def extended(messages: tuple[Message, ...], body_key: str = key) -> int | None:
        found = find_extension(candidate_keys(body_key, messages), messages, memory)
        return None if found is None else found.new_from

    follow = {"role": "user", "content": "thanks"}
    assert extended(canonical(SYSTEM, USER, response, follow)) == 3
    assert extended(canonical(SYSTEM, USER, response)) == 3  # asked again, nothing new
    assert extended(canonical(SYSTEM, follow, response, follow)) is None  # rewritten
    other_tools = render_key({"model": MODEL, "tools": []})
    assert extended(canonical(SYSTEM, USER, response, follow), other_tools) is None


def test_a_message_sent_as_one_text_block_then_as_its_string_is_the_same_history() -> None:
    # Claude Code sends a message as one text block while it holds the cache breakpoint, as a
    # string once the breakpoint moved on: the same rendering, so the same history.
    block = {"role": "system", "content": [{"type": "text", "text": "# Environment"}]}
    response = {"role": "assistant", "content": "21"}
    key = render_key({"model": MODEL})
    turn_id = turn_key(key, canonical(SYSTEM, USER, block), *canonical(response))
    assert turn_id is not None
    turn = Turn(turn_id, *canonical(response), pack_ids([1, 2, 3]))
    follow = {"role": "user", "content": "thanks"}

    def extended(again: dict[str, Any]) -> int | None:
        messages = canonical(SYSTEM, USER, again, response, follow)
        found = find_extension(candidate_keys(key, messages), messages, {turn.key: turn}.get)
        return None if found is None else found.new_from

    assert extended({"role": "system", "content": "# Environment"}) == 4
    assert extended(block) == 4
    # Two parts render joined by the template's own rule: compared as sent, never guessed.
    two_parts = [{"type": "text", "text": "# Env"}, {"type": "text", "text": "ironment"}]
    assert extended({"role": "system", "content": two_parts}) is None
    assert extended({"role": "system", "content": "# Environment, changed"}) is None


def billing_line(cch: str) -> str:
    """Claude Code's attribution line as it sends it to a first-party base URL."""
    return f"x-anthropic-billing-header: cc_version=2.1.3.a1f; cc_entrypoint=cli; cch={cch};"


def test_claude_codes_billing_line_is_compared_as_vllm_renders_it() -> None:
    # vLLM drops the line (and a block holding nothing else) from system messages before it
    # renders, so a cch that changes on every call changes no prompt.
    response = {"role": "assistant", "content": "21"}
    key = render_key({"model": MODEL})

    def system(cch: str, *, own_block: bool) -> dict[str, Any]:
        if own_block:
            blocks = [{"type": "text", "text": billing_line(cch)}, {"type": "text", "text": "Hi"}]
            return {"role": "system", "content": blocks}
        return {"role": "system", "content": [{"type": "text", "text": f"{billing_line(cch)}\nHi"}]}

    for own_block in (False, True):
        first = system("a1b2c", own_block=own_block)
        turn_id = turn_key(key, canonical(first, USER), *canonical(response))
        assert turn_id is not None
        turn = Turn(turn_id, *canonical(response), pack_ids([1, 2, 3]))
        again = system("ffee0", own_block=own_block)
        messages = canonical(again, USER, response, {"role": "user", "content": "thanks"})
        found = find_extension(candidate_keys(key, messages), messages, {turn.key: turn}.get)
        assert found is not None and found.new_from == 3
    # The line only counts where vLLM strips it: first in a system message's text part.
    changed = canonical({"role": "system", "content": "Hi"}, USER, response)
    turn_id = turn_key(
        key, canonical({"role": "system", "content": "Hello"}, USER), *canonical(response)
    )
    assert turn_id is not None
    turn = Turn(turn_id, *canonical(response), pack_ids([1, 2, 3]))
    assert find_extension(candidate_keys(key, changed), changed, {turn.key: turn}.get) is None
    user_line = {"role": "user", "content": billing_line("a1b2c")}
    assert canonical(user_line)[0] == as_rendered(canonical(user_line)[0])


def test_a_messages_session_with_a_new_cch_every_call_continues_exactly(
    exact_gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    url = f"{exact_gateway.url}/t/billing/v1/messages"
    history: list[Any] = [{"role": "user", "content": USER["content"]}]
    for cch in ("0a1b2", "c3d4e", "f5a6b"):
        system = [
            {"type": "text", "text": billing_line(cch)},
            {"type": "text", "text": SYSTEM["content"]},
        ]
        body = {"model": MODEL, "system": system, "messages": history, "max_tokens": 4}
        answer = httpx.post(url, json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        history = [
            *history,
            {"role": "assistant", "content": answer.json()["content"]},
            {"role": "user", "content": "go on"},
        ]
    steps = steps_of(pool_settings, "billing")
    assert [s.continuation for s in steps] == ["template", "exact", "exact"]
    assert all(s.extends_parent and "prefix_break" not in s.flags for s in steps[1:])


@pytest.fixture
def exact_gateway(
    vllm: vllm_server.VLLMServer, pool_settings: PoolSettings
) -> Iterator[BackgroundServer]:
    with gateway_with(pool_settings, free_port(), upstream_url=vllm.url) as server:
        yield server


def chat(server: BackgroundServer, trajectory_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """One chat call through the gateway: the answer's message (streamed calls reassembled)."""
    url = f"{server.url}/t/{trajectory_id}/v1/chat/completions"
    if not body.get("stream"):
        answer = httpx.post(url, json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        message: dict[str, Any] = answer.json()["choices"][0]["message"]
        return message
    text, calls = [], {}
    with httpx.stream("POST", url, json=body, timeout=120) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                delta = choice.get("delta", {})
                text.append(delta.get("content") or "")
                for part in delta.get("tool_calls") or []:
                    slot = calls.setdefault(
                        part["index"],
                        {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                    )
                    slot["id"] = part.get("id") or slot["id"]
                    function = part.get("function") or {}
                    slot["function"]["name"] += function.get("name") or ""
                    slot["function"]["arguments"] += function.get("arguments") or ""
    streamed: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        streamed["tool_calls"] = [calls[i] for i in sorted(calls)]
    return streamed


def tool_loop(
    server: BackgroundServer, trajectory_id: str, turns: int, *, stream: bool
) -> list[Any]:
    """An agent's loop: a forced, grammar-constrained tool call per turn (sampled as plain
    characters where the template renders the <tool_call> special token: a formatting the
    template does not produce), its result, then an answer; returns the history sent last."""
    messages: list[Any] = [SYSTEM, USER]
    for _turn in range(turns):
        messages = forced_turn(server, trajectory_id, messages, stream=stream)
    chat(
        server,
        trajectory_id,
        {
            "model": MODEL,
            "messages": messages,
            "tools": [WEATHER],
            "max_tokens": 4,
            "stream": stream,
        },
    )
    return messages


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_exact_mode_tool_loop_is_one_token_sequence(
    exact_gateway: BackgroundServer, pool_settings: PoolSettings, stream: bool
) -> None:
    tool_loop(exact_gateway, "exact-loop", 3, stream=stream)
    steps = steps_of(pool_settings, "exact-loop")
    assert [s.continuation for s in steps] == ["template", "exact", "exact", "exact"]
    assert all(s.extends_parent for s in steps[1:])
    assert not any("prefix_break" in s.flags for s in steps)
    for parent, step in itertools.pairwise(steps):
        sequence = [*parent.prompt_token_ids, *parent.response_token_ids]
        # The grammar's tool call ends without the end token: the template's close is added.
        assert step.prompt_token_ids[: len(sequence)] == sequence
        assert step.suffix_tokens == len(step.prompt_token_ids) - len(sequence)
    # The pool API (the inspector's step view) says what built each prompt.
    shown = httpx.get(f"{exact_gateway.url}/api/steps/{steps[1].id}", timeout=30).json()
    assert (shown["continuation"], shown["suffix_tokens"]) == ("exact", steps[1].suffix_tokens)


def test_template_mode_breaks_where_exact_mode_does_not(
    vllm: vllm_server.VLLMServer, pool_settings: PoolSettings
) -> None:
    with gateway_with(
        pool_settings, free_port(), upstream_url=vllm.url, continuation="template"
    ) as server:
        tool_loop(server, "template-loop", 2, stream=False)
    steps = steps_of(pool_settings, "template-loop")
    assert {s.continuation for s in steps} == {"template"}
    assert all("prefix_break" in s.flags for s in steps[1:])  # 3 of 3 re-rendered


def test_compaction_falls_back_to_the_template_and_is_recorded_as_a_break(
    exact_gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    messages = tool_loop(exact_gateway, "compacted", 1, stream=False)
    # The agent compacts: its history is replaced by a summary (the tool turn dropped).
    summary = [SYSTEM, {"role": "user", "content": "Summary: Paris is 21. Answer now."}]
    assert len(messages) > len(summary)
    chat(exact_gateway, "compacted", {"model": MODEL, "messages": summary, "max_tokens": 4})
    steps = steps_of(pool_settings, "compacted")
    last = steps[-1]
    assert last.continuation == "template" and last.suffix_tokens is None
    # A summary that keeps only the system message is a conversation start: recorded as a new
    # root of the trajectory's tree (side_call), never spliced onto the chain.
    assert (last.parent_step_id, last.divergence_kind) == (None, "side_call")
    assert not last.extends_parent


def test_a_rewritten_tool_result_falls_back_and_an_unknown_model_is_refused_cleanly(
    exact_gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    messages = tool_loop(exact_gateway, "rewritten", 1, stream=False)
    rewritten = [*messages[:2], {**messages[2], "content": "changed"}, *messages[3:]]
    chat(exact_gateway, "rewritten", {"model": MODEL, "messages": rewritten, "max_tokens": 4})
    assert steps_of(pool_settings, "rewritten")[-1].continuation == "template"
    # A bad body on an extension: vLLM's render refuses it; the client gets its 4xx, a
    # failed step is recorded, nothing is sampled.
    answer = httpx.post(
        f"{exact_gateway.url}/t/rewritten/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [*messages, {"role": "user", "content": "x"}],
            "max_tokens": -1,
        },
        timeout=60,
    )
    assert 400 <= answer.status_code < 500, answer.text
    assert "error" in answer.json()


def test_merged_rows_of_an_exact_trajectory_are_one_row_the_trainer_scores_exactly(
    exact_gateway: BackgroundServer, pool_settings: PoolSettings, tiny_model_dir: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from trainer_bridge.logprobs import token_logprobs

    # Free sampling (a grammar's forced call reports the narrowed distribution's logprobs,
    # invariant 9: such steps are kept out of training by the demo's curation rule): three
    # user turns, each answer cut at 8 tokens and closed by the template's end token.
    messages: list[Any] = [SYSTEM, USER]
    for turn in range(4):
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": turn % 2 == 1}
        answer = chat(exact_gateway, "proof", {**body, "temperature": 1.0, "seed": turn})
        echo = {"role": "assistant", "content": answer["content"]}
        messages = [*messages, echo, {"role": "user", "content": f"And {turn}?"}]
    steps = steps_of(pool_settings, "proof")
    assert [s.continuation for s in steps] == ["template", "exact", "exact", "exact"]
    tokens = [
        StepTokens(
            s.row,
            np.asarray(s.prompt_token_ids, dtype=np.int64),
            np.asarray(s.response_token_ids, dtype=np.int64),
            np.asarray(s.response_logprobs, dtype=np.float32),
        )
        for s in steps
    ]
    merged, dropped = segments(tokens, "merged", None)
    per_step, _ = segments(tokens, "per_step", None)
    assert (len(merged), dropped, len(per_step)) == (1, 0, 4)
    # The merged row is the last step's P + R; loss mask 1 on each step's response.
    last = steps[-1]
    sequence = [*last.prompt_token_ids, *last.response_token_ids]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.tensor([sequence])
    with torch.no_grad():
        recomputed, _ = token_logprobs(model, ids, torch.ones_like(ids))
    for step in steps:
        start = len(step.prompt_token_ids)
        end = start + len(step.response_token_ids)
        assert sequence[start:end] == step.response_token_ids
        got = recomputed[0, start:end].numpy()
        assert np.abs(got - np.asarray(step.response_logprobs)).max() < 1e-5
    # The batch exports, as a trainer reads them: per_step is 4 rows (P_k + R_k each), merged
    # is one row, the last step's P + R, with loss mask 1 on each step's response and its
    # behaviour logprobs there, equal to the trainer's recompute within 1e-5.
    store = PoolStore(make_engine(pool_settings.resolved_database_url()), pool_settings)
    close_trajectory(store.sessions, "proof", TrajectoryStatus.COMPLETE, final_reward=1.0)
    rows = {
        layout: build_rows(store, BatchSpec(algorithm="sft", layout=layout))[0].to_pylist()
        for layout in ("per_step", "merged")
    }
    assert [r["input_ids"] for r in rows["per_step"]] == [
        [*s.prompt_token_ids, *s.response_token_ids] for s in steps
    ]
    [row] = rows["merged"]
    assert row["input_ids"] == sequence and row["step_ids"] == [s.id for s in steps]
    mask = np.asarray(row["loss_mask"], dtype=bool)
    assert mask.sum() == sum(len(s.response_token_ids) for s in steps)
    behaviour = np.asarray(row["behaviour_logprobs"], dtype=np.float32)
    assert np.abs(recomputed[0].numpy()[mask] - behaviour[mask]).max() < 1e-5


def messages_loop(server: BackgroundServer, trajectory_id: str, *, stream: bool) -> None:
    """Anthropic's Messages API: a forced tool_use, its tool_result, an answer."""
    url = f"{server.url}/t/{trajectory_id}/v1/messages"
    tool = {
        "name": "get_weather",
        "strict": True,
        "input_schema": WEATHER["function"]["parameters"],  # type: ignore[index]
    }
    history: list[Any] = [{"role": "user", "content": USER["content"]}]
    base = {"model": MODEL, "system": SYSTEM["content"], "tools": [tool], "max_tokens": 96}
    forced = {**base, "tool_choice": {"type": "tool", "name": "get_weather"}, "temperature": 0.0}
    for body in (forced, {**base, "max_tokens": 4}):
        content = sse_or_json(url, {**body, "messages": history, "stream": stream}, "messages")
        if body is not forced:
            return
        use = next((b for b in content if b["type"] == "tool_use"), None)
        assert use is not None, content
        history = [
            *history,
            {"role": "assistant", "content": content},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "21"}],
            },
        ]


def responses_loop(server: BackgroundServer, trajectory_id: str, *, stream: bool) -> None:
    """The Responses API with the whole history as input items: a forced function_call, its
    output, an answer."""
    url = f"{server.url}/t/{trajectory_id}/v1/responses"
    function = WEATHER["function"]
    tool = {
        "type": "function",
        "name": "get_weather",
        "strict": True,
        "parameters": function["parameters"],  # type: ignore[index]
    }
    items: list[Any] = [{"role": "user", "content": USER["content"]}]
    base = {"model": MODEL, "instructions": SYSTEM["content"], "tools": [tool], "store": False}
    forced = {
        **base,
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 96,
        "temperature": 0.0,
    }
    for body in (forced, {**base, "max_output_tokens": 16}):
        output = sse_or_json(url, {**body, "input": items, "stream": stream}, "responses")
        if body is not forced:
            return
        call = next(item for item in output if item["type"] == "function_call")
        items = [
            *items,
            *output,
            {"type": "function_call_output", "call_id": call["call_id"], "output": "21"},
        ]


def sse_or_json(url: str, body: dict[str, Any], dialect: str) -> list[Any]:
    """The answer's content blocks (Messages) or output items (Responses), streamed or not."""
    if not body["stream"]:
        answer = httpx.post(url, json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        found: list[Any] = answer.json()["content" if dialect == "messages" else "output"]
        return found
    with httpx.stream("POST", url, json=body, timeout=120) as answer:
        assert answer.status_code == 200
        events = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: ")]
    final = events[-1] if dialect == "responses" else None
    if final is not None:
        # A turn cut at max_output_tokens ends incomplete (the answer turn asks for 16 tokens).
        if final["type"] == "response.incomplete":
            details = final["response"]["incomplete_details"]
            assert details == {"reason": "max_output_tokens"}, final
        else:
            assert final["type"] == "response.completed", final
        completed: list[Any] = final["response"]["output"]
        return completed
    blocks: dict[int, dict[str, Any]] = {}
    for event in events:
        if event["type"] == "content_block_start":
            blocks[event["index"]] = dict(event["content_block"])
        elif event["type"] == "content_block_delta":
            delta, block = event["delta"], blocks[event["index"]]
            if delta["type"] == "text_delta":
                block["text"] = block.get("text", "") + delta["text"]
            elif delta["type"] == "input_json_delta":
                block["partial"] = block.get("partial", "") + delta["partial_json"]
    for block in blocks.values():
        if block["type"] == "tool_use" and "partial" in block:
            block["input"] = json.loads(block.pop("partial"))
    return [blocks[i] for i in sorted(blocks)]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("loop", [messages_loop, responses_loop], ids=["messages", "responses"])
def test_exact_mode_serves_every_dialect_as_one_token_sequence(
    exact_gateway: BackgroundServer, pool_settings: PoolSettings, loop: Any, stream: bool
) -> None:
    loop(exact_gateway, "dialect-loop", stream=stream)
    steps = steps_of(pool_settings, "dialect-loop")
    assert [s.continuation for s in steps] == ["template", "exact"]
    assert steps[1].extends_parent and "prefix_break" not in steps[1].flags
    assert steps[1].suffix_tokens and steps[1].suffix_tokens > 0


# The answer after a tool result: the same tools offered (they are rendered: a call that drops
# them renders differently and is no extension).
ANSWER = {"model": MODEL, "tools": [WEATHER], "max_tokens": 4}


def forced_turn(
    server: BackgroundServer, trajectory_id: str, messages: list[Any], *, stream: bool = False
) -> list[Any]:
    """One forced, grammar-constrained tool call through ``server`` (sampled as plain
    characters where the template renders the ``<tool_call>`` special token: a formatting the
    template does not produce), returned as the history with its echo (the message as it came,
    minus what a client does not keep) and the tool's result."""
    body = {
        "model": MODEL,
        "messages": messages,
        "tools": [WEATHER],
        "tool_choice": FORCED,
        "max_tokens": 96,
        "temperature": 0.0,
        "stream": stream,
    }
    message = chat(server, trajectory_id, body)
    assert message.get("tool_calls"), message
    call = message["tool_calls"][0]
    echo = {"role": "assistant", "content": message.get("content"), "tool_calls": [call]}
    return [*messages, echo, {"role": "tool", "tool_call_id": call["id"], "content": "21"}]


def test_an_exact_stream_is_vllms_own_chat_stream_for_the_spliced_prompt(
    vllm: vllm_server.VLLMServer, exact_gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    # Invariant 2 for exact streams: vLLM's chat endpoint given the stored prompt as forwarded
    # ids answers the same tokens, text and logprobs (greedy), logprob token text included
    # (the streamed derender this replaced left every token "" and bytes null).
    messages = forced_turn(exact_gateway, "own-stream", [SYSTEM, USER])
    body = {**ANSWER, "messages": messages, "max_tokens": 12, "temperature": 0.0}
    body |= {"logprobs": True, "stream": True, "ignore_eos": True}
    through = _stream_parts(f"{exact_gateway.url}/t/own-stream/v1/chat/completions", body)
    _, step = steps_of(pool_settings, "own-stream")
    assert step.continuation == "exact" and step.extends_parent
    forwarded = {**body, "kv_transfer_params": {"prompt_token_ids": step.prompt_token_ids}}
    direct = _stream_parts(
        f"{vllm.url}/v1/chat/completions", {**forwarded, "return_token_ids": True}
    )
    assert through["token_ids"] == []  # not asked for: added upstream, stripped on the way back
    assert direct["token_ids"] == step.response_token_ids
    assert through["content"] == direct["content"]
    assert [e["token"] for e in through["logprobs"]] == [e["token"] for e in direct["logprobs"]]
    assert [e["bytes"] for e in through["logprobs"]] == [e["bytes"] for e in direct["logprobs"]]
    assert any(e["token"] for e in through["logprobs"])
    pairs = zip(through["logprobs"], direct["logprobs"], strict=True)
    gaps = [abs(a["logprob"] - b["logprob"]) for a, b in pairs]
    assert len(gaps) == 12 and max(gaps) < 1e-5


@pytest.mark.parametrize("stop", ["end-token", "stop-string"])
def test_an_exact_unary_answer_is_vllms_own_chat_answer_for_the_spliced_prompt(
    vllm: vllm_server.VLLMServer,
    exact_gateway: BackgroundServer,
    pool_settings: PoolSettings,
    stop: str,
) -> None:
    # Invariant 2 for exact unary calls (generate, then vLLM's derender): the chat endpoint
    # given the stored prompt as forwarded ids answers the same, for a turn that stopped on
    # the end token (derender decoded its text into the content: "...<|im_end|>") and one cut
    # by a stop string (derender kept the string the chat endpoint cuts).
    trajectory = f"own-unary-{stop}"
    messages = forced_turn(exact_gateway, trajectory, [SYSTEM, USER])
    url = f"{exact_gateway.url}/t/{trajectory}/v1/chat/completions"
    extra: dict[str, Any] = {"stop": ["e"]} if stop == "stop-string" else {}
    for seed in range(8):  # the tiny model ends a turn after ~300 tokens on average
        body = {**ANSWER, "messages": messages, "max_tokens": 900, "seed": seed, **extra}
        body |= {"logprobs": True, "return_token_ids": True}
        through = httpx.post(url, json=body, timeout=300).json()
        if through["choices"][0]["finish_reason"] == "stop":
            break
    else:
        pytest.fail("no seeded answer of the tiny model stopped within 900 tokens")
    step = steps_of(pool_settings, trajectory)[-1]
    assert step.continuation == "exact" and step.extends_parent
    forwarded = {**body, "kv_transfer_params": {"prompt_token_ids": step.prompt_token_ids}}
    direct = httpx.post(f"{vllm.url}/v1/chat/completions", json=forwarded, timeout=300).json()
    mine, theirs = through["choices"][0], direct["choices"][0]
    assert theirs["token_ids"] == mine["token_ids"] == step.response_token_ids
    assert mine["message"]["content"] == theirs["message"]["content"]
    assert (mine["finish_reason"], mine["stop_reason"]) == (
        theirs["finish_reason"],
        theirs["stop_reason"],
    )
    assert through["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]
    entries = mine["logprobs"]["content"], theirs["logprobs"]["content"]
    assert [e["token"] for e in entries[0]] == [e["token"] for e in entries[1]]
    assert len(entries[0]) == len(step.response_token_ids)


def test_derender_is_given_the_ids_the_chat_endpoint_writes_text_for() -> None:
    # The engine leaves the token that stopped sampling out of the text; derender decodes every
    # id it gets, so that token is hidden from it, except where the chat endpoint keeps it too.
    from gateway.engine.exact import _as_detokenized

    choices = [
        {"index": 0, "token_ids": [5, 6, 2], "finish_reason": "stop", "stop_reason": None},
        {"index": 1, "token_ids": [5, 6, 9], "finish_reason": "stop", "stop_reason": 9},
        {"index": 2, "token_ids": [5, 6, 7], "finish_reason": "stop", "stop_reason": "e"},
        {"index": 3, "token_ids": [5, 6, 7], "finish_reason": "length", "stop_reason": None},
        {"index": 4, "token_ids": [2], "finish_reason": "stop", "stop_reason": None},
    ]
    generated = {"request_id": "r", "choices": choices}
    seen = [c["token_ids"] for c in _as_detokenized(generated, {})["choices"]]
    # end token, a stop_token_ids id: hidden; a stop string, a length cut: whole; an answer
    # that is the end token alone: whole (derender refuses an empty one)
    assert seen == [[5, 6], [5, 6], [5, 6, 7], [5, 6, 7], [2]]
    assert generated["choices"][0]["token_ids"] == [5, 6, 2]  # the answer itself untouched
    kept = _as_detokenized(generated, {"include_stop_str_in_output": True})
    assert [c["token_ids"] for c in kept["choices"]] == [c["token_ids"] for c in choices]


def test_a_call_is_recorded_exact_only_when_the_engine_sampled_from_the_prompt_sent() -> None:
    from gateway.engine.exact import ExactAnswer
    from gateway.proxy.continuation.plan import Continuation

    answer = ExactAnswer(httpx.Response(200), "exact", suffix_tokens=2, prompt_token_ids=[1, 2, 3])
    sent = Continuation("exact", answer=answer)
    sent.confirm([1, 2, 3])
    assert (sent.built, sent.suffix_tokens) == ("exact", 2)
    # vLLM rendered the messages instead (echo, non-text content): the template's prompt.
    rendered = Continuation("exact", answer=answer)
    rendered.confirm([1, 2, 4])
    assert (rendered.built, rendered.suffix_tokens) == ("template", None)


def test_a_body_with_its_own_kv_transfer_params_is_not_continued(
    vllm: vllm_server.VLLMServer, pool_settings: PoolSettings
) -> None:
    # Disaggregated serving sends kv_transfer_params itself; the gateway, told to accept it,
    # leaves its prompt alone.
    with gateway_with(
        pool_settings,
        free_port(),
        upstream_url=vllm.url,
        allow_client_kv_transfer_params=True,
    ) as server:
        messages = forced_turn(server, "own-kv", [SYSTEM, USER])
        body = {**ANSWER, "messages": messages, "kv_transfer_params": {}, "stream": True}
        chat(server, "own-kv", body)
    _, step = steps_of(pool_settings, "own-kv")
    assert step.continuation == "template"


@pytest.mark.parametrize("kv", [{}, {"prompt_token_ids": []}, {"prompt_token_ids": [1, 2]}])
def test_a_clients_kv_transfer_params_is_refused_before_vllm_by_default(
    exact_gateway: BackgroundServer, pool_settings: PoolSettings, kv: dict[str, Any]
) -> None:
    # It would choose the prompt vLLM samples from ({"prompt_token_ids": []} was an ok,
    # trainable step with no prompt ids).
    body = {**ANSWER, "messages": [SYSTEM, USER], "kv_transfer_params": kv}
    answer = httpx.post(f"{exact_gateway.url}/t/own-kv/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "kv_transfer_params"
    assert steps_of(pool_settings, "own-kv") == []


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_an_exact_call_sends_its_render_before_the_pool_lookups_and_renders_once(
    exact_gateway: BackgroundServer,
    pool_settings: PoolSettings,
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
) -> None:
    # The render is the one exchange exact mode adds before sampling: it leaves while the
    # gateway asks the pool about re-sends (every call does), and the call uses it. Each one
    # has ended by the time its call is answered (the call's lifetime ends it: one the call
    # took is done, one it did not is cancelled).
    from gateway.engine import exact as engine
    from gateway.proxy import preparation

    events: list[str] = []
    sent: list[engine.RenderAhead] = []
    render, find_resend = engine._render, preparation.find_resend
    render_ahead = preparation.render_ahead

    def recorded_render_ahead(*args: Any) -> engine.RenderAhead:
        sent.append(render_ahead(*args))
        return sent[-1]

    async def recorded_render(*args: Any) -> httpx.Response:
        events.append("render")
        return await render(*args)

    def recorded_find_resend(*args: Any) -> str | None:
        events.append("lookup")
        return find_resend(*args)

    monkeypatch.setattr(engine, "_render", recorded_render)
    monkeypatch.setattr(preparation, "find_resend", recorded_find_resend)
    monkeypatch.setattr(preparation, "render_ahead", recorded_render_ahead)
    trajectory = f"ahead-{stream}"
    messages = forced_turn(exact_gateway, trajectory, [SYSTEM, USER], stream=stream)
    assert events == ["lookup"]  # a first call extends nothing: no render at all
    wait_for_exact_probes(exact_gateway)  # until then, a call extends without a render ahead
    answer = {**ANSWER, "messages": messages, "stream": stream}
    events.clear()
    chat(exact_gateway, trajectory, answer)
    assert events == ["render", "lookup"]
    assert_renders_ended(sent, 5.0)
    # The same body again (a re-send): prepared again under the earlier call's id, to the same
    # JSON, so the render sent ahead serves it.
    events.clear()
    chat(exact_gateway, trajectory, answer)
    assert events == ["render", "lookup"]
    assert_renders_ended(sent, 5.0)
    # A rewritten turn: the render sent ahead is dropped, the template renders the call.
    events.clear()
    rewritten = [*messages[:2], {**messages[2], "content": "changed"}, *messages[3:]]
    chat(exact_gateway, trajectory, {**answer, "messages": rewritten})
    assert events == ["render", "lookup"]
    assert len(sent) == 3
    assert_renders_ended(sent, 5.0)
    steps = steps_of(pool_settings, trajectory)
    assert [s.continuation for s in steps] == ["template", "exact", "exact", "template"]
    assert steps[2].call_id == steps[1].call_id and "resend" in steps[2].flags
    assert steps[1].prompt_token_ids == steps[2].prompt_token_ids


def test_the_forwarded_body_is_the_rendered_body_with_the_prompt_ids_added() -> None:
    from gateway.engine.exact import forwarding
    from gateway.engine.wire import dumps

    body = {"model": MODEL, "messages": [SYSTEM, USER], "tools": [WEATHER], "stream": True}
    forwarded = json.loads(forwarding(dumps(body), dumps([1, 2, 3])))
    assert forwarded == {**body, "kv_transfer_params": {"prompt_token_ids": [1, 2, 3]}}


def _stream_parts(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A chat stream's content, token ids (when sent) and logprob entries, reassembled."""
    content, ids, logprobs = [], [], []
    with httpx.stream("POST", url, json=body, timeout=120) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                content.append(choice["delta"].get("content") or "")
                ids += choice.get("token_ids") or []
                logprobs += (choice.get("logprobs") or {}).get("content") or []
    return {"content": "".join(content), "token_ids": ids, "logprobs": logprobs}


@pytest.mark.parametrize(
    ("body", "rendered", "restated"),
    [
        # render omits 16 (SamplingParams' default, msgspec omit_defaults): written back.
        ({"max_tokens": 16}, {"temperature": 1.0}, {"temperature": 1.0, "max_tokens": 16}),
        # max_completion_tokens wins over max_tokens, as in the chat endpoint; render's value stays.
        ({"max_completion_tokens": 17, "max_tokens": 99}, {"max_tokens": 17}, {"max_tokens": 17}),
        # No limit asked: render's default is 131,072 - 11 for the template's 11-token prompt,
        # not for the spliced one; dropped, so generate computes it for the spliced prompt.
        ({}, {"max_tokens": 131_061}, {}),
    ],
    ids=["sixteen", "completion-limit", "no-limit"],
)
def test_restate_max_tokens_gives_generate_the_limit_chat_would_apply(
    body: dict[str, Any], rendered: dict[str, Any], restated: dict[str, Any]
) -> None:
    from gateway.engine.exact import _restate_max_tokens

    _restate_max_tokens(rendered, body)
    assert rendered == restated


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_an_exact_continuation_samples_the_max_tokens_asked_for_even_16(
    exact_gateway: BackgroundServer, pool_settings: PoolSettings, stream: bool
) -> None:
    # vLLM's render writes no max_tokens equal to SamplingParams' default (16): generate then
    # sampled to the end of the context (3,690 tokens in the SmolLM2 demo).
    trajectory = f"sixteen-{stream}"
    messages = forced_turn(exact_gateway, trajectory, [SYSTEM, USER])
    for most in (16, 17):
        body = {**ANSWER, "messages": messages, "max_tokens": most, "ignore_eos": True}
        chat(exact_gateway, trajectory, {**body, "stream": stream})
    steps = steps_of(pool_settings, trajectory)
    assert [s.continuation for s in steps] == ["template", "exact", "exact"]
    assert [len(s.response_token_ids) for s in steps[1:]] == [16, 17]
    assert [s.finish_reason for s in steps[1:]] == ["length", "length"]


def test_a_restarted_gateway_continues_exactly_from_the_turn_in_the_pool(
    vllm: vllm_server.VLLMServer, pool_settings: PoolSettings
) -> None:
    # The first gateway serves the tool call and stops: its memory of the turn goes with it.
    with gateway_with(pool_settings, free_port(), upstream_url=vllm.url) as first:
        messages = forced_turn(first, "restarted", [SYSTEM, USER])
    with gateway_with(pool_settings, free_port(), upstream_url=vllm.url) as second:
        chat(second, "restarted", {**ANSWER, "messages": messages})
    steps = steps_of(pool_settings, "restarted")
    assert steps[0].turn_key is not None
    assert [s.continuation for s in steps] == ["template", "exact"]
    assert steps[1].extends_parent and "prefix_break" not in steps[1].flags
    parent = steps[0]
    assert steps[1].prompt_token_ids[: len(parent.prompt_token_ids)] == parent.prompt_token_ids


def test_two_gateways_taking_turns_keep_one_token_sequence(
    vllm: vllm_server.VLLMServer, pool_settings: PoolSettings
) -> None:
    # Two replicas (or workers) of the gateway on one pool, the agent's calls alternating: each
    # finds the turn the other served in the pool (the first has an older turn in memory).
    with (
        gateway_with(pool_settings, free_port(), upstream_url=vllm.url) as one,
        gateway_with(pool_settings, free_port(), upstream_url=vllm.url) as two,
    ):
        messages: list[Any] = [SYSTEM, USER]
        for server in (one, two, one):
            messages = forced_turn(server, "alternating", messages)
        chat(two, "alternating", {**ANSWER, "messages": messages})
    steps = steps_of(pool_settings, "alternating")
    assert [s.continuation for s in steps] == ["template", "exact", "exact", "exact"]
    for parent, step in itertools.pairwise(steps):
        assert step.parent_step_id == parent.id and step.extends_parent
        assert "prefix_break" not in step.flags


def test_an_answer_under_tool_choice_none_continues_exactly_where_vllm_renders_the_tools(
    exact_gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    # A tool turn, then the answer with tools offered but ``tool_choice: "none"``: vLLM as
    # ``trajgate vllm start`` runs it renders the tools anyway, so the prompt is the same one
    # the template would build and the answer continues the tool turn (it was the template).
    messages = forced_turn(exact_gateway, "none-choice", [SYSTEM, USER])
    chat(exact_gateway, "none-choice", {**ANSWER, "messages": messages, "tool_choice": "none"})
    turn, answer = steps_of(pool_settings, "none-choice")
    assert [turn.continuation, answer.continuation] == ["template", "exact"]
    assert (answer.parent_step_id, answer.extends_parent) == (turn.id, True)
    assert "prefix_break" not in answer.flags
    # The keys: "none" renders as the other choices, unless a replica leaves the tools out.
    auto = render_key(ANSWER)
    none = {**ANSWER, "tool_choice": "none"}
    assert render_key(none, tool_choice_none_renders=False) == auto != render_key(none)


def test_a_side_call_is_a_new_root_and_the_main_chain_stays_exact(
    exact_gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    messages = forced_turn(exact_gateway, "side", [SYSTEM, USER])
    # A title call: the same system message, a user message of its own, nothing else.
    title = {"role": "user", "content": "A title for: What is the temperature in Paris?"}
    chat(exact_gateway, "side", {"model": MODEL, "messages": [SYSTEM, title], "max_tokens": 4})
    chat(exact_gateway, "side", {**ANSWER, "messages": messages})
    main, side, answer = steps_of(pool_settings, "side")
    assert (side.parent_step_id, side.divergence_kind, side.continuation) == (
        None,
        "side_call",
        "template",
    )
    assert "prefix_break" not in side.flags
    # The main chain continues from its own turn, not from the side call.
    assert (answer.parent_step_id, answer.continuation) == (main.id, "exact")
    assert answer.extends_parent and "prefix_break" not in answer.flags


def test_a_compaction_keeping_the_task_is_a_recorded_break_rendered_by_the_template(
    exact_gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    messages = tool_loop(exact_gateway, "compacted-task", 1, stream=False)
    # The agent keeps its system message and the task and replaces the rest with a summary.
    summary = {"role": "user", "content": "Summary so far: Paris is 21. Answer now."}
    compacted = [SYSTEM, USER, summary]
    assert len(messages) > len(compacted)
    chat(exact_gateway, "compacted-task", {"model": MODEL, "messages": compacted, "max_tokens": 4})
    last = steps_of(pool_settings, "compacted-task")[-1]
    assert (last.continuation, last.suffix_tokens) == ("template", None)
    assert "prefix_break" in last.flags and last.divergence_kind == "history_rewritten"


def test_suffix_tokens_count_from_the_recorded_parent_not_an_older_extended_turn(
    exact_gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    # Turn Y sets a field that changes its turn key but not its rendering
    # (``add_special_tokens: false`` is vLLM's chat default), so the next call, which leaves it
    # out, finds no turn for Y's answer and extends the older turn X. Y's answer re-renders to
    # the ids Y sampled, so Y's P + R starts that call's prompt and Y is its recorded parent:
    # the tokens the step adds to its parent are those after Y's P + R, not after X's.
    letters = {"structured_outputs": {"regex": "[a-z]{2,6}"}, "max_tokens": 8}
    body: dict[str, Any] = {"model": MODEL, "temperature": 0, **letters}
    messages: list[Any] = [{"role": "user", "content": "Name a city."}]
    answer_x = chat(exact_gateway, "suffix", {**body, "messages": messages})
    messages = [*messages, answer_x, {"role": "user", "content": "Go on."}]
    answer_y = chat(
        exact_gateway, "suffix", {**body, "messages": messages, "add_special_tokens": False}
    )
    messages = [*messages, answer_y, {"role": "user", "content": "And a third?"}]
    chat(exact_gateway, "suffix", {**body, "messages": messages})
    x, y, z = steps_of(pool_settings, "suffix")
    s_x = [*x.prompt_token_ids, *x.response_token_ids]
    s_y = [*y.prompt_token_ids, *y.response_token_ids]
    assert z.continuation == "exact" and z.prompt_token_ids[: len(s_x)] == s_x  # extended X
    assert z.parent_step_id == y.id and z.extends_parent is True
    assert z.prompt_token_ids[: len(s_y)] == s_y
    # Counted from Y: len(P_z) - len(S_y), fewer than from X by len(S_y) - len(S_x).
    assert z.suffix_tokens == len(z.prompt_token_ids) - len(s_y)
