"""Asking vLLM for an exact continuation: render, generate from our ids, derender.

Owns: ``send_exact``, which answers a chat completions body as vLLM's ``/v1/chat/completions``
would, for the prompt ``gateway.proxy.continuation.prompt`` builds: vLLM renders the body
(``/v1/chat/completions/render``: the template's ids and vLLM's own sampling parameters for
it), samples from the spliced prompt (``/inference/v1/generate``), and turns the sampled ids
into the chat answer with its own tool and reasoning parsers (``/v1/chat/completions/derender``).
The result is an ``httpx.Response`` shaped like the chat endpoint's (JSON, or SSE chunks with
``prompt_token_ids`` first and ``token_ids`` and logprobs per chunk), so the proxy and every
dialect read it as they read vLLM's chat answers. Never: parses a tool call or reasoning, or
decodes a token (vLLM's derender does both).

Streams: each upstream read of ``/inference/v1/generate`` is derendered in one call per choice
(the chunks a read completed merged), so the derender round trips follow the engine's pace,
not one per token. vLLM's parser path replays its parser from the start of the response on
every call (O(T^2) in the response length T, by vLLM's docstring); merging reads bounds the
number of replays. vLLM's parsed derender does not resolve logprob token text: a streaming
client that asked for logprobs gets each token's ``logprob`` with ``token`` "" and
``bytes`` null (unary answers carry vLLM's full logprobs).

Endpoints needed: vLLM started with ``--enable-scale-out`` (``trajgate vllm start`` does);
``gateway.upstream.replicas.probe_exact`` tells whether a replica has them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from datapool.steps.canonical import CanonicalCall
from gateway.capture import dumps, loads
from gateway.proxy.continuation.history import Extension
from gateway.proxy.continuation.prompt import exact_prompt
from gateway.upstream.replicas import DERENDER_PATH, GENERATE_PATH, RENDER_PATH

log = logging.getLogger("trajgate.continuation")

ContinuationMode = Literal["exact", "template"]
CONTINUATION_MODES: tuple[ContinuationMode, ...] = ("exact", "template")
JSON_HEADERS = {"content-type": "application/json"}


@dataclass
class Continuation:
    """How one call's prompt is built. ``mode``: the channel's setting; ``extension``: the turn
    it extends (None: none, so the template renders it); ``built``: what built the prompt
    (``exact`` or ``template``), stored on the step; ``suffix_tokens``: in exact mode, how many
    tokens the template rendered for the new messages and the generation prompt; on an exact
    channel's chat path, ``render_key`` and ``canonical``: the call's ``history.render_key``
    and canonical record, from which each choice's ``turn_key`` is computed (None elsewhere);
    ``weight_versions``: by choice index, the engine's ``weight_versions`` spans as
    ``/inference/v1/generate`` reported them (its last chunk of the choice: ``[{"version",
    "start", "end"}, ...]``), read by ``gateway.upstream.weight_update.Ticket.version_spans``."""

    mode: ContinuationMode
    extension: Extension | None = None
    built: ContinuationMode = "template"
    suffix_tokens: int | None = None
    render_key: str | None = None
    canonical: CanonicalCall | None = None
    weight_versions: dict[int, list[Any]] = field(default_factory=dict)


class DerenderError(httpx.RemoteProtocolError):
    """vLLM's derender refused a chunk of a stream already under way (an upstream failure)."""


def _error_response(answer: httpx.Response, content: bytes) -> httpx.Response:
    return httpx.Response(
        answer.status_code,
        content=content,
        headers={"content-type": answer.headers.get("content-type", "application/json")},
    )


