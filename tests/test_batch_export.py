"""Exports of a batch for other trainers, and the ``trajgate batches`` CLI, on SQLite and
PostgreSQL: Parquet with prompt/response columns that are exact slices of the stored IDs, JSONL
chat messages for SFT."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pyarrow.parquet as pq
from batch_helpers import agent_turns, make_store, write_trajectory
from typer.testing import CliRunner

from datapool.settings import PoolSettings
from gateway.server import BackgroundServer
from trajgate.cli import app
from trajgate.vllm_server import VLLMServer


def test_cli_creates_lists_and_exports_a_batch_as_parquet_and_messages(
    pool_settings: PoolSettings, tmp_path: Path
) -> None:
    store = make_store(pool_settings)
    turns = agent_turns(12, 3)
    write_trajectory(store, "ex", turns, reward=1.0)
    steps = store.steps_of("ex")
    db = ["--database-url", pool_settings.resolved_database_url(), "--data-dir", str(tmp_path)]
    runner = CliRunner()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"algorithm": "reinforce_pp", "reward_names": ["final"]}))
    created = runner.invoke(
        app, ["batches", "create", "--spec", str(spec), "--layout", "merged", *db]
    )
    assert created.exit_code == 0, created.output
    batch_id = json.loads(created.output)["id"]
    listed = runner.invoke(app, ["batches", "list", *db])
    assert json.loads(listed.output.splitlines()[0])["id"] == batch_id

    out = tmp_path / "rows.parquet"
    exported = runner.invoke(app, ["batches", "export", batch_id, "--out", str(out), *db])
    assert exported.exit_code == 0, exported.output
    [row] = pq.read_table(out).to_pylist()
    p1 = len(steps[0].prompt_token_ids)
    assert row["prompt_ids"] == steps[0].prompt_token_ids
    assert row["response_ids"] == row["input_ids"][p1:]
    assert row["response_mask"] == row["loss_mask"][p1:]
    assert row["response_logprobs"] == row["behaviour_logprobs"][p1:]

    jsonl = tmp_path / "sft.jsonl"
    exported = runner.invoke(
        app, ["batches", "export", batch_id, "--out", str(jsonl), "--format", "messages", *db]
    )
    assert exported.exit_code == 0, exported.output
    [record] = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert record["messages"] == [*steps[-1].request["messages"], steps[-1].response_message]
    assert record["reward"] == 1.0 and record["step_ids"] == [s.id for s in steps]
    nothing = runner.invoke(app, ["batches", "create", *db])  # everything is batched already
    assert nothing.exit_code == 1


def test_messages_export_writes_a_real_vllm_reply_with_only_the_fields_it_has(
    vllm: VLLMServer, gateway: BackgroundServer, pool_settings: PoolSettings, tmp_path: Path
) -> None:
    """vLLM's reply message carries ``refusal``, ``annotations``, ``audio``, ``function_call``
    ... as null: the step stores it as sent, and the JSONL's last message is the canonical one,
    as every history message is (those null fields were exported, for an SFT chat template to
    read as present)."""
    body = {
        "model": vllm.served_model_name,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    with httpx.Client(base_url=gateway.url, timeout=120) as api:
        answered = api.post("/t/nulls/v1/chat/completions", json=body)
        assert answered.is_success, answered.text
        api.post("/api/trajectories/nulls/complete", json={"reward": 1.0}).raise_for_status()
    reply = answered.json()["choices"][0]["message"]
    store = make_store(pool_settings)
    [step] = store.steps_of("nulls")
    stored = step.response_message
    assert stored is not None
    nulls = sorted(k for k, v in stored.items() if v is None or v == [])
    assert {"annotations", "refusal"} <= set(nulls), stored  # vLLM's, as sent
    store.engine.dispose()
    db = ["--database-url", pool_settings.resolved_database_url(), "--data-dir", str(tmp_path)]
    runner = CliRunner()
    spec = tmp_path / "spec.json"  # one ungrouped trajectory: a baseline without groups
    spec.write_text(json.dumps({"algorithm": "reinforce_pp", "reward_names": ["final"]}))
    created = runner.invoke(app, ["batches", "create", "--spec", str(spec), *db])
    assert created.exit_code == 0, created.output
    batch_id = json.loads(created.output)["id"]
    jsonl = tmp_path / "sft.jsonl"
    exported = runner.invoke(
        app, ["batches", "export", batch_id, "--out", str(jsonl), "--format", "messages", *db]
    )
    assert exported.exit_code == 0, exported.output
    [record] = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert record["messages"] == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": reply["content"]},
    ]


def test_batches_list_refuses_a_status_no_batch_can_have(
    pool_settings: PoolSettings, tmp_path: Path
) -> None:
    """A misspelt status (``redy``) listed nothing and exited 0, as if the pool held no such
    batch; it is refused naming the statuses, like ``export trajectories --status``."""
    db = ["--database-url", pool_settings.resolved_database_url(), "--data-dir", str(tmp_path)]
    refused = CliRunner().invoke(app, ["batches", "list", "--status", "redy", *db])
    assert refused.exit_code == 2, refused.output
    assert "redy" in refused.output and "consumed" in refused.output
    assert CliRunner().invoke(app, ["batches", "list", "--status", "leased", *db]).exit_code == 0
    assert CliRunner().invoke(app, ["batches", "list", "--limit", "0", *db]).exit_code == 2


def test_get_batches_refuses_a_status_no_batch_can_have(gateway: BackgroundServer) -> None:
    with httpx.Client(base_url=gateway.url) as api:
        refused = api.get("/api/batches", params={"status": "redy"})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "status"
        assert api.get("/api/batches", params={"status": "ready"}).json() == []
