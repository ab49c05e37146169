"""The web inspector end to end: headless Chromium (Debian's package, driven by Playwright)
against the gateway in front of the real vLLM, with data captured from a real OpenAI-SDK agent.

Screenshots of every view go to ``test-artifacts/inspector/`` (gitignored).
"""

from __future__ import annotations

import functools
import http.server
import io
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
from gateway_helpers import emulated_gateway
from inspector_helpers import CHROMIUM, CHROMIUM_ARGS, SCRIPT_PAYLOAD, populate, run_episode
from playwright.sync_api import Browser, Page, expect, sync_playwright
from test_lineages import spawn_a_sub_agent_and_a_side_call

from datapool.settings import PoolSettings
from gateway.server import BackgroundServer
from trainer_bridge.client import PoolClient
from trainer_bridge.trainer import UpdateMetrics

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "inspector"

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason="needs Debian's chromium (scripts/setup.sh installs it)"
)


@pytest.fixture(autouse=True)
def _no_tokenizer_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """No TRAJGATE_TOKENIZER_DIR: the gateway learns the tokenizer from vLLM's /v1/models."""
    monkeypatch.delenv("TRAJGATE_TOKENIZER_DIR", raising=False)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1400, "height": 900}, accept_downloads=True)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert errors == [], f"script errors in the page: {errors}"


