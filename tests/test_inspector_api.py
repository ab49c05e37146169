"""The inspector's JSON endpoints on SQLite and PostgreSQL: sorted paged lists, the token view
(stored IDs exactly, never re-encoded), group advantages, training metrics, the admin token and
the refusal of cross-site writes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from batch_helpers import agent_turns, call, logprobs_of, make_store, write_trajectory
from fastapi.testclient import TestClient
from sqlalchemy import select, update
from tests_support import free_port

from datapool.models import Step, Trajectory
from datapool.rewards.values import RewardIn, add_rewards
from datapool.settings import PoolSettings
from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway.tokenizer_dirs import TokenizerChoice, TokenizerDirs


@pytest.fixture
def pool(pool_settings: PoolSettings) -> PoolSettings:
    """Four trajectories: g1 = a (reward 1.0), b (0.0), c (0.5); d unrewarded, no group."""
    store = make_store(pool_settings)
    for seed, (tid, group, reward) in enumerate(
        [("a", "g1", 1.0), ("b", "g1", 0.0), ("c", "g1", 0.5), ("d", None, None)]
    ):
        write_trajectory(store, tid, agent_turns(seed, 2), group_id=group, reward=reward)
    store.engine.dispose()
    return pool_settings


def client_for(pool: PoolSettings, **gateway: object) -> TestClient:
    # TestClient's Host, "testserver", is not one of the gateway's names by default.
    settings = GatewaySettings(allowed_hosts=["testserver"], **gateway)  # type: ignore[arg-type]
    return TestClient(create_app(settings, pool))


@pytest.fixture
def client(pool: PoolSettings) -> Iterator[TestClient]:
    with client_for(pool) as test_client:
        yield test_client


def test_list_sorts_by_reward_with_unrewarded_last_in_both_orders(client: TestClient) -> None:
    def ids(order: str) -> list[str]:
        page = client.get(
            "/api/inspector/trajectories",
            params={"sort": "reward", "order": order, "with_total": "true"},
        ).json()
        assert page["total"] == 4
        return [row["id"] for row in page["data"]]

    assert ids("desc") == ["a", "c", "b", "d"]
    assert ids("asc") == ["b", "c", "a", "d"]


def test_list_sorted_by_reward_pages_exactly_like_a_full_sort(pool_settings: PoolSettings) -> None:
    """Every page of the reward sort (walked from the reward index, then the unrewarded) equals
    the same slice of a full sort in Python: the current record per trajectory (re-scored: the
    latest; a later errored record does not count), ties by id, unrewarded last, with a filter."""
    store = make_store(pool_settings)
    rewards: dict[str, float | None] = {}
    for i in range(11):
        tid = f"t{i:02d}"
        reward = None if i % 4 == 3 else float(i % 3) / 2  # ties at 0.0, 0.5 and 1.0
        write_trajectory(store, tid, agent_turns(i, 1), reward=reward)
        rewards[tid] = reward
    add_rewards(
        store.sessions,
        [
            RewardIn("trajectory", "t00", "final", 0.75),  # re-scored: 0.0 -> 0.75
            RewardIn("trajectory", "t01", "final", None, error="reward model timed out"),
            RewardIn("trajectory", "t03", "final", 0.25),  # unrewarded -> rewarded
        ],
    )
    rewards["t00"], rewards["t03"] = 0.75, 0.25
    channels = {f"t{i:02d}": "val" if i % 2 else "train" for i in range(11)}
    with store.sessions.begin() as session:
        for tid, channel in channels.items():
            session.execute(update(Trajectory).where(Trajectory.id == tid).values(channel=channel))
    store.engine.dispose()

    def expected(order: str, channel: str | None) -> list[str]:
        ids = [t for t in sorted(rewards) if channel is None or channels[t] == channel]
        scored = sorted((t for t in ids if rewards[t] is not None), key=lambda t: (rewards[t], t))
        if order == "desc":
            scored.reverse()
        rest = sorted((t for t in ids if rewards[t] is None), reverse=order == "desc")
        return scored + rest

    with client_for(pool_settings) as client:
        for order in ("desc", "asc"):
            for channel in (None, "val"):
                want = expected(order, channel)
                for offset in range(len(want) + 1):
                    params: dict[str, str | int] = {
                        "sort": "reward",
                        "order": order,
                        "offset": offset,
                        "limit": 3,
                    }
                    if channel:
                        params["channel"] = channel
                    got = client.get("/api/inspector/trajectories", params=params).json()
                    assert [row["id"] for row in got["data"]] == want[offset : offset + 3], (
                        order,
                        channel,
                        offset,
                    )
        ranged = client.get(
            "/api/inspector/trajectories",
            params={"sort": "reward", "order": "asc", "reward_min": 0.25, "reward_max": 0.75},
        ).json()
        assert [row["id"] for row in ranged["data"]] == ["t03", "t01", "t04", "t10", "t00"]
        only_unrewarded = client.get(
            "/api/inspector/trajectories", params={"sort": "reward", "rewarded": "false"}
        ).json()
        assert [row["id"] for row in only_unrewarded["data"]] == ["t07"]


def test_list_filters_pages_and_counts_steps_and_tokens(client: TestClient) -> None:
    page = client.get(
        "/api/inspector/trajectories",
        params={"group_id": "g1", "reward_min": 0.5, "sort": "id", "order": "asc", "limit": 1},
    ).json()
    assert [row["id"] for row in page["data"]] == ["a"]
    # a: turn 1 = 5 prompt + 2 response, turn 2 = (5 + 2 + 3) + 2: 7 + 12 = 19 tokens, 2 steps.
    assert (page["data"][0]["steps"], page["data"][0]["tokens"]) == (2, 19)
    second = client.get(
        "/api/inspector/trajectories",
        params={"group_id": "g1", "reward_min": 0.5, "sort": "id", "order": "asc", "offset": 1},
    ).json()
    assert [row["id"] for row in second["data"]] == ["c"]
    unrewarded = client.get("/api/inspector/trajectories", params={"rewarded": "false"}).json()
    assert [row["id"] for row in unrewarded["data"]] == ["d"]


def test_step_tokens_are_the_stored_ids_with_mask_and_logprobs(pool: PoolSettings) -> None:
    # No vLLM answers on the upstream port, so no tokenizer is learnt: ids only, and why.
    with client_for(pool, upstream_url=f"http://127.0.0.1:{free_port()}") as client:
        view = client.get("/api/inspector/trajectories/a").json()
        second = view["steps"][1]
        tokens = client.get(f"/api/steps/{second['id']}/tokens").json()
    assert second["extends_parent"] is True
    (p0, r0), (p1, r1) = agent_turns(0, 2)
    assert tokens["prompt_token_ids"] == p1
    assert tokens["response_token_ids"] == r1
    assert tokens["response_logprobs"] == logprobs_of(r1)
    assert tokens["loss_mask"] == [0] * len(p1) + [1] * len(r1)
    assert tokens["prompt_base_tokens"] == len(p0) + len(r0)  # the parent's prompt + response
    assert tokens["token_texts"] is None and tokens["tokenizer"] is None
    assert "TRAJGATE_TOKENIZER_DIR" in tokens["tokenizer_note"]


def test_group_rollouts_carry_grpo_advantages(client: TestClient) -> None:
    # rewards 1, 0, 0.5: mean 0.5, unbiased std sqrt((0.25 + 0.25 + 0) / 2) = 0.5;
    # advantages (R - 0.5) / 0.5 = 1, -1, 0.
    group = client.get("/api/groups/g1/rollouts").json()
    advantages = {m["id"]: round(m["advantage"], 4) for m in group["members"]}
    assert advantages == {"a": 1.0, "b": -1.0, "c": 0.0}


def test_training_metrics_append_and_poll_after_an_id(client: TestClient) -> None:
    rows = [{"policy_version": 1, "step": s, "metrics": {"loss": 2.0 - s}} for s in range(3)]
    ids = client.post("/api/training-metrics", json={"rows": rows}).json()["ids"]
    assert len(ids) == 3
    newer = client.get("/api/training-metrics", params={"after_id": ids[0]}).json()
    assert [(r["step"], r["metrics"]["loss"]) for r in newer] == [(1, 1.0), (2, 0.0)]
    bad = client.post(
        "/api/training-metrics", json={"rows": [{"step": 1, "metrics": {"loss": "nan"}}]}
    )
    assert bad.status_code == 400


def test_charts_count_every_step_once(client: TestClient) -> None:
    charts = client.get("/api/charts", params={"bucket_s": 86400}).json()
    assert sum(b["steps"] for b in charts["steps_over_time"]) == 8  # 4 trajectories x 2 turns
    assert sum(charts["completion_tokens_histogram"]["counts"]) == 8
    (version,) = charts["reward_by_version"]
    # rewarded: 1.0, 0.0, 0.5 -> mean 0.5 over n = 3 (d is unrewarded, not 0); sample variance
    # (0.25 + 0.25 + 0) / 2 = 0.25, standard error sqrt(0.25 / 3) = 0.288675
    assert (version["channel"], version["mean"], version["n"]) == ("train", 0.5, 3)
    assert version["stderr"] == pytest.approx(0.288675, abs=1e-6)
    assert (charts["reward_name"], charts["reward_names"]) == ("final", ["final"])


def test_charts_default_to_the_reward_recorded_last_with_channels_side_by_side(
    pool: PoolSettings, client: TestClient
) -> None:
    # a second name, on a (1.0) and b (0.0), recorded after 'final'
    judge = [
        {"target": "trajectory", "target_id": t, "name": "judge", "value": v}
        for t, v in (("a", 1.0), ("b", 0.0))
    ]
    assert client.post("/api/rewards", json={"rewards": judge}).status_code == 201
    charts = client.get("/api/charts").json()
    assert (charts["reward_name"], charts["reward_names"]) == ("judge", ["judge", "final"])
    (version,) = charts["reward_by_version"]
    # 1.0 and 0.0: mean 0.5, sample variance 0.5, standard error sqrt(0.5 / 2) = 0.5
    assert (version["mean"], version["n"], version["stderr"]) == (0.5, 2, 0.5)
    # A 'control' trajectory with judge 1.0: its own row beside 'train' (n = 1, no SE).
    client.post("/api/trajectories", json={"id": "e", "channel": "control"}).raise_for_status()
    store = make_store(pool)
    write_trajectory(store, "e", agent_turns(4, 1), reward=None)
    store.engine.dispose()
    one = [{"target": "trajectory", "target_id": "e", "name": "judge", "value": 1.0}]
    assert client.post("/api/rewards", json={"rewards": one}).status_code == 201
    rows = client.get("/api/charts").json()["reward_by_version"]
    assert [(r["channel"], r["n"], r["mean"], r["stderr"]) for r in rows] == [
        ("control", 1, 1.0, None),
        ("train", 2, 0.5, 0.5),
    ]
    chosen = client.get("/api/charts", params={"reward_name": "final"}).json()
    assert chosen["reward_name"] == "final"
    assert [(r["channel"], r["n"]) for r in chosen["reward_by_version"]] == [("train", 3)]


def test_the_list_reads_the_reward_recorded_last_unless_one_is_named(client: TestClient) -> None:
    listed = client.get("/api/inspector/trajectories").json()
    assert listed["reward_name"] == "final"  # the only name in the pool
    judge = [
        {"target": "trajectory", "target_id": t, "name": "judge", "value": v}
        for t, v in (("a", 0.0), ("b", 1.0))
    ]
    assert client.post("/api/rewards", json={"rewards": judge}).status_code == 201
    # now 'judge' was recorded last: the list's reward column, filter and sort read it
    by_reward = client.get(
        "/api/inspector/trajectories", params={"sort": "reward", "order": "desc"}
    ).json()
    assert by_reward["reward_name"] == "judge"
    assert [r["id"] for r in by_reward["data"]][:2] == ["b", "a"]  # c, d have no 'judge'
    rewarded = client.get("/api/inspector/trajectories", params={"rewarded": "true"}).json()
    assert sorted(r["id"] for r in rewarded["data"]) == ["a", "b"]
    named = client.get("/api/inspector/trajectories", params={"reward_name": "final"}).json()
    assert named["reward_name"] == "final"


def test_flag_rates_count_flagged_steps_per_version(pool: PoolSettings, client: TestClient) -> None:
    # 8 unflagged steps at version 0 (the fixture); at version 1: one 'truncated', one
    # 'truncated' + 'prefix_break', one unflagged. Version 1: truncated 2/3, prefix_break 1/3.
    store = make_store(pool)
    for k, flags in enumerate([["truncated"], ["truncated", "prefix_break"], []]):
        prompt, response = agent_turns(10 + k, 1)[0]
        store.record_call(f"f{k}", call(prompt, response, flags=flags, policy_version=1))
    store.engine.dispose()
    rates = client.get("/api/charts").json()["flag_rates"]
    assert rates["flags"] == ["prefix_break", "truncated"]
    by_version = {v["policy_version"]: v for v in rates["versions"]}
    assert by_version[0] == {
        "policy_version": 0,
        "steps": 8,
        "rates": {"prefix_break": 0.0, "truncated": 0.0},
    }
    assert by_version[1]["steps"] == 3
    assert by_version[1]["rates"] == {
        "prefix_break": pytest.approx(1 / 3),
        "truncated": pytest.approx(2 / 3),
    }


def test_readiness_names_the_spec_it_is_judged_against(client: TestClient) -> None:
    # No batch yet: the pool's newest reward name ('final', the only one), which a carries.
    view = client.get("/api/inspector/trajectories/a").json()
    spec = view["readiness"]["spec"]
    assert (spec["source"], spec["reward_names"]) == ("pool", ["final"])
    assert view["readiness"]["ready"] is True
    # A batch of channel 'train' requiring 'judge': now readiness is judged against its spec.
    body = {
        "name": "needs-judge",
        "reward_names": ["judge"],
        "drop_degenerate_groups": False,
        "filters": {"trajectory_ids": ["a", "b", "c"]},
    }
    judge = [
        {"target": "trajectory", "target_id": t, "name": "judge", "value": 1.0}
        for t in ("a", "b", "c")
    ]
    client.post("/api/rewards", json={"rewards": judge})
    made = client.post("/api/batches", json=body)
    assert made.status_code == 201, made.text
    view = client.get("/api/inspector/trajectories/d").json()
    spec = view["readiness"]["spec"]
    assert (spec["source"], spec["name"], spec["reward_names"]) == (
        "batch",
        "needs-judge",
        ["judge"],
    )
    assert spec["batch_id"] == made.json()["id"]
    assert (
        "unrewarded: no current reward 'judge' (missing is not 0)" in view["readiness"]["reasons"]
    )
    assert [s["name"] for s in view["readiness"]["specs"]] == ["needs-judge"]
    # A chosen reward name, and a chosen batch by id; an unknown batch is a 404.
    chosen = client.get("/api/inspector/trajectories/a", params={"reward_name": "nope"}).json()
    assert chosen["readiness"]["spec"]["source"] == "chosen"
    assert (
        "unrewarded: no current reward 'nope' (missing is not 0)" in chosen["readiness"]["reasons"]
    )
    by_id = client.get("/api/inspector/trajectories/a", params={"batch_id": spec["batch_id"]})
    assert by_id.json()["readiness"]["spec"]["name"] == "needs-judge"
    missing = client.get("/api/inspector/trajectories/a", params={"batch_id": "no-such"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "batch_id"


def test_cross_site_writes_are_refused_and_same_origin_ones_pass(client: TestClient) -> None:
    body = {"rows": [{"step": 0, "metrics": {"loss": 1.0}}]}
    for headers in (
        {"sec-fetch-site": "cross-site"},
        {"sec-fetch-site": "same-site"},
        {"origin": "http://evil.example"},
    ):
        refused = client.post("/api/training-metrics", json=body, headers=headers)
        assert refused.status_code == 403, headers
        assert refused.json()["error"]["code"] == "cross_site"
    same = {"origin": "http://testserver", "sec-fetch-site": "same-origin"}
    assert client.post("/api/training-metrics", json=body, headers=same).status_code == 201
    assert client.post("/api/training-metrics", json=body).status_code == 201  # a trainer
    assert len(client.get("/api/training-metrics").json()) == 2


def test_admin_token_guards_the_inspector_api_but_not_its_page(pool: PoolSettings) -> None:
    with client_for(pool, admin_token="s3cret") as client:
        assert client.get("/inspector").status_code == 200  # the page holds no data
        denied = client.get("/api/inspector/trajectories")
        assert denied.status_code == 401
        assert denied.json()["error"]["code"] == "invalid_admin_token"
        ok = client.get("/api/inspector/trajectories", headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200


def test_inspector_page_forbids_inline_script(client: TestClient) -> None:
    page = client.get("/inspector/trajectories/a")
    assert page.status_code == 200
    csp = page.headers["content-security-policy"]
    assert "script-src 'self' 'unsafe-eval'" in csp and "unsafe-inline" not in csp.split(";")[1]
    assert client.get("/inspector/static/..%2Finspector.py").status_code == 404  # no traversal
    assert client.get("/inspector/static/vendor/alpinejs-3.17.5.min.js").status_code == 200


def test_tokenizer_dirs_follow_vllm_roots_and_adapter_parents(tmp_path: Path) -> None:
    """vLLM's /v1/models (the upstream edge, faked with MockTransport): a base model whose root
    holds tokenizer.json, a LoRA adapter without one (its parent's is used), and a model served
    from a path that is not on this machine (no tokenizer, and the note says which path)."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "tokenizer.json").write_text("{}")
    listed = [
        {"id": "base", "root": str(base), "parent": None},
        {"id": "policy-v3", "root": str(tmp_path / "adapters" / "v3"), "parent": "base"},
        {"id": "remote", "root": "/models/elsewhere", "parent": None},
    ]
    calls = []

    def models(request: httpx.Request) -> httpx.Response:
        calls.append(str(request.url))
        return httpx.Response(200, json={"object": "list", "data": listed})

    dirs = TokenizerDirs(refresh_s=60)

    async def learn_twice() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(models)) as client:
            await dirs.learn(client, ["http://vllm"], 1.0)
            await dirs.learn(client, ["http://vllm"], 1.0)  # within refresh_s: not asked again

    asyncio.run(learn_twice())
    assert calls == ["http://vllm/v1/models"]
    assert dirs.choose("base", None) == TokenizerChoice(base, "vLLM /v1/models root of 'base'")
    assert dirs.choose("policy-v3", None) == TokenizerChoice(
        base, "vLLM /v1/models root of 'policy-v3'"
    )
    assert dirs.choose("remote", None) is None
    assert "'/models/elsewhere'" in dirs.note("remote")
    # an adapter unloaded since: the one directory every listed model shares
    assert dirs.choose("policy-v1", None) == TokenizerChoice(
        base, "vLLM /v1/models root of the only served model"
    )
    override = tmp_path / "mine"
    assert dirs.choose("base", override) == TokenizerChoice(override, "TRAJGATE_TOKENIZER_DIR")


def test_steps_over_time_widens_buckets_past_500(pool: PoolSettings, client: TestClient) -> None:
    # The fixture's 8 steps moved 200 s apart from 2026-01-01 00:00:00 UTC: 1400 s span, so
    # 1 s buckets would be 1401 > 500; widened to ceil(1401 / 500) = 3 s, one step per bucket.
    store = make_store(pool)
    with store.sessions.begin() as session:
        ids = list(session.scalars(select(Step.id).order_by(Step.created_at, Step.id)))
        for k, step_id in enumerate(ids):
            at = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=200 * k)
            session.execute(update(Step).where(Step.id == step_id).values(created_at=at))
    store.engine.dispose()
    charts = client.get("/api/charts", params={"bucket_s": 1}).json()
    assert charts["bucket_s"] == 3
    start = int(datetime(2026, 1, 1, tzinfo=UTC).timestamp())  # a multiple of 3
    assert [b["t"] - start for b in charts["steps_over_time"]] == [
        200 * k // 3 * 3 for k in range(8)
    ]
    assert [b["steps"] for b in charts["steps_over_time"]] == [1] * 8
