"""One logical call while it is in flight: what it is, its attempts, its record and its commit.

Owns: ``Call`` (the client's body, the dialect's preparation, the attribution, the policy
version, the upstream attempts, the step ids named before a stream's commit), ``Attempts``
(the one recorder of those attempts: each outcome an attempt ends in is written there once),
turning a call into the pool's ``CallRecord``, the trajgate response headers, and committing
it with its metrics and log line. Never: talks to an upstream (``gateway.proxy.routes`` and
``gateway.proxy.streaming`` do) or reads an answer (the dialect does).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from datapool.models import StepOutcome
from datapool.steps.calls import AttemptRecord
from datapool.steps.canonical import response_of
from datapool.steps.payloads import pack_ids
from datapool.steps.records import CallRecord, ChoiceRecord
from gateway.capture import IDS_INCOMPLETE
from gateway.dialects import Dialect, Prepared
from gateway.proxy.attribution import Attribution
from gateway.proxy.continuation.history import HistoryKeys, Turn
from gateway.proxy.continuation.plan import Continuation
from gateway.proxy.sampling import sampling_flags
from gateway.state import GatewayState
from gateway.upstream.replicas import Replica
from gateway.upstream.weight_update import (
    ABORTED_FOR_WEIGHT_UPDATE,
    POLICY_VERSION_SPLIT_UNKNOWN,
    Ticket,
)

log = logging.getLogger("trajgate.proxy")


@dataclass
class Call:
    """Everything known about one logical call while it is in flight."""

    dialect: Dialect
    attribution: Attribution
    body: dict[str, Any]  # the client's body as sent (before the model alias was resolved)
    prepared: Prepared
    policy_version: int
    call_id: str
    request_hash: str
    idempotency_key: str | None
    resend_of: str | None
    started: float = field(default_factory=time.perf_counter)
    # Its upstream attempts, in order, each recorded through this (``Attempts``).
    attempts: Attempts = field(init=False)
    # Named when the call is prepared (``preparation.new_call``), before anything is written:
    # a stream's headers go out first, and a Responses id names its step. Index = choice.
    step_ids: list[str] = field(default_factory=list)
    # Admission through the weight gate: how long it was held, and the abort of its sampling.
    ticket: Ticket = field(default_factory=Ticket)
    # How its prompt is built: the template's rendering, or an exact continuation of a turn.
    continuation: Continuation = field(default_factory=lambda: Continuation("template"))
    # On an exact channel's chat path, the keys of its history (``history.history_keys``),
    # walked once when its turn was looked for: its own turn's key comes from them (``keyed``).
    history: HistoryKeys | None = None
    # What it samples with (``gateway.proxy.sampling.sampling_record``), stored as
    # ``steps.sampling``.
    sampling: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.attempts = Attempts(
            self.call_id, self.trajectory_id, self.idempotency_key, self.elapsed_ms
        )

    @property
    def trajectory_id(self) -> str:
        return self.attribution.trajectory_id

    @property
    def upstream_body(self) -> dict[str, Any]:
        return self.prepared.upstream_body

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000.0

    def record(
        self,
        replica: Replica | None,
        choices: list[ChoiceRecord],
        *,
        prompt_ids: list[int] | None = None,
        prompt_tokens: int | None = None,
        model: Any = None,
        outcome: str = StepOutcome.OK,
        error: str | None = None,
        ttft_ms: float | None = None,
    ) -> CallRecord:
        self.continuation.confirm(prompt_ids)
        choices = [self._with_versions(c) for c in choices]
        if outcome == StepOutcome.OK and self.continuation.render_key is not None:
            choices = [keyed(self, c) for c in choices]
        added = [] if self.sampling is None else sampling_flags(self.sampling)
        if self.resend_of is not None:
            added.append("resend")
        if added:
            choices = [replace(c, flags=[*c.flags, *added]) for c in choices]
        if self.step_ids:
            choices = [
                replace(c, step_id=self.step_ids[c.choice_index])
                if c.choice_index < len(self.step_ids)
                else c
                for c in choices
            ]
        return CallRecord(
            request=self.body,
            upstream_request=self.upstream_body,
            model=model if isinstance(model, str) else self.upstream_body.get("model"),
            upstream=replica.url if replica else "",
            policy_version=self.policy_version,
            latency_ms=self.elapsed_ms(),
            prompt_token_ids=prompt_ids,
            prompt_tokens=prompt_tokens,
            choices=choices,
            outcome=outcome,
            error=error,
            call_id=self.call_id,
            endpoint=self.dialect.name,
            request_hash=self.request_hash,
            idempotency_key=self.idempotency_key,
            ttft_ms=ttft_ms,
            held_ms=self.ticket.held_ms,
            sampling=self.sampling,
            group_id=self.attribution.group_id,
            channel=self.attribution.channel,
            attempts=tuple(self.attempts.records),
            continuation=self.continuation.built,
            suffix_tokens=self.continuation.suffix_tokens,
            canonical=self.continuation.canonical or self.dialect.canonical(self.upstream_body),
            history_field=self.dialect.history_field,
            lineage=self.attribution.lineage,
        )

    def _with_versions(self, choice: ChoiceRecord) -> ChoiceRecord:
        """``choice`` with the policy version spans of a kept weight reload it sampled across,
        or flagged ``policy_version_split_unknown`` where the split is not known. The engine's
        own spans are read where it reported them (exact continuation)."""
        reported = self.continuation.weight_versions.get(choice.choice_index)
        if not self.ticket.marks and reported is None:
            return choice
        tokens = len(choice.response_token_ids or [])
        try:
            spans = self.ticket.version_spans(
                self.policy_version, choice.choice_index, tokens, reported
            )
        except LookupError:
            return replace(choice, flags=[*choice.flags, POLICY_VERSION_SPLIT_UNKNOWN])
        return replace(choice, policy_version_spans=spans)

    def headers(self, step_ids: list[str], *, committed: bool = True) -> dict[str, str]:
        """The trajgate headers of the answer. ``committed``: ``step_ids`` came back from the
        commit (unary answers); a stream's ids are chosen before its commit."""
        headers = {
            "x-trajgate-trajectory-id": self.trajectory_id,
            "x-trajgate-call-id": self.call_id,
            "x-trajgate-step-id": ",".join(step_ids),
            "x-trajgate-policy-version": str(self.policy_version),
        }
        if committed:
            # False only under on_write_failure='serve' when the pool failed the commit.
            headers["x-trajgate-recorded"] = "true" if step_ids else "false"
        return headers


