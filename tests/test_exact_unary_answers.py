"""The exact unary path (render, generate, derender) against answers the real vLLM does not
send, from the emulator (trajgate/bench/emulator.py) with its scale-out answers rewritten here:
the step records generate's ids, logprobs and finish reason, never derender's re-telling of
them; a derender that disagrees with generate, and a render, generate or derender answer of the
wrong shape, is a 502 ``upstream_error`` with one recorded ``upstream_error`` step, never a 500.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from gateway_helpers import emulated_gateway, steps_of

from datapool.settings import PoolSettings
from gateway.engine.exact import DERENDER_SEED_IDS
from trajgate.bench import scale_out

EMULATOR = {"prompt_tokens": 3, "response_tokens": 2, "prompt_ids": "messages"}
Rewrite = Callable[[dict[str, Any]], Any]


@dataclass
class Emulated:
    """Rewrites of the emulator's unary render, generate and derender answers, by endpoint
    (``rewrites``), and the generate answers it sent (``generated``)."""

    rewrites: dict[str, Rewrite] = field(default_factory=dict)
    generated: list[dict[str, Any]] = field(default_factory=list)

    def rewrite(self, endpoint: str, answer: Any) -> Any:
        return self.rewrites.get(endpoint, lambda a: a)(answer)


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> Iterator[Emulated]:
    state = Emulated()
    render, derender, generate_parts = (
        scale_out.render,
        scale_out.derender,
        scale_out.generate_parts,
    )

    def generated(*args: Any) -> list[bytes]:
        parts = generate_parts(*args)
        answer = state.rewrite("generate", json.loads(parts[0]))
        state.generated.append(answer)
        return [json.dumps(answer).encode(), *parts[1:]]

    monkeypatch.setattr(scale_out, "render", lambda *a: state.rewrite("render", render(*a)))
    monkeypatch.setattr(scale_out, "derender", lambda *a: state.rewrite("derender", derender(*a)))
    monkeypatch.setattr(scale_out, "generate_parts", generated)
    yield state


def _second_turn(
    pool_settings: PoolSettings,
    trajectory: str,
    path: str,
    emulated: Emulated,
    faults: dict[str, Rewrite],
) -> httpx.Response:
    """A first call (the template's), then, with ``faults`` rewriting the emulator's answers,
    one that extends it: the exact unary path. (Faults set before would fail the probe.)"""
    with emulated_gateway(pool_settings, **EMULATOR) as server:
        url = f"{server.url}/t/{trajectory}/v1/{path}"
        if path == "messages":
            body: dict[str, Any] = {"model": "emulated", "max_tokens": 8}
            first = httpx.post(
                url, json={**body, "messages": [{"role": "user", "content": "Count."}]}, timeout=30
            )
            assert first.status_code == 200, first.text
            text = first.json()["content"][0]["text"]
        else:
            body = {"model": "emulated"}
            first = httpx.post(
                url, json={**body, "messages": [{"role": "user", "content": "Count."}]}, timeout=30
            )
            assert first.status_code == 200, first.text
            text = first.json()["choices"][0]["message"]["content"]
        messages = [
            {"role": "user", "content": "Count."},
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Again."},
        ]
        emulated.rewrites.update(faults)
        return httpx.post(url, json={**body, "messages": messages}, timeout=30)


def _logprobs(value: float) -> Rewrite:
    def rewrite(answer: dict[str, Any]) -> Any:
        for entry in answer["choices"][0]["logprobs"]["content"]:
            entry["logprob"] = value
        return answer

    return rewrite


def test_an_exact_unary_step_records_generates_logprobs_not_derenders(
    pool_settings: PoolSettings, emulated: Emulated
) -> None:
    faults = {"derender": _logprobs(-9.5)}
    answer = _second_turn(pool_settings, "derender-logprobs", "chat/completions", emulated, faults)
    assert answer.status_code == 200, answer.text
    (choice,) = emulated.generated[-1]["choices"]
    step = steps_of(pool_settings, "derender-logprobs")[1]
    assert step.continuation == "exact" and step.outcome == "ok"
    assert step.response_token_ids == choice["token_ids"]
    assert step.response_logprobs == [e["logprob"] for e in choice["logprobs"]["content"]]
    assert -9.5 not in step.response_logprobs


def _set(where: str, **fields: Any) -> Rewrite:
    def rewrite(answer: dict[str, Any]) -> Any:
        target = answer if where == "answer" else answer["choices"][0]
        for name, value in fields.items():
            if value is _DROP:
                del target[name]
            else:
                target[name] = value
        return answer

    return rewrite


_DROP = object()


def _extra_choice(answer: dict[str, Any]) -> Any:
    answer["choices"].append({**answer["choices"][0], "index": 1})
    return answer


@pytest.mark.parametrize(
    ("endpoint", "rewrite"),
    [
        # derender disagrees with what generate sampled (item: the exact path believes generate)
        ("derender", _set("choice", finish_reason="length")),
        ("derender", _set("choice", index=3)),
        ("derender", _extra_choice),
        ("derender", _set("choice", logprobs={"content": []})),
        # answers of the wrong shape
        ("derender", lambda answer: ["x"]),
        ("derender", _set("answer", choices=["x"])),
        ("generate", _set("choice", index=_DROP)),
        ("generate", _set("answer", choices=5)),
        ("generate", _set("choice", token_ids=[])),
        ("generate", _set("choice", finish_reason=5)),
        ("render", _set("answer", token_ids=[])),
        ("render", _set("answer", token_ids=["a", 1])),
        ("render", _set("answer", token_ids=[2**31])),
    ],
    ids=[
        "derender-finish",
        "derender-index",
        "derender-count",
        "derender-logprob-count",
        "derender-list",
        "derender-choice-string",
        "generate-no-index",
        "generate-choices-5",
        "generate-no-ids",
        "generate-finish-5",
        "render-no-ids",
        "render-text-ids",
        "render-int64-id",
    ],
)
def test_an_exact_unary_answer_generate_disowns_or_of_the_wrong_shape_is_502_with_one_step(
    pool_settings: PoolSettings, emulated: Emulated, endpoint: str, rewrite: Rewrite
) -> None:
    faults = {endpoint: rewrite}
    answer = _second_turn(pool_settings, "bad-answer", "chat/completions", emulated, faults)
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"]["code"] == "upstream_error"
    first, failed = steps_of(pool_settings, "bad-answer")
    assert first.outcome == "ok" and failed.outcome == "upstream_error"


def test_a_generate_answer_without_a_finish_reason_is_recorded_unfinished(
    pool_settings: PoolSettings, emulated: Emulated
) -> None:
    # derender is handed generate's null and tells it back: the step keeps generate's word.
    faults = {"generate": _set("choice", finish_reason=None)}
    answer = _second_turn(pool_settings, "unfinished", "chat/completions", emulated, faults)
    assert answer.status_code == 200, answer.text
    step = steps_of(pool_settings, "unfinished")[1]
    assert step.finish_reason is None and "unfinished" in step.flags


def test_a_messages_call_on_the_exact_path_answers_a_bad_generate_with_502_and_a_step(
    pool_settings: PoolSettings, emulated: Emulated
) -> None:
    faults = {"generate": _set("answer", choices=5)}
    answer = _second_turn(pool_settings, "bad-messages", "messages", emulated, faults)
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"]["type"] == "api_error"
    first, failed = steps_of(pool_settings, "bad-messages")
    assert first.outcome == "ok" and failed.outcome == "upstream_error"


def _render_id(position: int, value: Any) -> Rewrite:
    def rewrite(answer: dict[str, Any]) -> Any:
        answer["token_ids"][position] = value
        return answer

    return rewrite


@pytest.mark.parametrize("bad", [-1, 2**31, True, 1.0, "7"], ids=repr)
def test_a_bad_id_in_the_renders_suffix_is_502_with_one_step(
    pool_settings: PoolSettings, emulated: Emulated, bad: Any
) -> None:
    # The last id of the rendering is the generation prompt's: after the boundary, so it is
    # sent to the engine, and the check of the render's new part must refuse it.
    faults = {"render": _render_id(-1, bad)}
    answer = _second_turn(pool_settings, "bad-suffix", "chat/completions", emulated, faults)
    assert answer.status_code == 502, answer.text
    first, failed = steps_of(pool_settings, "bad-suffix")
    assert first.outcome == "ok" and failed.outcome == "upstream_error"


def test_a_bad_id_where_the_turns_own_ids_go_is_never_sent(
    pool_settings: PoolSettings, emulated: Emulated
) -> None:
    # The first id of the rendering is the first message's, before the boundary: the turn's
    # own ids replace it, so the prompt the engine samples from (and the step records) is the
    # first call's prompt and answer, then the template's suffix, with no -1 in it.
    faults = {"render": _render_id(0, -1)}
    answer = _second_turn(pool_settings, "bad-prefix", "chat/completions", emulated, faults)
    assert answer.status_code == 200, answer.text
    first, second = steps_of(pool_settings, "bad-prefix")
    assert second.continuation == "exact" and second.outcome == "ok"
    turn = [*first.prompt_token_ids, *first.response_token_ids]
    assert second.prompt_token_ids[: len(turn)] == turn
    assert -1 not in second.prompt_token_ids


def test_derender_is_sent_the_prompts_last_ids_and_its_whole_length(
    pool_settings: PoolSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's derender reads only the prompt's tail (it seeds its detokenizer from the last 7
    ids), so the gateway sends the last ``DERENDER_SEED_IDS``, not the whole prompt (~21k ids at
    turn 200 of a coding-agent session), with ``prompt_tokens`` the whole prompt's length."""
    sent: list[dict[str, Any]] = []
    derender = scale_out.derender

    def recorded(book: Any, body: dict[str, Any], request_id: str) -> Any:
        if "generate_response" in body:  # not the start-up probe's
            sent.append(body)
        return derender(book, body, request_id)

    monkeypatch.setattr(scale_out, "derender", recorded)
    with emulated_gateway(pool_settings, **{**EMULATOR, "prompt_tokens": 40}) as server:
        url = f"{server.url}/t/derender-seed/v1/chat/completions"
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Count."}]
        for again in ("Again.", "Once more."):
            answer = httpx.post(url, json={"model": "emulated", "messages": messages}, timeout=30)
            assert answer.status_code == 200, answer.text
            text = answer.json()["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": again}]
        answer = httpx.post(url, json={"model": "emulated", "messages": messages}, timeout=30)
        assert answer.status_code == 200, answer.text
    steps = steps_of(pool_settings, "derender-seed")
    exact = [step for step in steps if step.continuation == "exact"]
    assert len(exact) == len(sent) == 2  # the first call is the template's: no derender
    for step, body in zip(exact, sent, strict=True):
        prompt = list(step.prompt_token_ids)
        assert len(prompt) > DERENDER_SEED_IDS
        assert body["prompt_token_ids"] == prompt[-DERENDER_SEED_IDS:]
        assert body["prompt_tokens"] == len(prompt)
