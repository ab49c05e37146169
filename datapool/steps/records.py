"""What the gateway hands the pool for one LLM call (plain data, no SQL).

Owns: the shape of a captured call, and of one waiting for its commit. Never: holds text that
was re-encoded into IDs; every ID and logprob here is the engine's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from datapool.steps.canonical import CanonicalCall

# What a lineage (one conversation of a trajectory) is: the agent's own, a sub-agent's, a call
# beside them (a title, a summary, a check), the continuation of a compacted history.
LineageKind = Literal["main", "subagent", "side_call", "compaction"]
LINEAGE_KINDS: tuple[LineageKind, ...] = ("main", "subagent", "side_call", "compaction")
# Who named it: a client header (Claude Code, Codex, OpenCode, ``X-Trajgate-Lineage``), or the
# pool, from the continuation (``datapool.steps.lineage``: a side call starts a new lineage,
# any other step stays in its parent step's).
LineageSource = Literal["headers", "inferred"]
LINEAGE_SOURCES: tuple[LineageSource, ...] = ("headers", "inferred")


@dataclass(frozen=True)
class LineageRecord:
    """A step's lineage (``steps.lineage_*``): ``id`` (None: the lineage starts at this call,
    and its id is the call's first step id), the lineage it came from (``parent_id``), its
    ``kind`` and ``source``."""

    id: str | None
    parent_id: str | None
    kind: LineageKind
    source: LineageSource = "headers"


@dataclass(frozen=True)
class ChoiceRecord:
    """One choice of a call: the sampled response.

    ``response_token_ids`` and ``response_logprobs`` are ``[T]`` (T = sampled tokens, end token
    included) or None when the engine did not return them (flagged, never made up).
    """

    choice_index: int
    response_token_ids: list[int] | None
    response_logprobs: list[float] | None
    response_message: dict[str, Any] | None
    finish_reason: str | None
    flags: list[str] = field(default_factory=list)
    stop_reason: str | None = None
    # Set by the gateway when it must name the step before it is written (streaming answers
    # carry ``x-trajgate-step-id`` in headers sent before the first token); else the pool picks.
    step_id: str | None = None
    # [[version, start, end], ...] over the response tokens when a full-weight update replaced
    # the weights while this choice was sampling (``steps.policy_version_spans``).
    policy_version_spans: list[list[int]] | None = None
    # The key of the turn this choice answered, on exact channels
    # (``gateway.proxy.continuation.history.turn_key``, stored as ``steps.turn_key``).
    turn_key: str | None = None


@dataclass(frozen=True)
class AttemptRecord:
    """One try of a logical call against one upstream replica (``call_attempts``)."""

    id: str
    call_id: str
    trajectory_id: str
    attempt_index: int
    upstream: str | None
    status_code: int | None
    outcome: str
    error: str | None
    latency_ms: float
    idempotency_key: str | None = None
    response_body: dict[str, Any] | None = None


@dataclass(frozen=True)
class CallRecord:
    """One proxied call: what the client sent, what went upstream, and what came back.

    ``prompt_token_ids`` is ``[P]``, the exact IDs the engine used, or None when missing.
    ``latency_ms`` is wall time from receiving the client's request to the upstream's full answer;
    ``ttft_ms`` the time to the first streamed token (None when not streaming); ``held_ms`` how
    long a full-weight reload held the call before it went upstream (None when not held).
    """

    request: dict[str, Any]
    upstream_request: dict[str, Any]
    model: str | None
    upstream: str
    policy_version: int | None
    latency_ms: float
    prompt_token_ids: list[int] | None
    prompt_tokens: int | None
    choices: list[ChoiceRecord]
    outcome: str = "ok"
    error: str | None = None
    # The logical call: retries and linked re-sends share ``call_id``.
    call_id: str | None = None
    endpoint: str = "chat.completions"
    request_hash: str | None = None
    idempotency_key: str | None = None
    ttft_ms: float | None = None
    held_ms: float | None = None
    # The effective sampling parameters and the channel's policy (``gateway.proxy.sampling``).
    sampling: dict[str, Any] | None = None
    group_id: str | None = None
    channel: str | None = None
    # The upstream attempts of the call (retries included), committed in the same transaction as
    # its steps; none when the call was refused (trajectory closed).
    attempts: tuple[AttemptRecord, ...] = ()
    # What built the prompt: ``exact`` (a turn's own ids, then the template's rendering of the
    # new messages only: ``suffix_tokens`` of them) or ``template`` (the whole conversation
    # rendered); None when the gateway did not say (a completions prompt, older records).
    continuation: str | None = None
    # Counted by the gateway from the turn it continued; the writer stores it counted from the
    # recorded parent (``lineage.Placement.suffix_tokens``).
    suffix_tokens: int | None = None
    # What the engine was asked, in the one form every reader of the pool uses (written by the
    # call's dialect); None only for a call recorded without one.
    canonical: CanonicalCall | None = None
    # The field of ``request`` that holds the history the client resends (named by its
    # dialect; None: none), stored as a delta on the parent's (``datapool.steps.messages``).
    history_field: str | None = None
    # The lineage a client header named (``gateway.proxy.lineages``); None: the pool infers it.
    lineage: LineageRecord | None = None


@dataclass(frozen=True)
class PendingCall:
    """One call waiting to be committed to trajectory ``trajectory_id``."""

    trajectory_id: str
    call: CallRecord
