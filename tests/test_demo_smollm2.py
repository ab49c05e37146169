"""The real-model demo, reduced: ``trajgate demo --model smollm2`` on the real vLLM,
then its pool reopened with no vLLM and read in a real browser.

One update of 2 groups x 4 calculator episodes; what is asserted is correctness, not learning
(the curve is ``trajgate bench loop --model smollm2``, docs/demo.md): every step's ids and
logprobs whole, each round served by one policy version in order, the trainer's logprobs equal
to vLLM's (the gap), every answer turn within the 16 tokens it asked for (vLLM's render drops a
``max_tokens`` of 16, which exact continuation restates), each tool call parsed only when
complete, each answer after a tool result an exact continuation, rewards only 0 or 1 and 1 only
where the final answer states the product. The reopened pool decodes its tokens from the pool's
own copy of the tokenizer; screenshots of the trajectory and token views go to
``test-artifacts/inspector/smollm2-*.png``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from inspector_helpers import CHROMIUM, CHROMIUM_ARGS
from playwright.sync_api import expect, sync_playwright
from sqlalchemy import select
from tests_support import free_port

from datapool.db import make_engine
from datapool.models import Reward, Trajectory
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore, StoredStep
from trajgate import demo_task

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "inspector"
GROUPS, GROUP_SIZE = 2, 4
ANSWER_MAX_TOKENS = 16  # trajgate.demo.MODEL_DEFAULTS["smollm2"]["answer_max_tokens"]

pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason="needs Debian's chromium (scripts/setup.sh installs it)"
)


@pytest.fixture(scope="module")
def demo_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict, PoolSettings]]:
    """The summary of one reduced SmolLM2 demo and its pool (its own vLLM, started and stopped
    by the demo)."""
    cwd = tmp_path_factory.mktemp("smollm2-demo")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJGATE_DATA")}
    command = [sys.executable, "-m", "trajgate.cli", "demo", "--model", "smollm2", "--exit"]
    command += ["--json", "--rounds", "1", "--groups", str(GROUPS), "--group-size"]
    command += [str(GROUP_SIZE), "--agents", "4", "--no-control"]
    # SmolLM2's rounds are not replayed by default; the reduced run replays a round whose two
    # groups both scored alike (up to 3 times), so that one update is always trained.
    command += ["--resampled-rounds", "3"]
    command += ["--port", str(free_port()), "--vllm-port", str(free_port())]
    result = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    yield summary, PoolSettings(data_dir=cwd / summary["pool"])


def _store(pool: PoolSettings) -> PoolStore:
    return PoolStore(make_engine(pool.resolved_database_url()), pool)


def _steps(pool: PoolSettings) -> dict[str, list[StoredStep]]:
    """Each trajectory's steps, in order."""
    store = _store(pool)
    with store.sessions() as session:
        ids = session.scalars(select(Trajectory.id)).all()
    return {trajectory_id: store.steps_of(trajectory_id) for trajectory_id in ids}


