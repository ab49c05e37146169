"""The budget of body bytes a gateway process works on at once (``gateway.body_budget``):
eight concurrent 10.7 MiB bodies took main from 397 to 984 MB, with no bound, and four
concurrent 200 MB unary answers took it from 166 to 2,490 MB (answers were not counted). Unit
tests of the byte semaphore and of the answers a call reads whole, then the real gateway
holding a second body unread until the first one's answer is complete, while a request without
a body passes at once, and reading concurrent large answers one after another."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from gateway_helpers import emulated_gateway, gateway_with
from tests_support import free_port

from datapool.settings import PoolSettings
from gateway.body_budget import BodyBudget, Holding, answer_read, hold_answers
from gateway.settings import GatewaySettings


async def hold_while(budget: BodyBudget, sizes: list[int], until: asyncio.Event) -> Holding:
    """A request of ``budget`` that reads pieces of ``sizes`` bytes, then holds them until
    ``until`` is set."""
    async with budget.hold() as holding:
        for size in sizes:
            await holding.grow(size)
        await until.wait()
        return holding


def test_pieces_past_the_capacity_wait_oldest_request_first() -> None:
    async def scenario() -> list[str]:
        budget = BodyBudget(100)
        order: list[str] = []
        release_first = asyncio.Event()

        async def hold(name: str, size: int, until: asyncio.Event | None = None) -> None:
            async with budget.hold() as holding:
                await holding.grow(size)
                order.append(name)
                if until is not None:
                    await until.wait()

        first = asyncio.create_task(hold("first 70", 70, release_first))
        await asyncio.sleep(0)
        # 50 does not fit beside 70; 20 would, but waits behind it (no starving the large).
        large = asyncio.create_task(hold("then 50", 50))
        await asyncio.sleep(0)
        small = asyncio.create_task(hold("then 20", 20))
        await asyncio.sleep(0)
        assert (budget.in_use_bytes, budget.waiting) == (70, 2)
        release_first.set()
        await asyncio.gather(first, large, small)
        assert (budget.in_use_bytes, budget.waiting) == (0, 0)
        return order

    assert asyncio.run(scenario()) == ["first 70", "then 50", "then 20"]


def test_a_request_holds_only_the_pieces_it_was_given() -> None:
    """A body declared at 100 bytes of which 1 arrived holds 1 byte, not 100: the other 99
    of the budget stay free for the next request (main reserved the declared 100 up front)."""

    async def scenario() -> tuple[int, int]:
        budget = BodyBudget(100)
        release = asyncio.Event()
        dripper = asyncio.create_task(hold_while(budget, [1], release))
        await asyncio.sleep(0)
        other = asyncio.create_task(hold_while(budget, [99], release))
        await asyncio.sleep(0)
        held = (budget.in_use_bytes, budget.waiting)
        release.set()
        await asyncio.gather(dripper, other)
        return held

    assert asyncio.run(scenario()) == (100, 0)


def test_half_read_bodies_that_fill_the_budget_do_not_deadlock() -> None:
    """Budget 100. A and B each read 50, then ask for 30 more: every byte in use is held by a
    waiter, so none could ever be freed. A (the older) is let past the capacity: 130 in use,
    the bound being the capacity plus one body. B gets its 30 once A's answer is complete."""

    async def scenario() -> list[tuple[str, int]]:
        budget = BodyBudget(100)
        seen: list[tuple[str, int]] = []
        a_done = asyncio.Event()

        async def request(name: str, until: asyncio.Event | None) -> None:
            async with budget.hold() as holding:
                await holding.grow(50)
                await asyncio.sleep(0)  # both read their first piece before either the second
                await holding.grow(30)
                seen.append((name, budget.in_use_bytes))
                if until is not None:
                    await until.wait()

        a = asyncio.create_task(request("a", a_done))
        b = asyncio.create_task(request("b", None))
        await asyncio.sleep(0.01)
        seen.append(("b waiting", budget.waiting))
        a_done.set()
        await asyncio.wait_for(asyncio.gather(a, b), timeout=5)
        seen.append(("end", budget.in_use_bytes))
        return seen

    # a: 50 + 50 + 30 = 130 in use; b waits; a gives its 80 back: 50 + 30 = 80; then 0.
    assert asyncio.run(scenario()) == [("a", 130), ("b waiting", 1), ("b", 80), ("end", 0)]


