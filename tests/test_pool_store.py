"""The pool's storage: payloads as prompt deltas, exact reconstruction before and after
compaction into Parquet, and the fast lineage agreeing with ``prefix.choose_parent``."""

from __future__ import annotations

import gc
import random
import tracemalloc
from dataclasses import replace
from typing import Any

from sqlalchemy import select

from datapool.db import make_engine
from datapool.models import INCOMPLETE, Trajectory, TrajectoryGroup
from datapool.settings import PoolSettings
from datapool.steps.lineage import TrajectoryTokens
from datapool.steps.payloads import decode_logprobs, encode_ids, encode_logprobs
from datapool.steps.prefix import Candidate, Lineage, choose_parent
from datapool.steps.records import CallRecord, ChoiceRecord
from datapool.steps.store import PendingCall, PoolStore
from datapool.steps.transaction import Statements


def call(prompt: list[int] | None, response: list[int] | None, **kw: object) -> CallRecord:
    logprobs = None if response is None else [-0.5 - i / 4 for i in range(len(response))]
    return CallRecord(
        request={"messages": [{"role": "user", "content": "x"}]},
        upstream_request={},
        model="tiny",
        upstream="http://up",
        policy_version=0,
        latency_ms=1.0,
        prompt_token_ids=prompt,
        prompt_tokens=None if prompt is None else len(prompt),
        choices=[ChoiceRecord(0, response, logprobs, {"role": "assistant"}, "stop")],
        **kw,  # type: ignore[arg-type]
    )


def make_store(pool_settings: PoolSettings) -> PoolStore:
    return PoolStore(make_engine(pool_settings.resolved_database_url()), pool_settings)


