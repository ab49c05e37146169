"""The budget of request-body bytes a gateway process works on at once (issue 29 item 6;
``gateway.body_budget``): eight concurrent 10.7 MiB bodies took main from 397 to 984 MB, with
no bound. Unit tests of the byte semaphore, then the real gateway holding a second body unread
until the first one's answer is complete, while a request without a body passes at once."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import httpx
import pytest
from gateway_helpers import gateway_with
from tests_support import free_port

from datapool.settings import PoolSettings
from gateway.body_budget import BodyBudget
from gateway.settings import GatewaySettings


def test_reservations_past_the_capacity_wait_in_arrival_order() -> None:
    async def scenario() -> list[str]:
        budget = BodyBudget(100)
        order: list[str] = []
        release_first = asyncio.Event()

        async def hold(name: str, size: int, until: asyncio.Event | None = None) -> None:
            async with budget.reserve(size):
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


def test_a_cancelled_waiter_holds_nothing_and_lets_the_next_one_in() -> None:
    async def scenario() -> int:
        budget = BodyBudget(100)
        held = asyncio.Event()
        release = asyncio.Event()

        async def hold(size: int) -> None:
            async with budget.reserve(size):
                held.set()
                await release.wait()

        first = asyncio.create_task(hold(60))
        await held.wait()
        blocked = asyncio.create_task(hold(100))  # waits for all of it
        await asyncio.sleep(0)
        behind = asyncio.create_task(hold(40))  # fits now, but waits behind the 100
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