def test_a_cancelled_waiter_holds_nothing_and_lets_the_next_one_in() -> None:
    async def scenario() -> int:
        budget = BodyBudget(100)
        release = asyncio.Event()
        first = asyncio.create_task(hold_while(budget, [60], release))
        await asyncio.sleep(0)
        blocked = asyncio.create_task(hold_while(budget, [100], release))  # waits for all
        await asyncio.sleep(0)
        behind = asyncio.create_task(hold_while(budget, [40], release))  # waits behind the 100
        await asyncio.sleep(0)
        assert budget.waiting == 2
        blocked.cancel()
        await asyncio.sleep(0)
        assert (budget.waiting, budget.in_use_bytes) == (0, 100)  # the 40 got in at once
        release.set()
        await asyncio.gather(first, behind)
        with pytest.raises(asyncio.CancelledError):
            await blocked
        return budget.in_use_bytes

    assert asyncio.run(scenario()) == 0


def test_an_answer_read_whole_is_held_with_its_body_until_the_request_ends() -> None:
    """A request that reads 10 body bytes, then 30 bytes of an answer it reads whole, holds 40
    (main held 10: the answer was not counted); all 40 are given back at its end."""

    async def scenario() -> tuple[int, int, int]:
        budget = BodyBudget(100)
        async with budget.hold() as holding:
            await holding.grow(10)
            hold_answers()
            await answer_read(30)
            held = (holding.held_bytes, budget.in_use_bytes)
        return (*held, budget.in_use_bytes)

    assert asyncio.run(scenario()) == (40, 40, 0)


def test_a_streamed_answer_is_not_held() -> None:
    """Pieces of an answer passed on as they come (a stream: no ``hold_answers``), and answers
    read outside any request's holding, hold nothing."""

    async def scenario() -> tuple[int, int]:
        budget = BodyBudget(100)
        await answer_read(30)  # no request's holding: nothing to charge
        async with budget.hold() as holding:
            await holding.grow(10)
            await answer_read(30)
            return holding.held_bytes, budget.in_use_bytes

    assert asyncio.run(scenario()) == (10, 10)


def test_an_answer_read_by_a_task_after_its_request_ended_holds_nothing() -> None:
    """A task a request started (it inherits the request's holding) that reads an answer after
    the request ended charges nothing: the request's share was given back, and bytes added to
    it then would be held for ever."""

    async def scenario() -> int:
        budget = BodyBudget(100)
        request_ended = asyncio.Event()

        async def late_reader() -> None:
            await request_ended.wait()
            await answer_read(30)

        async with budget.hold() as holding:
            await holding.grow(10)
            hold_answers()
            task = asyncio.create_task(late_reader())
        request_ended.set()
        await task
        return budget.in_use_bytes

    assert asyncio.run(scenario()) == 0


def test_an_answer_piece_waits_for_room_while_another_request_holds_the_budget() -> None:
    """Budget 100: A holds an 80-byte body while its upstream works (not waiting on the
    budget); B holds 10 and reads a 30-byte piece of its answer: it waits, unread, until A's
    answer is complete, then gets it (main let it through at once, uncounted)."""

    async def scenario() -> list[tuple[str, int, int]]:
        budget = BodyBudget(100)
        seen: list[tuple[str, int, int]] = []
        a_done = asyncio.Event()
        a = asyncio.create_task(hold_while(budget, [80], a_done))
        await asyncio.sleep(0)

        async def b() -> None:
            async with budget.hold() as holding:
                await holding.grow(10)
                hold_answers()
                await answer_read(30)
                seen.append(("b read", budget.in_use_bytes, budget.waits))

        reader = asyncio.create_task(b())
        await asyncio.sleep(0.01)
        seen.append(("b waiting", budget.in_use_bytes, budget.waiting))
        a_done.set()
        await asyncio.wait_for(asyncio.gather(a, reader), timeout=5)
        return seen

    assert asyncio.run(scenario()) == [("b waiting", 90, 1), ("b read", 40, 1)]


