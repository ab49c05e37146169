"""Full-weight updates that keep the calls in flight (issue 27 part 1, invariant 9): vLLM pauses
with its requests frozen, the weights are replaced, the requests resume on the new weights, and
each streamed step records which tokens each version sampled.

The proof that the spans are exact: the stored behaviour logprob of every token equals the one
recomputed (transformers, float32, at the row's temperature) under the weights of its span's
version, within 1e-5, while the two versions' logprobs of the same tokens differ by far more.
A unary call in flight cannot tell where its answer was split: flagged, not trained on.

The session's vLLM serves these tests: they put the base weights back when they end. They pause
and reload it: leave TRAJGATE_TEST_VLLM_PORT unset (not the shared server).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest
import torch
from batch_helpers import make_store
from gateway_helpers import gateway_with
from tests_support import free_port
from weight_helpers import base_weights_put_back, noisy_versions

from datapool.batches.build import build_rows
from datapool.batches.spec import BatchSpec
from datapool.settings import PoolSettings
from trajgate.vllm_server import VLLMServer

TOLERANCE = 1e-5
TEMPERATURE = 0.6
LONG_TOKENS = 600  # long enough to still be sampling when the update pauses, on a quiet machine too
PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]
SPLIT_UNKNOWN = "policy_version_split_unknown"


@pytest.fixture(scope="module")
def two_versions(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return noisy_versions(tiny_model_dir, tmp_path_factory.mktemp("kept"), 1)


class LongCall(threading.Thread):
    """One long call (``LONG_TOKENS`` tokens, end token ignored); ``read`` counts the streamed
    tokens it got so far."""

    def __init__(self, gateway_url: str, trajectory: str, stream: bool) -> None:
        super().__init__(daemon=True)
        self.url = f"{gateway_url}/t/{trajectory}/v1/chat/completions"
        self.stream, self.read, self.status = stream, 0, 0
        self.started = threading.Event()

    def run(self) -> None:
        body: dict[str, Any] = {
            "model": "tiny",
            "messages": PROMPT,
            "max_tokens": LONG_TOKENS,
            "temperature": TEMPERATURE,
            "ignore_eos": True,
            "stream": self.stream,
            "logprobs": True,
        }
        if not self.stream:
            self.started.set()
            self.status = httpx.post(self.url, json=body, timeout=600).status_code
            return
        with httpx.stream("POST", self.url, json=body, timeout=600) as response:
            self.status = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: {") and '"logprobs":{' in line:
                    self.read += 1
                    if self.read >= 10:
                        self.started.set()
        self.started.set()


def _token_logprobs(model: Any, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log pi(response_t | ...) ``[R]`` at ``TEMPERATURE`` under ``model``."""
    ids = torch.tensor([prompt + response])  # [1, P + R]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()  # [P + R, V]
    logits = logits[len(prompt) - 1 : len(prompt) + len(response) - 1] / TEMPERATURE  # [R, V]
    picked = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None])
    return picked[:, 0]  # [R]


def test_a_kept_update_aborts_nothing_and_every_token_matches_its_spans_version(
    vllm: VLLMServer, tiny_model_dir: Path, two_versions: list[Path], sqlite_pool: PoolSettings
) -> None:
    from transformers import AutoModelForCausalLM

    with (
        base_weights_put_back(vllm, tiny_model_dir),
        gateway_with(sqlite_pool, free_port(), upstream_url=vllm.url) as gateway,
    ):
        api = httpx.Client(base_url=gateway.url, timeout=600)
        registered = api.post(
            "/admin/policy-versions",
            json={"version": 0, "model_name": vllm.served_model_name},
        )
        assert registered.status_code == 201, registered.text
        calls = [
            LongCall(gateway.url, "kept-s0", True),
            LongCall(gateway.url, "kept-s1", True),
            LongCall(gateway.url, "kept-unary", False),
        ]
        for call in calls:
            call.start()
        assert all(call.started.wait(300) for call in calls)
        update = api.post(
            "/admin/weight-updates",
            json={
                "version": 1,
                "model_name": vllm.served_model_name,
                "weights_location": str(two_versions[1]),
            },
        )
        assert update.status_code == 201, update.text
        report = update.json()
        for call in calls:
            call.join(600)
        assert [call.status for call in calls] == [200, 200, 200]
        assert report["mode"] == "keep" and report["aborted_calls"] == 0
        assert report["kept_calls"] == 3 and report["split_unknown_calls"] == 1
        for index, trajectory in enumerate(("kept-s0", "kept-s1", "kept-unary")):
            done = api.post(
                f"/api/trajectories/{trajectory}/complete", json={"reward": float(index % 2)}
            )
            assert done.status_code == 200, done.text
        steps = {
            t: api.get(
                f"/api/steps/{api.get(f'/api/trajectories/{t}').json()['steps'][0]['id']}"
            ).json()
            for t in ("kept-s0", "kept-s1", "kept-unary")
        }
        api.close()

    models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in two_versions]
    for trajectory in ("kept-s0", "kept-s1"):
        step = steps[trajectory]
        assert step["outcome"] == "ok" and len(step["response_token_ids"]) == LONG_TOKENS
        (old, start, split), (new, split_again, end) = step["policy_version_spans"]
        assert (old, new, start, split_again, end) == (0, 1, 0, split, LONG_TOKENS)
        print(f"{trajectory}: split at token {split} of {LONG_TOKENS}")
        assert 0 < split < LONG_TOKENS and step["policy_version"] == 0
        stored = torch.tensor(step["response_logprobs"])  # [R]
        under = [
            _token_logprobs(m, step["prompt_token_ids"], step["response_token_ids"]) for m in models
        ]  # each [R]
        assert float((stored[:split] - under[0][:split]).abs().max()) < TOLERANCE
        assert float((stored[split:] - under[1][split:]).abs().max()) < TOLERANCE
        # The check tells the versions apart: each span is far from the other version.
        assert float((stored[:split] - under[1][:split]).abs().mean()) > 100 * TOLERANCE
        assert float((stored[split:] - under[0][split:]).abs().mean()) > 100 * TOLERANCE
    unary = steps["kept-unary"]
    assert SPLIT_UNKNOWN in unary["flags"] and unary["policy_version_spans"] is None

    # Rows carry the spans in row positions; the unary step is kept out.
    table: pa.Table
    table, _ = build_rows(make_store(sqlite_pool), BatchSpec(algorithm="reinforce_pp"))
    rows = {r["trajectory_id"]: r for r in table.to_pylist()}
    assert set(rows) == {"kept-s0", "kept-s1"}
    for trajectory, row in rows.items():
        prompt = row["prompt_tokens"]
        (_, _, split), _ = steps[trajectory]["policy_version_spans"]
        assert row["policy_version_spans"] == [
            {"version": 0, "start": prompt, "end": prompt + split},
            {"version": 1, "start": prompt + split, "end": prompt + LONG_TOKENS},
        ]
        assert row["policy_version"] == 0 and row["temperature"] == pytest.approx(TEMPERATURE)
