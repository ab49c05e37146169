"""``trajgate bench horizon`` at a tiny size: the report's shape and figures that agree with
each other and with what was sent (no timing assertions: the bench measures, it never judges)."""

from __future__ import annotations

import json

import pytest

from trajgate.bench import agent_session
from trajgate.bench.gateway import BenchDialect
from trajgate.bench.horizon import (
    RATIO_FIGURES,
    TENTHS,
    HorizonSettings,
    run_horizon,
    side_by_side,
    value_bytes,
)


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_agent_session_turn_resends_the_whole_history_with_its_tools(dialect: BenchDialect) -> None:
    body = agent_session.body(
        dialect, 1, 3, " t5 t6", stream=False, response_tokens=2, tool_result_chars=450
    )
    history = body["input"] if dialect == "responses" else body["messages"]
    # chat carries the system prompt as its first message; the others in their own field
    history = history[1:] if dialect == "chat" else history
    # turn 3: the task, then 3 times (answer, tool result) = 1 + 2 * 3 = 7 messages
    assert [m["role"] for m in history] == ["user"] + ["assistant", "user"] * 3
    assert [m["content"] for m in history[1::2]] == [" t5 t6"] * 3
    assert all(len(m["content"]) == 450 for m in history[2::2])
    assert len({m["content"] for m in history[2::2]}) == 3  # each turn's result is its own
    assert len(body["tools"]) == 11
    assert 26_000 <= agent_session.tool_list_bytes(dialect) <= 30_000


def test_value_bytes_counts_text_as_utf8_blobs_by_length_and_numbers_as_eight() -> None:
    # "é" is 2 bytes in UTF-8; a JSON object is its dump: '{"a": 1}' = 8 bytes
    assert [value_bytes(v) for v in ("aé", b"\x00\x01\x02", 7, 1.5, None, {"a": 1})] == [
        3,
        3,
        8,
        8,
        0,
        8,
    ]


def test_horizon_reports_every_tenth_of_sessions_stored_exactly() -> None:
    sessions, turns = 2, 10
    settings = HorizonSettings(
        sessions=sessions,
        turns=turns,
        dialects=("chat", "responses", "messages"),
        streams=(False, True),
        prompt_tokens=4,
        response_tokens=3,
        tool_result_chars=100,
        reads_per_tenth=1,
    )
    report = run_horizon(settings)
    json.dumps(report)  # --json prints it

    assert (report["sessions"], report["turns"]) == (sessions, turns)
    assert [(run["dialect"], run["stream"]) for run in report["runs"]] == [
        (dialect, stream) for dialect in ("chat", "responses", "messages") for stream in (0, 1)
    ]
    for run in report["runs"]:
        assert run["errors"] == 0, run.get("first_error")
        assert run["steps_persisted"] == run["steps_expected"] == sessions * turns
        tenths = run["tenths"]
        # turns 0..9 cut in ten tenths of one turn each, every session sending each turn
        assert [t["turns"] for t in tenths] == [[k, k + 1] for k in range(TENTHS)]
        assert [t["calls"] for t in tenths] == [sessions] * TENTHS
        assert [t["steps"] for t in tenths] == [sessions] * TENTHS
        # each session's first turn is rendered whole, every later one continues exactly
        assert [t["exact_steps"] for t in tenths] == [0] + [sessions] * (TENTHS - 1)
        assert all(t["prefix_breaks"] == 0 for t in tenths)
        for t in tenths:
            assert t["errors"] == 0
            for figure in ("stored_bytes_per_step", "step_read_bytes", "direct_p50_ms"):
                assert t[figure] > 0, figure
            assert t["gateway_p50_ms"] > 0 and t["trajectory_view_ms"] > 0
            # /proc counts in 10 ms ticks: a tenth of two calls may read 0
            assert t["gateway_cpu_ms_per_call"] >= 0 and t["gateway_loop_cpu_ms_per_call"] >= 0
            # the emulator is a child process: its CPU clock is read, never None
            assert t["engine_direct_cpu_ms_per_call"] >= 0
            assert t["engine_gateway_cpu_ms_per_call"] >= 0
        # the history grows by an answer and a tool result per turn, the view by a step
        for figure in ("request_bytes", "trajectory_view_bytes"):
            values = [t[figure] for t in tenths]
            assert values == sorted(set(values)), (figure, values)
        # the per-step bytes add up to the session's; the whole pool holds at least those
        total = sum(t["stored_bytes_per_step"] * t["steps"] for t in tenths)
        assert abs(run["stored_bytes_per_session"] * sessions - total) <= TENTHS * sessions
        assert run["pool_bytes_per_session"] >= run["stored_bytes_per_session"]
        ratios = run["last_over_first"]
        assert set(ratios) == set(RATIO_FIGURES)
        first, last = tenths[0]["request_bytes"], tenths[-1]["request_bytes"]
        assert ratios["request_bytes"] == round(last / first, 3) > 1
    # the text output names each run's exact steps and prefix breaks, and every ratio figure
    text = side_by_side(report)
    headers = [line for line in text if not line.startswith(" ")]
    exact = (TENTHS - 1) * sessions
    assert len(headers) == len(report["runs"])
    assert all(f"({exact} exact, 0 prefix breaks)" in line for line in headers)
    assert sum(line.split()[0] in RATIO_FIGURES for line in text) == 6 * len(RATIO_FIGURES)


@pytest.mark.parametrize(
    ("field", "values", "named"),
    [("dialects", ("chat", "messages", "chat"), "chat"), ("streams", (False, False), "False")],
)
def test_a_configuration_named_twice_is_refused(
    field: str, values: tuple[object, ...], named: str
) -> None:
    """Run twice, it would continue its own first run's trajectories and count both."""
    with pytest.raises(ValueError, match=f"each value at most once; repeated: {named}"):
        HorizonSettings(**{field: values})


def test_the_cli_refuses_a_repeated_dialect_naming_only_the_flag() -> None:
    from typer.testing import CliRunner

    from trajgate.cli import app

    result = CliRunner().invoke(
        app, ["bench", "horizon", "--turns", "10", "--dialect", "chat", "--dialect", "chat"]
    )
    assert result.exit_code == 2
    assert "repeated: chat" in result.output
    # a benchmark's settings are flags alone: no TRAJGATE_* variable to point at
    assert result.output.rstrip().endswith("fix the flag")
