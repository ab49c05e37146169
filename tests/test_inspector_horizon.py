"""The inspector on a 200-turn coding-agent session: views that grow with the steps, not with
the square of the turns.

Per dialect (chat completions, and the Messages API as Claude Code speaks it), one session of 200
calls and one of 20, recorded through the dialect and the pool's own write path
(``trajgate.bench.long_session``: a 28 KB tool list on every call, each turn re-sending the whole
history plus the model's tool call and a ~450-character tool result), and the same two with
Claude Code's system message, whose ``cch`` changes on every call (``-cch-``), on SQLite only:
the views are computed in Python from the records the store reads back, the same on both
backends (the store's reads are tested on both in tests/test_request_storage.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from batch_helpers import make_store
from fastapi.testclient import TestClient
from gateway_helpers import gateway_with
from inspector_helpers import CHROMIUM
from playwright.sync_api import Page, expect
from test_inspector_browser import ARTIFACTS, browser, page  # noqa: F401 (the fixtures)
from tests_support import free_port

from datapool import db
from datapool.queries.edits import apply_edits
from datapool.settings import PoolSettings
from datapool.steps.canonical import response_of
from gateway.app import create_app
from gateway.dialects.chat_completions import ChatCompletions
from gateway.dialects.messages import Messages
from gateway.settings import GatewaySettings
from trajgate.bench.long_session import (
    DIALECTS,
    ENV_TOKENS,
    FIRST_PROMPT_TOKENS,
    RESPONSE_TOKENS,
    Session,
    billing,
    record_session,
    tool_result,
)

TURNS = 200
SHORT_TURNS = 20


@pytest.fixture(scope="module")
def horizon(tmp_path_factory: pytest.TempPathFactory) -> tuple[PoolSettings, dict[str, Session]]:
    """A SQLite pool holding trajectories ``<dialect>-long`` (200 turns) and ``<dialect>-short``
    (20 turns) of each dialect, and ``<dialect>-cch-long`` and ``<dialect>-cch-short``."""
    tmp = tmp_path_factory.mktemp("horizon")
    url = f"sqlite:///{tmp / 'pool.sqlite3'}"
    db.upgrade(url)
    pool = PoolSettings(data_dir=tmp / "data", database_url=url)
    store = make_store(pool)
    sessions = {}
    for dialect in DIALECTS:
        for name, turns in (("long", TURNS), ("short", SHORT_TURNS)):
            for cch in (False, True):
                trajectory_id = f"{dialect}{'-cch' if cch else ''}-{name}"
                sessions[trajectory_id] = record_session(store, trajectory_id, turns, dialect, cch)
    store.engine.dispose()
    return pool, sessions


@pytest.fixture(scope="module")
def client(horizon: tuple[PoolSettings, dict[str, Session]]) -> Iterator[TestClient]:
    # No vLLM on the upstream port: the token view shows ids (no tokenizer to learn).
    settings = GatewaySettings(
        allowed_hosts=["testserver"], upstream_url=f"http://127.0.0.1:{free_port()}"
    )
    with TestClient(create_app(settings, horizon[0])) as test_client:
        yield test_client


def canonical_of(dialect: str, request: dict[str, Any]) -> dict[str, Any]:
    """The canonical record of a request (what the pool records, from the same dialect code)."""
    translator = ChatCompletions() if dialect == "chat" else Messages()
    return translator.canonical(translator.prepare(request).upstream_body).to_json()


@pytest.mark.parametrize("dialect", DIALECTS)
def test_trajectory_view_bytes_per_step_do_not_grow_with_the_history(
    client: TestClient, dialect: str
) -> None:
    long = client.get(f"/api/inspector/trajectories/{dialect}-long")
    short = client.get(f"/api/inspector/trajectories/{dialect}-short")
    assert long.status_code == short.status_code == 200
    # Turn 200 re-sends ~150 KB of history and the 28 KB tool list; the view ships neither
    # again: a step adds one tool result (~0.5 KB) and its answer, so bytes per step stay flat
    # (the 20-turn view even carries its tool list once over fewer steps).
    per_step_long = len(long.content) / TURNS
    per_step_short = len(short.content) / SHORT_TURNS
    assert per_step_long <= 1.1 * per_step_short, (per_step_long, per_step_short)
    assert len(long.content) <= 1_000_000  # the goal for a 200-turn session: <= 1 MB
    assert len(long.json()["tools"]) == 1  # one tool list, sent once


def rebuilt_histories(view: dict[str, Any]) -> dict[str, list[Any]]:
    """Each step's canonical messages rebuilt from the view alone, parents first: its replaced
    first messages (``head_edits`` of ``head_texts``), the parent's history and answer it
    covers, what it appended."""
    by_id = {s["id"]: s for s in view["steps"]}
    full: dict[str, list[Any]] = {}
    for step in view["steps"]:  # call order: a parent before its children
        parent = by_id.get(step["parent_step_id"])
        head = []
        if parent is not None:
            head = [*full[parent["id"]], response_of(parent["response_message"]).to_json()]
        texts = [apply_edits(view["head_texts"][h["text"]], h["edits"]) for h in step["head_edits"]]
        covered = head[step["messages_replaced"] : step["messages_base"]]
        full[step["id"]] = [*map(json.loads, texts), *covered, *step["messages_added"]]
    return full


@pytest.mark.parametrize("cch", [False, True], ids=["plain", "cch"])
@pytest.mark.parametrize("dialect", DIALECTS)
def test_added_messages_along_the_parent_chain_rebuild_each_steps_full_history(
    client: TestClient, horizon: tuple[PoolSettings, dict[str, Session]], dialect: str, cch: bool
) -> None:
    name = f"{dialect}{'-cch' if cch else ''}-long"
    view = client.get(f"/api/inspector/trajectories/{name}").json()
    steps = view["steps"]
    assert len(steps) == TURNS
    full = rebuilt_histories(view)
    requests = horizon[1][name].requests
    tools = canonical_of(dialect, requests[0])["tools"]
    for k, step in enumerate(steps):
        expected = canonical_of(dialect, requests[k])["messages"]
        assert json.dumps(full[step["id"]]) == json.dumps(expected), f"turn {k}"
        assert view["tools"][step["tools_key"]] == tools
        if k:
            # Turn k sends 2 + 2k messages; its parent's history + answer is 2 + 2(k-1) + 1 of
            # them, so it adds one: the tool result of turn k - 1 (and, with a new cch, its
            # system message replaces the parent's first message).
            assert (step["messages_replaced"], step["messages_base"]) == (int(cch), 2 * k + 1)
            assert [m["content"] for m in step["messages_added"]] == [tool_result(k - 1)]


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_cch_sessions_view_ships_its_changing_system_message_as_edits_not_whole(
    client: TestClient, dialect: str
) -> None:
    long = client.get(f"/api/inspector/trajectories/{dialect}-cch-long")
    short = client.get(f"/api/inspector/trajectories/{dialect}-cch-short")
    assert long.status_code == short.status_code == 200
    view = long.json()
    system = view["steps"][0]["messages_added"][0]
    # Shipped whole twice: in the first step's messages and as the one text the others edit.
    assert view["head_texts"] == {"h0": json.dumps(system)}
    for k, step in enumerate(view["steps"][1:], start=1):
        # Per step the system message costs its new cch (5 hex digits) and the edit's place:
        # at most 64 bytes, where shipping it whole costs its ~6.4 KB again on every step.
        assert len(json.dumps(step["head_edits"])) <= 64, f"turn {k}"
    # Hence bytes per step stay flat (a step adds one tool result and an answer) and the
    # 200-turn view is under the goal of 1 MB (1.64 MB when each step shipped its system
    # message whole).
    per_step_long = len(long.content) / TURNS
    per_step_short = len(short.content) / SHORT_TURNS
    assert per_step_long <= 1.1 * per_step_short, (per_step_long, per_step_short)
    assert len(long.content) <= 1_000_000


def test_full_history_on_demand_is_the_request_exactly_as_sent(
    client: TestClient, horizon: tuple[PoolSettings, dict[str, Session]]
) -> None:
    session = horizon[1]["chat-long"]
    for k in (0, 1, TURNS // 2, TURNS - 1):
        response = client.get(f"/api/inspector/steps/{session.step_ids[k]}/history")
        assert response.status_code == 200, response.text
        history = response.json()
        # Same JSON text, key order included: the body exactly as the agent sent it.
        assert json.dumps(history["request"]) == json.dumps(session.requests[k])
        assert history["canonical"] == canonical_of("chat", session.requests[k])
        assert history["trajectory_id"] == "chat-long"
    missing = client.get("/api/inspector/steps/no-such-step/history")
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "step_id"


def test_token_pages_of_a_long_step_join_into_the_whole_step(
    client: TestClient, horizon: tuple[PoolSettings, dict[str, Session]]
) -> None:
    step_id = horizon[1]["chat-long"].step_ids[20]
    whole = client.get(f"/api/steps/{step_id}/tokens").json()
    prompt_count = FIRST_PROMPT_TOKENS + 20 * (RESPONSE_TOKENS + ENV_TOKENS)  # 2,600
    assert (whole["prompt_token_count"], whole["response_token_count"]) == (prompt_count, 40)
    assert whole["offset"] == 0 and whole["next_offset"] is None
    joined: dict[str, list[Any]] = {"prompt": [], "response": [], "logprobs": [], "mask": []}
    offset: int | None = 0
    pages = 0
    while offset is not None:
        window = {"offset": offset, "limit": 1000}
        page_json = client.get(f"/api/steps/{step_id}/tokens", params=window).json()
        assert page_json["offset"] == offset
        joined["prompt"] += page_json["prompt_token_ids"]
        joined["response"] += page_json["response_token_ids"]
        joined["logprobs"] += page_json["response_logprobs"]
        joined["mask"] += page_json["loss_mask"]
        offset = page_json["next_offset"]
        pages += 1
    assert pages == 3  # 2,640 positions in windows of 1,000
    assert joined["prompt"] == whole["prompt_token_ids"]
    assert joined["response"] == whole["response_token_ids"]
    assert joined["logprobs"] == whole["response_logprobs"]
    assert joined["mask"] == whole["loss_mask"]
    # A window across the prompt/response boundary: the last 5 prompt and first 5 sampled tokens.
    across = client.get(
        f"/api/steps/{step_id}/tokens", params={"offset": prompt_count - 5, "limit": 10}
    ).json()
    assert across["prompt_token_ids"] == whole["prompt_token_ids"][-5:]
    assert across["response_token_ids"] == whole["response_token_ids"][:5]
    assert across["response_logprobs"] == whole["response_logprobs"][:5]
    assert across["loss_mask"] == [0] * 5 + [1] * 5
    past = client.get(f"/api/steps/{step_id}/tokens", params={"offset": prompt_count + 41})
    assert past.status_code == 400
    assert past.json()["error"]["param"] == "offset"


pytest_browser = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason="needs Debian's chromium (scripts/setup.sh installs it)"
)


@pytest_browser
def test_a_200_turn_trajectory_opens_with_full_history_and_token_pages_on_demand(
    horizon: tuple[PoolSettings, dict[str, Session]],
    page: Page,  # noqa: F811 (the fixture)
) -> None:
    pool = horizon[0]
    last = TURNS - 1
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    unreachable = f"http://127.0.0.1:{free_port()}"
    with gateway_with(pool, free_port(), upstream_url=unreachable) as server:
        page.goto(f"{server.url}/inspector/trajectories/chat-long")
        steps = page.get_by_test_id("step")
        expect(steps).to_have_count(TURNS, timeout=30_000)
        final = steps.nth(last)
        # What the last turn added: the result of the tool called at turn 198, after the
        # 2 + 2 * 198 + 1 = 399 messages of step 198's history and answer.
        expect(final.get_by_test_id("message-content")).to_have_text([tool_result(last - 1)])
        expect(final.get_by_test_id("repeats")).to_contain_text(
            "399 earlier messages repeat step 198's conversation"
        )
        page.screenshot(path=str(ARTIFACTS / "horizon-trajectory.png"))
        final.get_by_test_id("show-history").click()
        # Turn 199 sent the system prompt, the task and 199 pairs: 400 messages.
        expect(final.get_by_test_id("message-content")).to_have_count(2 + 2 * last)
        expect(final.get_by_test_id("as-sent")).to_be_visible()
        final.screenshot(path=str(ARTIFACTS / "horizon-full-history.png"))

        # The token view of the last step: 20,540 positions, read 2,000 at a time.
        final.get_by_test_id("open-tokens").click()
        tokens = page.get_by_test_id("tokens").locator("span")
        expect(tokens).to_have_count(2000)
        total = FIRST_PROMPT_TOKENS + last * (RESPONSE_TOKENS + ENV_TOKENS) + RESPONSE_TOKENS
        expect(page.get_by_test_id("token-window")).to_have_text(
            f"showing tokens 0–2000 of {total}"
        )
        page.get_by_test_id("tokens-more").click()
        expect(tokens).to_have_count(4000)
        # Straight to what this step added: from the end of the parent's prompt + response.
        base = total - ENV_TOKENS - RESPONSE_TOKENS
        page.get_by_test_id("tokens-new").click()
        expect(page.get_by_test_id("token-window")).to_have_text(
            f"showing tokens {base}–{total} of {total}"
        )
        expect(tokens).to_have_count(ENV_TOKENS + RESPONSE_TOKENS)
        expect(page.locator("[data-boundary=response-start]")).to_have_count(1)
        page.get_by_test_id("tokens-earlier").click()
        expect(tokens).to_have_count(2000 + ENV_TOKENS + RESPONSE_TOKENS)
        page.screenshot(path=str(ARTIFACTS / "horizon-tokens.png"))


@pytest_browser
def test_a_cch_session_shows_each_steps_own_system_message(
    horizon: tuple[PoolSettings, dict[str, Session]],
    page: Page,  # noqa: F811 (the fixture)
) -> None:
    """The page rebuilds each step's system message from the view's edits: the last step shows
    its own cch, before and after its full history is fetched."""
    last = TURNS - 1
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    unreachable = f"http://127.0.0.1:{free_port()}"
    with gateway_with(horizon[0], free_port(), upstream_url=unreachable) as server:
        page.goto(f"{server.url}/inspector/trajectories/messages-cch-long")
        steps = page.get_by_test_id("step")
        expect(steps).to_have_count(TURNS, timeout=30_000)
        for k in (1, last):
            shown = steps.nth(k).get_by_test_id("message-content")
            # Its system message (rebuilt: billing line, identity, prompt), then the result of
            # the tool called at turn k - 1.
            expect(shown).to_have_count(2)
            expect(shown.nth(0)).to_contain_text(billing(k))
            expect(shown.nth(1)).to_have_text(tool_result(k - 1))
        final = steps.nth(last)
        # 2 + 2 * 198 + 1 = 399 messages of step 198's history and answer, less the replaced one.
        expect(final.get_by_test_id("repeats")).to_contain_text(
            "398 earlier messages repeat step 198's conversation after its first message"
        )
        final.screenshot(path=str(ARTIFACTS / "horizon-cch-step.png"))
        final.get_by_test_id("show-history").click()
        shown = final.get_by_test_id("message-content")
        expect(shown).to_have_count(2 + 2 * last)
        expect(shown.nth(0)).to_contain_text(billing(last))
