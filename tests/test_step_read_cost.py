"""What reading one step of a long trajectory loads (DESIGN.md invariant 10), counted rather
than timed: ``GET /api/steps/{id}``, the token view and the exact path's ``find_turn`` read one
step; its ancestors contribute only the deltas its prompt and bodies are built from."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import event
from test_pool_store import call, make_store

from datapool.models import Step
from datapool.settings import PoolSettings
from datapool.steps import payloads
from datapool.steps.store import PoolStore

TURNS = 30


@pytest.fixture
def long_session(pool_settings: PoolSettings) -> tuple[PoolStore, list[str], list[int]]:
    """A trajectory of ``TURNS`` calls, each prompt extending the last ``P + R`` by one token
    (so every step's prompt is a delta on its parent's): its store, step ids and last prompt."""
    store = make_store(pool_settings)
    prompt = [1, 2, 3]
    step_ids: list[str] = []
    for turn in range(TURNS):
        last_prompt = prompt
        record = call(prompt, [100 + turn])
        keyed = replace(record.choices[0], turn_key=f"turn-{turn}")
        [step_id] = store.record_call("long", replace(record, choices=[keyed]))
        step_ids.append(step_id)
        prompt = [*prompt, 100 + turn, 7]
    return store, step_ids, last_prompt


@pytest.fixture
def loads() -> Iterator[dict[str, list[Any]]]:
    """Step rows loaded as ORM objects (``rows``) and token payloads built as lists
    (``payloads``), while the test runs."""
    seen: dict[str, list[Any]] = {"rows": [], "payloads": []}

    def loaded(target: Step, _context: Any) -> None:
        seen["rows"].append(target.id)

    event.listen(Step, "load", loaded)
    token_payload = payloads.TokenPayload

    def counted(*args: Any) -> payloads.TokenPayload:
        seen["payloads"].append(args[0])
        return token_payload(*args)

    payloads.TokenPayload = counted  # type: ignore[assignment,misc]
    try:
        yield seen
    finally:
        payloads.TokenPayload = token_payload  # type: ignore[misc]
        event.remove(Step, "load", loaded)


def test_reading_the_last_step_loads_one_row_and_builds_one_payload(
    long_session: tuple[PoolStore, list[str], list[int]], loads: dict[str, list[Any]]
) -> None:
    # Before: every step row of the trajectory was loaded as an ORM object (its JSON columns
    # parsed) and every ancestor's prompt built as a list: 30 rows and 30 payloads here.
    store, step_ids, last_prompt = long_session
    step = store.get_step(step_ids[-1])
    assert step is not None
    # 3 + 2 tokens a turn: 3 + 2 * 29 = 61 prompt tokens, all read back through 29 deltas
    assert step.prompt_token_ids == last_prompt and len(last_prompt) == 61
    assert step.response_token_ids == [100 + TURNS - 1]
    assert step.request == {"messages": [{"role": "user", "content": "x"}]}
    assert loads["rows"] == [step_ids[-1]]
    assert len(loads["payloads"]) == 1


def test_finding_a_turn_loads_the_one_step_that_answered_it(
    long_session: tuple[PoolStore, list[str], list[int]], loads: dict[str, list[Any]]
) -> None:
    # The exact path's lookup of a turn another process served: one row, one payload
    # (before: the trajectory's 30 rows and 30 payloads, as get_step).
    store, step_ids, last_prompt = long_session
    turn = store.find_turn("long", ["turn-99", f"turn-{TURNS - 1}", "turn-3"])
    assert turn is not None and turn.id == step_ids[-1]
    assert turn.turn_key == f"turn-{TURNS - 1}"
    assert turn.prompt_token_ids == last_prompt
    assert turn.response_token_ids == [100 + TURNS - 1]
    assert turn.response_message == {"role": "assistant"}
    assert loads["rows"] == [step_ids[-1]]
    assert len(loads["payloads"]) == 1
