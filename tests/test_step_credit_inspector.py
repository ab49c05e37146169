"""Step-level credit in the web inspector (headless Chromium against a real gateway, SQLite and
PostgreSQL): the batch preview of an anchor-state spec shows each row's step reward and both
advantages, and lists the anchor sub-groups (which steps of which rollouts share a state)."""

from __future__ import annotations

from pathlib import Path

import pytest
from batch_helpers import make_store, write_trajectory
from gateway_helpers import gateway_with
from inspector_helpers import CHROMIUM
from playwright.sync_api import Page, expect
from test_inspector_browser import browser, page  # noqa: F401 (the fixtures)
from tests_support import free_port

from datapool.rewards.values import RewardIn, add_rewards
from datapool.settings import PoolSettings

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason="needs Debian's chromium (scripts/setup.sh installs it)"
)


def test_batch_preview_shows_step_advantages_and_the_anchor_sub_groups(
    pool_settings: PoolSettings,
    page: Page,  # noqa: F811 (the fixture)
) -> None:
    store = make_store(pool_settings)
    # one task prompt; a and b answer alike and see the same tool result, c answers otherwise
    shared = ([1, 2, 3, 10, 11, 7], [12, 13])
    write_trajectory(store, "a", [([1, 2, 3], [10, 11]), shared], group_id="g", reward=1.0)
    write_trajectory(store, "b", [([1, 2, 3], [10, 11]), shared], group_id="g", reward=0.0)
    c = write_trajectory(
        store, "c", [([1, 2, 3], [20, 21]), ([1, 2, 3, 20, 21, 7], [22])], group_id="g", reward=1.0
    )
    add_rewards(store.sessions, [RewardIn("step", c[1], "judge", 0.5)])
    store.engine.dispose()
    with gateway_with(pool_settings, free_port()) as server:
        page.goto(f"{server.url}/inspector/trajectories/c")
        expect(page.get_by_test_id("step").nth(1)).to_contain_text("rewards judge=0.500")
        page.goto(f"{server.url}/inspector?group_id=g")
        page.get_by_test_id("batch-from-filter").click()
        page.get_by_test_id("spec-step-advantage").select_option("anchor_state")
        page.get_by_test_id("batch-preview").click()
        expect(page.get_by_test_id("preview-row")).to_have_count(6)
        anchors = page.get_by_test_id("preview-anchor")
        # the first steps of a, b, c share the task state; the second steps of a and b share one
        expect(anchors).to_have_count(2)
        texts = sorted(anchors.all_inner_texts(), key=len)
        assert texts[0].startswith("group g · state ") and texts[0].endswith("a step 1, b step 1")
        assert texts[1].endswith("a step 0, b step 0, c step 0")
        expect(page.get_by_test_id("preview-anchors")).to_contain_text("5 steps share a state")
        # c's second step is alone: A^S = 0
        expect(page.get_by_test_id("preview-step-advantage")).to_contain_text(["0.000"])