def shot(page: Page, name: str, backend: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{backend}-{name}.png"), full_page=True)


def backend_of(pool_settings: PoolSettings) -> str:
    return "sqlite" if str(pool_settings.database_url).startswith("sqlite") else "postgresql"


def test_inspector_views_curation_and_batches_in_a_real_browser(
    gateway: BackgroundServer, pool_settings: PoolSettings, page: Page
) -> None:
    assert "TRAJGATE_TOKENIZER_DIR" not in os.environ
    base = gateway.url
    backend = backend_of(pool_settings)
    made = populate(base)

    # ---- list: 8 trajectories, newest first; filters narrow it and live in the URL.
    page.goto(f"{base}/inspector")
    rows = page.get_by_test_id("trajectory-row")
    expect(rows).to_have_count(8)
    expect(page.get_by_test_id("total")).to_have_text("8 matching")
    shot(page, "list", backend)
    page.locator("input[name=group_id]").fill("tokyo")
    page.locator("input[name=reward_min]").fill("0.5")
    page.get_by_test_id("apply-filters").click()
    expect(rows).to_have_count(2)  # tokyo-1 (1.0) and tokyo-2 (0.5); tokyo-0 has 0.0
    assert "group_id=tokyo" in page.url and "reward_min=0.5" in page.url
    page.get_by_role("columnheader", name="reward").click()  # sort by reward, descending
    expect(rows.nth(0)).to_contain_text("tokyo-1")
    expect(rows.nth(1)).to_contain_text("tokyo-2")
    assert "sort=reward" in page.url
    page.reload()  # the filter and sort come back from the URL alone
    expect(rows).to_have_count(2)
    expect(rows.nth(0)).to_contain_text("tokyo-1")
    shot(page, "list-filtered", backend)
    page.goto(f"{base}/inspector?rewarded=false")
    expect(rows).to_have_count(1)
    expect(rows.nth(0)).to_contain_text("lonely")
    expect(rows.nth(0).get_by_test_id("row-reward")).to_have_text("unrewarded")

    # ---- trajectory view: steps in order with state, action, policy version, flags.
    page.goto(f"{base}/inspector/trajectories/paris-0")
    steps = page.get_by_test_id("step")
    expect(steps).to_have_count(len(made["paris-0"]["steps"]))
    expect(steps.nth(0)).to_contain_text("What is the weather in Paris?")
    expect(steps.nth(0)).to_contain_text("policy v0")
    expect(steps.nth(0)).to_contain_text("rewards format=0.250")
    expect(page.get_by_test_id("trajectory-rewards")).to_have_text("final=1.000")
    # No batch yet: readiness is judged against the pool's newest reward name, which it carries.
    expect(page.get_by_test_id("readiness-spec")).to_contain_text("requires final")
    expect(page.get_by_test_id("readiness")).to_contain_text("ready for a batch")
    if any(s["extends_parent"] is False for s in made["paris-0"]["steps"]):
        expect(page.get_by_test_id("prefix-break").first).to_contain_text("prefix break at token")
    shot(page, "trajectory", backend)

    # ---- token view: every prompt and response token as text, decoded with the tokenizer the
    # gateway learnt from vLLM (no setting), the boundary, special tokens, hover, ids on demand.
    step = made["paris-0"]["steps"][-1]
    page.get_by_test_id("open-tokens").last.click()
    tokens = page.get_by_test_id("tokens").locator("span")
    expect(tokens).to_have_count(step["prompt_tokens"] + step["completion_tokens"])
    expect(page.get_by_test_id("tokenizer")).to_contain_text("vLLM /v1/models root of 'tiny'")
    strip = page.get_by_test_id("tokens")
    expect(strip).to_contain_text("What is the weather in Paris?")  # the prompt, as text
    expect(strip.locator(".special").first).to_have_text("<|im_start|>")
    boundary = page.locator("[data-boundary=response-start]")
    expect(boundary).to_have_count(1)
    boundary.hover()
    hover = page.get_by_test_id("token-hover")
    expect(hover).to_contain_text(f"#{step['prompt_tokens']} response")
    expect(hover).to_contain_text("text ")
    expect(hover).to_contain_text("logprob -")
    expect(hover).to_contain_text("loss mask 1")
    # Long prompts wrap inside the page: the strip is no wider than its box.
    assert strip.evaluate("e => e.scrollWidth <= e.clientWidth")
    shot(page, "tokens", backend)
    page.get_by_test_id("token-mode-ids").click()
    expect(strip).not_to_contain_text("What is the weather")
    first_id = httpx.get(f"{base}/api/steps/{step['id']}/tokens").json()["prompt_token_ids"][0]
    expect(tokens.first).to_have_text(f"{first_id} ")
    assert strip.evaluate("e => e.scrollWidth <= e.clientWidth")
    shot(page, "tokens-ids", backend)
    page.get_by_test_id("token-mode-text").click()
    expect(strip).to_contain_text("What is the weather in Paris?")

    # ---- group view: rollouts side by side with GRPO advantages.
    # paris rewards 1, 0, 1: mean 2/3, unbiased std sqrt(1/3) = 0.5774;
    # advantages (1 - 2/3) / 0.5774 = 0.577 and (0 - 2/3) / 0.5774 = -1.155.
    page.goto(f"{base}/inspector/groups/paris")
    advantages = page.get_by_test_id("advantage")
    expect(advantages).to_have_text(["0.577", "-1.155", "0.577"])
    shot(page, "group", backend)

    # ---- curation changes what a batch contains: exclude paris-1 from the trajectory view.
    before = httpx.post(
        f"{base}/api/batches/preview",
        json={"filters": {"group_ids": ["paris"]}, "drop_degenerate_groups": False},
    ).json()
    assert {r["trajectory_id"] for r in before["head"]} == {"paris-0", "paris-1", "paris-2"}
    page.goto(f"{base}/inspector/trajectories/paris-1")
    page.get_by_test_id("trajectory-decision").select_option("exclude")
    page.get_by_test_id("trajectory-note").fill("answer is nonsense")
    page.get_by_test_id("trajectory-label-save").click()
    expect(page.get_by_test_id("trajectory-label")).to_contain_text("exclude")
    expect(page.get_by_test_id("readiness")).to_contain_text("not ready")

    # Bulk on the filter, keyboard review: tag every tokyo trajectory, then exclude one by key.
    page.goto(f"{base}/inspector?group_id=tokyo")
    expect(rows).to_have_count(3)
    page.get_by_test_id("bulk-scope").select_option("filter")
    page.get_by_test_id("bulk-tags").fill("reviewed")
    page.get_by_test_id("bulk-apply").click()
    expect(page.get_by_test_id("message")).to_have_text("labelled 3 trajectory(s)")
    expect(rows.filter(has_text="reviewed")).to_have_count(3)
    page.locator("body").press("j")  # cursor to the second row (tokyo-1)
    page.locator("body").press("x")  # exclude it
    expect(rows.nth(1).get_by_test_id("row-decision")).to_have_text("exclude")

    # ---- batches: the spec comes from the list's filter; preview, materialise, download.
    page.goto(f"{base}/inspector?group_id=paris")
    page.get_by_test_id("batch-from-filter").click()
    expect(page.get_by_test_id("spec-filters")).to_contain_text('"group_ids":["paris"]')
    page.get_by_test_id("spec-name").fill("paris-batch")
    # Without paris-1 the group's rewards are 1, 1: degenerate (std 0), so keep it explicitly.
    page.get_by_test_id("spec-drop-degenerate").uncheck()
    page.get_by_test_id("batch-preview").click()
    preview_rows = page.get_by_test_id("preview-row")
    expect(preview_rows.first).to_be_visible()
    texts = preview_rows.all_inner_texts()
    assert not any("paris-1" in t for t in texts), "the excluded trajectory is not in the batch"
    assert {"paris-0", "paris-2"} <= {t.split()[0] for t in texts}
    page.get_by_test_id("batch-create").click()
    expect(page.get_by_test_id("batch-detail")).to_contain_text("paris-0")
    expect(page.get_by_test_id("batch-detail")).not_to_contain_text("paris-1")
    shot(page, "batches", backend)
    batch_id = httpx.get(f"{base}/api/batches").json()[0]["id"]
    with page.expect_download() as download_info:
        page.get_by_test_id(f"download-{batch_id}").click()
    table = pq.read_table(io.BytesIO(Path(download_info.value.path()).read_bytes()))
    assert set(table["trajectory_id"].to_pylist()) == {"paris-0", "paris-2"}
    page.goto(f"{base}/inspector/trajectories/paris-0")  # now judged against that batch's spec
    expect(page.get_by_test_id("readiness-spec")).to_contain_text("batch paris-batch")

    # ---- curation page: a rule, what it marked and why.
    page.goto(f"{base}/inspector/curation")
    page.get_by_test_id("rule-name").fill("short-responses-only")
    page.get_by_test_id("rule-kind").select_option("length")
    page.get_by_test_id("rule-params").fill('{"max_response_tokens": 8}')
    page.get_by_test_id("rule-create").click()
    expect(page.get_by_test_id("marks")).to_contain_text("short-responses-only")
    expect(page.get_by_test_id("marks")).to_contain_text("response")
    shot(page, "curation", backend)

    # ---- charts render from the aggregates and the trainer's metrics.
    page.goto(f"{base}/inspector/charts")
    expect(page.locator("#chart-training canvas")).to_have_count(1)
    expect(page.locator("#chart-reward canvas")).to_have_count(1)
    expect(page.locator("#chart-completion canvas")).to_have_count(1)
    shot(page, "charts", backend)


def _update(step: int, loss: float) -> UpdateMetrics:
    return UpdateMetrics(
        loss=loss,
        clip_fraction=0.0,
        ratio_mean=1.0,
        kl=None,
        entropy_mean=2.0,
        grad_norm=0.5,
        tokens=100,
        tokens_per_s=50.0,
        logprob_gap_mean_abs=0.01,
        logprob_gap_max_abs=0.1,
        step=step,
    )


def _axis_ticks(page: Page, chart: str) -> list[float]:
    """The x-axis tick values uPlot drew in ``chart`` (its ``_splits``)."""
    ticks: list[float] = page.evaluate(
        """(id) => {
            const data = window.Alpine.$data(document.querySelector("[x-data]"));
            const plot = data.plots.find((p) => p.root.parentElement.id === id);
            return plot.axes[0]._splits;
        }""",
        chart,
    )
    return ticks


def test_charts_show_the_pools_reward_name_and_the_trainers_metrics_live(
    gateway: BackgroundServer, pool_settings: PoolSettings, page: Page
) -> None:
    """Rewards under a name other than 'final' (as the demo's ``numeric_answer``), on real
    agent trajectories in two channels, and the metrics the trainer's client posts."""
    base = gateway.url
    backend = backend_of(pool_settings)
    rewards = []
    for channel, values in (("train", [1.0, 0.0, 1.0]), ("control", [0.0, 1.0])):
        for k, value in enumerate(values):
            tid = f"{channel}-{k}"
            run_episode(base, tid, seed=k, channel=channel)
            rewards.append(
                {"target": "trajectory", "target_id": tid, "name": "numeric_answer", "value": value}
            )
    httpx.post(f"{base}/api/rewards", json={"rewards": rewards}).raise_for_status()
    with PoolClient(base) as pool:
        for step in (1, 2):
            pool.post_training_metrics("train", step, _update(step, 1.0 / step))

    page.goto(f"{base}/inspector/charts")
    expect(page.get_by_test_id("chart-reward-name")).to_have_value("numeric_answer")
    # train: 1, 0, 1 -> mean 2/3, sample variance 1/3, SE sqrt(1/9) = 0.333, n 3 (policy v0);
    # control: 0, 1 -> mean 0.5, sample variance 0.5, SE sqrt(0.25) = 0.5, n 2.
    rows = page.get_by_test_id("reward-row")
    expect(rows).to_have_count(2)
    expect(rows.nth(0)).to_have_text("control00.500± 0.5002")
    expect(rows.nth(1)).to_have_text("train00.667± 0.3333")
    expect(page.locator("#chart-reward canvas")).to_have_count(1)
    expect(page.get_by_test_id("chart-metric")).to_have_value("loss")
    training = page.get_by_test_id("chart-training")
    expect(training.locator("canvas")).to_have_count(1)
    expect(training).to_contain_text("train loss")  # the legend: one line per run
    shot(page, "charts-reward-and-training", backend)
    # Integer axes: policy versions and optimiser steps are ticked at whole numbers only.
    for chart in ("chart-reward", "chart-flags", "chart-training"):
        ticks = _axis_ticks(page, chart)
        assert ticks and all(float(t).is_integer() for t in ticks), (chart, ticks)

    # Live: a new run's metrics appear while the page is open, without a reload.
    with PoolClient(base) as pool:
        pool.post_training_metrics("second-run", 3, _update(3, 0.2))
    expect(training).to_contain_text("second-run loss", timeout=15_000)
    page.get_by_test_id("chart-metric").select_option("grad_norm")
    expect(training).to_contain_text("train grad_norm")
    shot(page, "charts-live", backend)


def test_inspector_renders_captured_script_as_text_and_updates_live(
    gateway: BackgroundServer, pool_settings: PoolSettings, page: Page
) -> None:
    base = gateway.url
    backend = backend_of(pool_settings)
    run_episode(base, "xss", question=SCRIPT_PAYLOAD, reward=0.0)

    page.goto(f"{base}/inspector/trajectories/xss")
    user = page.get_by_test_id("message-content").nth(1)
    expect(user).to_have_text(SCRIPT_PAYLOAD)  # the markup shows as its own characters
    assert page.evaluate("window.__pwned") is None  # and neither the script nor onerror ran
    assert user.evaluate("element => element.children.length") == 0  # text, no elements
    assert page.locator("img, main script").count() == 0
    shot(page, "script-as-text", backend)

    # Live: a trajectory recorded while the list is open appears without a reload; paused, not.
    page.goto(f"{base}/inspector")
    rows = page.get_by_test_id("trajectory-row")
    expect(rows).to_have_count(1)
    run_episode(base, "arrives-live", complete=False)
    expect(rows).to_have_count(2, timeout=10_000)
    expect(rows.nth(0)).to_contain_text("arrives-live")
    page.get_by_test_id("live-toggle").click()  # pause
    run_episode(base, "arrives-paused", complete=False)
    page.wait_for_timeout(5000)  # more than two live intervals
    expect(rows).to_have_count(2)
    page.get_by_test_id("live-toggle").click()  # resume
    expect(rows).to_have_count(3, timeout=10_000)
    shot(page, "list-live", backend)


def test_cross_site_page_cannot_write_through_the_inspector(
    gateway: BackgroundServer, page: Page, tmp_path: Path
) -> None:
    """A page on another origin posts to the gateway; the browser sends it, the gateway refuses
    it, and nothing is written."""
    base = gateway.url
    run_episode(base, "victim", reward=1.0)
    # Another origin on this machine (a different port is another origin, and the same site).
    evil_dir = tmp_path / "evil"
    evil_dir.mkdir()
    (evil_dir / "evil.html").write_text("<html><body>evil</body></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(evil_dir))
    evil = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    try:
        page.goto(f"http://127.0.0.1:{evil.server_address[1]}/evil.html")
        statuses = page.evaluate(
            """async (base) => {
                const out = [];
                // A 'simple' request needs no preflight: the browser really sends it.
                for (const path of ["/api/training-metrics", "/api/labels"]) {
                    const r = await fetch(base + path, {method: "POST", mode: "no-cors",
                        headers: {"Content-Type": "text/plain"},
                        body: JSON.stringify({rows: [{step: 1, metrics: {x: 1}}],
                            target: "trajectory", target_id: "victim", decision: "exclude"})});
                    out.push(r.type);
                }
                return out;
            }""",
            base,
        )
        assert statuses == ["opaque", "opaque"]
        assert httpx.get(f"{base}/api/training-metrics").json() == []
        assert httpx.get(f"{base}/api/labels", params={"trajectory_id": "victim"}).json() == []
    finally:
        evil.shutdown()


def test_the_trajectory_view_labels_each_step_with_its_lineage(
    gateway: BackgroundServer, pool_settings: PoolSettings, page: Page
) -> None:
    # A main agent and its sub-agent, named by trajgate's own headers, take turns: each step
    # is labelled with its conversation's kind and id (the sub-agent's with its parent's).
    base = gateway.url
    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    for name, parent in (("planner", None), ("searcher", "planner"), ("planner", None)):
        headers = {"X-Trajgate-Lineage": name}
        if parent is not None:
            headers["X-Trajgate-Lineage-Parent"] = parent
        answer = httpx.post(
            f"{base}/t/lineages/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": name}], "max_tokens": 2},
            headers=headers,
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
    page.goto(f"{base}/inspector/trajectories/lineages")
    labels = page.get_by_test_id("lineage")
    expect(labels).to_have_count(3)
    expect(labels.nth(0)).to_have_text("main planner")
    expect(labels.nth(1)).to_have_text("subagent searcher (of planner)")
    expect(labels.nth(2)).to_have_text("main planner")
    shot(page, "lineages", backend_of(pool_settings))


