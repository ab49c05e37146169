"""Full-weight updates while agents call, and the version a call naming a
model is stamped with when several versions share that name.

A full reload happens in place in vLLM, so the gateway holds new calls, lets the calls in flight
finish (aborting them past the drain limit: mode 'drain', tested here; mode 'keep' is in
test_weight_updates_kept.py), reloads, and releases the held calls on the new version. The
proof that no step mixes two versions: every recorded step's behaviour logprobs equal the
trainer's logprobs of the same tokens under the weights of the version the step is
stamped with (the usual sampler/trainer gap, 1e-5 nats on the CPU build in float32), while the
versions' weights differ by far more than that.

The session's vLLM serves every test: the tests here put the base weights back when they end.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from gateway_helpers import gateway_with
from tests_support import free_port
from weight_helpers import base_weights_put_back, noisy_versions

from datapool.settings import PoolSettings
from gateway.server import BackgroundServer
from trainer_bridge.collate import collate, row_from_step
from trainer_bridge.logprobs import token_logprobs
from trainer_bridge.sync import WeightSync
from trajgate.vllm_server import MAX_MODEL_LEN, VLLMServer

# Mean |trainer - vLLM| logprob of sampled tokens, as in test_trainer_bridge (measured 1.5e-7).
GAP_TOLERANCE = 1e-5
ABORTED = "aborted_for_weight_update"
PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]
# The stream the 1 s drain limit must cut: the whole context but room for the prompt (a few
# dozen tokens). It was 2000 tokens, which the tiny model samples in 4.7 s on 2 busy cores
# (425 tokens/s) but in under 1 s on a fast free host, where the stream then ended before the
# limit and nothing was aborted (flaky). 130,048 tokens end within 1 s only above 130,000
# tokens/s, 300x that rate. The stream is cut at the limit either way: no slower test.
LONG_STREAM_TOKENS = MAX_MODEL_LEN - 1024


@pytest.fixture(scope="module")
def version_weights(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Checkpoint directories of versions 0 (the base weights), 1 and 2."""
    return noisy_versions(tiny_model_dir, tmp_path_factory.mktemp("weights"), 2)


class Agent(threading.Thread):
    """Multi-turn episodes of 3 calls (unary, streamed, unary) until ``stop``; every call and
    every error it got are counted."""

    def __init__(self, gateway_url: str, name: str, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.gateway_url, self.name_, self.stop = gateway_url, name, stop
        self.calls = 0
        self.errors: list[openai.APIError] = []
        self.trajectories: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            trajectory = f"{self.name_}-{len(self.trajectories)}"
            self.trajectories.append(trajectory)
            client = openai.OpenAI(
                base_url=f"{self.gateway_url}/t/{trajectory}/v1",
                api_key="unused",
                max_retries=0,
                timeout=300,
                default_headers={"X-Trajgate-Group": "weights"},
            )
            messages: list[Any] = list(PROMPT)
            for turn in range(3):
                if self.stop.is_set():
                    break
                body: dict[str, Any] = {
                    "model": "policy",
                    "messages": messages,
                    "max_tokens": 3,
                    "temperature": 1.0,
                }
                try:
                    if turn == 1:
                        chunks = client.chat.completions.create(**body, stream=True)
                        text = "".join(
                            c.choices[0].delta.content or "" for c in chunks if c.choices
                        )
                    else:
                        text = client.chat.completions.create(**body).choices[0].message.content
                except openai.APIError as exc:
                    self.errors.append(exc)
                    break
                self.calls += 1
                messages = [*messages, {"role": "assistant", "content": text or ""}]
                messages.append({"role": "user", "content": "And tomorrow?"})


def _long_stream(gateway_url: str, started: threading.Event, outcome: dict[str, Any]) -> None:
    """One short call, then a stream that cannot end before any drain limit
    (``LONG_STREAM_TOKENS``)."""
    client = openai.OpenAI(
        base_url=f"{gateway_url}/t/long/v1",
        api_key="unused",
        max_retries=0,
        timeout=600,
        default_headers={"X-Trajgate-Group": "weights"},
    )
    body: dict[str, Any] = {"model": "policy", "messages": PROMPT, "temperature": 1.0}
    client.chat.completions.create(**body, max_tokens=3)
    try:
        for _ in client.chat.completions.create(
            **body, max_tokens=LONG_STREAM_TOKENS, stream=True, extra_body={"ignore_eos": True}
        ):
            started.set()
        outcome["finished"] = True
    except openai.APIError as exc:
        outcome["error"] = exc
    finally:
        started.set()


def _gap(model: Any, step: dict[str, Any]) -> float:
    """Mean |trainer logprob - behaviour logprob| over the step's sampled tokens, in nats."""
    row = row_from_step(
        step["prompt_token_ids"], step["response_token_ids"], step["response_logprobs"], 0.0
    )
    batch = collate([row], 0)
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)  # [1, T]
    mask = batch.loss_mask.bool()
    return float((logprobs - batch.behaviour_logprobs).abs()[mask].mean())