class Attempts:
    """One call's upstream attempts in the order they ended (``AttemptRecord``, stored with its
    steps as ``call_attempts``): each outcome an attempt can end in is written here, by one
    method each, and nowhere else. The caller decides which outcome an attempt met (the loop
    ``gateway.proxy.attempts``, the answer ``gateway.proxy.answer`` and
    ``gateway.proxy.streaming``); each method but ``ok`` returns the outcome, which the call's
    failed step is recorded with (``fail_call``).

    ``replica``: the replica tried (None: the call never reached one); ``status_code``: the
    HTTP status it answered (None before a status line); ``error``: what went wrong, as text.
    ``latency_ms`` of each is the call's time so far (``elapsed_ms``, in ms).
    """

    def __init__(
        self,
        call_id: str,
        trajectory_id: str,
        idempotency_key: str | None,
        elapsed_ms: Callable[[], float],
    ) -> None:
        self.records: list[AttemptRecord] = []
        self._call_id = call_id
        self._trajectory_id = trajectory_id
        self._idempotency_key = idempotency_key
        self._elapsed_ms = elapsed_ms

    def ok(self, replica: Replica, *, response_body: dict[str, Any] | None = None) -> None:
        """The replica answered 200 and the answer was read whole; ``response_body``: the
        client's answer, kept for Idempotency-Key replays (None: not kept)."""
        self._add(replica, StepOutcome.OK, 200, None, response_body)

    def upstream_error(
        self, replica: Replica, *, status_code: int | None = None, error: str | None = None
    ) -> str:
        """The replica was reached and its answer is what failed: a refusal (a non-200
        status), an answer broken in transport or framing, one the capture cannot read, or
        vLLM's own error event ending a stream."""
        return self._add(replica, StepOutcome.UPSTREAM_ERROR, status_code, error)

    def unreachable(self, replica: Replica, error: str) -> str:
        """The replica could not be reached (refused, reset, a connect timeout)."""
        return self._add(replica, StepOutcome.UPSTREAM_UNREACHABLE, None, error)

    def timed_out(self, replica: Replica, error: str, *, status_code: int | None = None) -> str:
        """The replica did not answer (or stream on) within a time limit."""
        return self._add(replica, StepOutcome.UPSTREAM_TIMEOUT, status_code, error)

    def aborted(self, replica: Replica | None, *, status_code: int | None = None) -> str:
        """A full-weight update aborted the attempt (``weight_update.CallAborted``)."""
        return self._add(replica, ABORTED_FOR_WEIGHT_UPDATE, status_code, "weight update")

    def _add(
        self,
        replica: Replica | None,
        outcome: str,
        status_code: int | None,
        error: str | None,
        response_body: dict[str, Any] | None = None,
    ) -> str:
        self.records.append(
            AttemptRecord(
                id=str(uuid.uuid4()),
                call_id=self._call_id,
                trajectory_id=self._trajectory_id,
                attempt_index=len(self.records),
                upstream=replica.url if replica else None,
                status_code=status_code,
                outcome=outcome,
                error=error,
                latency_ms=self._elapsed_ms(),
                idempotency_key=self._idempotency_key,
                response_body=response_body,
            )
        )
        return outcome


