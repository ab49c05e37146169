"""``trajgate export trajectories`` writes Parquet that pyarrow, DuckDB and Polars read without
trajgate, with exact IDs, null rewards for the unrewarded, and untrainable rows marked; and
``trajgate rewards import`` appends rewards from JSONL."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from datapool.db import make_engine
from datapool.lifecycle.transitions import close_trajectory, create_trajectory
from datapool.models import Reward, TrajectoryStatus
from datapool.queries.rewards import reward_history
from datapool.settings import PoolSettings
from datapool.steps.records import CallRecord, ChoiceRecord
from datapool.steps.store import PoolStore
from trajgate.cli import app


def _records(store: PoolStore) -> list[Reward]:
    return reward_history(store.sessions, trajectory_id="i1", target_id=None, limit=100)


def _call(prompt: list[int], response: list[int]) -> CallRecord:
    return CallRecord(
        request={"messages": [{"role": "user", "content": "q"}]},
        upstream_request={},
        model="tiny",
        upstream="http://up",
        policy_version=3,
        latency_ms=1.0,
        prompt_token_ids=prompt,
        prompt_tokens=len(prompt),
        choices=[ChoiceRecord(0, response, [-0.5] * len(response), {"content": "a"}, "stop")],
    )


def _cli_pool(pool_settings: PoolSettings) -> list[str]:
    return ["--database-url", pool_settings.resolved_database_url()]


def test_export_parquet_reads_back_in_pyarrow_duckdb_and_polars(
    pool_settings: PoolSettings, tmp_path: Path
) -> None:
    store = PoolStore(make_engine(pool_settings.resolved_database_url()), pool_settings)
    store.record_call("e1", _call([1, 2], [3]))
    store.record_call("e1", _call([1, 2, 3, 4], [5, 6]))  # delta [4] on base 3 tokens
    close_trajectory(store.sessions, "e1", TrajectoryStatus.COMPLETE, final_reward=1.0)
    create_trajectory(store.sessions, "e2")
    close_trajectory(store.sessions, "e2", TrajectoryStatus.COMPLETE)  # empty (C15)
    out = tmp_path / "steps.parquet"
    result = CliRunner().invoke(
        app,
        [
            "export",
            "trajectories",
            "--out",
            str(out),
            "--status",
            "complete",
            *_cli_pool(pool_settings),
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["rows"] == 2  # e2 has no steps
    table = pq.read_table(out)
    assert table.column("prompt_token_ids").to_pylist() == [[1, 2], [1, 2, 3, 4]]
    assert table.column("trajectory_rewards_json").to_pylist() == ['{"final": 1.0}'] * 2
    assert table.column("step_rewards_json").to_pylist() == ["{}", "{}"]  # unrewarded
    duck = duckdb.sql(
        f"SELECT response_token_ids, policy_version FROM read_parquet('{out}') ORDER BY step_index"
    ).fetchall()
    assert duck == [([3], 3), ([5, 6], 3)]
    frame = pl.read_parquet(out)
    assert frame["trainable"].to_list() == [True, True]
    assert frame["response_logprobs"].to_list()[1] == [-0.5, -0.5]


def test_rewards_import_appends_from_jsonl_and_rejects_unknown_targets(
    pool_settings: PoolSettings, tmp_path: Path
) -> None:
    store = PoolStore(make_engine(pool_settings.resolved_database_url()), pool_settings)
    [step_id] = store.record_call("i1", _call([1], [2]))
    good = tmp_path / "good.jsonl"
    good.write_text(
        json.dumps({"target": "step", "target_id": step_id, "name": "judge", "value": 0.25})
        + "\n"
        + json.dumps({"target": "trajectory", "target_id": "i1", "name": "final", "value": 1})
        + "\n"
    )
    ok = CliRunner().invoke(app, ["rewards", "import", str(good), *_cli_pool(pool_settings)])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output) == {"imported": 2}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"target": "step", "target_id": "nope", "name": "x", "value": 1}))
    failed = CliRunner().invoke(app, ["rewards", "import", str(bad), *_cli_pool(pool_settings)])
    assert failed.exit_code == 1
    assert "nothing imported" in failed.stderr and "nope" in failed.stderr
    assert failed.exception is not None and not failed.stderr.startswith("Traceback")


def test_export_refuses_an_unknown_status_and_a_data_dir_without_a_pool(
    pool_settings: PoolSettings, tmp_path: Path
) -> None:
    out = tmp_path / "x.parquet"
    bogus = CliRunner().invoke(
        app,
        [
            "export",
            "trajectories",
            "--out",
            str(out),
            "--status",
            "bogus",
            *_cli_pool(pool_settings),
        ],
    )
    assert bogus.exit_code == 2
    assert "bogus" in bogus.stderr and "complete" in bogus.stderr
    typo = tmp_path / "no-such-pool"
    missing = CliRunner().invoke(
        app, ["export", "trajectories", "--out", str(out), "--data-dir", str(typo)]
    )
    assert missing.exit_code == 2
    assert "no pool at" in missing.stderr
    assert not typo.exists()  # nothing was created at the mistyped path
    assert not out.exists()


def test_a_postgres_url_without_a_driver_means_psycopg() -> None:
    for written in ("postgres://u@h:5432/db", "postgresql://u@h:5432/db"):
        assert PoolSettings(database_url=written).resolved_database_url() == (
            "postgresql+psycopg://u@h:5432/db"
        )


_GOOD_ROW = {"target": "trajectory", "target_id": "i1", "name": "judge", "value": 0.5}


@pytest.mark.parametrize(
    ("row", "said"),
    [
        ({**_GOOD_ROW, "value": True}, "value"),  # float(True) recorded 1.0
        ({**_GOOD_ROW, "value": "0.7"}, "value"),  # the API refuses a string number too
        ({**_GOOD_ROW, "value": [1]}, "value"),  # was a TypeError traceback
        ({**_GOOD_ROW, "author": 5}, "author"),  # was a TypeError traceback
        ({**_GOOD_ROW, "target_id": 5}, "target_id"),
        ({**_GOOD_ROW, "sorce": "human"}, "sorce"),  # a misspelt column recorded source 'model'
        ([1, 2], "object"),
    ],
)
def test_rewards_import_refuses_a_row_of_the_wrong_type_naming_it_and_imports_nothing(
    pool_settings: PoolSettings, tmp_path: Path, row: object, said: str
) -> None:
    store = PoolStore(make_engine(pool_settings.resolved_database_url()), pool_settings)
    store.record_call("i1", _call([1], [2]))
    path = tmp_path / "rewards.jsonl"
    path.write_text(json.dumps(_GOOD_ROW) + "\n" + json.dumps(row) + "\n")
    result = CliRunner().invoke(app, ["rewards", "import", str(path), *_cli_pool(pool_settings)])
    assert result.exit_code == 1, result.output
    assert "nothing imported" in result.stderr and "row 2" in result.stderr
    assert said in result.stderr
    assert isinstance(result.exception, SystemExit)  # one line, never a traceback
    assert _records(store) == []


def test_rewards_import_reads_a_parquet_file_strictly_too(
    pool_settings: PoolSettings, tmp_path: Path
) -> None:
    store = PoolStore(make_engine(pool_settings.resolved_database_url()), pool_settings)
    store.record_call("i1", _call([1], [2]))
    path = tmp_path / "rewards.parquet"
    table = {key: [value] for key, value in _GOOD_ROW.items()}
    pq.write_table(pa.table({**table, "source": [None], "value": [2]}), path)
    ok = CliRunner().invoke(app, ["rewards", "import", str(path), *_cli_pool(pool_settings)])
    assert ok.exit_code == 0, ok.output
    [record] = _records(store)
    assert (record.value, record.source) == (2.0, "model")
    pq.write_table(pa.table({**table, "value": [True]}), path)
    bad = CliRunner().invoke(app, ["rewards", "import", str(path), *_cli_pool(pool_settings)])
    assert bad.exit_code == 1 and "row 1" in bad.stderr and "value" in bad.stderr
