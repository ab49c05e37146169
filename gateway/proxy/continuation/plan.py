"""One call's continuation plan: how its prompt is built, and what the engine reported of it.

Owns: ``Continuation``, made by ``gateway.proxy.preparation.plan_continuation`` for every call,
handed to the engine room's exact exchange (``gateway.engine.exact.send_exact``, which reads
it as an ``ExactPlan``: the exact prefix of the turn it extends, the render sent ahead) and read
by the call's record (``gateway.proxy.call``) and the weight gate's version spans.
Never: talks to an engine (``gateway.engine`` does) or tokenizes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from datapool.steps.canonical import CanonicalCall
from gateway.engine.exact import RenderAhead
from gateway.proxy.continuation.history import Extension
from gateway.proxy.continuation.prompt import TurnPrefix, turn_prefix

log = logging.getLogger("trajgate.continuation")

ContinuationMode = Literal["exact", "template"]
CONTINUATION_MODES: tuple[ContinuationMode, ...] = ("exact", "template")


@dataclass
class Continuation:
    """How one call's prompt is built. ``mode``: the channel's setting; ``extension``: the turn
    it extends (None: none, so the template renders it); ``built``: what built the prompt
    (``exact`` or ``template``), stored on the step; ``suffix_tokens``: in exact mode, how many
    tokens the template rendered for the new messages and the generation prompt; on an exact
    channel's chat path, ``render_key`` and ``canonical``: the call's ``history.render_key``
    and canonical record, from which each choice's ``turn_key`` is computed (None elsewhere);
    ``weight_versions``: by choice index, the engine's ``weight_versions`` spans as a unary
    ``/inference/v1/generate`` reported them (``[{"version", "start", "end"}, ...]``), read by
    ``gateway.upstream.weight_update.Ticket.version_spans``; ``prompt_token_ids``: the prompt
    sent to the engine (``confirm`` checks the engine used it); ``ahead``: the render sent
    ahead for it, until ``send_exact`` takes it (the call's lifetime, ``CallLifetime.ahead``,
    cancels one never taken)."""

    mode: ContinuationMode
    extension: Extension | None = None
    built: ContinuationMode = "template"
    suffix_tokens: int | None = None
    render_key: str | None = None
    canonical: CanonicalCall | None = None
    weight_versions: dict[int, list[Any]] = field(default_factory=dict)
    prompt_token_ids: list[int] | None = None
    ahead: RenderAhead | None = None

    def exact_prefix(self, end_token: int) -> TurnPrefix | None:
        """The extended turn's ids closed as the template closes a turn with ``end_token``,
        ready to splice into the template's rendering (``prompt.turn_prefix``); None for an
        empty turn. Only for a call that extends one."""
        assert self.extension is not None, "only a call that extends a turn continues it"
        return turn_prefix(self.extension.turn.sequence, end_token)

    def confirm(self, engine_prompt: list[int] | None) -> None:
        """Keep ``built`` = ``exact`` only when the engine reports the prompt it was sent:
        vLLM renders the messages instead of taking forwarded ids for some bodies (``echo``,
        non-text content), and such a call was then the template's."""
        if (
            self.built != "exact"
            or engine_prompt is self.prompt_token_ids
            or engine_prompt == self.prompt_token_ids
        ):
            return
        log.warning("the engine did not sample from the exact prompt sent: recorded as template")
        self.built, self.suffix_tokens = "template", None