def test_extending_prompt_is_stored_as_a_delta_and_read_back_exactly(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    p1, r1 = [1, 2, 3], [4, 5]
    p2 = [*p1, *r1, 6, 7]  # extends: delta is [6, 7], base = 3 + 2 = 5 tokens
    p3 = [1, 2, 9, 9]  # breaks at offset 2 against step 2's sequence
    [s1] = store.record_call("t1", call(p1, r1))
    [s2] = store.record_call("t1", call(p2, [8]))
    [s3] = store.record_call("t1", call(p3, [10, 11]))
    steps = store.steps_of("t1")
    assert [s.id for s in steps] == [s1, s2, s3]
    assert [s.prompt_token_ids for s in steps] == [p1, p2, p3]
    assert [s.response_token_ids for s in steps] == [r1, [8], [10, 11]]
    assert steps[1].response_logprobs == [-0.5]
    assert steps[1].prompt_base_tokens == 5 and steps[1].extends_parent is True
    assert steps[2].extends_parent is False and steps[2].divergence_offset == 2
    assert steps[2].prompt_base_tokens == 2  # the shared head [1, 2] is not stored again
    assert steps[2].parent_step_id == s2
    assert store.get_step(s3).prompt_token_ids == p3  # type: ignore[union-attr]


def test_compaction_moves_payloads_to_parquet_and_reads_stay_exact(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    p1, r1 = [1, 2, 3], [4, 5]
    store.record_call("t2", call(p1, r1))
    file = store.payloads.compact(max_steps=100)
    assert file is not None and file.steps == 1
    assert store.payloads.pending_steps() == 0
    # a new step on top of a compacted parent: delta against a payload read from Parquet
    p2 = [*p1, *r1, 6]
    [s2] = store.record_call("t2", call(p2, [7]))
    PoolStore(store.engine, pool_settings)  # a fresh process' store reads the same
    fresh = make_store(pool_settings)
    assert fresh.get_step(s2).prompt_token_ids == p2  # type: ignore[union-attr]
    store.payloads.compact(max_steps=100)
    steps = fresh.steps_of("t2")
    assert [s.prompt_token_ids for s in steps] == [p1, p2]
    assert all(s.payload_file_id is not None for s in steps)


def test_a_step_written_by_another_store_is_the_parent_of_the_next_one(
    pool_settings: PoolSettings,
) -> None:
    """Two gateway processes (two stores) take turns on one trajectory: each sees the other's
    steps, so every prompt extends the step just before it."""
    a, b = make_store(pool_settings), make_store(pool_settings)
    p1, r1 = [1, 2], [3]
    p2, r2 = [*p1, *r1, 4], [5]  # extends s1: base 2 + 1 = 3 tokens
    p3, r3 = [*p2, *r2, 6], [7]  # extends s2 (which store a never wrote): base 4 + 1 = 5
    [s1] = a.record_call("t5", call(p1, r1))
    [s2] = b.record_call("t5", call(p2, r2))
    [s3] = a.record_call("t5", call(p3, r3))
    steps = make_store(pool_settings).steps_of("t5")
    assert [s.parent_step_id for s in steps] == [None, s1, s2]
    assert [s.prompt_base_tokens for s in steps] == [0, 3, 5]
    assert [s.step_index for s in steps] == [0, 1, 2]
    assert [s.prompt_token_ids for s in steps] == [p1, p2, p3]
    assert steps[2].id == s3


def test_missing_ids_stay_missing_and_failed_calls_have_no_payload(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    store.record_call("t3", call(None, None))
    store.record_call("t3", call([1], None, outcome="upstream_error", error="400"))
    steps = store.steps_of("t3")
    assert [s.prompt_token_ids for s in steps] == [None, [1]]
    assert [s.response_token_ids for s in steps] == [None, None]
    assert steps[1].parent_step_id == steps[0].id


def test_logprobs_are_float32_when_exact_and_float64_otherwise() -> None:
    exact = [-0.5, -0.25]  # representable in float32: 1 width byte + 2 * 4 bytes
    inexact = [-0.1]  # not representable in float32: 1 + 8 bytes
    assert len(encode_logprobs(exact) or b"") == 9
    assert len(encode_logprobs(inexact) or b"") == 9
    assert list(decode_logprobs(encode_logprobs(inexact))) == inexact  # type: ignore[arg-type]


def test_fast_lineage_agrees_with_prefix_choose_parent() -> None:
    rng = random.Random(3)
    for _ in range(300):
        tokens = TrajectoryTokens()
        candidates: list[Candidate] = []
        for k in range(rng.randint(0, 5)):
            base = (
                list(rng.choice(candidates).sequence) if candidates and rng.random() < 0.7 else []
            )
            prompt = base[: rng.randint(0, len(base))] + [rng.randint(0, 3) for _ in range(3)]
            response = [rng.randint(0, 3) for _ in range(rng.randint(0, 2))]
            lineage = tokens.choose_parent(encode_ids(prompt) or b"")
            assert lineage == choose_parent(candidates, prompt)
            call = rng.choice([None, k, k - 1]) if k else None  # sometimes choices of one call
            tokens.add(
                f"s{k}", lineage, encode_ids(prompt) or b"", encode_ids(response) or b"", call=call
            )
            candidates.append(Candidate(f"s{k}", [*prompt, *response], len(prompt), call, lineage))
        probe = [rng.randint(0, 3) for _ in range(rng.randint(0, 9))]
        assert tokens.choose_parent(encode_ids(probe) or b"") == choose_parent(candidates, probe)
    assert Lineage(None, None, None) == TrajectoryTokens().choose_parent(b"")


def test_a_batch_over_more_trajectories_than_the_lineage_cache_commits_every_call(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings.model_copy(update={"lineage_cache_trajectories": 2}))
    first = [PendingCall(f"t{i}", call([1, 2], [3])) for i in range(3)]
    assert all(isinstance(r, list) for r in store.record_calls(first))
    # Each prompt extends its trajectory's [1, 2] + [3]: base 2 + 1 = 3 tokens, delta [4].
    second = [PendingCall(f"t{i}", call([1, 2, 3, 4], [5])) for i in range(3)]
    results = store.record_calls(second)
    for i, result in enumerate(results):
        assert isinstance(result, list)
        steps = store.steps_of(f"t{i}")
        assert [s.prompt_token_ids for s in steps] == [[1, 2], [1, 2, 3, 4]]
        assert steps[1].parent_step_id == steps[0].id and steps[1].prompt_base_tokens == 3


def test_the_prepared_state_select_reads_one_or_many_ids_as_sqlalchemys_select_does(
    pool_settings: PoolSettings,
) -> None:
    """The state SELECT compiled once per number of ids and run by the driver reads the same
    (status, call_count, flags) as SQLAlchemy's own typed SELECT, flags decoded from JSON."""
    store = make_store(pool_settings)
    store.record_call("open-1", call([1], [2]))
    store.record_call("open-2", call([1], [2]))
    store.record_call("open-2", call([1, 2, 3], [4]))
    store.record_call("closed", call([1], [2]))
    with store.sessions.begin() as session:
        session.get_one(Trajectory, "open-2").flags = [INCOMPLETE, "other"]
        session.get_one(Trajectory, "closed").status = "complete"
    table = Trajectory.__table__.c
    statements = Statements(store.engine.dialect)
    many = ["open-1", "open-2", "closed", "absent"]
    with store.engine.begin() as connection:
        for ids in (["open-2"], many, ["absent"], many):  # many twice: the compiled one again
            typed = select(table.id, table.status, table.call_count, table.flags)
            reference = {
                tid: (status, count, flags)
                for tid, status, count, flags in connection.execute(typed.where(table.id.in_(ids)))
            }
            assert statements.select_state(connection, ids) == reference
        assert statements.select_state(connection, []) == {}  # an empty batch reads nothing
        # By hand: open-2 had two calls, the others one each; "absent" was never written.
        assert statements.select_state(connection, many) == {
            "open-1": ("open", 1, []),
            "open-2": ("open", 2, [INCOMPLETE, "other"]),
            "closed": ("complete", 1, []),
        }


def test_a_batch_creating_one_trajectory_and_extending_another_counts_and_stamps_both(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    assert store.record_calls([]) == []  # an empty batch commits nothing and refuses nothing
    store.record_call("old", call([1], [2]))
    with store.sessions.begin() as session:
        session.get_one(Trajectory, "old").flags = [INCOMPLETE]  # cut by a crash
    batch = [
        PendingCall("old", call([1, 2, 3], [4])),
        PendingCall("new", call([5], [6], group_id="g")),
        PendingCall("new", call([5, 6, 7], [8])),
    ]
    results = store.record_calls(batch, writer_id="host:1:0")
    assert all(isinstance(r, list) for r in results)
    old, new = store.get_trajectory("old"), store.get_trajectory("new")
    assert old is not None and new is not None
    # old: one call before, one now (2), and its agent came back: the flag is lifted.
    assert (old.call_count, old.flags, old.writer_id) == (2, [], "host:1:0")
    # new: created by this batch, in the group its first call named, with both calls.
    assert (new.status, new.group_id, new.call_count, new.writer_id) == ("open", "g", 2, "host:1:0")
    steps = store.steps_of("new")
    assert [s.step_index for s in steps] == [0, 1]
    # One clock per batch: the counters' last_step_at is the time its steps were stamped with.
    assert old.last_step_at == new.last_step_at == steps[1].created_at
    with store.sessions() as session:
        group = session.get_one(TrajectoryGroup, "g")
        assert group.status == "open"


def _random_calls(rng: random.Random, n: int) -> list[CallRecord]:
    """``n`` calls of one agent: next turns, re-sends of an earlier prompt, rewritten histories,
    turns that extend an older step only (hidden breaks), several choices, failed calls."""
    calls: list[CallRecord] = []
    sequences: list[list[int]] = []  # S = P + R of each ok choice so far
    prompts: list[list[int]] = []
    for _ in range(n):
        roll = rng.random()
        if prompts and roll < 0.2:
            prompt = list(rng.choice(prompts))  # the same prompt again: a fork
        elif sequences and roll < 0.8:
            base = rng.choice([sequences[-1], *sequences])  # the latest turn weighs double
            cut = rng.choice([0, 0, 0, 1])  # sometimes a rewritten last token
            prompt = [*base[: len(base) - cut], rng.randint(0, 3)]
        else:
            prompt = [rng.randint(0, 3) for _ in range(3)]
        if rng.random() < 0.1:
            calls.append(call(prompt, None, outcome="upstream_error", error="500"))
            continue
        responses = [[rng.randint(0, 3) for _ in range(2)] for _ in range(rng.choice([1, 1, 2]))]
        choices = [
            ChoiceRecord(c, r, [-0.5] * len(r), {"role": "assistant"}, "stop")
            for c, r in enumerate(responses)
        ]
        calls.append(replace(call(prompt, responses[0]), choices=choices))
        prompts.append(prompt)
        sequences += [[*prompt, *r] for r in responses]
    return calls


def _lineage_columns(store: PoolStore, trajectory_id: str) -> list[tuple[object, ...]]:
    """Each step's lineage, with step ids replaced by their (step_index, choice_index)."""
    steps = store.steps_of(trajectory_id)
    place = {s.id: (s.step_index, s.choice_index) for s in steps}

    def named(step_id: object) -> object:
        return place.get(step_id, step_id) if isinstance(step_id, str) else step_id

    return [
        (
            named(s.parent_step_id),
            s.extends_parent,
            s.divergence_offset,
            s.divergence_kind,
            named((s.divergence_detail or {}).get("step_id")),
            sorted(s.flags),
        )
        for s in steps
    ]


def test_lineage_is_the_same_whichever_gateway_writes_each_call(
    pool_settings: PoolSettings,
) -> None:
    """A non-sticky fleet: the same calls written by one store, and by three stores taking
    turns at random (each rebuilds what the others wrote from the database), give every step
    the same parent, extension, divergence and flags."""
    one = make_store(pool_settings)
    fleet = [make_store(pool_settings) for _ in range(3)]
    rng = random.Random(17)
    for trial in range(40):
        calls = _random_calls(rng, 8)
        for c in calls:
            one.record_call(f"sticky-{trial}", c)
            rng.choice(fleet).record_call(f"spread-{trial}", c)
        sticky = _lineage_columns(one, f"sticky-{trial}")
        assert _lineage_columns(one, f"spread-{trial}") == sticky, trial


def test_the_lineage_memory_estimate_follows_what_a_long_session_holds(
    pool_settings: PoolSettings,
) -> None:
    """``TrajectoryTokens.approx_bytes`` against tracemalloc: what dropping a 60-turn session's
    memory frees (its sequence, message keys and bodies' keys), within a third."""
    from gateway.dialects.chat_completions.serving import canonical_of_chat

    store = make_store(pool_settings)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "sys " * 200},
        {"role": "user", "content": "task"},
    ]
    prompt = list(range(1000))
    tracemalloc.start()
    try:
        for turn in range(60):
            response = [5000 + 40 * turn + i for i in range(40)]
            answer = {"role": "assistant", "content": f"answer {turn} " * 20}
            body = {"model": "tiny", "messages": list(messages)}
            record = CallRecord(
                request=body,
                upstream_request=body,
                model="tiny",
                upstream="http://up",
                policy_version=0,
                latency_ms=1.0,
                prompt_token_ids=prompt,
                prompt_tokens=len(prompt),
                choices=[ChoiceRecord(0, response, [-0.5] * 40, answer, "stop")],
                history_field="messages",
                canonical=canonical_of_chat(body),
            )
            store.record_call("long", record)
            messages += [answer, {"role": "tool", "content": f"result {turn} " * 60}]
            prompt = [*prompt, *response, *range(7000 + 300 * turn, 7260 + 300 * turn)]
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        entry = store._lineage.get("long")
        assert entry is not None and len(entry.candidates) == 60
        estimate = entry.approx_bytes
        del entry
        store._lineage.clear()
        gc.collect()
        freed = held - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert 0.75 < freed / estimate < 1.33, (freed, estimate)


def test_the_lineage_memory_drops_the_least_recently_used_trajectories_past_its_bytes() -> None:
    from datapool.steps.lineage import LineageCache

    def memory(size: int) -> TrajectoryTokens:
        return TrajectoryTokens(approx_bytes=size)

    cache = LineageCache(max_trajectories=10, max_bytes=1000)
    for name in ("a", "b", "c"):
        cache.put(name, memory(300))
    assert cache.total_bytes == 900
    assert cache.get("a") is not None  # "b" is now the least recently used
    grown = cache.get("c")
    assert grown is not None
    grown.approx_bytes = 500  # its trajectory's steps were added in place
    assert cache.get("c") is grown  # measured again: 1100 > 1000, "b" dropped
    assert cache.get("b") is None and cache.total_bytes == 800
    cache.put("huge", memory(5000))  # alone over the bound: kept, every other one dropped
    assert [cache.get(n) is None for n in ("a", "c")] == [True, True]
    assert cache.get("huge") is not None and cache.total_bytes == 5000
    cache.forget("huge")
    assert cache.total_bytes == 0
