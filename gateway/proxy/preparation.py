"""Preparing a call before it goes upstream: what the pool and the settings make of it.

Owns: Idempotency-Key replays, the call's channel (``settle_channel``), the policy alias, the
channel's sampling defaults and policy, re-send detection, the earlier call a body continues,
the exact-continuation plan and the render sent ahead of it (held by the call's lifetime,
``gateway.proxy.lifetime``), and the pool reads all of that needs (``pool_lookup``: off the
event loop, under the pool's failure mode). Never: sends the call (``gateway.proxy.attempts``)
or answers it (``gateway.proxy.answer``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

from sqlalchemy.exc import SQLAlchemyError

from datapool.lifecycle.transitions import ensure_trajectory
from datapool.models import TrajectoryStatus
from datapool.steps.calls import find_exchange, find_resend
from datapool.steps.faults import is_storage_fault
from gateway.capture import request_hash
from gateway.dialects import Dialect, EarlierCall, Prepared, check_limits, with_sampling_defaults
from gateway.engine.exact import RenderAhead, continues_exactly, render_ahead
from gateway.engine.paths import CHAT_PATH
from gateway.errors import PermissionDeniedError
from gateway.proxy.attempts import upstream_timeout
from gateway.proxy.attribution import Attribution
from gateway.proxy.call import Call
from gateway.proxy.continuation.history import (
    HistoryKeys,
    find_extension,
    render_key,
    stored_turn,
)
from gateway.proxy.continuation.plan import CONTINUATION_MODES, Continuation
from gateway.proxy.continuation.walk import walk_history
from gateway.proxy.lifetime import CallLifetime
from gateway.proxy.sampling import apply_policy, sampling_record
from gateway.state import GatewayState
from gateway.upstream.replicas import NoHealthyUpstreamError

T = TypeVar("T")


async def new_call(
    state: GatewayState,
    dialect: Dialect,
    prepared: Prepared,
    attribution: Attribution,
    idempotency_key: str | None,
    lifetime: CallLifetime,
) -> Call:
    """The ``prepared`` call with the policy alias resolved, the channel's sampling defaults
    where the client omitted a field, and the earlier call it re-sends (same body within
    ``resend_window_s``), whose call id it then shares. A body continuing an earlier call
    (``Dialect.earlier_call_id``) gets that call's step read from the pool.

    The upstream body is final before the pool is asked about re-sends and turns, so an exact
    continuation's render is already on its way meanwhile (``render_ahead_of``), held by
    ``lifetime`` (``CallLifetime.ahead``), whose end cancels it if no attempt took it.

    The ids its steps will be recorded under are drawn here, before the dialect prepares the
    call, so an answer may name its own step (a Responses id is ``resp_<step id>``): a re-send
    shares the earlier call's id but never its steps' ids."""
    body = prepared.client_body
    resolution = state.policy.resolve(body.get("model"))
    digest = request_hash(dialect.name, body)
    earlier = await earlier_call(state, dialect, body, attribution)
    defaults = state.settings.sampling_defaults_for(attribution.channel)
    policy = state.settings.sampling_policy_for(attribution.channel)
    tool_strict_level = state.settings.upstream_tool_strict_level

    first_step_id = str(uuid.uuid4())
    final = with_sampling_defaults(
        dialect.prepare_call(prepared, resolution.upstream_model, first_step_id, earlier),
        defaults,
    )
    final, replaced = apply_policy(dialect, final, policy, defaults, tool_strict_level)
    check_limits(dialect, final, state.settings.generation_limits)
    step_ids = [first_step_id, *(str(uuid.uuid4()) for _ in range(final.n_choices - 1))]
    call_id = str(uuid.uuid4())
    # Owned by the call's lifetime from here: whatever ends the call (a refusal below, a
    # failed or cancelled attempt) ends the render too.
    lifetime.ahead = render_ahead_of(state, attribution, dialect, final)
    if lifetime.ahead is not None:
        # Let the render reach the replica before the pool lookups below, whose threads
        # would otherwise hold the GIL while the render is still being sent.
        await asyncio.sleep(0)
    resend_of = None
    if state.settings.resend_window_s > 0 and not idempotency_key:
        resend_of = await pool_lookup(
            state,
            find_resend,
            state.store.engine,
            attribution.trajectory_id,
            digest,
            state.settings.resend_window_s,
        )
    if resend_of is not None:
        call_id = resend_of
    continuation, history = await plan_continuation(
        state, attribution, final.upstream_body, dialect
    )
    sampling = sampling_record(
        final.upstream_body,
        state.settings.upstream_logprobs_mode,
        policy,
        replaced,
        tool_strict_level=tool_strict_level,
    )
    if continuation.extension is not None:
        continuation.ahead = lifetime.ahead  # for the first exact attempt to take
    else:
        # Dropped now, not when the call ends: a call that extends no turn is the template's,
        # and would otherwise keep a render nothing reads for as long as it samples.
        lifetime.drop_ahead()
    return Call(
        dialect=dialect,
        attribution=attribution,
        body=body,
        prepared=final,
        policy_version=resolution.policy_version,
        call_id=call_id,
        step_ids=step_ids,
        request_hash=digest,
        idempotency_key=idempotency_key,
        resend_of=resend_of,
        continuation=continuation,
        history=history,
        sampling=sampling,
    )


def render_ahead_of(
    state: GatewayState, attribution: Attribution, dialect: Dialect, prepared: Prepared
) -> RenderAhead | None:
    """The exact continuation's render, sent now (``engine.render_ahead``) when the call would
    send one: an exact channel's chat call whose trajectory has a turn in this gateway's
    memory (so it most likely extends one), to the replica ``open_upstream`` will try first,
    once that replica is known to serve exact continuations for this kind of call. None
    otherwise (the render, if any, is then sent when the call goes upstream)."""
    body = prepared.upstream_body
    if (
        state.settings.continuation_for(attribution.channel) != "exact"
        or dialect.upstream_path != CHAT_PATH
        or "kv_transfer_params" in body
        or not state.turns.turns_of(attribution.trajectory_id)
    ):
        return None
    try:
        replica = state.upstreams.pick(attribution.trajectory_id)
    except NoHealthyUpstreamError:
        return None
    if not continues_exactly(replica, body):
        return None
    timeout = None if prepared.stream else upstream_timeout(state)
    return render_ahead(state.client, replica, body, timeout)


async def plan_continuation(
    state: GatewayState, attribution: Attribution, upstream_body: dict[str, Any], dialect: Dialect
) -> tuple[Continuation, HistoryKeys | None]:
    """How the call's prompt will be built: on an exact channel, the latest turn of the
    trajectory its canonical conversation extends (``gateway.proxy.continuation.history``),
    from the gateway's memory or else from the pool (a turn another worker, replica or an
    earlier run of the gateway served), if any; the template's rendering otherwise. With it,
    on an exact channel's chat path, the keys of the call's history (``walk.walk_history``), from
    which its own turn's key is made once answered (``gateway.proxy.call.keyed``)."""
    mode = state.settings.continuation_for(attribution.channel)
    if mode == "template" or dialect.upstream_path != CHAT_PATH:
        return Continuation(mode), None
    if "kv_transfer_params" in upstream_body:  # disaggregated serving chooses its own prompt
        return Continuation(mode), None
    if mode != "exact":
        raise ValueError(f"continuation {mode!r}; valid: {', '.join(CONTINUATION_MODES)}")
    body_key = render_key(
        upstream_body, tool_choice_none_renders=state.upstreams.tool_choice_none_renders()
    )
    trajectory_id = attribution.trajectory_id
    canonical, history = walk_history(
        state.walks,
        trajectory_id,
        upstream_body.get("messages"),
        body_key,
        dialect.name,
        lambda known: dialect.canonical_continuing(upstream_body, known),
    )
    continuation = Continuation(mode, render_key=body_key, canonical=canonical)
    if canonical.messages is None or history is None:  # no conversation: no turn to key
        return continuation, None
    messages = canonical.messages
    candidates = history.candidates
    if not candidates:
        return continuation, history
    memory = state.turns.turns_of(trajectory_id)
    extension = find_extension(candidates, messages, memory.get)
    # A later turn than memory's may be in the pool (served by another process).
    later = [(k, key) for k, key in candidates if extension is None or k >= extension.new_from]
    if later:
        keys = [key for _, key in later]
        stored = await pool_lookup(state, state.store.find_turn, trajectory_id, keys)
        turn = None if stored is None else stored_turn(stored)
        found = None if turn is None else find_extension(later, messages, {turn.key: turn}.get)
        if found is not None:
            state.turns.add(trajectory_id, found.turn)
            extension = found
    continuation.extension = extension
    return continuation, history