def test_the_smollm2_demo_trains_on_exact_ids_served_by_each_version_in_turn(
    demo_pool: tuple[dict, PoolSettings],
) -> None:
    summary, pool = demo_pool
    assert summary["model"] == "smollm2" and summary["batches_trained"] == 1
    assert summary["policy_versions"] == [0, 1]
    assert summary["logprob_gap_mean_abs"] < 1e-4  # fp32 vLLM and trainer agree
    curve = summary["reward_by_policy_version"]
    # v0 plays at least one round (more when no group had a reward spread), v1 one round
    assert [v for v, _, _ in curve] == [0, 1]
    assert all(n % (GROUPS * GROUP_SIZE) == 0 and n > 0 for _, _, n in curve)
    steps = _steps(pool)
    assert len(steps) == sum(n for _, _, n in curve) == summary["trajectories"]
    rounds: dict[int, set[int | None]] = {}
    for trajectory_id, trajectory in steps.items():
        round_index = int(trajectory_id.split("-r")[1].split("-")[0])
        rounds.setdefault(round_index, set()).update(s.policy_version for s in trajectory)
        for step in trajectory:
            assert step.outcome == "ok", (trajectory_id, step.error)
            assert step.response_token_ids is not None and step.response_logprobs is not None
            assert len(step.response_token_ids) == len(step.response_logprobs)
            assert len(step.response_token_ids) == step.completion_tokens
            assert "ids_incomplete" not in step.flags
            calls = (step.response_message or {}).get("tool_calls")
            if calls:  # a parsed call is a complete one, never cut at its limit
                assert step.finish_reason != "length" and "tool_call_truncated" not in step.flags
        for answer in trajectory[1:]:  # the turn after the calculator's result
            assert answer.completion_tokens <= ANSWER_MAX_TOKENS
            assert answer.continuation == "exact" and answer.extends_parent
    # each round was served by one version, the last round by the trained one
    served = [rounds[r] for r in sorted(rounds)]
    assert all(len(versions) == 1 for versions in served)
    assert served[-1] == {1} and all(versions == {0} for versions in served[:-1])


def test_the_smollm2_demos_rewards_are_the_products_stated(
    demo_pool: tuple[dict, PoolSettings],
) -> None:
    summary, pool = demo_pool
    with _store(pool).sessions() as session:
        rewards = session.execute(
            select(Reward.trajectory_id, Reward.value).where(Reward.name == "correct_answer")
        ).all()
    values: dict[str, set[float | None]] = {}
    for trajectory_id, value in rewards:
        values.setdefault(trajectory_id, set()).add(value)
    rewarded = 0
    for trajectory_id, trajectory in _steps(pool).items():
        round_index, group = (int(part[1:]) for part in trajectory_id.split("-")[1:3])
        _, product = demo_task.product_question(round_index, group)
        final = trajectory[-1].response_message or {}
        assert values[trajectory_id] in ({0.0}, {1.0}), (trajectory_id, values[trajectory_id])
        if values[trajectory_id] == {1.0}:
            rewarded += 1
            text = str(final.get("content") or "")
            assert not final.get("tool_calls") and demo_task.states_number(text, product)
    means = [mean * n for _, mean, n in summary["reward_by_policy_version"]]
    assert rewarded == round(sum(means))


def test_the_reopened_smollm2_pool_reads_as_english_in_the_browser(
    demo_pool: tuple[dict, PoolSettings],
) -> None:
    # No vLLM runs now: the token view decodes from the pool's own copy of the tokenizer.
    _, pool = demo_pool
    steps = _steps(pool)
    called = next(t for t, s in steps.items() if len(s) > 1)  # a call, its result, an answer
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJGATE_")}
    serve = subprocess.Popen(
        [
            *(sys.executable, "-m", "trajgate.cli", "serve", "--data-dir", str(pool.data_dir)),
            *("--port", str(port), "--upstream", f"http://127.0.0.1:{free_port()}"),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and serve.poll() is None, "serve did not start"
            time.sleep(0.5)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{base}/inspector/trajectories/{called}")
            shown = page.get_by_test_id("step")
            expect(shown).to_have_count(len(steps[called]))
            expect(shown.nth(0)).to_contain_text("What is")
            expect(shown.nth(0)).to_contain_text("calculator")
            page.screenshot(path=str(ARTIFACTS / "smollm2-trajectory.png"), full_page=True)
            page.get_by_test_id("open-tokens").last.click()
            expect(page.get_by_test_id("tokenizer")).to_contain_text("the pool's copy")
            strip = page.get_by_test_id("tokens")
            expect(strip).to_contain_text("What is")
            expect(strip).to_contain_text("calculator")
            page.screenshot(path=str(ARTIFACTS / "smollm2-tokens.png"), full_page=True)
            browser.close()
    finally:
        serve.terminate()
        serve.wait(timeout=30)
