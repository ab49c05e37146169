"""The completions dialect: ``POST /v1/completions``, passed through to vLLM's own.

Owns: the one-prompt rule (a batch of prompts is refused, so every prompt is its own step),
``max_completion_tokens`` honoured (vLLM's completions endpoint ignores it and samples its
default 16 tokens: it goes upstream as ``max_tokens`` when the client sent none, and the step
records that upstream body) and where completions answers keep their fields (prompt IDs per
choice, logprobs under ``logprobs.token_logprobs``, the message as ``{"text": ...}``). Never:
changes what the client receives beyond hiding the capture fields it did not ask for
(``gateway.dialects.choices``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from datapool.steps.canonical import CanonicalCall
from gateway.dialects.base import Prepared
from gateway.dialects.chat_completions.serving import sampling_of
from gateway.dialects.choices import ChoicesDialect, ChoiceState
from gateway.dialects.wire import CompletionAnswer, CompletionChoice
from gateway.engine import answers
from gateway.engine.paths import COMPLETIONS_PATH
from gateway.engine.wire import token_ids
from gateway.errors import InvalidRequestError


class Completions(ChoicesDialect[CompletionChoice, CompletionChoice]):
    name = "completions"
    answer_shape = answers.COMPLETION_ANSWER
    chunk_shape = answers.COMPLETION_CHUNK
    client_paths = ("/completions",)
    upstream_path = COMPLETIONS_PATH

    def canonical(self, upstream_body: Mapping[str, Any]) -> CanonicalCall:
        """A prompt and its sampling parameters: no messages, no tools."""
        prompt = upstream_body.get("prompt")
        return CanonicalCall(
            messages=None,
            sampling=sampling_of(upstream_body),
            prompt=prompt if isinstance(prompt, str | list) else None,
        )

    def check_input(self, body: dict[str, Any]) -> None:
        prompt = body.get("prompt")
        single_text = isinstance(prompt, str)
        single_ids = isinstance(prompt, list) and all(
            isinstance(token, int) and not isinstance(token, bool) for token in prompt
        )
        if not (single_text or single_ids) or not prompt:
            raise InvalidRequestError(
                "'prompt' must be one non-empty string or one list of token ids (send one "
                "request per prompt, so each becomes its own step)",
                param="prompt",
            )

    def prepare(self, body: dict[str, Any]) -> Prepared:
        """The shared upstream body, with the client's ``max_completion_tokens`` as
        ``max_tokens`` (the field vLLM's completions endpoint reads) unless ``max_tokens`` was
        sent too, which then wins as vLLM would have it."""
        prepared = super().prepare(body)
        if "max_completion_tokens" not in body:
            return prepared
        upstream = dict(prepared.upstream_body)
        limit = upstream.pop("max_completion_tokens")
        if upstream.get("max_tokens") is None:
            upstream["max_tokens"] = limit
        return replace(prepared, upstream_body=upstream)

    def upstream_logprobs(self, body: dict[str, Any]) -> tuple[bool, Any]:
        # ``logprobs: <int>`` asks for that many alternatives; the sampled token's logprob comes
        # with any count, so the client's own count (at least 1) goes upstream.
        client_logprobs = body.get("logprobs")
        asked = isinstance(client_logprobs, int) and not isinstance(client_logprobs, bool)
        return asked, client_logprobs if asked else 1

    def prompt_ids(self, answer: CompletionAnswer) -> list[int] | None:
        for choice in answer.get("choices") or ():
            ids = token_ids(choice.get("prompt_token_ids"))
            if ids is not None:
                return ids
        return None

    def choice_logprobs(self, choice: CompletionChoice) -> list[float] | None:
        logprobs = choice.get("logprobs")
        if not logprobs:
            return None
        values = logprobs.get("token_logprobs")
        return None if values is None else [float(value) for value in values]

    def answer_message(self, choice: CompletionChoice) -> dict[str, Any] | None:
        return {"text": choice.get("text")}

    def delta_text(self, choice: CompletionChoice) -> str:
        return str(choice.get("text") or "")

    def add_delta(self, state: ChoiceState, choice: CompletionChoice) -> None:
        state.text_parts.append(str(choice.get("text") or ""))

    def stream_message(self, state: ChoiceState) -> dict[str, Any]:
        return {"text": "".join(state.text_parts)}