def failed_choice(outcome: str) -> list[ChoiceRecord]:
    """The one record of a call that got no answer: no ids, flagged with its outcome."""
    return [ChoiceRecord(0, None, None, None, None, flags=[outcome])]


async def fail_call(
    state: GatewayState, call: Call, replica: Replica | None, outcome: str, error: str
) -> None:
    """Commit a call that ended without an answer (``outcome``: why) and count it."""
    await commit(
        state, call, call.record(replica, failed_choice(outcome), outcome=outcome, error=error)
    )
    state.metrics.requests.labels(call.dialect.name, "error").inc()


async def commit(state: GatewayState, call: Call, record: CallRecord) -> list[str]:
    """Make the call durable (steps and attempts) and count it."""
    step_ids = await state.record(call.trajectory_id, record)
    if call.continuation.mode == "exact" and record.outcome == StepOutcome.OK:
        remember_turns(state, call, record)
    state.metrics.steps_written.inc(len(step_ids))
    for choice in record.choices:
        for flag in choice.flags:
            state.metrics.step_flags.labels(flag).inc()
    if record.prompt_tokens:
        state.metrics.tokens.labels("prompt").inc(record.prompt_tokens)
    sampled = sum(len(choice.response_token_ids or []) for choice in record.choices)
    state.metrics.tokens.labels("completion").inc(sampled)
    log.info(
        "call trajectory=%s call=%s endpoint=%s outcome=%s steps=%d prompt_tokens=%s "
        "completion_tokens=%d latency_ms=%.1f policy_version=%d",
        call.trajectory_id,
        call.call_id,
        call.dialect.name,
        record.outcome,
        len(step_ids),
        record.prompt_tokens,
        sampled,
        record.latency_ms,
        call.policy_version,
    )
    return step_ids


def remember_turns(state: GatewayState, call: Call, record: CallRecord) -> None:
    """Keep each keyed choice of a committed call of an exact channel as a turn a later call of
    the trajectory may extend (``gateway.proxy.continuation.history``): its key, the response
    message returned, ``P + R``."""
    prompt = record.prompt_token_ids
    if prompt is None:
        return
    for choice in record.choices:
        response, answer = choice.response_token_ids, choice.response_message
        if choice.turn_key is None or response is None or answer is None:
            continue
        turn = Turn(choice.turn_key, response_of(answer), pack_ids([*prompt, *response]))
        state.turns.add(call.trajectory_id, turn)


def keyed(call: Call, choice: ChoiceRecord) -> ChoiceRecord:
    """``choice`` with the key of the turn it answered (``history.turn_key``, stored as
    ``steps.turn_key``) on an exact channel's chat path, when its ids are whole."""
    history = call.history
    if (
        history is None
        or choice.response_message is None
        or choice.response_token_ids is None
        or IDS_INCOMPLETE in choice.flags
    ):
        return choice
    return replace(choice, turn_key=history.answered_by(response_of(choice.response_message)))