async def earlier_call(
    state: GatewayState, dialect: Dialect, body: dict[str, Any], attribution: Attribution
) -> EarlierCall | None:
    """The stored exchange of the trajectory's step or call that ``body`` continues, if it
    names one and the pool holds it (the dialect refuses a reference that finds nothing)."""
    named = dialect.earlier_call_id(body)
    if named is None:
        return None
    found = await pool_lookup(
        state, find_exchange, state.store.sessions, attribution.trajectory_id, named, needed=True
    )
    return None if found is None else EarlierCall(*found)


async def settle_channel(state: GatewayState, attribution: Attribution) -> Attribution:
    """The call's attribution with its trajectory's own channel, whose settings the call gets
    (``TRAJGATE_CONTINUATION_CHANNELS``, ``TRAJGATE_SAMPLING_POLICY``,
    ``TRAJGATE_SAMPLING_DEFAULTS``) whatever channel the call names, or none.

    A channel named by ``X-Trajgate-Channel`` or a channel-bound key that is not an existing
    trajectory's own raises ``PermissionDeniedError`` (403) before anything goes upstream: a
    trajectory's channel is set when it is created, and a key bound to a channel writes only
    into that channel's trajectories. A new trajectory is created here in the named channel
    (else 'train'), before anything goes upstream, so that concurrent first calls settle on
    one channel. The pool is read only when the channel can matter: a channel named by the
    call, or settings per channel; a read for a channel-bound key is ``needed`` (refused when
    the pool cannot answer), any other goes on as for a new trajectory in 'serve' mode.
    """
    settings = state.settings
    per_channel = (
        bool(settings.continuation_channels)
        or any(name != "*" for name in settings.sampling_policy)
        or any(name != "*" for name in settings.sampling_defaults)
    )
    if attribution.channel is None and not per_channel:
        return attribution  # every channel gets the same settings and none is named
    trajectory = await pool_lookup(
        state,
        state.store.get_trajectory,
        attribution.trajectory_id,
        needed=attribution.key_channel is not None,
    )
    if trajectory is None:
        # A new trajectory is created now in the channel this call names (insert-or-ignore):
        # concurrent first calls then all read one stored channel and get its settings, where
        # each used to record under the channel it named, a mismatched one accepted too.
        trajectory = await pool_lookup(
            state,
            ensure_trajectory,
            state.store.sessions,
            attribution.trajectory_id,
            attribution.group_id,
            attribution.channel or "train",
            needed=attribution.key_channel is not None,
        )
    if trajectory is None:
        return attribution
    if trajectory.status != TrajectoryStatus.OPEN and state.writer is not None:
        # Read anyway: a closed one is refused before sampling (``PoolWriter.check_open``).
        state.writer.known_closed.add(trajectory.id, trajectory.status)
    named, own = attribution.channel, trajectory.channel
    if named is not None and named != own:
        if attribution.key_channel is not None:
            raise PermissionDeniedError(
                f"this API key is bound to channel {attribution.key_channel!r}; trajectory "
                f"{attribution.trajectory_id!r} is in channel {own!r}"
            )
        raise PermissionDeniedError(
            f"X-Trajgate-Channel names channel {named!r}; trajectory "
            f"{attribution.trajectory_id!r} is in channel {own!r} (a trajectory's channel is "
            "set when it is created)",
            code="channel_mismatch",
        )
    return replace(attribution, channel=own)


async def pool_lookup(
    state: GatewayState, lookup: Callable[..., T | None], *args: Any, needed: bool = False
) -> T | None:
    """Run a read of the pool before the call goes upstream.

    For a read the call only benefits from (idempotent replay, re-send detection), 'serve' mode
    goes on without it when the database fails it (the call will not be recorded either), and
    'refuse' mode raises ``PoolUnavailableError`` (503) with the fault's reason. A read the call
    is ``needed`` for (an earlier response it continues) raises in both modes.
    """
    try:
        # asyncio's own executor, not anyio's thread runner (``run_in_threadpool``): its
        # capacity limiter and cancel scopes cost more CPU than a SQLite lookup (py-spy, c=16).
        # The lookup is read-only, so a call cancelled meanwhile leaves nothing to undo.
        return await asyncio.get_running_loop().run_in_executor(None, partial(lookup, *args))
    except SQLAlchemyError as exc:
        if not is_storage_fault(exc):
            raise
        assert state.writer is not None, "the lifespan starts the pool writer"
        error = state.writer.report_fault(exc, f"lookup {lookup.__name__}")
        if state.store.settings.on_write_failure == "serve" and not needed:
            return None
        state.writer.stats.refused_calls += 1
        raise error from exc
