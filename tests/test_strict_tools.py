"""Strict tools on the real vLLM (the tiny model, hermes parser, as ``trajgate vllm start`` runs
it): vLLM samples under a structural tag when a tool is ``strict`` (the OpenAI Agents SDK's
default), even with ``tool_choice`` auto; such steps are flagged ``constrained``
(gateway.proxy.sampling.constrained_by). The tag masks the text before any call too: an answer
without a call has other logprobs than the same seeded request without ``strict``. A channel
whose sampling policy is ``override`` strips ``strict`` before vLLM sees it, recorded in
``sampling.replaced``, and its steps are not flagged.

The tiny model rarely opens a call by itself, so the flagged call biases ``<tool_call>`` (id
2042 in its tokenizer) by +100: the step is also ``narrowed``, which the test allows for.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from gateway_helpers import gateway_with, sse_payloads, steps_of
from tests_support import free_port

from datapool.settings import PoolSettings
from trajgate.vllm_server import VLLMServer

TOOL_CALL_ID = 2042  # "<tool_call>" in the tiny model's tokenizer (an added, non-special token)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]


def _call(url: str, trajectory: str, channel: str, **fields: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": PROMPT, "seed": 5, "temperature": 1.0, **fields}
    response = httpx.post(
        f"{url}/t/{trajectory}/v1/chat/completions",
        json=body,
        headers={"X-Trajgate-Channel": channel},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response


def test_a_strict_tool_call_is_flagged_constrained_and_a_stripped_one_reaches_vllm_without_strict(
    vllm: VLLMServer, sqlite_pool: PoolSettings
) -> None:
    opened = {"tools": [WEATHER], "logit_bias": {str(TOOL_CALL_ID): 100}, "max_tokens": 40}
    with gateway_with(
        sqlite_pool, free_port(), upstream_url=vllm.url, sampling_policy={"strip": "override"}
    ) as gateway:
        _call(gateway.url, "strict-unary", "train", **opened)
        streamed = _call(gateway.url, "strict-stream", "train", **opened, stream=True)
        assert "tool_calls" in "".join(sse_payloads(streamed.text))
        _call(gateway.url, "strict-stripped", "strip", **opened)
        _call(gateway.url, "strict-answer", "train", tools=[WEATHER], max_tokens=6)
        free = {**WEATHER, "function": {**WEATHER["function"], "strict": False}}
        _call(gateway.url, "free-answer", "train", tools=[free], max_tokens=6)

    for trajectory in ("strict-unary", "strict-stream"):
        (step,) = steps_of(sqlite_pool, trajectory)
        # The grammar wrote the tool's name after <tool_call> (a random model would not); the
        # bias opens a second call that max_tokens cuts (a unary answer keeps it as text).
        assert '"name": "get_weather"' in json.dumps(step.response_message).replace("\\", "")
        assert "constrained" in step.flags and "narrowed" in step.flags  # narrowed: the bias
        assert step.sampling["constrained_by"] == ["tools.strict"]

    (stripped,) = steps_of(sqlite_pool, "strict-stripped")
    assert "constrained" not in stripped.flags and "narrowed" not in stripped.flags
    assert stripped.sampling["constrained_by"] == []
    assert stripped.sampling["replaced"] == {
        "logit_bias": {str(TOOL_CALL_ID): 100},
        "tools.strict": {"get_weather": True},
    }
    (sent_tool,) = stripped.upstream_request["tools"]
    assert "strict" not in sent_tool["function"] and "logit_bias" not in stripped.upstream_request

    # Strict tools offered, no call opened: the tag masked the answer's tokens all the same
    # (same ids, other logprobs than without strict: 0.025 nats apart on the first token).
    (answer,) = steps_of(sqlite_pool, "strict-answer")
    (unconstrained,) = steps_of(sqlite_pool, "free-answer")
    assert not answer.response_message.get("tool_calls") and "constrained" in answer.flags
    assert "constrained" not in unconstrained.flags
    assert answer.response_token_ids == unconstrained.response_token_ids
    assert answer.response_logprobs != unconstrained.response_logprobs
