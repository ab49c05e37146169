"""The weight gate's ticket without an engine: what ``Ticket.guard`` raises, and when.

The full protocol against the real vLLM (drain, abort, reload, versions) is in
tests/test_weight_updates.py; this pins the guard's cancellation rules, which the stream relay
uses once per upstream read.
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.engine.admin import ReloadError
from gateway.errors import ServiceUnavailableError
from gateway.upstream.replicas import UpstreamPool
from gateway.upstream.weight_update import CallAborted, Ticket, WeightGate


async def _aborted_while_waiting() -> str:
    gate = WeightGate()
    ticket = await gate.admit()
    waiting = asyncio.ensure_future(ticket.guard(asyncio.sleep(30, result="slept")))
    await asyncio.sleep(0.01)
    ticket.abort()
    try:
        await waiting
    except CallAborted:
        return "aborted"
    return "not aborted"


def test_an_abort_cuts_the_guarded_wait_with_call_aborted() -> None:
    assert asyncio.run(_aborted_while_waiting()) == "aborted"


def test_a_cancellation_from_elsewhere_passes_through_the_guard() -> None:
    async def cancelled() -> bool:
        ticket = await WeightGate().admit()
        waiting = asyncio.ensure_future(ticket.guard(asyncio.sleep(30)))
        await asyncio.sleep(0.01)
        waiting.cancel()  # the client left: not an abort
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return ticket.aborted

    assert asyncio.run(cancelled()) is False


def test_an_aborted_ticket_refuses_the_next_wait_and_a_released_one_waits_plainly() -> None:
    async def run() -> tuple[str, str]:
        gate = WeightGate()
        aborted = await gate.admit()
        aborted.abort()
        with pytest.raises(CallAborted):
            await aborted.guard(asyncio.sleep(0))
        released = await gate.admit()
        released.release()
        released.abort()  # nothing to cut, but the call is marked
        with pytest.raises(CallAborted):
            await released.guard(asyncio.sleep(0))
        fresh = await gate.admit()
        return "ok", await fresh.guard(asyncio.sleep(0, result="done"))

    assert asyncio.run(run()) == ("ok", "done")


def test_an_abort_and_an_outside_cancel_together_end_as_the_cancel() -> None:
    async def both() -> str:
        ticket = await WeightGate().admit()
        waiting = asyncio.ensure_future(ticket.guard(asyncio.sleep(30)))
        await asyncio.sleep(0.01)
        ticket.abort()
        waiting.cancel()
        try:
            await waiting
        except asyncio.CancelledError:
            return "cancelled"
        except CallAborted:
            return "aborted"
        return "neither"

    assert asyncio.run(both()) == "cancelled"


# The engine's spans (vLLM's ``weight_versions`` on ``/inference/v1/generate``) read as policy
# versions. A ticket made without a gate stands for a call admitted under version 3; ``mark``
# records the kept reloads it sampled across, as ``WeightGate.keep`` does.


def _span(label: str, start: int, end: int) -> dict[str, object]:
    return {"version": label, "start": start, "end": end}


def _call_across(*reloads: int, counts: dict[int, int] | None = None) -> Ticket:
    ticket = Ticket()
    if counts is not None:
        ticket.sampled = lambda: dict(counts)
    for version in reloads:
        ticket.mark(version, counts is not None, f"{version}:x")
    return ticket


def test_a_unary_call_split_by_a_kept_reload_takes_the_engines_spans() -> None:
    # Admitted under 3, one reload to 4; the engine labelled its first 7 tokens "default" (no
    # version set before) and the last 5 "4": tokens [0, 7) are 3's, [7, 12) are 4's.
    ticket = _call_across(4)
    reported = [_span("default", 0, 7), _span("4:x", 7, 12)]
    assert ticket.version_spans(3, 0, 12, reported) == [[3, 0, 7], [4, 7, 12]]


def test_without_the_engines_report_a_unary_split_stays_unknown() -> None:
    with pytest.raises(LookupError):
        _call_across(4).version_spans(3, 0, 12)


def test_the_engines_spans_win_over_the_gateways_counts() -> None:
    # The gateway read 6 tokens before the reload, the engine says 7 (a token in the socket):
    # the engine's report is the exact one.
    ticket = _call_across(4, counts={0: 6})
    assert ticket.version_spans(3, 0, 12) == [[3, 0, 6], [4, 6, 12]]
    reported = [_span("3", 0, 7), _span("4:x", 7, 12)]
    assert ticket.version_spans(3, 0, 12, reported) == [[3, 0, 7], [4, 7, 12]]


def test_two_reloads_map_each_label_to_its_reload_in_order() -> None:
    ticket = _call_across(4, 5)
    reported = [_span("3", 0, 2), _span("4:x", 2, 9), _span("5:x", 9, 10)]
    assert ticket.version_spans(3, 0, 10, reported) == [[3, 0, 2], [4, 2, 9], [5, 9, 10]]


def test_a_call_queued_through_the_reload_is_the_new_versions_alone() -> None:
    # Admitted under 3 but first scheduled after the reload: every token is 4's.
    assert _call_across(4).version_spans(3, 0, 12, [_span("4:x", 0, 12)]) == [[4, 0, 12]]


def test_a_call_finished_before_the_reload_is_its_own_versions_alone() -> None:
    # Its answer was on the way when the gate closed: one span labelled before the reload.
    assert _call_across(4).version_spans(3, 0, 12, [_span("default", 0, 12)]) is None


def test_a_stale_label_equal_to_the_new_version_is_not_taken_for_the_reload() -> None:
    # An engine labelled "4" by an earlier run (another pool, or before a restart): the tokens
    # before this reload carry it, those after carry the reload's own label ("4:x"): the
    # stale "4" is the admitted version 3, not 4 (with bare version labels the two would be
    # one span "4", read as all 4's: measured on the real vLLM before labels were unique).
    reported = [_span("4", 0, 6), _span("4:x", 6, 12)]
    assert _call_across(4).version_spans(3, 0, 12, reported) == [[3, 0, 6], [4, 6, 12]]


def test_unreadable_engine_spans_fall_back_to_the_gateways_counts() -> None:
    ticket = _call_across(4, counts={0: 6})
    unreadable = [
        [_span("3", 0, 7), _span("9", 7, 12)],  # a label no reload of this call set
        [_span("3", 0, 7), _span("4:x", 8, 12)],  # a gap
        [_span("3", 0, 7), _span("4:x", 7, 11)],  # short of the 12 tokens
        [_span("4:x", 0, 7), _span("3", 7, 12)],  # out of order
        [{"version": "3", "start": 0, "end": True}],  # not an int
        ["3", 0, 12],  # not spans
    ]
    for reported in unreadable:
        assert ticket.version_spans(3, 0, 12, reported) == [[3, 0, 6], [4, 6, 12]], reported


def test_an_engine_split_no_reload_of_this_gateway_made_is_unknown() -> None:
    # Another gateway (or an operator) changed the engine's weights during the call.
    with pytest.raises(LookupError):
        _call_across().version_spans(3, 0, 12, [_span("3", 0, 7), _span("8", 7, 12)])
    assert _call_across().version_spans(3, 0, 12, [_span("3", 0, 12)]) is None


# A kept update that fails: ``WeightGate.keep`` marks the calls in flight, and
# ``UpstreamPool.replacing_weights`` takes the replicas it touched out of routing.


def test_a_call_in_flight_across_a_failed_kept_update_is_unknown_whatever_the_engine_reports() -> (
    None
):
    async def across_a_failed_update() -> Ticket:
        gate = WeightGate()
        ticket = await gate.admit()

        async def reload() -> None:  # the replica took the reload, then refused its label
            raise ReloadError("http://r", ["http://r"], "404: no /update_weight_version")

        async def resume() -> None:
            pass

        with pytest.raises(ReloadError):
            await gate.keep(reload, resume, 4, "4:x")
        return ticket

    ticket = asyncio.run(across_a_failed_update())
    # The label was never set, so the engine reports one span under its old label: read
    # alone it would say every token is version 3's.
    with pytest.raises(LookupError):
        ticket.version_spans(3, 0, 12, [_span("default", 0, 12)])


def test_replicas_a_failed_update_touched_are_never_picked_until_a_publish_succeeds() -> None:
    pool = UpstreamPool(["http://a", "http://b", "http://c"])
    # a accepted the reload, b's reload failed once sent, c refused before reloading.
    with pytest.raises(ReloadError), pool.replacing_weights(2):
        raise ReloadError("http://b", ["http://a"], "500: reload broke", partial=True)
    assert {pool.pick(f"t{n}").url for n in range(20)} == {"http://c"}
    with pytest.raises(ReloadError), pool.replacing_weights(3):
        raise ReloadError("http://c", ["http://c"], "404: no /update_weight_version")
    with pytest.raises(ServiceUnavailableError) as refused:
        pool.pick("t0")
    assert (refused.value.status_code, refused.value.code) == (503, "replica_weights_unknown")
    with pool.replacing_weights(4):
        pass  # every replica reloaded and the version registered
    assert {pool.pick(f"t{n}").url for n in range(20)} == {"http://a", "http://b", "http://c"}


def test_a_publish_that_fails_after_the_reloads_leaves_every_replicas_weights_unknown() -> None:
    pool = UpstreamPool(["http://a", "http://b"])
    with pytest.raises(RuntimeError), pool.replacing_weights(2):
        raise RuntimeError("the pool could not register version 2")
    assert [r.weights_unknown is not None for r in pool.replicas] == [True, True]