async def send_exact(
    client: httpx.AsyncClient,
    base_url: str,
    body: dict[str, Any],
    continuation: Continuation,
    end_token: int,
    timeout: httpx.Timeout | None,
) -> httpx.Response:
    """The chat answer to ``body`` (an upstream chat completions body) with its prompt built
    from ``continuation.extension`` (``end_token``: the template's end-of-turn token, from
    ``gateway.upstream.replicas.probe_exact``); ``continuation.built`` and ``suffix_tokens``
    are set on the way (``template`` when the rendering has no boundary: then the template's own ids
    are the prompt). A non-200 answer of any endpoint is returned as it came. Raises
    ``httpx.HTTPError`` as the HTTP client does."""
    extension = continuation.extension
    assert extension is not None, "send_exact continues a turn"
    render = await client.post(
        base_url + RENDER_PATH, content=dumps(body), headers=JSON_HEADERS, timeout=timeout
    )
    if render.status_code != 200:
        return _error_response(render, render.content)
    request: dict[str, Any] = render.json()
    _restate_max_tokens(request["sampling_params"], body)
    built = exact_prompt(extension.turn.sequence, end_token, request["token_ids"])
    if built is not None:
        request["token_ids"] = built.token_ids
        continuation.built, continuation.suffix_tokens = "exact", built.suffix_tokens
    else:
        continuation.built, continuation.suffix_tokens = "template", None
    prompt: list[int] = request["token_ids"]
    stream = body.get("stream") is True
    generate = client.build_request(
        "POST",
        base_url + GENERATE_PATH,
        content=dumps(request),
        headers=JSON_HEADERS,
        timeout=timeout,
    )
    answer = await client.send(generate, stream=stream)
    if answer.status_code != 200:
        content = await answer.aread()
        await answer.aclose()
        return _error_response(answer, content)
    if not stream:
        generated = answer.json()
        _keep_weight_versions(continuation, generated.get("choices"))
        return await _unary(client, base_url, body, prompt, generated, timeout)
    return httpx.Response(
        200,
        headers={"content-type": "text/event-stream"},
        stream=_DerenderedStream(client, base_url, body, prompt, answer, continuation),
    )


# ``SamplingParams.max_tokens``' default in vLLM 0.32: its msgspec struct omits fields equal to
# their default (``omit_defaults=True``), so render's JSON has no ``max_tokens`` when it is 16.
SAMPLING_PARAMS_DEFAULT_MAX_TOKENS = 16


def _restate_max_tokens(params: dict[str, Any], body: dict[str, Any]) -> None:
    """Make the rendered ``sampling_params``' ``max_tokens`` mean for generate what the chat
    endpoint would apply to the spliced prompt.

    Generate treats an absent ``max_tokens`` as unset and samples to the end of the context
    (found in the SmolLM2 demo: a turn that asked for 16 tokens took 3,690). So a limit the
    client set (``max_completion_tokens``, else ``max_tokens``, the chat endpoint's order) is
    written out, 16 where render omitted it. Without one, render's default was computed for
    the template's prompt ``F``; it is dropped so generate computes the same default
    (``get_max_tokens``) for the prompt it samples from."""
    limit = body.get("max_completion_tokens")
    if limit is None:
        limit = body.get("max_tokens")
    if limit is None:
        params.pop("max_tokens", None)
    else:
        params.setdefault("max_tokens", SAMPLING_PARAMS_DEFAULT_MAX_TOKENS)


def _keep_weight_versions(continuation: Continuation, choices: Any) -> None:
    """Keep the ``weight_versions`` of each generate choice that carries them (vLLM sets them
    on a choice's final output only)."""
    for choice in choices if isinstance(choices, list) else []:
        if not isinstance(choice, dict) or not isinstance(choice.get("weight_versions"), list):
            continue
        index = choice.get("index", 0)
        if type(index) is int:
            continuation.weight_versions[index] = choice["weight_versions"]


async def _unary(
    client: httpx.AsyncClient,
    base_url: str,
    body: dict[str, Any],
    prompt: list[int],
    generated: dict[str, Any],
    timeout: httpx.Timeout | None,
) -> httpx.Response:
    derender = await client.post(
        base_url + DERENDER_PATH,
        content=dumps(
            {
                "model": body.get("model"),
                "generate_response": generated,
                "chat_request": body,
                "prompt_token_ids": prompt,
                "prompt_tokens": len(prompt),
            }
        ),
        headers=JSON_HEADERS,
        timeout=timeout,
    )
    if derender.status_code != 200:
        return _error_response(derender, derender.content)
    answer: dict[str, Any] = derender.json()
    # What the chat endpoint adds for ``return_token_ids`` (the gateway always asks): the
    # prompt at the top level, the sampled ids per choice.
    answer["prompt_token_ids"] = prompt
    sampled = {choice["index"]: choice for choice in generated.get("choices", [])}
    asked_top = bool(body.get("top_logprobs"))
    for choice in answer.get("choices", []):
        choice["token_ids"] = sampled.get(choice.get("index"), {}).get("token_ids")
        logprobs = choice.get("logprobs")
        if not asked_top and logprobs and logprobs.get("content"):
            for entry in logprobs["content"]:
                entry["top_logprobs"] = []
    return httpx.Response(200, content=dumps(answer), headers=JSON_HEADERS)


