"""LoRA updates through the gateway (``POST /admin/weight-updates``, ``weight_format: "lora"``):
each version is a new adapter in every replica, registered and activated only once every replica
loaded it, the old ones unloaded past ``lora_adapters_kept``; nothing paused, a call in flight
finishes on the adapter it started with; bad input is 400 and changes nothing. And their release
(``POST /admin/adapter-releases``, the trainer's ``WeightSync.release_adapters``): the adapters
its prefix names unloaded from every replica, the active one only when asked (409 otherwise), a
replica that fails an unload named in a 502 that says what was released, never across a weight
update in flight.

The real vLLM is the shared one (``--enable-lora``, runtime LoRA updates on, as the LoRA tests of
tests/test_trainer_bridge.py use it): adapters are loaded under a prefix of their own per test
and unloaded when the test ends, and nothing here reloads its base weights. A replica without
LoRA is the project's emulator (``trajgate.bench.emulator``), which has no LoRA route, as vLLM
without ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (404). vLLM's other answers to a load (its engine
without ``--enable-lora``, which the shared server is not) are played by ``httpx.MockTransport``
with vLLM 0.32's bodies, the edge we do not own.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from gateway_helpers import gateway_with, sse_chunks, steps_of
from tests_support import free_port

from datapool.settings import PoolSettings
from gateway.engine.paths import LOAD_LORA_ADAPTER_PATH as LOAD_PATH
from gateway.engine.paths import MODELS_PATH
from gateway.engine.paths import UNLOAD_LORA_ADAPTER_PATH as UNLOAD_PATH
from trainer_bridge.sync import WeightSync, WeightSyncError
from trajgate.bench.emulator import EmulatorSettings, EmulatorThread
from trajgate.bench.weight_endpoints import RELOAD_PATH
from trajgate.vllm_server import VLLMServer

PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two rank-4 adapters of the tiny model with random A and B (peft's
    ``init_lora_weights=False``), so each changes what vLLM samples."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    dirs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        config = LoraConfig(
            r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        )
        get_peft_model(model, config).save_pretrained(root / f"adapter-{seed}")
        dirs.append(root / f"adapter-{seed}")
    return dirs


@contextmanager
def gateway_over(
    pool: PoolSettings, upstream_urls: list[str], vllm: VLLMServer, prefix: str, **settings: Any
) -> Iterator[httpx.Client]:
    """A gateway in front of ``upstream_urls`` with version 0 (the base model) active; every
    adapter whose name starts with ``prefix`` is unloaded from the real vLLM on exit (their
    directories are temporary)."""
    with ExitStack() as stack:
        gateway = stack.enter_context(
            gateway_with(pool, free_port(), upstream_url=",".join(upstream_urls), **settings)
        )
        api = stack.enter_context(httpx.Client(base_url=gateway.url, timeout=120))
        stack.callback(_unload_prefixed, vllm, prefix)
        base = {"version": 0, "model_name": vllm.served_model_name, "activate": True}
        assert api.post("/admin/policy-versions", json=base).status_code == 201
        yield api


def _unload_prefixed(vllm: VLLMServer, prefix: str) -> None:
    for name in _adapters_served(vllm):
        if name.startswith(prefix):
            httpx.post(f"{vllm.url}{UNLOAD_PATH}", json={"lora_name": name}, timeout=60)


def _adapters_served(vllm: VLLMServer) -> set[str]:
    entries = httpx.get(f"{vllm.url}/v1/models", timeout=30).json()["data"]
    return {entry["id"] for entry in entries if entry.get("parent")}


def _publish_lora(api: httpx.Client, version: int, path: Path | str, prefix: str) -> httpx.Response:
    body = {
        "version": version,
        "weight_format": "lora",
        "weights_location": str(path),
        "adapter_prefix": prefix,
    }
    return api.post("/admin/weight-updates", json=body)


def _release(api: httpx.Client, adapter_prefix: str, **body: Any) -> httpx.Response:
    return api.post("/admin/adapter-releases", json={"adapter_prefix": adapter_prefix, **body})


def _served_starting(vllm: VLLMServer, prefix: str) -> set[str]:
    return {name for name in _adapters_served(vllm) if name.startswith(prefix)}


def _versions(api: httpx.Client) -> list[tuple[int, str, bool]]:
    rows = api.get("/admin/policy-versions").json()
    return [(row["version"], row["model_name"], row["active"]) for row in rows]


def test_each_lora_version_is_a_new_adapter_and_those_past_the_kept_ones_are_unloaded(
    vllm: VLLMServer, pool_settings: PoolSettings, adapter_dirs: list[Path], tmp_path: Path
) -> None:
    prefix = f"kept-{secrets.token_hex(4)}"
    with gateway_over(pool_settings, [vllm.url], vllm, prefix, lora_adapters_kept=2) as api:
        chat = {"model": "policy", "messages": PROMPT, "max_tokens": 8, "temperature": 0}
        assert api.post("/t/kept/v1/chat/completions", json=chat).is_success
        published = []
        # Versions 1 and 3 load the same directory: still two adapters, one name per version.
        for version, path in ((1, adapter_dirs[0]), (2, adapter_dirs[1]), (3, adapter_dirs[0])):
            answer = _publish_lora(api, version, path, prefix)
            assert answer.status_code == 201, answer.text
            published.append(answer.json())
        after = api.post("/t/kept/v1/chat/completions", json=chat)
        served = {name for name in _adapters_served(vllm) if name.startswith(prefix)}
        versions = _versions(api)

    first, second, third = published
    assert first["model_name"] == f"{prefix}-v1"
    assert (first["weight_format"], first["pause_ms"], first["mode"]) == ("lora", 0.0, None)
    assert first["replicas"] == [vllm.url]
    assert first["unloaded_adapters"] == second["unloaded_adapters"] == []
    # Kept 2: publishing version 3 unloads version 1 (3 registered adapters - 2 kept).
    assert third["unloaded_adapters"] == [f"{prefix}-v1"]
    assert served == {f"{prefix}-v2", f"{prefix}-v3"}
    assert versions == [
        (0, vllm.served_model_name, False),
        (1, f"{prefix}-v1", False),
        (2, f"{prefix}-v2", False),
        (3, f"{prefix}-v3", True),
    ]
    assert after.headers["x-trajgate-policy-version"] == "3"
    base_step, adapter_step = steps_of(pool_settings, "kept")
    assert (base_step.policy_version, adapter_step.policy_version) == (0, 3)
    assert adapter_step.upstream_request["model"] == f"{prefix}-v3"


def test_a_call_in_flight_finishes_on_its_adapter_while_newer_ones_are_published(
    vllm: VLLMServer, sqlite_pool: PoolSettings, adapter_dirs: list[Path], tmp_path: Path
) -> None:
    """No pause: the stream resolved the alias to version 1's adapter and keeps it, even once
    versions 2 and 3 are published and version 1's adapter is unloaded (kept 2)."""
    prefix = f"flight-{secrets.token_hex(4)}"
    with gateway_over(sqlite_pool, [vllm.url], vllm, prefix, lora_adapters_kept=2) as api:
        assert _publish_lora(api, 1, adapter_dirs[0], prefix).status_code == 201
        chat = {
            "model": "policy",
            "messages": PROMPT,
            "max_tokens": 400,
            "temperature": 1.0,
            "stream": True,
        }
        unloaded = []
        with api.stream("POST", "/t/flight/v1/chat/completions", json=chat) as stream:
            assert stream.headers["x-trajgate-policy-version"] == "1"
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            for version, path in ((2, adapter_dirs[1]), (3, adapter_dirs[0])):
                answer = _publish_lora(api, version, path, prefix)
                assert answer.status_code == 201, answer.text
                unloaded += answer.json()["unloaded_adapters"]
            body = "\n\n".join([first, *(line for line in lines if line)])
        later = api.post(
            "/t/later/v1/chat/completions", json={**chat, "stream": False, "max_tokens": 4}
        )

    assert unloaded == [f"{prefix}-v1"]
    chunks = sse_chunks(body + "\n\n")
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    [step] = steps_of(sqlite_pool, "flight")
    assert (step.policy_version, step.upstream_request["model"]) == (1, f"{prefix}-v1")
    assert step.policy_version_spans is None
    # "truncated" when it reached max_tokens: the only flag it may carry
    assert set(step.flags) <= {"truncated"} and step.outcome == "ok"
    assert len(step.response_token_ids) == step.completion_tokens > 0
    assert later.headers["x-trajgate-policy-version"] == "3"


