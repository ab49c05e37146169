"""Prefix breaks that never mislead, through the whole gateway: a break
hidden behind an older ancestor is flagged, counted and shown; a re-send is a fork, never a break.

The upstream is a mock (``httpx.MockTransport``) because the test needs prompt IDs chosen by hand
to make each lineage case exact; the same cases against the real vLLM and the tiny model's
template are in tests/test_gateway_cases.py (C02, C13).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from gateway_helpers import chat_response, gateway_with, steps_of
from tests_support import free_port

from datapool.curation.rules import create_rule
from datapool.db import make_engine
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore

# Per turn (messages in the request → prompt IDs, sampled IDs, content). Turn 1 reasoned, and the
# agent sends it back without its reasoning, so P_2 = [1, 2, 3, 4, 9] leaves S_1 = [1, 2, 3, 4, 5,
# 6] at offset 4 while still extending S_0 = [1, 2, 3].
TURNS: dict[int, tuple[list[int], list[int], str]] = {
    1: ([1, 2], [3], "plain"),
    3: ([1, 2, 3, 4], [5, 6], "<think>hm</think>ok"),
    5: ([1, 2, 3, 4, 9], [7], "done"),
}


def _answer(request: httpx.Request) -> httpx.Response:
    if request.url.path != "/v1/chat/completions":
        return httpx.Response(200 if request.url.path == "/health" else 404)
    prompt, sampled, content = TURNS[len(json.loads(request.content)["messages"])]
    body = chat_response(
        sampled,
        [-0.5] * len(sampled),
        completion_tokens=len(sampled),
        prompt_ids=prompt,
        content=content,
    )
    return httpx.Response(200, json=body)


def _messages(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "q0"}]
    for turn in range(1, turns):
        said = TURNS[len(messages)][2].split("</think>")[-1]  # reasoning left out of history
        messages += [
            {"role": "assistant", "content": said},
            {"role": "user", "content": f"q{turn}"},
        ]
    return messages


def test_hidden_break_is_flagged_counted_shown_and_curated_and_a_resend_is_none(
    pool_settings: PoolSettings,
) -> None:
    transport = httpx.MockTransport(_answer)
    with gateway_with(pool_settings, free_port(), transport=transport) as gw:
        url = f"{gw.url}/t/hidden/v1/chat/completions"
        for turns in (1, 2, 3, 3):  # the last one an identical re-send of turn 2
            body = {"model": "tiny", "messages": _messages(turns)}
            assert httpx.post(url, json=body, timeout=30).status_code == 200
        metrics = httpx.get(f"{gw.url}/metrics", timeout=30).text
        shown = httpx.get(f"{gw.url}/api/inspector/trajectories/hidden", timeout=30).json()
    turn0, turn1, turn2, again = steps_of(pool_settings, "hidden")

    # Both facts: turn 2 extends turn 0 (its parent) and leaves turn 1 (the latest) at 4.
    assert (turn2.parent_step_id, turn2.extends_parent) == (turn0.id, True)
    assert (turn2.divergence_offset, turn2.divergence_kind) == (4, "thinking_stripped")
    assert "prefix_break" in turn2.flags
    # The window: 8 tokens either side of offset 4 from token 0, of turn 1's S and of P_2.
    assert turn2.divergence_detail == {
        "step_id": turn1.id,
        "offset": 4,
        "window_start": 0,
        "parent_ids": [1, 2, 3, 4, 5, 6],
        "prompt_ids": [1, 2, 3, 4, 9],
    }
    # Its prompt is still stored as a delta on its parent: S_0 (3 tokens) + [4, 9].
    assert turn2.prompt_base_tokens == 3 and turn2.prompt_token_ids == [1, 2, 3, 4, 9]

    # The re-send: turn 2's sibling with the same facts, flagged resend, not a second break.
    assert (again.parent_step_id, again.extends_parent) == (turn0.id, True)
    assert "resend" in again.flags and "prefix_break" not in again.flags
    assert again.prompt_token_ids == [1, 2, 3, 4, 9]

    # Counted once, by kind (the re-send is not counted).
    assert 'trajgate_pool_prefix_breaks_total{kind="thinking_stripped"} 1.0' in metrics
    # Shown where breaks are shown: the inspector's step data.
    (shown_break,) = [s for s in shown["steps"] if "prefix_break" in s["flags"]]
    assert shown_break["id"] == turn2.id and shown_break["extends_parent"] is True
    assert shown_break["divergence_offset"] == 4
    assert shown_break["divergence_detail"]["step_id"] == turn1.id
    # Selected by the curation rule for prefix breaks.
    store = PoolStore(make_engine(pool_settings.resolved_database_url()), pool_settings)
    _rule, result = create_rule(store, "no-breaks", "prefix_break")
    assert result is not None and result.matched == 1
    store.engine.dispose()
