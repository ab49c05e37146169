"""Relaying a vLLM SSE stream to the client while capturing every sampled token.

Owns: per-choice accumulation of sampled IDs, logprobs, content, reasoning and tool calls
(reassembled from deltas by index) across chunks, including chunks whose text a tool or
reasoning parser held back (``delta: {}`` with ``token_ids``: case C05); and what each chunk
looks like to the client. Never: re-orders or merges chunks, or buffers chunks that are not
terminal: each event is handed back for flushing as soon as it is fed in (case C10).

Two places hold output back, both only at the very end of a stream:

- The last terminal chunk (the one that finishes the last choice) is held until the upstream's
  ``[DONE]``, so the pool commit happens before the client has the whole answer (durability).
- The gateway always asks for ``stream_options.include_usage`` (to check sampled IDs against the
  usage count). vLLM then moves ``system_fingerprint`` from every terminal chunk to the usage
  chunk; for a client that did not ask for usage, the usage chunk is dropped and the fingerprint
  is stamped back on terminal chunks. The fingerprint is learnt per upstream; until it is known,
  terminal chunks are held until the usage chunk brings it.

Payloads are bytes end to end: a chunk the client sees unchanged is sent as the very bytes vLLM
sent; a chunk with fields removed is re-serialised by orjson, whose output (compact, UTF-8 kept,
floats as shortest round-trip digits) is byte for byte what vLLM's pydantic ``model_dump_json``
writes for the same values.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from httpx_sse import EventSource

from datapool.steps.records import ChoiceRecord
from gateway.capture import (
    ABORTED,
    ClientAsked,
    Endpoint,
    check_against_usage,
    choice_logprobs,
    integrity_flags,
    loads,
    quality_flags,
    strip_for_client,
)


async def sse_data(response: httpx.Response) -> AsyncIterator[bytes]:
    """The ``data`` payload of each server-sent event of ``response``, in order, as UTF-8 bytes.

    Parsing is httpx-sse's (the SSE rules: line endings, multi-line data, comments); a silence
    longer than the client's read timeout raises ``httpx.ReadTimeout`` from here.
    """
    async for event in EventSource(response).aiter_sse():
        yield event.data.encode()


def _dumps(chunk: dict[str, Any]) -> bytes:
    """A chunk as vLLM serialises it (pydantic: compact, UTF-8 as is, shortest float digits).

    orjson refuses integers past 64 bits and strings with lone surrogates, which pydantic would
    write; those chunks fall back to ``json`` (same layout; floats may then differ in notation).
    """
    try:
        return orjson.dumps(chunk)
    except TypeError:
        return json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode(
            "utf-8", "surrogatepass"
        )


@dataclass
class _ChoiceState:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ids_gap: bool = False  # a token-bearing chunk came without token_ids
    logprobs_gap: bool = False
    role: str | None = None
    text_parts: list[str] = field(default_factory=list)
    reasoning_parts: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    stop_reason: str | None = None


class StreamCapture:
    """Feed upstream SSE ``data`` payloads in order; get back the payloads to send the client.

    ``n_choices`` is the request's ``n``; ``fingerprint`` the upstream's ``system_fingerprint``
    when already known. After the stream, ``choices()`` gives one ``ChoiceRecord`` per choice.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        asked: ClientAsked,
        n_choices: int,
        fingerprint: str | None,
    ) -> None:
        self.endpoint = endpoint
        self.body = body
        self.asked = asked
        self.n_choices = n_choices
        self.fingerprint = fingerprint
        self.prompt_ids: list[int] | None = None
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.model: str | None = None
        self.first_token_seen = False
        self._states: dict[int, _ChoiceState] = {}
        self._held: list[dict[str, Any]] = []

    # -- feeding -------------------------------------------------------------------------

    def feed(self, data: bytes) -> list[bytes]:
        """Take one upstream event payload; return the payloads to flush to the client now."""
        chunk = loads(data)
        if not isinstance(chunk, dict):
            return [data]
        if "error" in chunk and "choices" not in chunk:
            self.error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk}
            return [*self._release(), data]
        self.model = chunk.get("model", self.model)
        self._accumulate(chunk)
        if chunk.get("usage") is not None and not chunk.get("choices"):
            self.usage = chunk["usage"]
            self.fingerprint = chunk.get("system_fingerprint", self.fingerprint)
            if not self.asked.include_usage:
                return []
            self._held.append(chunk)
            return []
        terminal = any(c.get("finish_reason") is not None for c in chunk.get("choices") or [])
        needs_fingerprint = not self.asked.include_usage and self.fingerprint is None
        if self._held or (terminal and (self._all_finished() or needs_fingerprint)):
            self._held.append(chunk)
            return []
        return [self._for_client(chunk, data)]

    def release(self) -> list[bytes]:
        """Payloads held back at the end (terminal and usage chunks); call after committing."""
        return self._release()

    def _release(self) -> list[bytes]:
        released = [self._for_client(chunk, None) for chunk in self._held]
        self._held = []
        return released

    def _for_client(self, chunk: dict[str, Any], raw: bytes | None) -> bytes:
        client = strip_for_client(chunk, self.asked)
        terminal = any(c.get("finish_reason") is not None for c in chunk.get("choices") or [])
        if terminal and not self.asked.include_usage and self.fingerprint is not None:
            client = dict(client)
            client["system_fingerprint"] = self.fingerprint
        if client is chunk and raw is not None:
            return raw
        return _dumps(client)

    def _all_finished(self) -> bool:
        finished = sum(1 for s in self._states.values() if s.finish_reason is not None)
        return finished >= self.n_choices

    def _accumulate(self, chunk: dict[str, Any]) -> None:
        if self.endpoint == "chat.completions" and chunk.get("prompt_token_ids") is not None:
            self.prompt_ids = chunk["prompt_token_ids"]
        for choice in chunk.get("choices") or []:
            state = self._states.setdefault(int(choice.get("index", 0)), _ChoiceState())
            if self.endpoint == "completions" and choice.get("prompt_token_ids") is not None:
                self.prompt_ids = choice["prompt_token_ids"]
            ids = choice.get("token_ids")
            logprobs = choice_logprobs(self.endpoint, choice.get("logprobs"))
            carries_tokens = bool(ids) or bool(self._delta_text(choice))
            if ids is not None:
                state.ids.extend(ids)
                self.first_token_seen = self.first_token_seen or bool(ids)
            elif carries_tokens:
                state.ids_gap = True
            if logprobs is not None:
                state.logprobs.extend(logprobs)
            elif carries_tokens:
                state.logprobs_gap = True
            self._accumulate_message(state, choice)
            if choice.get("finish_reason") is not None:
                state.finish_reason = choice["finish_reason"]
                stop = choice.get("stop_reason")
                state.stop_reason = None if stop is None else str(stop)

    def _delta_text(self, choice: dict[str, Any]) -> str:
        if self.endpoint == "completions":
            return str(choice.get("text") or "")
        return str((choice.get("delta") or {}).get("content") or "")

    def _accumulate_message(self, state: _ChoiceState, choice: dict[str, Any]) -> None:
        if self.endpoint == "completions":
            state.text_parts.append(str(choice.get("text") or ""))
            return
        delta = choice.get("delta") or {}
        state.role = delta.get("role", state.role)
        if delta.get("content"):
            state.text_parts.append(delta["content"])
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        if reasoning:
            state.reasoning_parts.append(reasoning)
        for call_delta in delta.get("tool_calls") or []:
            slot = state.tool_calls.setdefault(
                int(call_delta.get("index", 0)),
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if call_delta.get("id"):
                slot["id"] = call_delta["id"]
            if call_delta.get("type"):
                slot["type"] = call_delta["type"]
            function = call_delta.get("function") or {}
            if function.get("name"):
                slot["function"]["name"] += function["name"]
            if function.get("arguments"):
                slot["function"]["arguments"] += function["arguments"]

    # -- results -------------------------------------------------------------------------

    def choices(self, abort_reason: str | None = None) -> list[ChoiceRecord]:
        """One record per choice. ``abort_reason`` (``client_disconnect``, ``upstream_timeout``,
        ``upstream_error``) replaces a missing finish reason and flags the step ``aborted``."""
        indices = sorted(self._states) or list(range(self.n_choices))
        records: list[ChoiceRecord] = []
        for index in indices:
            state = self._states.get(index, _ChoiceState())
            ids = None if state.ids_gap else state.ids
            logprobs = None if state.logprobs_gap else state.logprobs
            message = self._message(state)
            finish_reason = state.finish_reason
            flags = integrity_flags(ids, logprobs, self.prompt_ids)
            if finish_reason is None and abort_reason is not None:
                finish_reason = abort_reason
                flags.append(ABORTED)
            flags += quality_flags(self.body, finish_reason, message)
            records.append(
                ChoiceRecord(
                    choice_index=index,
                    response_token_ids=ids,
                    response_logprobs=logprobs,
                    response_message=message,
                    finish_reason=finish_reason,
                    flags=flags,
                    stop_reason=state.stop_reason,
                )
            )
        if abort_reason is None:
            check_against_usage(records, (self.usage or {}).get("completion_tokens"))
        return records

    def _message(self, state: _ChoiceState) -> dict[str, Any]:
        text = "".join(state.text_parts)
        if self.endpoint == "completions":
            return {"text": text}
        message: dict[str, Any] = {"role": state.role or "assistant", "content": text or None}
        if state.tool_calls:
            message["tool_calls"] = [state.tool_calls[i] for i in sorted(state.tool_calls)]
        if state.reasoning_parts:
            message["reasoning"] = "".join(state.reasoning_parts)
        return message
