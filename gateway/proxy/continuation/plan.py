"""One call's continuation plan: how its prompt is built, and what the engine reported of it.

Owns: ``Continuation``, made by ``gateway.proxy.preparation.plan_continuation`` for every call:
the attempt loop (``gateway.proxy.attempts``) hands its exact prefix and render sent ahead to
the engine room's exact exchange (``gateway.engine.exact.send_exact``) and keeps the value that
comes back (``ExactAnswer``) on it, read by the call's record (``gateway.proxy.call``) and the
weight gate's version spans.
Never: talks to an engine (``gateway.engine`` does) or tokenizes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from datapool.steps.canonical import CanonicalCall
from gateway.engine.exact import ExactAnswer, RenderAhead
from gateway.proxy.continuation.history import Extension
from gateway.proxy.continuation.prompt import TurnPrefix, turn_prefix

log = logging.getLogger("trajgate.continuation")

ContinuationMode = Literal["exact", "template"]
CONTINUATION_MODES: tuple[ContinuationMode, ...] = ("exact", "template")


@dataclass
class Continuation:
    """How one call's prompt is built. ``mode``: the channel's setting; ``extension``: the turn
    it extends (None: none, so the template renders it); on an exact channel's chat path,
    ``render_key`` and ``canonical``: the call's ``history.render_key`` and canonical record,
    from which each choice's ``turn_key`` is computed (None elsewhere); ``ahead``: the render
    sent ahead for it, until an attempt takes it (``take_ahead``; the call's lifetime,
    ``CallLifetime.ahead``, cancels one never taken); ``answer``: what the engine room's exact
    exchange answered its latest exact attempt (``ExactAnswer``), set by the attempt loop
    (``gateway.proxy.attempts``), None while no exact attempt answered. ``built``,
    ``suffix_tokens``, ``prompt_token_ids`` and ``weight_versions`` are read from it."""

    mode: ContinuationMode
    extension: Extension | None = None
    render_key: str | None = None
    canonical: CanonicalCall | None = None
    ahead: RenderAhead | None = None
    answer: ExactAnswer | None = None

    @property
    def built(self) -> ContinuationMode:
        """What built the prompt (``exact`` or ``template``), stored on the step."""
        return "template" if self.answer is None else self.answer.built

    @property
    def suffix_tokens(self) -> int | None:
        """In exact mode, how many tokens the template rendered for the new messages and the
        generation prompt; None otherwise."""
        return None if self.answer is None else self.answer.suffix_tokens

    @property
    def prompt_token_ids(self) -> list[int] | None:
        """The prompt sent to the engine (``[P]``) by an exact attempt (``confirm`` checks the
        engine used it); None when none was sent."""
        return None if self.answer is None else self.answer.prompt_token_ids

    @property
    def weight_versions(self) -> Mapping[int, list[Any]]:
        """By choice index, the engine's ``weight_versions`` spans as a unary
        ``/inference/v1/generate`` reported them (``[{"version", "start", "end"}, ...]`` over
        the choice's ``[T]`` output tokens), read by
        ``gateway.upstream.weight_update.Ticket.version_spans``; empty when none reported."""
        return {} if self.answer is None else self.answer.weight_versions

    def take_ahead(self) -> RenderAhead | None:
        """The render sent ahead, handed to the first attempt that asks (``send_exact`` then
        owns it: uses or discards it); None after that, or when none was sent."""
        ahead, self.ahead = self.ahead, None
        return ahead

    def exact_prefix(self, end_token: int) -> TurnPrefix | None:
        """The extended turn's ids closed as the template closes a turn with ``end_token``,
        ready to splice into the template's rendering (``prompt.turn_prefix``); None for an
        empty turn. Only for a call that extends one."""
        assert self.extension is not None, "only a call that extends a turn continues it"
        return turn_prefix(self.extension.turn.sequence, end_token)

    def confirm(self, engine_prompt: list[int] | None) -> None:
        """Keep ``built`` = ``exact`` only when the engine reports the prompt it was sent:
        vLLM renders the messages instead of taking forwarded ids for some bodies (``echo``,
        non-text content), and such a call was then the template's (``answer`` is replaced by
        one saying so)."""
        answer = self.answer
        if (
            answer is None
            or answer.built != "exact"
            or engine_prompt is answer.prompt_token_ids
            or engine_prompt == answer.prompt_token_ids
        ):
            return
        log.warning("the engine did not sample from the exact prompt sent: recorded as template")
        self.answer = replace(answer, built="template", suffix_tokens=None)
