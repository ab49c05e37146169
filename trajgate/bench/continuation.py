"""``trajgate bench gateway --continuation exact|template``: exact against template, side by side.

Owns: the multi-turn conversations the bench sends when it compares continuation modes, the
channel per mode, and the comparison of the modes within one run. Never: asserts goals.

The gateway runs once, with ``TRAJGATE_CONTINUATION_CHANNELS`` mapping channel
``bench-<mode>`` to each mode; the load generator sends each mode's calls with
``x-trajgate-channel: bench-<mode>``, so both modes are measured by the same gateway process
against the same emulator, one after the other in each configuration (``stream`` ×
``concurrency``). The emulator runs with ``prompt_ids="messages"``, which also serves vLLM's
scale-out endpoints (``trajgate.bench.scale_out``).

A trajectory's turn ``i`` (``0 <= i < S``, ``S = steps_per_trajectory``) sends the system prompt,
the user turn of ``prompt_tokens`` words, then ``i`` times the emulator's answer (its
``" t<id>"`` text for choice 0's ``response_tokens`` ids, what the gateway returned) and a short
user turn: an agent that only appends. In exact mode turns ``1..S-1`` are exact continuations
(``exact_steps`` counts them from the pool); in template mode every turn is rendered whole.

Per mode: the gateway's figures against the direct run (``_compare`` of
``trajgate.bench.gateway``), ``first_byte_p50_ms`` (a stream's first event: time to first
token), steps persisted and expected, exact steps, and CPU ms per call of each process. Across
modes (``exact_over_template``): ``gateway_cpu_per_call_ratio`` (exact ÷ template),
``gateway_cpu_us_per_token`` per mode on streams (CPU per call ÷ ``response_tokens``) and
``added_first_byte_ms`` (exact's first-byte p50 minus template's, ms). Goals: the ratio ≤ 1.3,
and at concurrency 1 the added first byte ≤ 1 ms (exact continuation is the default for
training channels, so it must not cost a call much more than the template: docs/benchmarks.md,
"Exact against template continuation").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import httpx

from trajgate.bench.book import EmulatorSettings, ResponseBook

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

ContinuationMode = Literal["exact", "template"]
GOAL_CPU_RATIO = 1.3
GOAL_ADDED_FIRST_BYTE_MS = 1.0


def channel_of(mode: str) -> str:
    return f"bench-{mode}"


def channel_settings(modes: Sequence[ContinuationMode]) -> dict[str, ContinuationMode]:
    """``TRAJGATE_CONTINUATION_CHANNELS`` for the modes measured."""
    return {channel_of(mode): mode for mode in modes}


def mode_headers(mode: str) -> dict[str, str]:
    return {"x-trajgate-channel": channel_of(mode)}


def emulator_answer(response_tokens: int) -> str:
    """The text of the emulator's answer (choice 0, default seed, ``response_tokens`` long),
    what an agent that only appends echoes back as its assistant turn."""
    settings = EmulatorSettings(response_tokens=response_tokens, prompt_ids="messages")
    return ResponseBook(settings).answer_text(0, response_tokens)


def conversation_bodies(first: dict[str, Any], turns: int, response_tokens: int) -> list[bytes]:
    """The ``S = turns`` bodies of a trajectory (see the module docstring); ``first`` is the
    bench's chat request (turn 0), ``response_tokens`` the emulator's answer length."""
    answer = {"role": "assistant", "content": emulator_answer(response_tokens)}
    bodies, messages = [], list(first["messages"])
    for turn in range(turns):
        bodies.append(httpx.Request("POST", "/", json={**first, "messages": messages}).content)
        messages = [*messages, answer, {"role": "user", "content": f"Go on ({turn})."}]
    return bodies


def _gateway_cpu(measured: dict[str, Any]) -> float | None:
    value = measured["cpu_ms_per_call"].get("gateway_cpu_ms_per_call")
    return None if value is None else float(value)


def compare_modes(
    modes: Mapping[str, dict[str, Any]], stream: bool, response_tokens: int
) -> dict[str, Any]:
    """``exact_over_template`` of one run (empty unless both modes ran)."""
    if "exact" not in modes or "template" not in modes:
        return {}
    exact, template = modes["exact"], modes["template"]
    cpu_exact, cpu_template = _gateway_cpu(exact), _gateway_cpu(template)
    result: dict[str, Any] = {
        "gateway_cpu_per_call_ratio": (
            round(cpu_exact / cpu_template, 3) if cpu_exact and cpu_template else None
        ),
    }
    if stream:
        result["gateway_cpu_us_per_token"] = {
            mode: None if cpu is None else round(cpu * 1000.0 / response_tokens, 2)
            for mode, cpu in (("exact", cpu_exact), ("template", cpu_template))
        }
        first_exact, first_template = exact["first_byte_p50_ms"], template["first_byte_p50_ms"]
        result["added_first_byte_ms"] = (
            None
            if first_exact is None or first_template is None
            else round(first_exact - first_template, 3)
        )
    return {"exact_over_template": result}


def continuation_goals_met(runs: Sequence[dict[str, Any]]) -> dict[str, bool | None]:
    """The continuation goals (module docstring) over the runs that compared both modes (none:
    no key)."""
    compared = [r for r in runs if "exact_over_template" in r]
    if not compared:
        return {}
    ratios = [
        r["exact_over_template"]["gateway_cpu_per_call_ratio"]
        for r in compared
        if r["exact_over_template"]["gateway_cpu_per_call_ratio"] is not None
    ]
    added = [
        r["exact_over_template"]["added_first_byte_ms"]
        for r in compared
        if r["concurrency"] == 1 and r["exact_over_template"].get("added_first_byte_ms") is not None
    ]
    return {
        "exact_cpu_ratio": all(v <= GOAL_CPU_RATIO for v in ratios) if ratios else None,
        "exact_added_first_byte_ms_at_c1": (
            all(v <= GOAL_ADDED_FIRST_BYTE_MS for v in added) if added else None
        ),
    }
