"""A full-weight update that fails after a replica accepted the reload (invariant 9: a version
is never a guess).

A kept update pauses every replica, reloads each, sets its engine's weight label and registers
the version. When a step after a replica's reload fails (its label route missing, as on a vLLM
build without ``/update_weight_version``, or the reload of another replica), that replica holds
the new weights while the old version stays active: the publish's 502 names it as reloaded,
calls are refused on it (503 ``replica_weights_unknown`` in the dialect's envelope) until a
publish succeeds, and a call in flight across the failure is flagged
``policy_version_split_unknown`` whatever the engine's ``weight_versions`` say.

Fakes at the edge we do not own: the real vLLM cannot be told to answer 404 on one of its
routes, so the replicas are the project's emulator (``trajgate.bench.emulator``), whose
weight-update endpoints fail on demand and whose generate reports its label as vLLM does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest
from gateway_helpers import gateway_with, steps_of
from tests_support import free_port

from datapool.settings import PoolSettings
from trajgate.bench.emulator import EmulatorSettings, EmulatorThread
from trajgate.bench.weight_endpoints import (
    LABEL_PATH,
    PAUSE_PATH,
    RELOAD_PATH,
    RESET_PATH,
    RESUME_PATH,
)

MODEL = "emulated"  # the emulator's model name
PROMPT = [{"role": "user", "content": "hi"}]
SPLIT_UNKNOWN = "policy_version_split_unknown"


@contextmanager
def replicas_behind_gateway(
    pool: PoolSettings, count: int, listings: list[dict[str, Any]] | None = None
) -> Iterator[tuple[list[EmulatorThread], httpx.Client]]:
    """``count`` emulated replicas behind one gateway in which version 1 is active; replica
    ``n`` lists the models ``listings[n]`` names (``model``, ``also_serves``: its adapters)."""
    with ExitStack() as stack:
        engines = []
        for n in range(count):
            listed = listings[n] if listings else {}
            settings = EmulatorSettings(
                port=free_port(), prompt_ids="messages", response_tokens=3, **listed
            )
            engine = EmulatorThread(settings).start()
            stack.callback(engine.stop)
            engines.append(engine)
        urls = ",".join(engine.url for engine in engines)
        gateway = stack.enter_context(gateway_with(pool, free_port(), upstream_url=urls))
        api = stack.enter_context(httpx.Client(base_url=gateway.url, timeout=60))
        registered = api.post("/admin/policy-versions", json={"version": 1, "model_name": MODEL})
        assert registered.status_code == 201, registered.text
        yield engines, api


def _publish(api: httpx.Client, version: int, mode: str = "keep") -> httpx.Response:
    body = {
        "version": version,
        "model_name": MODEL,
        "weights_location": f"/ckpt/v{version}",
        "mode": mode,
    }
    return api.post("/admin/weight-updates", json=body)


def _chat(api: httpx.Client, trajectory: str, messages: list[Any] = PROMPT) -> httpx.Response:
    body = {"model": "policy", "messages": messages, "max_tokens": 3}
    return api.post(f"/t/{trajectory}/v1/chat/completions", json=body)


def _active(api: httpx.Client) -> list[tuple[int, bool]]:
    return [(v["version"], v["active"]) for v in api.get("/admin/policy-versions").json()]


def test_a_kept_update_whose_label_fails_names_the_reloaded_replica_and_refuses_it_until_a_publish_succeeds(  # noqa: E501
    sqlite_pool: PoolSettings,
) -> None:
    with replicas_behind_gateway(sqlite_pool, 1) as ([engine], api):
        engine.fail(LABEL_PATH, 404)  # a vLLM build without /update_weight_version
        failed = _publish(api, 2)
        assert failed.status_code == 502, failed.text
        error = failed.json()["error"]
        assert error["code"] == "weight_update_failed"
        assert f"replicas that accepted the reload: ['{engine.url}']" in error["message"]
        assert "version 2 is not registered" in error["message"]
        # It took the reload, then failed its label; it was resumed all the same.
        assert engine.book.weights.asked == [
            PAUSE_PATH,
            RELOAD_PATH,
            RESET_PATH,
            LABEL_PATH,
            RESUME_PATH,
        ]
        assert _active(api) == [(1, True)]

        # It holds version 2's weights under version 1: refused, in each dialect's envelope,
        # and nothing recorded.
        refused = _chat(api, "after-failure")
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "replica_weights_unknown"
        body = {"model": "policy", "max_tokens": 3, "messages": PROMPT}
        messages = api.post("/t/after-failure/v1/messages", json=body)
        assert messages.status_code == 503, messages.text
        assert messages.json()["type"] == "error"
        assert "[replica_weights_unknown]" in messages.json()["error"]["message"]
        assert steps_of(sqlite_pool, "after-failure") == []

        engine.fail(LABEL_PATH, None)
        published = _publish(api, 2)
        assert published.status_code == 201, published.text
        served = _chat(api, "after-publish")
        assert served.status_code == 200, served.text
        assert served.headers["x-trajgate-policy-version"] == "2"


def test_a_replica_that_refused_before_its_reload_keeps_serving_and_one_that_failed_during_it_is_refused(  # noqa: E501
    sqlite_pool: PoolSettings,
) -> None:
    with replicas_behind_gateway(sqlite_pool, 2) as ([first, second], api):
        # The second refuses the reload as a request (404: no such route): its weights are
        # the active version's; the first took the reload.
        second.fail(RELOAD_PATH, 404)
        failed = _publish(api, 2)
        assert failed.status_code == 502, failed.text
        assert f"accepted the reload: ['{first.url}']" in failed.json()["error"]["message"]
        for trajectory in [f"served-{n}" for n in range(6)]:
            answer = _chat(api, trajectory)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-trajgate-policy-version"] == "1"
            [step] = steps_of(sqlite_pool, trajectory)
            assert step.upstream == second.url

        # Now its reload breaks once begun (500): its weights are unknown as well.
        second.fail(RELOAD_PATH, 500)
        failed = _publish(api, 3)
        assert failed.status_code == 502, failed.text
        assert f"{second.url}'s reload failed part way" in failed.json()["error"]["message"]
        refused = _chat(api, "refused")
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "replica_weights_unknown"


@pytest.mark.parametrize(
    ("failing", "status"),
    [(LABEL_PATH, 404), (RELOAD_PATH, 500)],
    ids=["label-fails", "reload-fails"],
)
def test_an_exact_unary_call_in_flight_across_a_failed_kept_update_is_flagged_split_unknown(
    sqlite_pool: PoolSettings, failing: str, status: int
) -> None:
    with replicas_behind_gateway(sqlite_pool, 1) as ([engine], api):
        first = _chat(api, "across")
        assert first.status_code == 200, first.text
        said = first.json()["choices"][0]["message"]["content"]
        history = [
            *PROMPT,
            {"role": "assistant", "content": said},
            {"role": "user", "content": "?"},
        ]
        # The second turn extends the first: an exact continuation, sampled by generate, whose
        # answer reports one weight label over its tokens ("default": no label was ever set).
        engine.hold_answers()
        answers: list[httpx.Response] = []
        caller = threading.Thread(target=lambda: answers.append(_chat(api, "across", history)))
        caller.start()
        deadline = time.monotonic() + 60
        while engine.held_answers() < 1:  # sampled, its answer held: the call is in flight
            assert time.monotonic() < deadline, "the second turn never reached the engine"
            time.sleep(0.01)
        engine.fail(failing, status)
        failed = _publish(api, 2)
        engine.release_answers()
        caller.join(60)
        assert failed.status_code == 502, failed.text
        assert [answer.status_code for answer in answers] == [200], answers[0].text
        _, step = steps_of(sqlite_pool, "across")
        assert step.continuation == "exact" and step.outcome == "ok"
        assert step.policy_version == 1
        assert SPLIT_UNKNOWN in step.flags


def test_a_drained_update_whose_cache_reset_fails_after_the_reload_refuses_the_replica_too(
    sqlite_pool: PoolSettings,
) -> None:
    with replicas_behind_gateway(sqlite_pool, 1) as ([engine], api):
        engine.fail(RESET_PATH, 500)
        failed = _publish(api, 2, "drain")
        assert failed.status_code == 502, failed.text
        assert f"accepted the reload: ['{engine.url}']" in failed.json()["error"]["message"]
        assert engine.book.weights.asked == [RELOAD_PATH, RESET_PATH]
        refused = _chat(api, "after-drain")
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "replica_weights_unknown"
        engine.fail(RESET_PATH, None)
        published = _publish(api, 2, "drain")
        assert published.status_code == 201, published.text
        assert _chat(api, "after-drain").headers["x-trajgate-policy-version"] == "2"


def test_a_full_weight_update_naming_a_model_no_replica_serves_is_400_before_anything_pauses(
    sqlite_pool: PoolSettings,
) -> None:
    # The emulator lists only "emulated": a reload under another name would pause every call,
    # reload, and activate a version whose model no replica serves.
    with replicas_behind_gateway(sqlite_pool, 1) as ([engine], api):
        body = {"version": 2, "model_name": "tiny", "weights_location": "/ckpt/v2"}
        refused = api.post("/admin/weight-updates", json=body)
        versions = _active(api)
        served = _chat(api, "after-refusal")

    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_served", "model_name")
    assert "'tiny' is not served" in error["message"] and "['emulated']" in error["message"]
    assert engine.book.weights.asked == []  # no pause, reload or resume sent
    assert versions == [(1, True)]  # version 2 neither claimed nor activated
    assert served.status_code == 200 and served.headers["x-trajgate-policy-version"] == "1"


def test_a_full_weight_update_naming_a_loaded_lora_adapter_is_400_before_anything_pauses(
    sqlite_pool: PoolSettings,
) -> None:
    # vLLM lists the adapter with a parent: a reload under its name would replace the base
    # weights and stamp the adapter's steps with version 2, which they never ran on.
    listing = {"also_serves": ["lora-b-v1"]}
    with replicas_behind_gateway(sqlite_pool, 1, [listing]) as ([engine], api):
        body = {"version": 2, "model_name": "lora-b-v1", "weights_location": "/ckpt/v2"}
        refused = api.post("/admin/weight-updates", json=body)
        versions = _active(api)
        # A policy version may still be registered under the adapter (loaded outside the
        # gateway): nothing is reloaded for it.
        adapter_version = {"version": 3, "model_name": "lora-b-v1", "activate": False}
        registered = api.post("/admin/policy-versions", json=adapter_version)

    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_served", "model_name")
    assert "'lora-b-v1' is not served" in error["message"]
    assert "every replica serves are ['emulated']" in error["message"]
    assert "weight_format 'lora'" in error["message"]
    assert engine.book.weights.asked == []  # no pause, reload or resume sent
    assert versions == [(1, True)]  # version 2 neither claimed nor activated
    assert registered.status_code == 201, registered.text


def test_a_full_weight_update_naming_a_base_model_only_one_replica_serves_is_400(
    sqlite_pool: PoolSettings,
) -> None:
    # The reload goes to every replica: the one serving "emulated" would load "other"'s weights
    # under its own name.
    listings = [{"model": "emulated"}, {"model": "other"}]
    with replicas_behind_gateway(sqlite_pool, 2, listings) as (engines, api):
        body = {"version": 2, "model_name": "other", "weights_location": "/ckpt/v2"}
        refused = api.post("/admin/weight-updates", json=body)
        versions = _active(api)

    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_served", "model_name")
    # {"emulated"} & {"other"} = {}: no base model is served everywhere.
    assert "every replica serves are []" in error["message"]
    assert [engine.book.weights.asked for engine in engines] == [[], []]
    assert versions == [(1, True)]