class _DerenderedStream(httpx.AsyncByteStream):
    """The chat SSE of a streamed exact continuation, derendered from the generate stream."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        body: dict[str, Any],
        prompt: list[int],
        generate: httpx.Response,
        continuation: Continuation,
    ) -> None:
        self._client = client
        self._continuation = continuation
        self._url = base_url + DERENDER_PATH
        self._body = body
        self._prompt = prompt
        self._generate = generate
        self._states: dict[int, Any] = {}
        self._prompt_sent = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for payloads in _data_reads(self._generate):
            out: list[bytes] = []
            for chunk in _merged(payloads):
                if chunk is None:
                    out.append(b"data: [DONE]\n\n")
                else:
                    out.append(b"data: " + dumps(await self._derendered(chunk)) + b"\n\n")
            if out:
                yield b"".join(out)

    async def _derendered(self, chunk: dict[str, Any]) -> dict[str, Any]:
        choices = chunk.get("choices") or []
        index = int(choices[0].get("index", 0)) if choices else -1
        _keep_weight_versions(self._continuation, choices)
        answer = await self._client.post(
            self._url,
            content=dumps(
                {
                    "stream": True,
                    "model": self._body.get("model"),
                    "generate_chunk": chunk,
                    "stream_state": self._states.get(index),
                    "chat_request": self._body,
                    "prompt_token_ids": self._prompt,
                    "prompt_tokens": len(self._prompt),
                }
            ),
            headers=JSON_HEADERS,
        )
        if answer.status_code != 200:
            raise DerenderError(f"derender answered {answer.status_code}: {answer.text[:300]}")
        result = answer.json()
        self._states[index] = result.get("stream_state")
        out: dict[str, Any] = {k: v for k, v in result["chunk"].items() if v is not None}
        if not self._prompt_sent:
            out["prompt_token_ids"] = self._prompt
            self._prompt_sent = True
        for piece, choice in zip(choices, out.get("choices", []), strict=False):
            choice["delta"] = {
                k: v for k, v in (choice.get("delta") or {}).items() if v is not None
            }
            if choice.get("stop_reason") is None:
                choice.pop("stop_reason", None)
            choice["token_ids"] = piece.get("token_ids") or []
            content = (piece.get("logprobs") or {}).get("content")
            choice["logprobs"] = (
                None
                if content is None
                else {
                    "content": [
                        {
                            "token": "",
                            "logprob": entry["logprob"],
                            "bytes": None,
                            "top_logprobs": [],
                        }
                        for entry in content
                    ]
                }
            )
        return out

    async def aclose(self) -> None:
        await self._generate.aclose()  # closing the connection makes vLLM abort the request


async def _data_reads(response: httpx.Response) -> AsyncIterator[list[bytes]]:
    """The ``data`` payloads of vLLM's generate stream (``data: <json>`` lines, blank lines
    between events), one list per read that completed at least one."""
    tail = b""
    async for piece in response.aiter_raw():
        lines = (tail + piece).split(b"\n")
        tail = lines.pop()
        payloads = [line[6:] for line in lines if line.startswith(b"data: ")]
        if payloads:
            yield payloads
    if tail.startswith(b"data: "):
        yield [tail[6:]]


def _merged(payloads: list[bytes]) -> list[dict[str, Any] | None]:
    """One read's generate chunks with each choice's consecutive chunks merged into one (ids,
    logprobs concatenated; the last finish reason, weight versions and usage kept); None for
    ``[DONE]``. Order across choices and around usage-only chunks is kept."""
    merged: list[dict[str, Any] | None] = []
    for payload in payloads:
        if payload.strip() == b"[DONE]":
            merged.append(None)
            continue
        chunk = loads(payload)
        previous = merged[-1] if merged else None
        choices = chunk.get("choices") or []
        if (
            previous is not None
            and len(choices) == 1
            and len(previous.get("choices") or []) == 1
            and previous["choices"][0].get("index") == choices[0].get("index")
            and previous["choices"][0].get("finish_reason") is None
            and not previous.get("usage")
        ):
            _extend(previous["choices"][0], choices[0])
            continue
        merged.append(chunk)
    return merged


def _extend(into: dict[str, Any], more: dict[str, Any]) -> None:
    into["token_ids"] = [*(into.get("token_ids") or []), *(more.get("token_ids") or [])]
    mine, theirs = into.get("logprobs"), more.get("logprobs")
    if mine is not None and theirs is not None:
        mine["content"] = [*(mine.get("content") or []), *(theirs.get("content") or [])]
    for name in ("finish_reason", "stop_reason", "weight_versions"):
        if more.get(name) is not None:
            into[name] = more[name]
