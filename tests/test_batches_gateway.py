"""The whole path through the real gateway in front of the real vLLM, on SQLite and PostgreSQL:
agents call, trajectories complete with rewards, labels and rules curate, a batch is
materialised, a trainer leases it with ``PoolClient``, reads exact rows as Arrow, acks, and the
lineage of a step names the batch and the policy version trained."""

from __future__ import annotations

import io
from typing import Any

import httpx
import numpy as np
import pyarrow.parquet as pq

from datapool.settings import PoolSettings
from gateway.server import BackgroundServer
from trainer_bridge.client import PoolClient, train_batch


def chat(api: httpx.Client, trajectory_id: str, group: str, turns: int) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"solve {trajectory_id}"}]
    for turn in range(turns):
        response = api.post(
            f"/t/{trajectory_id}/v1/chat/completions",
            json={"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 1.0},
            headers={"X-Trajgate-Group": group},
        )
        assert response.status_code == 200, response.text
        messages += [
            {"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"tool result {turn}"},
        ]


def test_a_trainer_leases_exact_rows_of_curated_real_trajectories_and_acks(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    api = httpx.Client(base_url=gateway.url, timeout=120)
    for i, reward in enumerate([1.0, 0.0, 0.5]):
        chat(api, f"real-{i}", "task-1", turns=2)
        done = api.post(f"/api/trajectories/real-{i}/complete", json={"reward": reward})
        assert done.status_code == 200, done.text
    # curation: exclude one member by label, declare an integrity rule
    label = api.post(
        "/api/labels",
        json={"target": "trajectory", "target_id": "real-2", "decision": "exclude", "author": "me"},
    )
    assert label.status_code == 201, label.text
    rule = api.post("/api/curation/rules", json={"name": "integrity", "kind": "integrity"})
    assert rule.status_code == 201 and rule.json()["result"]["matched"] == 0
    assert [r["name"] for r in api.get("/api/curation/rules").json()] == ["integrity"]
    readiness = api.get("/api/trajectories/real-2/readiness").json()
    assert readiness["ready"] is False and "excluded by label" in readiness["reasons"][0]
    assert api.get("/api/trajectories/real-0/readiness").json()["ready"] is True
    group = api.get("/api/groups/task-1/readiness").json()
    assert group["ready"] is False and len(group["members"]) == 3
    bulk = api.post(
        "/api/labels/bulk",
        json={"target": "trajectory", "filter": {"group_ids": ["task-1"]}, "tags": ["seen"]},
    )
    assert len(bulk.json()["ids"]) == 3
    current = api.get("/api/labels/current", params={"target": "trajectory", "target_id": "real-2"})
    assert current.json()["tags"] == ["seen"] and current.json()["decision"] == "exclude"
    assert len(api.get("/api/labels", params={"trajectory_id": "real-2"}).json()) == 2

    bad = api.post("/api/batches", json={"layout": "merged", "reward_to_steps": "discounted"})
    assert bad.status_code == 400 and set(bad.json()) == {"error"}
    created = api.post("/api/batches", json={"name": "b1", "algorithm": "grpo", "layout": "merged"})
    assert created.status_code == 201, created.text
    batch = created.json()
    assert batch["manifest"]["counts"]["trajectories"] == 2  # real-2 is excluded
    nothing = api.post("/api/batches", json={"algorithm": "grpo"})  # all batched already
    assert nothing.status_code == 409 and nothing.json()["error"]["code"] == "nothing_ready"

    with PoolClient(gateway.url) as pool:
        lease = pool.lease("trainer-0", lease_s=60)
        assert lease is not None and lease.batch_id == batch["id"]
        assert pool.lease("trainer-1", lease_s=60) is None  # held by trainer-0
        table = pool.rows(lease.batch_id)
        for row in table.to_pylist():
            for step_id in row["step_ids"]:
                step = api.get(f"/api/steps/{step_id}").json()
                p, r = len(step["prompt_token_ids"]), len(step["response_token_ids"])
                ids = row["input_ids"]
                assert ids[:p] == step["prompt_token_ids"]  # vLLM's own prompt ids
                assert ids[p : p + r] == step["response_token_ids"]
                assert row["loss_mask"][p : p + r] == [1] * r
                expected = np.asarray(step["response_logprobs"], dtype=np.float32).tolist()
                assert row["behaviour_logprobs"][p : p + r] == expected
            assert sum(row["loss_mask"]) == row["num_loss_tokens"]
        rewards = {row["trajectory_id"]: row["advantage"] for row in table.to_pylist()}
        # GRPO over [1.0, 0.0]: mean 0.5, std sqrt(0.5) -> +-0.5 / 0.7071
        assert rewards["real-0"] > 0.7 and rewards["real-1"] < -0.7
        tensors = train_batch(table, pad_token_id=0)
        assert tensors.rows == table.num_rows
        pool.ack(lease, policy_version_trained=7)
        assert pool.lease("trainer-0", lease_s=60) is None  # trained once per consumer

    detail = api.get(f"/api/batches/{batch['id']}").json()
    assert detail["status"] == "consumed"
    assert detail["consumed_by"][0]["policy_version_trained"] == 7
    step_id = table["step_ids"].to_pylist()[0][0]
    lineage = api.get(f"/api/steps/{step_id}/batches").json()
    assert lineage[0]["batch_id"] == batch["id"]
    assert lineage[0]["trained"] == [{"consumer": "trainer-0", "policy_version_trained": 7}]
    parquet = api.get(f"/api/batches/{batch['id']}/rows", params={"format": "parquet"})
    assert pq.read_table(io.BytesIO(parquet.content)).num_rows == table.num_rows
    assert [b["id"] for b in api.get("/api/batches").json()] == [batch["id"]]
    rule_id = api.get("/api/curation/rules").json()[0]["id"]
    assert api.post("/api/curation/apply", json={}).json()[0]["rule_id"] == rule_id
    assert api.delete(f"/api/curation/rules/{rule_id}").status_code == 204
    api.close()
