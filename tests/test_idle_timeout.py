"""The idle timeout against calls in flight: a call that outlasts
``trajectory_idle_timeout_s`` is recorded (its trajectory is not idle while the engine
works), and the trajectory completes by idle timeout once the call has committed. Real
gateway, real vLLM (tiny model), both database backends."""

from __future__ import annotations

import time

import httpx
import pytest
from gateway_helpers import gateway_with
from tests_support import free_port

from datapool.settings import PoolSettings
from trajgate.vllm_server import VLLMServer

IDLE_TIMEOUT_S = 0.5
LONG_TOKENS = 800
# 800 tokens take 2.8-50 s on the CPU build (about 3.5-60 ms a token, by machine load; 400 once
# took only 1.4 s on a quiet machine): always longer than twice the idle timeout, which the test
# checks before trusting its outcome.
LONG_CALL = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "tell a long story"}],
    "max_tokens": LONG_TOKENS,
    "ignore_eos": True,
}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_call_outlasting_the_idle_timeout_is_recorded_then_the_trajectory_idles_out(
    vllm: VLLMServer, pool_settings: PoolSettings, stream: bool
) -> None:
    pool = pool_settings.model_copy(
        update={"trajectory_idle_timeout_s": IDLE_TIMEOUT_S, "compaction_interval_s": 0.1}
    )
    url = "/t/long-1/v1/chat/completions"
    with (
        gateway_with(pool, free_port(), upstream_url=vllm.url) as gateway,
        httpx.Client(base_url=gateway.url, timeout=300) as client,
    ):
        first = client.post(url, json={**LONG_CALL, "max_tokens": 1})  # the trajectory exists
        assert first.status_code == 200, first.text
        started = time.monotonic()
        if stream:
            with client.stream("POST", url, json={**LONG_CALL, "stream": True}) as response:
                status, text = response.status_code, response.read().decode()
            assert text.rstrip().endswith("data: [DONE]") and "trajectory_closed" not in text
        else:
            response = client.post(url, json=LONG_CALL)
            status, text = response.status_code, response.text
        elapsed_s = time.monotonic() - started
        assert elapsed_s > 2 * IDLE_TIMEOUT_S, f"the call took {elapsed_s:.1f} s: not long enough"
        assert status == 200, text
        detail = client.get("/api/trajectories/long-1").json()
        assert [s["completion_tokens"] for s in detail["steps"]] == [1, LONG_TOKENS]
        deadline = time.monotonic() + 10 * IDLE_TIMEOUT_S
        while detail["status"] == "open" and time.monotonic() < deadline:
            time.sleep(0.2)
            detail = client.get("/api/trajectories/long-1").json()
        assert (detail["status"], detail["completion_reason"]) == ("complete", "idle_timeout")
        assert detail["rejected_calls"] == 0
