"""The emulator's answers: its settings, its seeded tokens and the bytes of each answer shape.

Owns: ``EmulatorSettings``, ``ResponseBook`` (the seeded prompt and response ids, the prompt of a
conversation with ``prompt_ids="messages"``, and the serialised chat answers per shape) and the
emulator's text of a token (``" t<id>"``). Never: serves HTTP (``trajgate.bench.emulator`` does,
with the scale-out endpoints of ``trajgate.bench.scale_out``); both read this book. See
``trajgate.bench.emulator`` for the shapes and what is deliberately different from vLLM.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from trajgate.bench.weight_endpoints import WeightEndpoints
from trajgate.config import ConfigFileSettings

SYSTEM_FINGERPRINT = "vllm-0.32.0-emulated"
# How a path told to fail answers (``EmulatorThread.fail``): an HTTP status, "hang" (never a
# byte) or "trickle" (a 200 head, then one body byte every TRICKLE_S, never the end).
Fault = int | Literal["hang", "trickle"]
TRICKLE_S = 0.1
_ID_MARK = "@@TRAJGATE_ID@@"
_CREATED_MARK = "@@TRAJGATE_CREATED@@"
# With prompt_ids="messages" the prompt differs per request: its IDs and counts are marks in the
# cached templates, filled in per answer like the id.
_PROMPT_MARK = "@@TRAJGATE_PROMPT@@"
_PROMPT_TOKENS_MARK = "@@TRAJGATE_PROMPT_TOKENS@@"
_TOTAL_TOKENS_MARK = "@@TRAJGATE_TOTAL_TOKENS@@"
_SAMPLED_TEXT = re.compile(r"(?: t\d+)+")  # an answer of this emulator: " t<id>" per token
_MAX_HEAD_BYTES = 64 * 1024


class EmulatorSettings(ConfigFileSettings):
    """What the emulated engine answers and how fast (``TRAJGATE_EMULATOR_*`` variables)."""

    model_config = SettingsConfigDict(env_prefix="TRAJGATE_EMULATOR_", extra="ignore")
    config_section = "emulator"

    host: str = Field(default="127.0.0.1", description="Address the emulator binds to.")
    port: int = Field(default=8200, ge=0, le=65535, description="Port; 0 picks a free one.")
    model: str = Field(default="emulated", description="Model name reported in responses.")
    also_serves: list[str] = Field(
        default_factory=list,
        description="More model names GET /v1/models lists after model, each with model as "
        "its parent (as vLLM lists the LoRA adapters it loaded), so a gateway registers policy "
        "versions of them (but refuses full-weight updates of them); a call may name any model "
        "either way.",
    )
    prompt_tokens: int = Field(
        default=1000,
        ge=1,
        description="Length of every prompt's token ids (tokens); with prompt_ids='messages', "
        "of each message that is not one of the emulator's own answers.",
    )
    prompt_ids: Literal["fixed", "messages"] = Field(
        default="fixed",
        description="'fixed': every prompt is the same prompt_tokens seeded ids (a proxy "
        "benchmark: nothing is rendered per request). 'messages': the ids follow the messages "
        "like a chat template's, message by message: an assistant message whose content is "
        "one of the emulator's own answers (' t<id>' per token) renders to exactly those ids, "
        "any other message to prompt_tokens ids seeded by its role and content; so a next turn "
        "extends the previous prompt + response and a rewritten history breaks it, as with a "
        "real engine (the fleet audit of trajgate.bench.fleet needs this).",
    )
    response_tokens: int = Field(
        default=200,
        ge=1,
        description="Tokens sampled per choice unless max_tokens cuts it shorter (tokens).",
    )
    ttft_ms: float = Field(
        default=0.0, ge=0, description="Delay before the first token (ms), per request."
    )
    inter_token_ms: float = Field(
        default=0.0,
        ge=0,
        description="Delay between tokens (ms); a non-streaming answer waits for all of them.",
    )
    seed: int = Field(default=0, description="Seed of the token ids and logprobs.")
    vocab_size: int = Field(default=2048, ge=2, description="Token ids are drawn in [0, V).")


@dataclass(frozen=True)
class _Shape:
    """What a request asked for that changes the bytes of the answer."""

    stream: bool
    return_token_ids: bool
    logprobs: bool
    include_usage: bool
    completion_tokens: int
    n: int
    finish_reason: str


class ResponseBook:
    """Seeded tokens and the serialised answers for every shape asked so far.

    ``prompt_ids [P]``; per choice ``c``: ``ids[c] [T]`` and ``logprobs[c] [T]`` with
    ``P = prompt_tokens`` and ``T = response_tokens``; choice ``c`` is seeded by ``(seed, c)``.
    ``token_times``: per streamed answer (the latest 64), the monotonic time (s) at which the
    chunk of each token position ``[T']`` was written (``T'`` = tokens sent so far).
    """

    def __init__(self, settings: EmulatorSettings) -> None:
        self.settings = settings
        rng = random.Random(f"{settings.seed}:prompt")
        self.prompt_ids = [
            rng.randrange(settings.vocab_size) for _ in range(settings.prompt_tokens)
        ]
        self._choices: dict[int, tuple[list[int], list[float]]] = {}
        self._templates: dict[_Shape, list[bytes]] = {}
        self.token_times: collections.deque[list[float]] = collections.deque(maxlen=64)
        # Cleared: streams wait after their first token (``EmulatorThread.stall_streams``);
        # touched only from the serving loop.
        self.streams_flow = asyncio.Event()
        self.streams_flow.set()
        # Cleared: unary answers wait before they are sent (``EmulatorThread.hold_answers``);
        # ``held_answers`` of them are waiting now.
        self.answers_flow = asyncio.Event()
        self.answers_flow.set()
        self.held_answers = 0
        self.weights = WeightEndpoints()  # the weight-update endpoints and the engine's label
        # Path -> how a request to it fails instead (``EmulatorThread.fail``).
        self.faults: dict[str, Fault] = {}

    def prompt_of(self, body: dict[str, Any]) -> list[int]:
        """The prompt's IDs ``[P]`` for a request ``body`` (see ``prompt_ids``); raises
        ``ValueError`` when ``prompt_ids="messages"`` and ``messages`` is not a list of objects."""
        if self.settings.prompt_ids == "fixed":
            return self.prompt_ids
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of objects")
        ids: list[int] = []
        for message in messages:
            role, content = message.get("role"), message.get("content")
            sampled = isinstance(content, str) and _SAMPLED_TEXT.fullmatch(content)
            if role == "assistant" and sampled:  # the inverse of ``_text``
                ids += [int(word[1:]) for word in str(content).split()]
            else:
                rng = random.Random(f"{self.settings.seed}:{role}:{_dumps(content).decode()}")
                size, count = self.settings.vocab_size, self.settings.prompt_tokens
                ids += [rng.randrange(size) for _ in range(count)]
            ids.append(self.end_token)  # every turn closes with it, as ChatML's <|im_end|>
        return ids

    def chat_prompt_of(self, body: dict[str, Any]) -> list[int]:
        """The prompt the chat endpoint samples from ``[P]``: the forwarded ids of
        ``kv_transfer_params.prompt_token_ids`` when the body has them (vLLM 0.32's decode-side
        reuse, which exact continuation's streams use), else ``prompt_of``. Raises
        ``ValueError`` on forwarded ids that are not a non-empty list of non-negative ints."""
        params = body.get("kv_transfer_params")
        forwarded = params.get("prompt_token_ids") if isinstance(params, dict) else None
        if forwarded is None:
            return self.prompt_of(body)
        if (
            not isinstance(forwarded, list)
            or not forwarded
            or any(type(i) is not int or i < 0 for i in forwarded)
        ):
            raise ValueError("kv_transfer_params.prompt_token_ids must be non-negative ints")
        return forwarded

    @property
    def end_token(self) -> int:
        """The id that closes every rendered turn with ``prompt_ids="messages"``: ``V``, one
        past the sampled ids ``[0, V)``, so a response never holds it (a special token)."""
        return self.settings.vocab_size

    def choice_tokens(self, choice_index: int) -> tuple[list[int], list[float]]:
        """Sampled ids ``[T]`` and their logprobs ``[T]`` (nats, < 0) of one choice. With
        ``prompt_ids="messages"`` the last id is the end token (``end_token``): an answer that
        finishes with ``"stop"`` stopped on it, as an engine stops on ``<|im_end|>``, so the
        ids a chat answer, generate and derender give, and the template's rendering of the
        answer echoed back (its text, then the end token) are one sequence."""
        if choice_index not in self._choices:
            rng = random.Random(f"{self.settings.seed}:choice:{choice_index}")
            size = self.settings.vocab_size
            ids = [rng.randrange(size) for _ in range(self.settings.response_tokens)]
            logprobs = [-round(rng.expovariate(0.5) + 1e-6, 6) for _ in ids]
            if self.settings.prompt_ids == "messages":
                ids[-1] = self.end_token
            self._choices[choice_index] = (ids, logprobs)
        return self._choices[choice_index]

    def text_of(self, ids: list[int]) -> str:
        """The answer's text of sampled ``ids``: ``" t<id>"`` per token, without the end token
        that stopped sampling (an engine leaves it out of the text: vLLM's
        ``IncrementalDetokenizer``), which the template renders again when the answer is
        echoed."""
        return "".join(_text(i) for i in ids if i != self.end_token)

    def answer_text(self, choice_index: int, completion_tokens: int) -> str:
        """The chat answer's text of choice ``choice_index`` cut at ``completion_tokens``."""
        ids, _logprobs = self.choice_tokens(choice_index)
        return self.text_of(ids[:completion_tokens])

    def shape_of(self, body: dict[str, Any]) -> _Shape:
        """Read the fields that change the answer; raise ``ValueError`` on bad values."""
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"max_tokens must be a positive integer, got {limit!r}")
        n = body.get("n") or 1
        if not isinstance(n, int) or not 1 <= n <= 128:
            raise ValueError(f"n must be an integer in [1, 128], got {n!r}")
        completion_tokens = self.settings.response_tokens
        finish_reason = "stop"
        if limit is not None and limit < completion_tokens:
            completion_tokens, finish_reason = limit, "length"
        options = body.get("stream_options") or {}
        return _Shape(
            stream=body.get("stream") is True,
            return_token_ids=body.get("return_token_ids") is True,
            logprobs=body.get("logprobs") is True,
            include_usage=isinstance(options, dict) and options.get("include_usage") is True,
            completion_tokens=completion_tokens,
            n=n,
            finish_reason=finish_reason,
        )

    def render(
        self, shape: _Shape, request_id: str, created_s: int, prompt: list[int] | None = None
    ) -> list[bytes]:
        """The answer's bytes: one JSON body, or one ``data: ...\\n\\n`` event per SSE chunk;
        ``prompt`` (``prompt_of``) is needed when ``prompt_ids="messages"``."""
        templates = self._templates.get(shape)
        if templates is None:
            templates = self._build(shape)
            self._templates[shape] = templates
        id_bytes = request_id.encode()
        created = str(created_s).encode()
        mark_id, mark_created = _ID_MARK.encode(), f'"{_CREATED_MARK}"'.encode()
        parts = [
            t.replace(mark_id, id_bytes, 1).replace(mark_created, created, 1) for t in templates
        ]
        if self.settings.prompt_ids == "fixed":
            return parts
        if prompt is None:
            raise ValueError("prompt_ids='messages' renders each answer with its prompt")
        total = len(prompt) + shape.completion_tokens * shape.n
        fills = [
            (f'"{_PROMPT_MARK}"'.encode(), _dumps(prompt)),
            (f'"{_PROMPT_TOKENS_MARK}"'.encode(), str(len(prompt)).encode()),
            (f'"{_TOTAL_TOKENS_MARK}"'.encode(), str(total).encode()),
        ]
        for mark, value in fills:
            parts = [part.replace(mark, value) for part in parts]
        return parts

    def _prompt_fields(self, shape: _Shape) -> tuple[Any, Any, Any]:
        """``(prompt_token_ids, usage prompt_tokens, usage total_tokens)`` of a template: the
        values themselves, or with ``prompt_ids="messages"`` the marks ``render`` fills."""
        if self.settings.prompt_ids == "messages":
            marked = _PROMPT_MARK if shape.return_token_ids else None
            return marked, _PROMPT_TOKENS_MARK, _TOTAL_TOKENS_MARK
        prompt = self.settings.prompt_tokens
        ids = self.prompt_ids if shape.return_token_ids else None
        return ids, prompt, prompt + shape.completion_tokens * shape.n

    def _build(self, shape: _Shape) -> list[bytes]:
        if shape.stream:
            events = [_dumps(chunk) for chunk in self._chunks(shape)]
            return [b"data: " + event + b"\n\n" for event in [*events, b"[DONE]"]]
        return [_dumps(self._completion(shape))]

    def _head(self, kind: str) -> dict[str, Any]:
        return {
            "id": _ID_MARK,
            "object": kind,
            "created": _CREATED_MARK,
            "model": self.settings.model,
        }

    def _logprob_entries(self, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
        return [
            {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
            for text, lp in zip((_text(i) for i in ids), logprobs, strict=True)
        ]

    def _completion(self, shape: _Shape) -> dict[str, Any]:
        choices = []
        for index in range(shape.n):
            ids, logprobs = self.choice_tokens(index)
            ids, logprobs = ids[: shape.completion_tokens], logprobs[: shape.completion_tokens]
            message = {
                "role": "assistant",
                "content": self.text_of(ids),
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            }
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": (
                        {"content": self._logprob_entries(ids, logprobs)}
                        if shape.logprobs
                        else None
                    ),
                    "finish_reason": shape.finish_reason,
                    "stop_reason": None,
                    "token_ids": ids if shape.return_token_ids else None,
                    "routed_experts": None,
                }
            )
        completion = shape.completion_tokens * shape.n
        prompt_ids, prompt, total = self._prompt_fields(shape)
        return {
            **self._head("chat.completion"),
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": {
                "prompt_tokens": prompt,
                "total_tokens": total,
                "completion_tokens": completion,
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            },
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _chunks(self, shape: _Shape) -> list[dict[str, Any]]:
        kind = "chat.completion.chunk"
        chunks: list[dict[str, Any]] = []
        prompt_ids, prompt, total = self._prompt_fields(shape)
        for index in range(shape.n):
            first = {"index": index, "delta": {"role": "assistant", "content": ""}}
            chunks.append(
                {
                    **self._head(kind),
                    "choices": [{**first, "logprobs": None, "finish_reason": None}],
                    "prompt_token_ids": prompt_ids,
                    "prompt_text": None,
                }
            )
        for position in range(shape.completion_tokens):
            last = position == shape.completion_tokens - 1
            for index in range(shape.n):
                ids, logprobs = self.choice_tokens(index)
                token_id, logprob = ids[position], logprobs[position]
                choice: dict[str, Any] = {
                    "index": index,
                    "delta": {"content": self.text_of([token_id])},
                    "logprobs": (
                        {"content": self._logprob_entries([token_id], [logprob])}
                        if shape.logprobs
                        else None
                    ),
                    "finish_reason": shape.finish_reason if last else None,
                }
                if last:
                    choice["stop_reason"] = None
                choice["token_ids"] = [token_id] if shape.return_token_ids else None
                chunk: dict[str, Any] = {**self._head(kind), "choices": [choice]}
                if last and not shape.include_usage:
                    # vLLM puts the fingerprint on the usage chunk when there is one.
                    chunk["system_fingerprint"] = SYSTEM_FINGERPRINT
                chunks.append(chunk)
        if shape.include_usage:
            completion = shape.completion_tokens * shape.n
            chunks.append(
                {
                    **self._head(kind),
                    "choices": [],
                    "usage": {
                        "prompt_tokens": prompt,
                        "total_tokens": total,
                        "completion_tokens": completion,
                    },
                    "system_fingerprint": SYSTEM_FINGERPRINT,
                }
            )
        return chunks


def _text(token_id: int) -> str:
    return f" t{token_id}"


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