def test_a_lora_update_whose_directory_holds_no_adapter_is_400_and_changes_nothing(
    vllm: VLLMServer, sqlite_pool: PoolSettings, tmp_path: Path
) -> None:
    prefix = f"missing-{secrets.token_hex(4)}"
    with gateway_over(sqlite_pool, [vllm.url], vllm, prefix) as api:
        refused = _publish_lora(api, 1, tmp_path / "no-adapter-here", prefix)
        versions = _versions(api)
        served = _adapters_served(vllm)

    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("lora_adapter_not_found", "weights_location")
    assert (
        "No adapter found" in error["message"] and "version 1 is not registered" in error["message"]
    )
    assert versions == [(0, vllm.served_model_name, True)]
    assert f"{prefix}-v1" not in served


def test_a_lora_update_on_a_replica_without_lora_is_400_and_unloads_it_from_the_others(
    vllm: VLLMServer, sqlite_pool: PoolSettings, adapter_dirs: list[Path], tmp_path: Path
) -> None:
    """vLLM (first) loads the adapter, the emulator (second) has no LoRA route: 400
    ``lora_not_enabled``, the adapter unloaded from vLLM again, the version not registered.
    A replica that fails otherwise (500) is 502 ``weight_update_failed``, the same undone."""
    prefix = f"nolora-{secrets.token_hex(4)}"
    emulator = EmulatorThread(EmulatorSettings(port=free_port())).start()
    try:
        with gateway_over(sqlite_pool, [vllm.url, emulator.url], vllm, prefix) as api:
            refused = _publish_lora(api, 1, adapter_dirs[0], prefix)
            served_after_refusal = _adapters_served(vllm)
            emulator.fail(LOAD_PATH, 500)
            failed = _publish_lora(api, 1, adapter_dirs[0], prefix)
            served_after_failure = _adapters_served(vllm)
            versions = _versions(api)
    finally:
        emulator.stop()

    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("lora_not_enabled", "weight_format")
    assert emulator.url in error["message"] and "--enable-lora" in error["message"]
    assert failed.status_code == 502
    assert failed.json()["error"]["code"] == "weight_update_failed"
    assert f"{prefix}-v1" not in served_after_refusal | served_after_failure
    assert versions == [(0, vllm.served_model_name, True)]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"weight_format": "lora", "model_name": "tiny"}, "model_name"),
        ({"weight_format": "lora", "mode": "drain"}, "mode"),
        ({"weight_format": "lora", "drain_timeout_s": 1}, "drain_timeout_s"),
        ({"weight_format": "lora", "adapter_prefix": "no spaces"}, "adapter_prefix"),
        ({"weight_format": "full"}, "model_name"),
        ({"model_name": "tiny", "adapter_prefix": "p"}, "adapter_prefix"),
        ({"model_name": "tiny", "weight_format": "qlora"}, "weight_format"),
    ],
    ids=[
        "lora-with-model-name",
        "lora-with-mode",
        "lora-with-drain-limit",
        "lora-bad-prefix",
        "full-without-model-name",
        "full-with-prefix",
        "unknown-format",
    ],
)
def test_a_weight_update_mixing_the_formats_fields_is_400_naming_the_field(
    sqlite_pool: PoolSettings, body: dict[str, Any], param: str
) -> None:
    # Nothing reaches a replica: nothing listens at the upstream.
    upstream = f"http://127.0.0.1:{free_port()}"
    with gateway_with(sqlite_pool, free_port(), upstream_url=upstream) as gateway:
        full_body = {"version": 1, "weights_location": "/weights/v1", **body}
        refused = httpx.post(f"{gateway.url}/admin/weight-updates", json=full_body, timeout=30)
        versions = httpx.get(f"{gateway.url}/admin/policy-versions", timeout=30).json()
    assert refused.status_code == 400, refused.text
    assert param in str(refused.json()["error"]["param"])
    assert versions == []


