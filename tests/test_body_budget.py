"""The budget of request-body bytes a gateway process works on at once (issue 29 item 6;
``gateway.body_budget``): eight concurrent 10.7 MiB bodies took main from 397 to 984 MB, with
no bound. Unit tests of the byte semaphore, then the real gateway holding a second body unread
until the first one's answer is complete, while a request without a body passes at once."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from gateway_helpers import gateway_with
from tests_support import free_port

from datapool.settings import PoolSettings
from gateway.body_budget import BodyBudget, Holding
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