def test_answers_that_fill_the_budget_do_not_deadlock() -> None:
    """Budget 100: A and B hold 40-byte bodies and each reads a 50-byte answer piece. Neither
    fits beside the other's body and every byte in use is held by a waiter: A (the older) is
    let past the capacity (130), B reads once A is done. The deadlock-freedom of bodies holds
    for answers."""

    async def scenario() -> tuple[int, int]:
        budget = BodyBudget(100)

        async def request() -> None:
            async with budget.hold() as holding:
                await holding.grow(40)
                await asyncio.sleep(0)  # both hold their body before either reads its answer
                hold_answers()
                await answer_read(50)
                await answer_read(10)

        await asyncio.wait_for(asyncio.gather(request(), request()), timeout=5)
        return budget.peak_in_use_bytes, budget.in_use_bytes

    assert asyncio.run(scenario()) == (140, 0)  # 40 + 40 + 50 + 10: one past the capacity


def test_a_budget_smaller_than_the_largest_body_is_refused_at_start_up() -> None:
    with pytest.raises(ValueError, match="must be at least max_body_bytes"):
        GatewaySettings(max_body_bytes=2000, max_body_bytes_in_flight=1000)


def test_a_second_body_waits_unread_until_the_first_answer_is_complete(
    pool_settings: PoolSettings,
) -> None:
    """Budget = one 1000-byte body. A sends half its body and stops; /health (no body) answers
    meanwhile; B, sent then, gets no answer while A holds the budget (main answered it at once);
    once A's body is complete, A is answered, then B (B's trajectory is created after A's)."""
    body_a = json.dumps({"id": "budget-a"}).encode().ljust(1000)
    body_b = json.dumps({"id": "budget-b"}).encode().ljust(1000)
    answers: dict[str, int] = {}
    with gateway_with(
        pool_settings, free_port(), max_body_bytes=1000, max_body_bytes_in_flight=1000
    ) as server:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as client_a:
            client_a.sendall(
                b"POST /api/trajectories HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n" + body_a[:500]
            )
            assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200

            def send_b() -> None:
                answers["b"] = httpx.post(
                    f"{server.url}/api/trajectories",
                    content=body_b,
                    headers={"content-type": "application/json"},
                    timeout=30,
                ).status_code

            waiting = threading.Thread(target=send_b)
            waiting.start()
            waiting.join(timeout=1.0)
            assert "b" not in answers  # held unread behind A
            client_a.sendall(body_a[500:])
            answer_a = client_a.recv(65536)
        waiting.join()
        listed = httpx.get(f"{server.url}/api/trajectories", params={"limit": 10}).json()
    assert answer_a.startswith(b"HTTP/1.1 201 "), answer_a[:100]
    assert answers["b"] == 201
    created = {row["id"]: row["created_at"] for row in listed["data"]}
    assert created["budget-a"] < created["budget-b"]


def open_body(server_url: str, head_extra: bytes, first_bytes: bytes) -> socket.socket:
    """A connection that sent a POST's head (with ``head_extra``) and ``first_bytes`` of its
    body, then stops: a client dripping its body."""
    host, port = server_url.removeprefix("http://").split(":")
    client = socket.create_connection((host, int(port)), timeout=30)
    client.sendall(
        b"POST /t/dripper/v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        b"content-type: application/json\r\n" + head_extra + b"\r\n" + first_bytes
    )
    return client


