"""A call's upstream attempts, recorded through one recorder (``gateway.proxy.call.Attempts``).

What each outcome kind writes is pinned here by hand; the stored rows per failure are tested
end to end in tests/test_gateway_cases.py and tests/test_upstream_faults.py. A source check
keeps the recorder the one place an attempt is built.
"""

from __future__ import annotations

from pathlib import Path

from gateway.proxy.call import Attempts
from gateway.upstream.replicas import Replica

PROXY = Path(__file__).resolve().parent.parent / "gateway" / "proxy"


def test_each_outcome_kind_writes_its_outcome_status_and_error_in_order() -> None:
    clock = iter([1.5, 2.5, 3.5, 4.5, 5.5, 6.5])
    attempts = Attempts("call-1", "traj-1", "key-1", lambda: next(clock))
    replica = Replica("http://r.test")
    returned = [
        attempts.unreachable(replica, "ConnectError()"),
        attempts.timed_out(replica, "ReadTimeout()"),
        attempts.upstream_error(replica, status_code=503, error="busy"),
        attempts.aborted(None),
        attempts.timed_out(replica, "silent", status_code=200),
    ]
    attempts.ok(replica, response_body={"id": "answer"})
    rows = [
        (r.attempt_index, r.upstream, r.status_code, r.outcome, r.error, r.latency_ms)
        for r in attempts.records
    ]
    assert rows == [
        (0, "http://r.test", None, "upstream_unreachable", "ConnectError()", 1.5),
        (1, "http://r.test", None, "upstream_timeout", "ReadTimeout()", 2.5),
        (2, "http://r.test", 503, "upstream_error", "busy", 3.5),
        (3, None, None, "aborted_for_weight_update", "weight update", 4.5),
        (4, "http://r.test", 200, "upstream_timeout", "silent", 5.5),
        (5, "http://r.test", 200, "ok", None, 6.5),
    ]
    assert returned == [row[3] for row in rows[:5]]  # the outcome the failed step gets
    assert {(r.call_id, r.trajectory_id, r.idempotency_key) for r in attempts.records} == {
        ("call-1", "traj-1", "key-1")
    }
    assert [r.response_body for r in attempts.records][-1] == {"id": "answer"}
    assert len({r.id for r in attempts.records}) == 6


def test_no_proxy_module_but_the_recorder_builds_an_attempt_record() -> None:
    building = sorted(
        path.name for path in PROXY.rglob("*.py") if "AttemptRecord(" in path.read_text()
    )
    assert building == ["call.py"]
