"""Real captured data for the inspector's tests: an unmodified OpenAI-SDK tool agent
(examples/openai_tool_agent.py) run through the gateway, then rewards through the pool API."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import openai_tool_agent

# Captured content is untrusted: a question that would run script if rendered as HTML.
SCRIPT_PAYLOAD = (
    '<script>window.__pwned = "script"</script>'
    '<img src="x" onerror="window.__pwned = \'img\'"><b>bold?</b>'
)
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def run_episode(
    base_url: str,
    trajectory_id: str,
    *,
    group_id: str | None = None,
    question: str = "What is the weather in Paris?",
    seed: int = 0,
    tags: list[str] | None = None,
    reward: float | None = None,
    complete: bool = True,
    channel: str = "train",
) -> dict[str, Any]:
    """Register, run the agent (2 real vLLM calls), complete with ``reward``; the detail."""
    with httpx.Client(base_url=base_url, timeout=60) as client:
        created = client.post(
            "/api/trajectories",
            json={
                "id": trajectory_id,
                "group_id": group_id,
                "tags": tags or [],
                "channel": channel,
            },
        )
        created.raise_for_status()
        openai_tool_agent.run(
            f"{base_url}/t/{trajectory_id}/v1",
            question=question,
            seed=seed,
            max_tokens=64,
            answer_max_tokens=24,
        )
        if complete:
            body = {} if reward is None else {"reward": reward}
            client.post(f"/api/trajectories/{trajectory_id}/complete", json=body).raise_for_status()
        detail: dict[str, Any] = client.get(f"/api/trajectories/{trajectory_id}").json()
        return detail


def populate(base_url: str) -> dict[str, Any]:
    """Two groups of three rewarded rollouts, one unrewarded, one with a script payload.

    Rewards: group ``paris`` 1.0, 0.0, 1.0; group ``tokyo`` 0.0, 1.0, 0.5. A step reward of 0.25
    on the first step of ``paris-0`` (through ``POST /api/rewards``).
    """
    made: dict[str, Any] = {}
    for group, city, rewards in (
        ("paris", "Paris", [1.0, 0.0, 1.0]),
        ("tokyo", "Tokyo", [0.0, 1.0, 0.5]),
    ):
        for k, value in enumerate(rewards):
            tid = f"{group}-{k}"
            made[tid] = run_episode(
                base_url,
                tid,
                group_id=group,
                question=f"What is the weather in {city}?",
                seed=k,
                tags=["weather", group],
                reward=value,
            )
    made["lonely"] = run_episode(base_url, "lonely", seed=7, tags=["weather"])
    made["xss"] = run_episode(base_url, "xss", question=SCRIPT_PAYLOAD, seed=3, reward=0.0)
    first_step = made["paris-0"]["steps"][0]["id"]
    httpx.post(
        f"{base_url}/api/rewards",
        json={
            "rewards": [
                {"target": "step", "target_id": first_step, "name": "format", "value": 0.25}
            ]
        },
    ).raise_for_status()
    httpx.post(
        f"{base_url}/api/training-metrics",
        json={
            "rows": [
                {"policy_version": 0, "step": s, "metrics": {"loss": 1.0 / (s + 1), "kl": 0.01 * s}}
                for s in range(5)
            ]
        },
    ).raise_for_status()
    return made
