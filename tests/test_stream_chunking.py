"""However the upstream's bytes are cut into reads, the client sees the same bytes and the pool
gets the same token ids and logprobs.

The upstream is the emulator's chat stream (``trajgate.bench.emulator.ResponseBook``: vLLM 0.32's
chunk shapes) with every token's text made multi-byte UTF-8 (2-, 3- and 4-byte characters and
U+2028), served by an ``httpx.MockTransport`` that cuts the same bytes at chosen offsets: every
byte alone (so a cut lands inside each UTF-8 sequence, each ``data:`` field name and each line
ending), then random cuts of 1 to 64 bytes under several seeds. The same bytes are also sent
with CRLF and with CR line endings, which the SSE rules read as the same events.

Expected values are not computed by the gateway under test: the upstream's payloads are read
back with ``json`` from the bytes the mock sends; a client that asked for ids, logprobs and
usage must see those bytes exactly (LF framing); one that asked for none must see the same
bytes whatever the cuts, with the ids and logprobs hidden.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from gateway_helpers import gateway_with, steps_of
from tests_support import free_port

from datapool.settings import PoolSettings
from trajgate.bench.emulator import EmulatorSettings, ResponseBook

TOKENS = 12
# One character of each UTF-8 length (1 to 4 bytes) and U+2028, which JSON may leave unescaped.
ALPHABET = ["a", "é", "漢", "😀", "\u2028"]
CREATED_S = 1767225600


def multibyte_stream(book: ResponseBook, body: dict[str, Any]) -> bytes:
    """The emulator's SSE answer to ``body`` with each token's text replaced by three characters
    of ``ALPHABET`` (picked by the token id), serialised compactly with UTF-8 as is (as vLLM)."""
    parts = book.render(book.shape_of(body), "chatcmpl-fuzz", CREATED_S)
    out = []
    for part in parts:
        payload = part.removeprefix(b"data: ").removesuffix(b"\n\n")
        if payload == b"[DONE]":
            out.append(part)
            continue
        chunk = json.loads(payload)
        for choice in chunk["choices"]:
            if choice["delta"].get("content") and choice.get("token_ids"):
                token = choice["token_ids"][0]
                choice["delta"]["content"] = "".join(
                    ALPHABET[(token + k) % len(ALPHABET)] for k in range(3)
                )
        out.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
    return b"".join(out)


def cuts(size: int, variant: str) -> list[int]:
    """Offsets at which the upstream body of ``size`` bytes is cut into reads."""
    if variant == "whole":
        return []
    if variant == "bytewise":
        return list(range(1, size))
    rng = random.Random(variant)  # "seed-<n>"
    offsets, at = [], 0
    while True:
        at += rng.randint(1, 64)
        if at >= size:
            return offsets
        offsets.append(at)


def pieces(data: bytes, offsets: list[int]) -> list[bytes]:
    bounds = [0, *offsets, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


class ChoppingUpstream:
    """The emulated engine behind a mock transport; each stream's body is cut at ``offsets``
    (set per call) and its line endings rewritten to ``newline``. Keeps the last body sent."""

    def __init__(self) -> None:
        self.book = ResponseBook(EmulatorSettings(prompt_tokens=9, response_tokens=TOKENS))
        self.variant = "whole"
        self.newline = b"\n"
        self.sent = b""

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "emulated"}]})
        body = json.loads(request.content)
        if not body.get("stream"):
            answer = self.book.render(self.book.shape_of(body), "chatcmpl-probe", CREATED_S)[0]
            return httpx.Response(200, content=answer, headers={"content-type": "application/json"})
        self.sent = multibyte_stream(self.book, body)
        data = self.sent.replace(b"\n", self.newline)
        chopped = pieces(data, cuts(len(data), self.variant))

        async def reads() -> AsyncIterator[bytes]:
            for piece in chopped:
                yield piece

        headers = {"content-type": "text/event-stream; charset=utf-8"}
        return httpx.Response(200, content=reads(), headers=headers)


def upstream_tokens(sent: bytes) -> tuple[list[int], list[float]]:
    """Sampled ids ``[T]`` and logprobs ``[T]`` as the upstream's chunks carry them."""
    ids: list[int] = []
    logprobs: list[float] = []
    for event in sent.split(b"\n\n"):
        payload = event.removeprefix(b"data: ")
        if not payload or payload == b"[DONE]":
            continue
        for choice in json.loads(payload)["choices"]:
            ids += choice.get("token_ids") or []
            entries = (choice["logprobs"] or {}).get("content", [])
            logprobs += [entry["logprob"] for entry in entries]
    return ids, logprobs


ASKED_ALL = {"return_token_ids": True, "logprobs": True, "stream_options": {"include_usage": True}}
VARIANTS = ["whole", "bytewise", *(f"seed-{n}" for n in range(6))]
NEWLINES = {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}


@pytest.mark.parametrize("asked", ["all", "none"])
def test_client_bytes_and_captured_tokens_do_not_depend_on_where_reads_cut_the_stream(
    pool_settings: PoolSettings, asked: str
) -> None:
    upstream = ChoppingUpstream()
    body: dict[str, Any] = {
        "model": "emulated",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        **(ASKED_ALL if asked == "all" else {}),
    }
    transport = httpx.MockTransport(upstream.handle)
    seen: dict[tuple[str, str], bytes] = {}
    with gateway_with(pool_settings, free_port(), transport=transport) as gw:
        for newline_name, newline in NEWLINES.items():
            for variant in VARIANTS:
                upstream.variant, upstream.newline = variant, newline
                trajectory = f"chop-{asked}-{newline_name}-{variant}"
                response = httpx.post(
                    f"{gw.url}/t/{trajectory}/v1/chat/completions", json=body, timeout=60
                )
                assert response.status_code == 200, response.text
                seen[(newline_name, variant)] = response.content
                ids, logprobs = upstream_tokens(upstream.sent)
                assert len(ids) == TOKENS and len(logprobs) == TOKENS
                (step,) = steps_of(pool_settings, trajectory)
                assert step.response_token_ids == ids, (newline_name, variant)
                assert step.response_logprobs == logprobs, (newline_name, variant)
                assert step.response_message["content"] == "".join(
                    ALPHABET[(token + k) % len(ALPHABET)] for token in ids for k in range(3)
                )
                assert step.flags == []
    reference = seen[("lf", "whole")]
    if asked == "all":
        # Nothing hidden: vLLM's own bytes, event for event, whatever the upstream's line endings.
        assert reference == upstream.sent
    else:
        assert b'"token_ids":null' in reference and b"usage" not in reference
        assert "漢".encode() in reference
    for key, content in seen.items():
        assert content == reference, key