def test_clients_dripping_declared_or_chunked_bodies_hold_no_budget_from_others(
    pool_settings: PoolSettings,
) -> None:
    """Budget = two 1000-byte bodies. One connection declares 1000 bytes and sends 1, another
    sends a chunked body's first 1-byte chunk; both then stop, their body deadline 30 s away.
    On main they held the whole budget (1000 declared + 1000 for a body without a length), so
    the next POST waited for their deadline; here they hold 2 bytes, and it is answered at
    once (the 5 s client timeout fails main)."""
    body = json.dumps({"id": "not-stalled"}).encode()
    with gateway_with(
        pool_settings, free_port(), max_body_bytes=1000, max_body_bytes_in_flight=2000
    ) as server:
        declared = open_body(server.url, b"content-length: 1000\r\n", b"{")
        chunked = open_body(server.url, b"transfer-encoding: chunked\r\n", b"1\r\n{\r\n")
        with declared, chunked:
            time.sleep(0.3)  # both heads read, their routes waiting for the rest
            answer = httpx.post(
                f"{server.url}/api/trajectories",
                content=body,
                headers={"content-type": "application/json"},
                timeout=5,
            )
    assert answer.status_code == 201, answer.text


def test_a_request_without_a_key_is_refused_before_it_waits_for_budget(
    pool_settings: PoolSettings,
) -> None:
    """With keys required, a call without one is refused 401 at once, though a dripping body
    (to a management route, which takes no agent key) holds what main reserved for it: main
    made the call wait for the budget before its key was checked (the 5 s timeout fails it)."""
    with gateway_with(
        pool_settings,
        free_port(),
        max_body_bytes=1000,
        max_body_bytes_in_flight=1000,
        require_api_key=True,
    ) as server:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as dripper:
            dripper.sendall(
                b"POST /api/trajectories HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n{"
            )
            time.sleep(0.3)
            answer = httpx.post(
                f"{server.url}/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                timeout=5,
            )
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"]["code"] == "missing_api_key"


def test_concurrent_large_unary_answers_are_read_one_after_another(
    pool_settings: PoolSettings,
) -> None:
    """Budget 4 KiB, answers of about 27 KB (300 tokens with logprobs). A stream holds only its
    body (its pieces pass on as they come). A lone unary call holds its body and its whole
    answer (main held only the body: its answer was not counted). Then three calls whose
    answers come together after 1 s: each answer waits for room, so they are held one after
    another, never all three at once (the budget's peak stays under two calls' worth), and
    every call is answered."""
    body = {
        "model": "emulated",
        "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True,
    }
    limits = {"max_body_bytes": 4096, "max_body_bytes_in_flight": 4096}
    with emulated_gateway(
        pool_settings, gateway=limits, response_tokens=300, ttft_ms=1000
    ) as server:
        budget: BodyBudget = server.app.state.body_budget
        streamed = httpx.post(
            f"{server.url}/t/streamed/v1/chat/completions",
            json={**body, "stream": True},
            timeout=60,
        )
        after_stream = budget.peak_in_use_bytes
        lone = httpx.post(f"{server.url}/t/lone/v1/chat/completions", json=body, timeout=60)
        alone = budget.peak_in_use_bytes

        def call(index: int) -> int:
            url = f"{server.url}/t/together-{index}/v1/chat/completions"
            return httpx.post(url, json=body, timeout=60).status_code

        with ThreadPoolExecutor(3) as pool:
            statuses = list(pool.map(call, range(3)))
    assert streamed.status_code == 200 and len(streamed.content) > 20_000
    assert after_stream < 1000  # a stream's pieces pass on: only its body is held
    assert lone.status_code == 200, lone.text
    assert alone > len(lone.content) > 20_000  # the answer is held, not only the body
    assert statuses == [200, 200, 200]
    assert budget.waits >= 1
    assert budget.peak_in_use_bytes < 2 * alone
    assert budget.in_use_bytes == 0