# vLLM 0.32's answers to /v1/load_lora_adapter (read in vllm/entrypoints/serve/lora and
# openai/models/serving.py; the "No adapter found" one seen on the shared server).
LORA_OFF = {
    "error": {
        "message": "LoRA is not enabled. Use --enable-lora to enable LoRA.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}
NO_ADAPTER = {
    "error": {
        "message": "Loading lora a-v1 failed: No adapter found for /x",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }
}
TAKEN = {
    "error": {
        "message": "The lora adapter 'a-v1' has already been loaded.",
        "type": "InvalidUserInput",
        "param": None,
        "code": 400,
    }
}
ENGINE_DEAD = {
    "error": {
        "message": "EngineCore encountered an issue.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}


@pytest.mark.parametrize(
    ("status", "answer", "code"),
    [
        (404, {"detail": "Not Found"}, "lora_not_enabled"),  # runtime LoRA updates off
        (500, LORA_OFF, "lora_not_enabled"),  # --enable-lora missing
        (404, NO_ADAPTER, "lora_adapter_not_found"),
        (400, TAKEN, "lora_adapter_refused"),
        (500, ENGINE_DEAD, None),  # a failing replica: 502 weight_update_failed
    ],
    ids=["no-route", "no-lora-engine", "no-adapter", "name-taken", "engine-failed"],
)
@pytest.mark.anyio
async def test_a_refused_adapter_is_told_from_a_failing_replica_by_vllms_answer(
    status: int, answer: dict[str, Any], code: str | None
) -> None:
    from gateway.engine.admin import AdapterRefusedError, ReloadError, load_adapter

    def vllm(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json=answer)

    async with httpx.AsyncClient(transport=httpx.MockTransport(vllm)) as client:
        with pytest.raises(ReloadError) as raised:
            await load_adapter(client, ["http://replica"], "a-v1", "/x", 5.0, in_place=False)
    failure = raised.value
    assert (failure.code if isinstance(failure, AdapterRefusedError) else None) == code


def test_a_release_unloads_the_adapters_its_prefix_names_and_the_active_one_only_when_asked(
    vllm: VLLMServer, sqlite_pool: PoolSettings, adapter_dirs: list[Path]
) -> None:
    """Run ``prefix`` published versions 1 and 2, another run (``<prefix>-other``) version 3,
    now active. Releasing ``<prefix>-v`` unloads 1 and 2 and leaves the other run's adapter;
    releasing ``<prefix>-other-v`` is 409 while its adapter serves the alias, and unloads it with
    ``include_active``. The registry forgets no version."""
    prefix = f"release-{secrets.token_hex(4)}"
    other = f"{prefix}-other"
    with gateway_over(sqlite_pool, [vllm.url], vllm, prefix, lora_adapters_kept=3) as api:
        for version, path, run in ((1, adapter_dirs[0], prefix), (2, adapter_dirs[1], prefix)):
            assert _publish_lora(api, version, path, run).status_code == 201
        assert _publish_lora(api, 3, adapter_dirs[0], other).status_code == 201
        ours = _release(api, f"{prefix}-v")
        served_after_ours = _served_starting(vllm, prefix)
        refused = _release(api, f"{other}-v")
        served_after_refusal = _served_starting(vllm, prefix)
        chat = {"model": "policy", "messages": PROMPT, "max_tokens": 4, "temperature": 0}
        still_served = api.post("/t/release/v1/chat/completions", json=chat)
        forced = _release(api, f"{other}-v", include_active=True)
        served_after_forced = _served_starting(vllm, prefix)
        versions = _versions(api)

    assert ours.status_code == 200, ours.text
    released = {vllm.url: [f"{prefix}-v1", f"{prefix}-v2"]}
    assert ours.json() == {"adapter_prefix": f"{prefix}-v", "released": released}
    assert served_after_ours == {f"{other}-v3"}
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "lora_adapter_active"
    assert f"adapter {other}-v3 serves the active policy version 3" in error["message"]
    assert served_after_refusal == {f"{other}-v3"}  # nothing released
    assert still_served.status_code == 200, still_served.text
    assert still_served.headers["x-trajgate-policy-version"] == "3"
    assert forced.status_code == 200, forced.text
    assert forced.json()["released"] == {vllm.url: [f"{other}-v3"]}
    assert served_after_forced == set()
    assert versions == [
        (0, vllm.served_model_name, False),
        (1, f"{prefix}-v1", False),
        (2, f"{prefix}-v2", False),
        (3, f"{other}-v3", True),
    ]


def test_the_trainers_release_goes_through_the_gateway_and_keeps_the_active_adapter_unless_asked(
    vllm: VLLMServer, sqlite_pool: PoolSettings, adapter_dirs: list[Path]
) -> None:
    prefix = f"trainer-{secrets.token_hex(4)}"
    with gateway_over(sqlite_pool, [vllm.url], vllm, prefix) as api:
        sync = WeightSync(str(api.base_url), adapter_prefix=prefix)
        for version, path in ((1, adapter_dirs[0]), (2, adapter_dirs[1])):
            sync.publish(version, path, "lora")
        with pytest.raises(WeightSyncError) as refused:
            sync.release_adapters()
        served_after_refusal = _served_starting(vllm, prefix)
        released = sync.release_adapters(include_active=True)
        served_after_release = _served_starting(vllm, prefix)
        sync.close()

    assert "-> 409" in str(refused.value) and "lora_adapter_active" in str(refused.value)
    assert served_after_refusal == {f"{prefix}-v1", f"{prefix}-v2"}
    assert released == {vllm.url: [f"{prefix}-v1", f"{prefix}-v2"]}
    assert served_after_release == set()


def test_a_replica_failing_an_unload_is_502_naming_it_and_what_the_others_released(
    vllm: VLLMServer, sqlite_pool: PoolSettings, adapter_dirs: list[Path]
) -> None:
    """vLLM (first) serves the adapter, the emulator (second) fails every unload with a 500:
    vLLM still releases it, and the 502 names the emulator, the adapter and what was released.
    The emulator has no LoRA route, so the adapter is loaded into vLLM directly (as an operator
    would), not published."""
    prefix = f"failing-{secrets.token_hex(4)}"
    name = f"{prefix}-v1"
    emulator = EmulatorThread(EmulatorSettings(port=free_port())).start()
    try:
        with gateway_over(sqlite_pool, [vllm.url, emulator.url], vllm, prefix) as api:
            load = {"lora_name": name, "lora_path": str(adapter_dirs[0])}
            httpx.post(f"{vllm.url}{LOAD_PATH}", json=load, timeout=120).raise_for_status()
            emulator.fail(UNLOAD_PATH, 500)
            failed = _release(api, f"{prefix}-v")
            served_after_failure = _served_starting(vllm, prefix)
            emulator.fail(UNLOAD_PATH, None)
            again = _release(api, f"{prefix}-v")
    finally:
        emulator.stop()

    assert failed.status_code == 502, failed.text
    error = failed.json()["error"]
    assert error["code"] == "lora_release_failed"
    assert f"replica {emulator.url}, adapter {name}: 500" in error["message"]
    assert f"{{'{vllm.url}': ['{name}'], '{emulator.url}': []}}" in error["message"]
    assert served_after_failure == set()
    # Released again: vLLM lists nothing of the prefix any more, so nothing is selected.
    assert again.status_code == 200, again.text
    assert again.json()["released"] == {vllm.url: [], emulator.url: []}


def test_a_release_no_replica_answers_a_model_list_for_is_502_and_releases_nothing(
    sqlite_pool: PoolSettings,
) -> None:
    emulator = EmulatorThread(EmulatorSettings(port=free_port())).start()
    try:
        with gateway_with(sqlite_pool, free_port(), upstream_url=emulator.url) as gateway:
            emulator.fail(MODELS_PATH, 500)
            failed = httpx.post(
                f"{gateway.url}/admin/adapter-releases", json={"adapter_prefix": "p-v"}, timeout=30
            )
    finally:
        emulator.stop()
    assert failed.status_code == 502, failed.text
    error = failed.json()["error"]
    assert error["code"] == "lora_release_failed"
    assert (
        "answered its model list" in error["message"] and "nothing was released" in error["message"]
    )


def test_a_release_waits_for_a_weight_update_in_flight(sqlite_pool: PoolSettings) -> None:
    """The emulator's reload hangs until the update's 2 s reload deadline: a release sent
    meanwhile answers only after the update ended (ungated, it answered in milliseconds: the
    emulator lists no adapter)."""
    emulator = EmulatorThread(EmulatorSettings(port=free_port())).start()
    try:
        with gateway_with(
            sqlite_pool, free_port(), upstream_url=emulator.url, upstream_total_timeout_s=2
        ) as gateway:
            registered = httpx.post(
                f"{gateway.url}/admin/policy-versions",
                json={"version": 0, "model_name": "emulated"},
                timeout=30,
            )
            assert registered.status_code == 201, registered.text
            emulator.fail(RELOAD_PATH, "hang")
            update = {"version": 1, "model_name": "emulated", "weights_location": "/ckpt/v1"}
            answers: dict[str, httpx.Response] = {}

            def publish() -> None:
                url = f"{gateway.url}/admin/weight-updates"
                answers["update"] = httpx.post(url, json=update, timeout=30)

            publisher = threading.Thread(target=publish)
            publisher.start()
            deadline = time.monotonic() + 10
            while RELOAD_PATH not in emulator.book.weights.asked:
                assert time.monotonic() < deadline, "the update never reached its reload"
                time.sleep(0.01)
            started = time.monotonic()
            released = httpx.post(
                f"{gateway.url}/admin/adapter-releases", json={"adapter_prefix": "p-v"}, timeout=30
            )
            waited_s = time.monotonic() - started
            publisher.join()
    finally:
        emulator.stop()
    assert answers["update"].status_code == 502  # its reload timed out
    assert released.status_code == 200, released.text
    assert released.json()["released"] == {emulator.url: []}
    # It was sent within a few ms of the reload, whose deadline is 2 s after: it waited ~2 s.
    assert waited_s > 1.0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "adapter_prefix"),
        ({"adapter_prefix": ""}, "adapter_prefix"),
        ({"adapter_prefix": 7}, "adapter_prefix"),
        ({"adapter_prefix": "p-v", "include_active": "yes"}, "include_active"),
        ({"adapter_prefix": "p-v", "adapter": "p-v1"}, "adapter"),
    ],
    ids=["missing-prefix", "empty-prefix", "prefix-not-a-string", "flag-not-a-bool", "unknown"],
)
def test_a_release_with_a_bad_body_is_400_naming_the_field_and_asks_no_replica(
    sqlite_pool: PoolSettings, body: dict[str, Any], param: str
) -> None:
    asked: list[str] = []

    def replica(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(200, json={"object": "list", "data": []})

    with gateway_with(sqlite_pool, free_port(), transport=httpx.MockTransport(replica)) as gateway:
        asked.clear()  # the gateway's start-up probes
        refused = httpx.post(f"{gateway.url}/admin/adapter-releases", json=body, timeout=30)
    assert refused.status_code == 400, refused.text
    assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
    assert refused.json()["error"]["param"] == param
    assert MODELS_PATH not in asked and UNLOAD_PATH not in asked


def test_a_release_needs_the_admin_token_as_every_admin_route(sqlite_pool: PoolSettings) -> None:
    upstream = f"http://127.0.0.1:{free_port()}"  # nothing listens: nothing may be asked
    with gateway_with(
        sqlite_pool, free_port(), upstream_url=upstream, admin_token="s3cret-token-for-tests"
    ) as gateway:
        url = f"{gateway.url}/admin/adapter-releases"
        anonymous = httpx.post(url, json={"adapter_prefix": "p-v"}, timeout=30)
        wrong = httpx.post(
            url,
            json={"adapter_prefix": "p-v"},
            headers={"Authorization": "Bearer wrong"},
            timeout=30,
        )
    assert (anonymous.status_code, wrong.status_code) == (401, 401)