def _wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_full_weight_updates_under_load_never_mix_versions_in_a_step(
    vllm: VLLMServer, tiny_model_dir: Path, version_weights: list[Path], sqlite_pool: PoolSettings
) -> None:
    from transformers import AutoModelForCausalLM

    api_port = free_port()
    with (
        base_weights_put_back(vllm, tiny_model_dir),
        gateway_with(
            sqlite_pool, api_port, upstream_url=vllm.url, weight_update_mode="drain"
        ) as gateway,
    ):
        api = httpx.Client(base_url=gateway.url, timeout=600)
        sync = WeightSync(gateway.url, base_model_name=vllm.served_model_name)
        sync.register(0, vllm.served_model_name, str(tiny_model_dir))
        stop = threading.Event()
        agents = [Agent(gateway.url, f"agent{i}", stop) for i in range(2)]
        for agent in agents:
            agent.start()
        _wait_for(lambda: all(a.calls >= 1 for a in agents), 300, "a call of each agent on v0")

        # Update 1, with a 1 s drain limit and a stream that cannot finish within it.
        started, long_outcome = threading.Event(), {}
        long = threading.Thread(
            target=_long_stream, args=(gateway.url, started, long_outcome), daemon=True
        )
        long.start()
        assert started.wait(300)
        first = api.post(
            "/admin/weight-updates",
            json={
                "version": 1,
                "model_name": vllm.served_model_name,
                "weights_location": str(version_weights[1]),
                "drain_timeout_s": 1.0,
            },
        )
        assert first.status_code == 201, first.text
        report = first.json()
        assert report["aborted_calls"] >= 1 and report["pause_ms"] >= 1000.0
        long.join(60)
        error = long_outcome.get("error")
        # The stream ends in an error event in the dialect's envelope; the SDK raises it.
        assert isinstance(error, openai.APIError) and error.code == ABORTED, long_outcome

        # A call answered after an update returned was admitted after its pause: it ran on the
        # new version. Update 2 the trainer's way (WeightSync.publish), the default drain limit.
        calls_before = [a.calls for a in agents]
        _wait_for(
            lambda: any(a.calls > c for a, c in zip(agents, calls_before, strict=True)),
            300,
            "v1 calls",
        )
        published = sync.publish(2, version_weights[2], "full")
        assert published.pause_ms is not None and published.pause_ms > 0
        calls_before = [a.calls for a in agents]
        _wait_for(
            lambda: any(a.calls > c for a, c in zip(agents, calls_before, strict=True)),
            300,
            "v2 calls",
        )
        stop.set()
        for agent in agents:
            agent.join(300)

        # (an agent's last episode may have stopped before its first call: no trajectory)
        trajectories = [
            t
            for t in ["long", *(t for a in agents for t in a.trajectories)]
            if api.get(f"/api/trajectories/{t}").status_code == 200
        ]
        steps = [
            api.get(f"/api/steps/{summary['id']}").json()
            for t in trajectories
            for summary in api.get(f"/api/trajectories/{t}").json()["steps"]
        ]
        metrics = api.get("/metrics").text

        # Every answered step matches the weights of its stamped version, and only those.
        models = [
            AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in version_weights
        ]
        answered = [s for s in steps if s["outcome"] == "ok"]
        assert {s["policy_version"] for s in answered} == {0, 1, 2}
        for step in answered:
            own = _gap(models[step["policy_version"]], step)
            gaps = [_gap(model, step) for model in models]  # for the message only
            assert own < GAP_TOLERANCE, (step["id"], step["policy_version"], gaps)
        other = _gap(models[(answered[0]["policy_version"] + 1) % 3], answered[0])
        assert other > 100 * GAP_TOLERANCE  # the check can tell the versions apart

        # Held calls waited, and went upstream on the version that released them.
        held = [s for s in answered if s["held_ms"] is not None]
        assert held and all(s["held_ms"] > 0 and s["policy_version"] >= 1 for s in held)
        # The long stream: cut, recorded with the outcome and flag, partial tokens kept.
        aborted = [s for s in steps if s["outcome"] == ABORTED]
        long_steps = [s for s in aborted if s["trajectory_id"] == "long"]
        assert len(long_steps) == 1 and ABORTED in long_steps[0]["flags"]
        assert long_steps[0]["policy_version"] == 0
        assert "trajgate_weight_update_pause_seconds_count 2.0" in metrics
        assert 'trajgate_weight_update_calls_total{fate="aborted"}' in metrics

        # A batch of everything: every answered step is a row, no aborted step is.
        for index, trajectory in enumerate(trajectories):
            done = api.post(
                f"/api/trajectories/{trajectory}/complete", json={"reward": float(index % 2)}
            )
            assert done.status_code == 200, done.text
        created = api.post(
            "/api/batches", json={"algorithm": "grpo", "reward_to_steps": "broadcast"}
        )
        assert created.status_code == 201, created.text
        rows = httpx.get(
            f"{gateway.url}/api/batches/{created.json()['id']}/rows", timeout=60
        ).content
        import pyarrow as pa

        table = pa.ipc.open_stream(pa.py_buffer(rows)).read_all()
        batched = {step_id for ids in table["step_ids"].to_pylist() for step_id in ids}
        assert batched == {s["id"] for s in answered}
        assert not batched & {s["id"] for s in aborted}
        api.close()
        sync.close()


