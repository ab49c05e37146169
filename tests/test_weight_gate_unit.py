"""The weight gate's ticket without an engine: what ``Ticket.guard`` raises, and when.

The full protocol against the real vLLM (drain, abort, reload, versions) is in
tests/test_weight_updates.py; this pins the guard's cancellation rules, which the stream relay
uses once per upstream read.
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.upstream.weight_update import CallAborted, WeightGate


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