def test_a_resent_step_shows_its_call_id_and_the_step_it_re_sent(
    gateway: BackgroundServer, page: Page
) -> None:
    # The same body twice within TRAJGATE_RESEND_WINDOW_S: the second is flagged resend and
    # keeps the first call's call_id, which the page shows on both, naming the first step.
    base = gateway.url
    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "again"}], "max_tokens": 2}
    for _ in range(2):
        answer = httpx.post(f"{base}/t/resent/v1/chat/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
    steps = httpx.get(f"{base}/api/trajectories/resent", timeout=30).json()["steps"]
    assert [s["flags"].count("resend") for s in steps] == [0, 1]
    page.goto(f"{base}/inspector/trajectories/resent")
    calls = page.get_by_test_id("call-id")
    expect(calls).to_have_count(2)
    expect(calls.nth(0)).to_have_text(f"call {steps[0]['call_id']}")
    expect(calls.nth(1)).to_have_text(f"call {steps[0]['call_id']}")
    expect(page.get_by_test_id("resent-step").nth(1)).to_have_text("re-sends step 0")
    expect(page.get_by_test_id("resent-step").nth(0)).to_be_hidden()


def test_the_trajectory_view_nests_a_sub_agent_under_its_spawning_step_and_marks_side_calls(
    gateway: BackgroundServer, pool_settings: PoolSettings, page: Page
) -> None:
    # Calls m0 s0 s1 m1 t0 m2 (test_lineages.spawn_a_sub_agent_and_a_side_call): the planner's
    # three turns, its sub-agent "searcher" spawned by m0, a title side call after m1. By
    # lineage the view shows m0, then the searcher one level deeper, then m1, the title one
    # level deeper, m2; each lineage's first step under a header with its kind and training
    # rows, each step with its row.
    spawn_a_sub_agent_and_a_side_call(gateway, "spawned")
    base = gateway.url
    page.goto(f"{base}/inspector/trajectories/spawned")
    wraps = page.get_by_test_id("step-wrap")
    expect(wraps).to_have_count(6)
    depths = [wraps.nth(k).get_attribute("data-depth") for k in range(6)]
    kinds = [wraps.nth(k).get_attribute("data-lineage-kind") for k in range(6)]
    assert depths == ["0", "1", "1", "0", "1", "0"]
    assert kinds == ["main", "subagent", "subagent", "main", "side_call", "main"]
    steps = page.get_by_test_id("step")
    order = [steps.nth(k).locator("b").first.inner_text() for k in range(6)]
    assert order == ["step 0", "step 1", "step 2", "step 3", "step 4", "step 5"]
    # The sub-agent is drawn to the right of the planner's steps (nested, not just labelled).
    assert steps.nth(1).bounding_box()["x"] > steps.nth(0).bounding_box()["x"]  # type: ignore[index]
    heads = page.locator("[data-testid=lineage-start]:visible")
    expect(heads).to_have_count(3)
    expect(heads.nth(0)).to_contain_text("main planner · 3 steps · 1 training row")
    expect(heads.nth(1)).to_contain_text("subagent searcher (of planner) · spawned by step 0")
    expect(heads.nth(2)).to_contain_text("side_call")
    expect(heads.nth(2)).to_contain_text("(of planner) · after step 3 · 1 step · 1 training row")
    rows = [0, 1, 1, 0, 2, 0]
    expect(page.get_by_test_id("step-row")).to_have_text([f"training row {k}" for k in rows])
    entries = page.get_by_test_id("lineage-entry")
    expect(entries).to_have_count(3)
    expect(page.get_by_test_id("lineage-row")).to_have_text(
        ["row 0 (steps 0, 3, 5)", "row 1 (steps 1, 2)", "row 2 (step 4)"]
    )
    # The title call between two planner turns is no break of the planner's chain.
    expect(page.locator(".flag", has_text="prefix_break")).to_have_count(0)
    shot(page, "lineage-nesting", backend_of(pool_settings))


@pytest.mark.parametrize("offset", ["abc", "-5", "1e3"])
def test_a_garbled_token_view_offset_is_the_apis_error_not_the_first_window(
    sqlite_pool: PoolSettings, page: Page, offset: str
) -> None:
    """``/inspector/steps/<id>?offset=`` is the token view's page cursor: one the API would
    refuse was read as 0 (``Number("abc") || 0``) and the first window shown as if asked for.
    An emulated upstream: the view's own tokens are not what is tested here."""
    with emulated_gateway(sqlite_pool, prompt_tokens=6, response_tokens=3) as gateway:
        chat = {"model": "emulated", "messages": [{"role": "user", "content": "hi"}]}
        answered = httpx.post(f"{gateway.url}/t/tokens-offset/v1/chat/completions", json=chat)
        step_id = answered.headers["x-trajgate-step-id"]
        page.goto(f"{gateway.url}/inspector/steps/{step_id}?offset={offset}")
        message = page.get_by_test_id("message")
        expect(message).to_contain_text(f"got '{offset}'")  # the API's 400, param offset
        expect(message).to_have_class("status error")
        page.goto(f"{gateway.url}/inspector/steps/{step_id}?offset=2")  # 6 + 3 positions
        expect(page.get_by_test_id("token-window")).to_have_text("showing tokens 2–9 of 9")
        expect(page.get_by_test_id("message")).to_have_text("")