def test_a_named_model_is_stamped_with_the_version_serving_it_not_the_highest(
    gateway: BackgroundServer, vllm: VLLMServer
) -> None:
    # v1, v2 (active), then v3 registered without activation, all under one model name (the
    # full-weight set-up): a call naming the model is stamped 2 (main stamped 3), and 1 after
    # a rollback to v1.
    api = httpx.Client(base_url=gateway.url, timeout=300)
    name = vllm.served_model_name
    for version, activate in ((1, True), (2, True), (3, False)):
        registered = api.post(
            "/admin/policy-versions",
            json={"version": version, "model_name": name, "activate": activate},
        )
        assert registered.status_code == 201, registered.text
    body = {"model": name, "messages": PROMPT, "max_tokens": 1}

    def stamped() -> str:
        answer = api.post("/t/stamp/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        return answer.headers["x-trajgate-policy-version"]

    assert stamped() == "2"
    assert api.post("/admin/policy-versions/1/activate").status_code == 200
    assert stamped() == "1"
    steps = api.get("/api/trajectories/stamp").json()["steps"]
    assert [s["policy_version"] for s in steps] == [2, 1]
    api.close()


def test_train_loop_publishes_full_weights_through_the_pause_and_records_its_length(
    vllm: VLLMServer, tiny_model_dir: Path, sqlite_pool: PoolSettings, tmp_path: Path
) -> None:
    from trainer_bridge.loop import LoopSettings, run_loop
    from trainer_bridge.settings import TrainerSettings

    with (
        base_weights_put_back(vllm, tiny_model_dir),
        gateway_with(sqlite_pool, free_port(), upstream_url=vllm.url) as gateway,
    ):
        api = httpx.Client(base_url=gateway.url, timeout=300)
        WeightSync(gateway.url).register(0, vllm.served_model_name, str(tiny_model_dir))
        for member, reward in enumerate([1.0, 0.0]):
            trajectory = f"full-{member}"
            api.post("/api/trajectories", json={"id": trajectory, "group_id": "full-g"})
            body = {"model": "policy", "messages": PROMPT, "max_tokens": 3, "temperature": 1.0}
            assert api.post(f"/t/{trajectory}/v1/chat/completions", json=body).is_success
            api.post(f"/api/trajectories/{trajectory}/complete", json={"reward": reward})
        loop = LoopSettings(
            gateway_url=gateway.url,
            consumer="full-loop",
            spec={"channel": "train", "algorithm": "grpo", "group_size": 2},
            max_updates=1,
            adapter_dir=tmp_path,
            adapter_prefix="full",
        )
        settings = TrainerSettings(model_dir=tiny_model_dir, lora_rank=0, learning_rate=1e-3)
        run_loop(loop, settings, say=lambda _: None)
        [posted] = api.get("/api/training-metrics", params={"run": "full-loop"}).json()
        assert posted["policy_version"] == 1 and posted["metrics"]["weight_update_pause_ms"] > 0
        versions = api.get("/admin/policy-versions").json()
        assert [(v["version"], v["model_name"], v["active"]) for v in versions] == [
            (0, vllm.served_model_name, False),
            (1, vllm.served_model_name, True),
        ]
        after = api.post("/t/full-after/v1/chat/completions", json=body)
        assert after.headers["x-trajgate-policy-version"] == "1"
        assert "trajgate_weight_update_pause_seconds_count 1.0" in api.get("/metrics").text
        api.close()


def test_one_version_gets_one_weight_set_through_gateways_sharing_the_database(
    vllm: VLLMServer, tiny_model_dir: Path, pool_settings: PoolSettings, tmp_path: Path
) -> None:
    """Version 9 published, then published again with other weights: 409 naming both weight
    sets, nothing reloaded or paused (main answered 201, reloaded v9-b and kept v9-a in the
    registry). Then two gateways on one database publish version 10 with two weight sets at
    once: exactly one 201, one 409, and the registry holds the winner's; a publish whose reload
    the replica refuses (502) leaves its version free. Both weight sets are the base weights
    (the second through a directory of links), so vLLM ends as it began."""
    linked = tmp_path / "v10-b"
    linked.mkdir()
    for file in tiny_model_dir.iterdir():
        (linked / file.name).symlink_to(file)
    ports = (free_port(), free_port())
    with (
        gateway_with(pool_settings, ports[0], upstream_url=vllm.url) as first,
        gateway_with(pool_settings, ports[1], upstream_url=vllm.url) as second,
    ):
        api = [httpx.Client(base_url=g.url, timeout=300) for g in (first, second)]
        publish = {"version": 9, "model_name": vllm.served_model_name}
        sent = api[0].post(
            "/admin/weight-updates", json={**publish, "weights_location": str(tiny_model_dir)}
        )
        assert sent.status_code == 201, sent.text
        other = api[0].post(
            "/admin/weight-updates", json={**publish, "weights_location": "/ckpt/v9-b"}
        )
        assert other.status_code == 409, other.text
        error = other.json()["error"]
        assert (error["code"], error["param"]) == ("policy_version_conflict", "version")
        assert f"weights_location {str(tiny_model_dir)!r}, not" in error["message"]
        assert "'/ckpt/v9-b'" in error["message"]
        stamped = api[0].post(
            "/t/after/v1/chat/completions",
            json={"model": "policy", "messages": PROMPT, "max_tokens": 1},
        )
        assert stamped.headers["x-trajgate-policy-version"] == "9"

        answers: list[httpx.Response] = []
        barrier = threading.Barrier(2)

        def publish_ten(client: httpx.Client, location: Path) -> None:
            barrier.wait()
            body = {**publish, "version": 10, "weights_location": str(location)}
            answers.append(client.post("/admin/weight-updates", json=body))

        racers = [
            threading.Thread(target=publish_ten, args=(client, location))
            for client, location in zip(api, (tiny_model_dir, linked), strict=True)
        ]
        for racer in racers:
            racer.start()
        for racer in racers:
            racer.join()
        assert sorted(a.status_code for a in answers) == [201, 409], [a.text for a in answers]
        winner = next(a.json() for a in answers if a.status_code == 201)
        listed = api[1].get("/admin/policy-versions").json()
        assert [(v["version"], v["weights_location"], v["active"]) for v in listed] == [
            (9, str(tiny_model_dir), False),
            (10, winner["weights_location"], True),
        ]
        # A reload the replica refuses gives the claim back: the version can be published
        # again, with other weights.
        eleven = {**publish, "version": 11}
        refused = api[0].post(
            "/admin/weight-updates", json={**eleven, "weights_location": str(tmp_path / "none")}
        )
        assert refused.status_code == 502, refused.text
        assert 11 not in [v["version"] for v in api[0].get("/admin/policy-versions").json()]
        again = api[0].post(
            "/admin/weight-updates", json={**eleven, "weights_location": str(tiny_model_dir)}
        )
        assert again.status_code == 201, again.text
        for client in api:
            client.close()
