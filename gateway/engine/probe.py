"""What a replica is: alive, returning token ids, serving exact continuation. Asked, not assumed.

Owns: the health check's exchange (``healthy``), the token-id probe (``probe_token_ids``, case
C06) and the exact-continuation probe (``probe_exact_endpoints``: the render, generate and
derender routes, the template's end-of-turn token, whether the chat endpoint samples from
forwarded prompt ids, whether the template leaves the tools out under ``tool_choice:
"none"``), each exchange within the ``timeout_s`` it is given in all (``deadline``). Each
returns what it found as a value; ``gateway.upstream.replicas`` keeps it on its ``Replica`` and
decides when to ask again.

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.engine.errors import deadline
from gateway.engine.paths import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    DERENDER_PATH,
    GENERATE_PATH,
    HEALTH_PATH,
    MODELS_PATH,
    RENDER_PATH,
)

log = logging.getLogger("trajgate.upstreams")

# A tool offered to the template by the probe: is it rendered under ``tool_choice: "none"``?
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe", "parameters": {"type": "object", "properties": {}}},
}


@dataclass(frozen=True)
class ExactProbe:
    """What ``probe_exact_endpoints`` found. ``routes``: the replica serves render, generate and
    derender (False: none of the rest was asked); ``end_token``: the template's end-of-turn
    token (None: its template closes no assistant turn with one token);
    ``forwards_prompt_ids``: its chat endpoint samples from forwarded prompt ids;
    ``excludes_tools_for_none``: its template leaves the tools out under ``tool_choice:
    "none"`` (vLLM's --exclude-tools-when-tool-choice-none)."""

    routes: bool
    end_token: int | None = None
    forwards_prompt_ids: bool = False
    excludes_tools_for_none: bool | None = None

    @property
    def serves_exact(self) -> bool:
        """Whether calls to the replica can be continued exactly."""
        return self.routes and self.end_token is not None


async def healthy(client: httpx.AsyncClient, url: str, timeout_s: float) -> bool:
    """Whether the replica at ``url`` answers ``GET /health`` with 200 within ``timeout_s`` in
    all (an error, a timeout or another status: not healthy)."""
    try:
        async with deadline(timeout_s, HEALTH_PATH):
            response = await client.get(f"{url}{HEALTH_PATH}", timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


async def _post(
    client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any], timeout_s: float
) -> httpx.Response:
    async with deadline(timeout_s, path):
        return await client.post(f"{url}{path}", json=body, timeout=timeout_s)


async def _first_model(client: httpx.AsyncClient, url: str, timeout_s: float) -> Any:
    async with deadline(timeout_s, MODELS_PATH):
        models = (await client.get(f"{url}{MODELS_PATH}", timeout=timeout_s)).json()
    return models["data"][0]["id"]


async def probe_exact_endpoints(
    client: httpx.AsyncClient, url: str, timeout_s: float
) -> ExactProbe | None:
    """Whether the replica at ``url`` serves the render, generate and derender endpoints (an
    empty body is refused as invalid, 400/422, where a route exists; 404 where none does), and
    its template's end-of-turn token (``end_of_turn``). Also whether its chat endpoint samples
    from forwarded prompt ids (one token sampled from ids the messages sent would not render,
    and reported as the prompt), and whether its template leaves the tools out under
    ``tool_choice: "none"``. Each exchange within ``timeout_s``. None when the probe could not
    run (unknown: tried again at the next health check)."""
    try:
        for path in (RENDER_PATH, GENERATE_PATH, DERENDER_PATH):
            answer = await _post(client, url, path, {}, timeout_s)
            if answer.status_code in (404, 405):
                log.warning(
                    "upstream %s has no %s (start vLLM with --enable-scale-out, as `trajgate "
                    "vllm start` does): its calls use continuation 'template'",
                    url,
                    path,
                )
                return ExactProbe(routes=False)
        model = await _first_model(client, url, timeout_s)
        rendered = []
        for text in ("y", "z"):
            body = {
                "model": model,
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": text},
                ],
                "add_generation_prompt": False,
            }
            answer = await _post(client, url, RENDER_PATH, body, timeout_s)
            rendered.append(answer.json()["token_ids"])
        forwarded = rendered[0]  # x, then the assistant's y: not what [x] renders
        with_tools = []
        for choice in ({}, {"tool_choice": "none"}):
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [_PROBE_TOOL],
                **choice,
            }
            answer = await _post(client, url, RENDER_PATH, body, timeout_s)
            with_tools.append(answer.json()["token_ids"])
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 1,
            "return_token_ids": True,
            "kv_transfer_params": {"prompt_token_ids": forwarded},
        }
        answer = await _post(client, url, CHAT_PATH, body, timeout_s)
        sampled_from = answer.json().get("prompt_token_ids") if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    forwards = sampled_from == forwarded
    if not forwards:
        log.warning(
            "upstream %s: its chat endpoint does not sample from forwarded prompt ids "
            "(kv_transfer_params.prompt_token_ids, vLLM >= 0.32): its streamed calls and its "
            "unary calls with stop strings use continuation 'template'",
            url,
        )
    end_token = end_of_turn(rendered[0], rendered[1])
    if end_token is None:
        log.warning(
            "upstream %s: its template closes no assistant turn with one token: its calls use "
            "continuation 'template'",
            url,
        )
    return ExactProbe(True, end_token, forwards, with_tools[0] != with_tools[1])


def end_of_turn(with_y: list[int], with_z: list[int]) -> int | None:
    """The token the template closes an assistant turn with, from its renderings of the same
    conversation ending in an assistant message "y" and "z": after the content they differ in,
    both end with the same closing tokens (end-of-turn, then any separator), whose first is it.
    None when the two renderings share no closing tokens."""
    common = 0
    while common < min(len(with_y), len(with_z)) and with_y[-1 - common] == with_z[-1 - common]:
        common += 1
    return with_y[-common] if common else None


async def probe_token_ids(client: httpx.AsyncClient, url: str, timeout_s: float) -> bool | None:
    """Ask the replica at ``url`` for one token with ``return_token_ids`` (case C06), each
    exchange within ``timeout_s``.

    Returns True when the answer carries ``token_ids``, False when a well-formed answer has
    none (an old server, or a proxy that rebuilt the response and dropped the field), None when
    the probe itself could not run (no model listed, an error): unknown, so not refused.
    """
    try:
        model = await _first_model(client, url, timeout_s)
        body = {"model": model, "prompt": "a", "max_tokens": 1, "return_token_ids": True}
        answer = await _post(client, url, COMPLETIONS_PATH, body, timeout_s)
        choice = answer.json()["choices"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None
    if not isinstance(choice, dict) or "text" not in choice:
        return None
    returns_ids = isinstance(choice.get("token_ids"), list)
    if not returns_ids:
        log.error("upstream %s returns no token ids: not routed to (capture would lose them)", url)
    return returns_ids
