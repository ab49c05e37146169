"""Curation: rules declared in the pool and the marks they leave.

Owns: curation rules (create / list / delete / apply), their *marks* (which rule matched which
step, trajectory or group, with a reason), and applying every enabled rule to a trajectory when
it completes. Readiness, which reads the marks, is ``datapool.curation.readiness``. Never: deletes
or
changes data; a rule only marks, and marks are derived (re-applying a rule replaces its marks
in the scope it ran on).

Rule kinds (``params`` in brackets; ``target`` = ``step`` (default) or ``trajectory`` where
step-level kinds accept it):

- ``integrity`` [flags, target]: steps with an integrity flag (default ``ids_missing``,
  ``ids_incomplete``, ``prompt_ids_missing``, ``aborted``, ``raw_logprobs``,
  ``policy_version_split_unknown``), an outcome other than ``ok``
  (upstream errors, timeouts, client disconnects) or ``finish_reason == "abort"``.
- ``prefix_break`` []: trajectories with a prefix break (batches split at breaks anyway; this
  rule drops such trajectories entirely).
- ``truncated`` [target]: steps flagged ``truncated`` or with ``finish_reason == "length"``.
- ``empty`` []: trajectories flagged ``empty`` or closed without a step (C15).
- ``degenerate_group`` [reward_name="final", eps=1e-6, success_reward=1.0, fail_reward=0.0]:
  groups whose rewarded members' reward std is below ``eps`` (or that have fewer than two
  rewarded members), with all-success / all-fail reported (C17).
- ``stale`` [max_versions_behind, current_version?, target]: steps more than K policy versions
  behind the active version (the active row of ``policy_versions``; else the newest step's).
- ``length`` [max_prompt_tokens, max_response_tokens, max_total_tokens, max_steps, target]
- ``duplicate_prompt`` []: a trajectory whose first call has the same request hash as an older
  trajectory's first call in another group (members of one group share a prompt on purpose).
- ``reward_threshold`` [name="final", min?, max?]: trajectories whose current reward is outside
  [min, max] (unrewarded ones are not matched; readiness keeps them out anyway).
- ``predicate`` [function="pkg.mod:fn"]: ``fn(RewardContext)`` returns truthy to match (a string
  is the reason). The function must import and accept one positional argument when the rule is
  declared; a predicate that raises makes the whole rule fail (below), it matches nothing.

Params are typed per kind (``datapool.curation.rule_params``: unknown names, loose types and
out-of-bounds values are refused with ``InvalidPoolRequestError`` naming ``params.<field>``), on
create and again each time a rule is applied. A rule that fails when applied (stored params
that no longer validate, e.g. declared before the typed check; a predicate that is gone or
raises) keeps the marks of its last good run, stores its ``error`` and is skipped; the other
rules run. Completion hooks and ``/api/curation/apply`` report it; a batch that re-applies the
rules is refused (``CurationRuleFailedError``, 409) until the rule is deleted: one broken rule
never excludes everything, nor lets through silently what it was meant to keep out.

A rule's action is ``exclude`` (readiness keeps the target out, unless a human ``include`` label
on the same target overrides it) or ``flag`` (the mark is only shown in readiness ``notes``).

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np
from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session, sessionmaker

from datapool.curation.rule_params import (
    PredicateParams,
    RuleParams,
    parse_params,
)
from datapool.db import chunks
from datapool.errors import CurationRuleFailedError, InvalidPoolRequestError, UnknownTargetError
from datapool.models import (
    EMPTY,
    CurationMark,
    CurationRule,
    PolicyVersion,
    Step,
    Trajectory,
    TrajectoryStatus,
    utc_now,
)
from datapool.rewards.group_stats import group_stats
from datapool.rewards.values import RewardContext, current_rewards
from datapool.steps.store import PoolStore

RuleKind = Literal[
    "integrity",
    "prefix_break",
    "truncated",
    "empty",
    "degenerate_group",
    "stale",
    "length",
    "duplicate_prompt",
    "reward_threshold",
    "predicate",
]
RULE_KINDS: tuple[str, ...] = get_args(RuleKind)
RuleAction = Literal["exclude", "flag"]
RULE_ACTIONS: tuple[str, ...] = get_args(RuleAction)
INTEGRITY_FLAGS: tuple[str, ...] = (
    "ids_missing",
    "ids_incomplete",
    "prompt_ids_missing",
    "aborted",
    # The engine gave a choice no finish reason (a stream cut off): a possible prefix of the sample.
    "unfinished",
    # Behaviour logprobs not of the distribution that sampled (gateway.proxy.sampling; invariant 9).
    "raw_logprobs",
    # Sampled across a full-weight reload where the gateway could not tell which tokens each
    # version sampled (a unary call; gateway.upstream.weight_update).
    "policy_version_split_unknown",
)
# The signature a predicate is called with: one positional argument, a RewardContext.
_PREDICATE_PROBE = object()


@dataclass(frozen=True)
class Match:
    """A rule matched ``target_kind``/``target_id`` (in ``trajectory_id``) because ``reason``."""

    target_kind: str
    target_id: str
    trajectory_id: str | None
    reason: str


@dataclass
class RuleResult:
    """What applying one rule did: its matches in the scope, and group counts (degenerate)."""

    rule_id: int
    name: str
    matched: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    error: str | None = None  # the rule failed: its marks were left as they were


class _RuleFailed(Exception):
    """A rule that cannot be evaluated (stored params no longer valid, predicate missing or
    raising); caught per rule in ``apply_rules``."""


# ---- rules ---------------------------------------------------------------------------------


def check_rule(
    kind: str, action: str, params: dict[str, Any], allowed_modules: Sequence[str] = ()
) -> RuleParams:
    """``params`` as ``kind``'s typed model (``datapool.curation.rule_params``); a predicate's
    function must be in ``allowed_modules`` (``PoolSettings.curation_predicate_modules``),
    import and accept one positional argument.

    Raises ``InvalidPoolRequestError`` for an unknown kind/action or unknown/bad params.
    """
    if action not in RULE_ACTIONS:
        raise InvalidPoolRequestError(
            f"action must be one of {RULE_ACTIONS}, got {action!r}", param="action"
        )
    typed = parse_params(kind, params)
    if isinstance(typed, PredicateParams):
        resolve_predicate(typed.function, allowed_modules)
    return typed


def predicate_allowed(module_name: str, allowed_modules: Sequence[str]) -> bool:
    """Whether ``module_name`` is one of ``allowed_modules`` (``pkg.mod``) or under one of its
    ``pkg.*`` entries."""
    for allowed in allowed_modules:
        if allowed.endswith(".*"):
            if module_name.startswith(allowed[:-1]):
                return True
        elif module_name == allowed:
            return True
    return False


def resolve_predicate(
    name: str, allowed_modules: Sequence[str] = ()
) -> Callable[[RewardContext], Any]:
    """Import ``pkg.mod:fn`` when its module is allowed (``predicate_allowed``); raises
    ``InvalidPoolRequestError`` (param ``params.function``) when it is not, when the import
    finds no callable, or one that cannot be called as ``fn(context)``. Nothing is imported
    from a module that is not allowed."""
    module_name, _, attribute = name.partition(":")
    if not predicate_allowed(module_name, allowed_modules):
        raise InvalidPoolRequestError(
            f"predicate {name!r}: module {module_name!r} is not in "
            f"TRAJGATE_CURATION_PREDICATE_MODULES ({list(allowed_modules)}); a predicate rule "
            "runs code on the gateway, so its modules are named by the operator, not the caller",
            param="params.function",
        )
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as exc:
        raise InvalidPoolRequestError(
            f"predicate {name!r} cannot be imported (expected 'pkg.mod:fn'): {exc}",
            param="params.function",
        ) from exc
    if not callable(target):
        raise InvalidPoolRequestError(
            f"predicate {name!r} is not callable (got {type(target).__name__})",
            param="params.function",
        )
    try:
        inspect.signature(target).bind(_PREDICATE_PROBE)
    except TypeError as exc:
        raise InvalidPoolRequestError(
            f"predicate {name!r} cannot be called as fn(context): {exc}",
            param="params.function",
        ) from exc
    except ValueError:
        pass  # no signature to inspect (some builtins): a call failure shows at apply time
    fn: Callable[[RewardContext], Any] = target
    return fn


def create_rule(
    store: PoolStore,
    name: str,
    kind: str,
    *,
    action: str = "exclude",
    params: dict[str, Any] | None = None,
    author: str | None = None,
    apply_now: bool = True,
) -> tuple[CurationRule, RuleResult | None]:
    """Declare a rule (names are unique) and, by default, apply it to the whole pool.

    Raises ``InvalidPoolRequestError`` for bad params, a taken name, or (``apply_now``) a rule
    that fails on the pool as it is (a predicate that raises): then nothing is stored.
    """
    params = dict(params or {})
    check_rule(kind, action, params, store.settings.curation_predicate_modules)
    with store.sessions.begin() as session:
        if session.scalar(select(CurationRule.id).where(CurationRule.name == name)) is not None:
            raise InvalidPoolRequestError(f"a rule named {name!r} exists already", param="name")
        rule = CurationRule(
            name=name,
            kind=kind,
            action=action,
            params=params,
            enabled=True,
            author=author,
            created_at=utc_now(),
        )
        session.add(rule)
        session.flush()
    if not apply_now:
        return rule, None
    [result] = apply_rules(store, rule_ids=[rule.id], on_failure="report")
    if result.error is not None:
        delete_rule(store.sessions, rule.id)
        raise InvalidPoolRequestError(
            f"rule {name!r} was not stored: it fails on the pool: {result.error}", param="params"
        )
    with store.sessions() as session:
        stored = session.get(CurationRule, rule.id)
        assert stored is not None  # created above
    return stored, result


def list_rules(sessions: sessionmaker[Session]) -> list[CurationRule]:
    with sessions() as session:
        return list(session.scalars(select(CurationRule).order_by(CurationRule.id)))


def delete_rule(sessions: sessionmaker[Session], rule_id: int) -> None:
    """Delete a rule and its marks (what it excluded becomes eligible again)."""
    with sessions.begin() as session:
        rule = session.get(CurationRule, rule_id)
        if rule is None:
            raise UnknownTargetError(f"no curation rule {rule_id}", param="rule_id")
        session.execute(delete(CurationMark).where(CurationMark.rule_id == rule_id))
        session.delete(rule)


def apply_rules(
    store: PoolStore,
    *,
    rule_ids: Sequence[int] | None = None,
    trajectory_ids: Sequence[str] | None = None,
    on_failure: Literal["raise", "report"] = "raise",
) -> list[RuleResult]:
    """Apply rules (default: every enabled one) to ``trajectory_ids`` (default: the whole pool).

    Each rule's marks inside the scope are replaced by its new matches in one transaction per
    rule; group rules run on the groups of the scope's trajectories.

    A rule that fails (its stored params no longer validate, its predicate does not import or
    raises on a trajectory) is skipped: its marks are left as they were (what it excluded stays
    excluded, nothing new is excluded), its ``error`` and ``failed_at`` are stored and its
    result carries the ``error``; the other rules still run. Then ``on_failure="raise"`` raises
    ``CurationRuleFailedError`` naming the failed rules (a batch is not formed while a rule
    cannot say what it excludes); ``"report"`` returns the results. Raises
    ``UnknownTargetError`` for a ``rule_ids`` entry that names no rule.
    """
    if on_failure not in ("raise", "report"):
        raise ValueError(f"on_failure must be one of ('raise', 'report'), got {on_failure!r}")
    with store.sessions() as session:
        query = select(CurationRule).order_by(CurationRule.id)
        if rule_ids is not None:
            query = query.where(CurationRule.id.in_(rule_ids))
        else:
            query = query.where(CurationRule.enabled.is_(True))
        rules = list(session.scalars(query))
        missing = set(rule_ids or []) - {r.id for r in rules}
        if missing:
            raise UnknownTargetError(f"no curation rule(s) {sorted(missing)}", param="rule_ids")
    results = []
    for rule in rules:
        result = RuleResult(rule.id, rule.name)
        try:
            matches = _evaluate(store, rule, trajectory_ids, result)
        except _RuleFailed as exc:
            result.error = str(exc)
            with store.sessions.begin() as session:
                stored = session.get(CurationRule, rule.id)
                if stored is not None:
                    stored.error, stored.failed_at = result.error, utc_now()
            results.append(result)
            continue
        with store.sessions.begin() as session:
            _replace_marks(session, rule, trajectory_ids, matches)
            stored = session.get(CurationRule, rule.id)
            if stored is not None:
                stored.applied_at, stored.error, stored.failed_at = utc_now(), None, None
        result.matched = len(matches)
        results.append(result)
    failed = [r for r in results if r.error is not None]
    if failed and on_failure == "raise":
        raise CurationRuleFailedError(
            "curation rule(s) failed, so what they exclude is unknown: "
            + "; ".join(f"rule {r.name!r} (id {r.rule_id}): {r.error}" for r in failed)
            + ". Delete each failed rule and declare it again with valid params, or form the "
            "batch with apply_rules=false (the marks of its last good run stay)",
            param="rules",
        )
    return results


def apply_on_completion(store: PoolStore, trajectory_id: str) -> None:
    """Hook run after a trajectory completes (after its reward functions): every enabled rule.

    A failed rule does not fail the hook: its error is stored on the rule (``apply_rules``).
    """
    apply_rules(store, trajectory_ids=[trajectory_id], on_failure="report")


def _scope_groups(session: Session, trajectory_ids: Sequence[str]) -> list[str]:
    groups: set[str] = set()
    for chunk in chunks(list(trajectory_ids)):
        groups |= {
            g
            for g in session.scalars(select(Trajectory.group_id).where(Trajectory.id.in_(chunk)))
            if g is not None
        }
    return sorted(groups)


def _replace_marks(
    session: Session,
    rule: CurationRule,
    trajectory_ids: Sequence[str] | None,
    matches: Sequence[Match],
) -> None:
    base = delete(CurationMark).where(CurationMark.rule_id == rule.id)
    if trajectory_ids is None:
        session.execute(base)
    elif rule.kind == "degenerate_group":
        for chunk in chunks(_scope_groups(session, trajectory_ids)):
            session.execute(
                base.where(CurationMark.target_kind == "group", CurationMark.target_id.in_(chunk))
            )
    else:
        for chunk in chunks(list(trajectory_ids)):
            session.execute(base.where(CurationMark.trajectory_id.in_(chunk)))
    if matches:
        now = utc_now()
        session.execute(
            insert(CurationMark),
            [
                {
                    "rule_id": rule.id,
                    "target_kind": m.target_kind,
                    "target_id": m.target_id,
                    "trajectory_id": m.trajectory_id,
                    "action": rule.action,
                    "reason": m.reason,
                    "created_at": now,
                }
                for m in matches
            ],
        )


# ---- evaluating rules ----------------------------------------------------------------------


def _steps_in(session: Session, trajectory_ids: Sequence[str] | None, *columns: Any) -> list[Any]:
    query = select(Step.id, Step.trajectory_id, *columns)
    if trajectory_ids is None:
        return list(session.execute(query))
    return [
        row
        for chunk in chunks(list(trajectory_ids))
        for row in session.execute(query.where(Step.trajectory_id.in_(chunk)))
    ]


def _trajectories_in(session: Session, trajectory_ids: Sequence[str] | None) -> list[Trajectory]:
    query = select(Trajectory)
    if trajectory_ids is None:
        return list(session.scalars(query))
    return [
        t
        for chunk in chunks(list(trajectory_ids))
        for t in session.scalars(query.where(Trajectory.id.in_(chunk)))
    ]


def _step_matches(
    rows: Sequence[Any], test: Callable[[Any], str | None], target: str
) -> list[Match]:
    """Rows ``(step_id, trajectory_id, ...)``; ``test`` gives a reason or None."""
    matches: list[Match] = []
    seen: set[str] = set()
    for row in rows:
        reason = test(row)
        if reason is None:
            continue
        if target == "step":
            matches.append(Match("step", row[0], row[1], reason))
        elif row[1] not in seen:
            seen.add(row[1])
            matches.append(Match("trajectory", row[1], row[1], f"step {row[0]}: {reason}"))
    return matches


def active_policy_version(session: Session) -> int | None:
    """The active registered policy version, else the newest version any step has."""
    active = session.scalar(
        select(PolicyVersion.version).where(PolicyVersion.active.is_(True)).limit(1)
    )
    if active is not None:
        return int(active)
    newest = session.scalar(select(func.max(Step.policy_version)))
    return None if newest is None else int(newest)


def _evaluate(
    store: PoolStore, rule: CurationRule, scope: Sequence[str] | None, result: RuleResult
) -> list[Match]:
    # Over 80 lines on purpose: one short branch per rule kind, each reading only the columns it
    # needs; a table of ten closures would read worse than the branches side by side.
    try:
        p = parse_params(rule.kind, rule.params or {}).model_dump(exclude_none=True)
    except InvalidPoolRequestError as exc:
        raise _RuleFailed(f"stored params no longer valid: {exc.message}") from exc
    target = str(p.get("target", "step"))
    with store.sessions() as session:
        if rule.kind == "integrity":
            flags = set(p.get("flags") or INTEGRITY_FLAGS)
            rows = _steps_in(session, scope, Step.flags, Step.outcome, Step.finish_reason)

            def integrity(row: Any) -> str | None:
                bad = sorted(flags & set(row[2] or []))
                if bad:
                    return f"integrity flag(s) {bad}"
                if row[3] != "ok":
                    return f"outcome {row[3]!r} (expected 'ok')"
                if row[4] == "abort":
                    return "finish_reason 'abort'"
                return None

            return _step_matches(rows, integrity, target)
        if rule.kind == "truncated":
            rows = _steps_in(session, scope, Step.flags, Step.finish_reason)
            return _step_matches(
                rows,
                lambda r: "truncated" if "truncated" in (r[2] or []) or r[3] == "length" else None,
                target,
            )
        if rule.kind == "prefix_break":
            rows = _steps_in(session, scope, Step.flags)
            return _step_matches(
                rows,
                lambda r: "prefix break" if "prefix_break" in (r[2] or []) else None,
                "trajectory",
            )
        if rule.kind == "stale":
            current = p.get("current_version")
            current = active_policy_version(session) if current is None else int(current)
            if current is None:
                return []
            k = int(p["max_versions_behind"])
            rows = _steps_in(session, scope, Step.policy_version)
            return _step_matches(
                rows,
                lambda r: (
                    f"policy version {r[2]} is more than {k} behind {current}"
                    if r[2] is not None and r[2] < current - k
                    else None
                ),
                target,
            )
        if rule.kind == "length":
            rows = _steps_in(session, scope, Step.prompt_tokens, Step.completion_tokens)
            matches = _step_matches(rows, lambda r: _too_long(p, r[2], r[3]), target)
            if p.get("max_steps") is not None:
                known = {m.trajectory_id for m in matches}
                for t in _trajectories_in(session, scope):
                    if t.call_count > int(p["max_steps"]) and t.id not in known:
                        matches.append(
                            Match(
                                "trajectory",
                                t.id,
                                t.id,
                                f"{t.call_count} calls > max_steps {p['max_steps']}",
                            )
                        )
            return matches
        if rule.kind == "empty":
            return [
                Match("trajectory", t.id, t.id, "empty: closed or rewarded without a step (C15)")
                for t in _trajectories_in(session, scope)
                if EMPTY in (t.flags or [])
                or (t.call_count == 0 and t.status != TrajectoryStatus.OPEN.value)
            ]
        if rule.kind == "reward_threshold":
            return _reward_threshold(session, p, scope)
        if rule.kind == "duplicate_prompt":
            return _duplicates(session, scope)
        if rule.kind == "degenerate_group":
            groups = None if scope is None else _scope_groups(session, scope)
            return _degenerate_groups(session, p, groups, result)
    if rule.kind == "predicate":
        return _predicate(store, p, scope)
    raise InvalidPoolRequestError(f"rule kind must be one of {RULE_KINDS}, got {rule.kind!r}")


def _too_long(p: dict[str, Any], prompt: int | None, response: int | None) -> str | None:
    limits = (
        ("max_prompt_tokens", prompt),
        ("max_response_tokens", response),
        ("max_total_tokens", (prompt or 0) + (response or 0)),
    )
    for name, value in limits:
        if p.get(name) is not None and value is not None and value > int(p[name]):
            return f"{value} tokens > {name} {p[name]}"
    return None


def _reward_threshold(
    session: Session, p: dict[str, Any], scope: Sequence[str] | None
) -> list[Match]:
    name = str(p.get("name", "final"))
    ids = [t.id for t in _trajectories_in(session, scope)]
    values = current_rewards(session, "trajectory", ids)
    low, high = p.get("min"), p.get("max")
    matches = []
    for trajectory_id in ids:
        value = values.get(trajectory_id, {}).get(name)
        if value is None:
            continue
        if low is not None and value < float(low):
            matches.append(
                Match("trajectory", trajectory_id, trajectory_id, f"{name} {value} < min {low}")
            )
        elif high is not None and value > float(high):
            matches.append(
                Match("trajectory", trajectory_id, trajectory_id, f"{name} {value} > max {high}")
            )
    return matches


def _duplicates(session: Session, scope: Sequence[str] | None) -> list[Match]:
    rows = session.execute(
        select(Step.trajectory_id, Step.request_hash, Trajectory.group_id)
        .join(Trajectory, Trajectory.id == Step.trajectory_id)
        .where(Step.step_index == 0, Step.choice_index == 0, Step.request_hash.is_not(None))
        .order_by(Trajectory.created_at, Trajectory.id)
    )
    first: dict[str, tuple[str, str | None]] = {}
    wanted = None if scope is None else set(scope)
    matches = []
    for trajectory_id, request_hash, group_id in rows:
        assert request_hash is not None  # filtered in SQL
        if request_hash not in first:
            first[request_hash] = (trajectory_id, group_id)
            continue
        original, original_group = first[request_hash]
        if group_id is not None and group_id == original_group:
            continue  # a group's members share their task on purpose
        if wanted is None or trajectory_id in wanted:
            matches.append(
                Match(
                    "trajectory", trajectory_id, trajectory_id, f"same first prompt as {original}"
                )
            )
    return matches


@dataclass(frozen=True)
class GroupVerdict:
    """A group's reward statistics over its rewarded members (C16, C17)."""

    members: int
    scored: int
    mean: float
    std: float
    degenerate: bool
    kind: str  # all_success / all_fail / mixed / constant / unscored


def judge_group(
    values: Sequence[float], eps: float, success_reward: float, fail_reward: float
) -> GroupVerdict:
    """Statistics of one group's member rewards ``values`` (NaN = unrewarded), via
    ``datapool.rewards.group_stats`` (unbiased std, degenerate when std < eps)."""
    rewards = np.array(list(values), dtype=np.float64)  # [G]
    stats = group_stats(rewards, np.zeros(len(values), dtype=np.int64), degenerate_eps=eps)
    scored = int(stats.scored_size[0]) if len(values) else 0
    mean = float(stats.mean[0]) if scored else math.nan
    std = float(stats.std[0]) if scored else math.nan
    degenerate = bool(stats.degenerate[0]) if scored else True
    rewarded = [v for v in values if not math.isnan(v)]
    if not rewarded:
        kind = "unscored"
    elif all(v >= success_reward for v in rewarded):
        kind = "all_success"
    elif all(v <= fail_reward for v in rewarded):
        kind = "all_fail"
    else:
        kind = "constant" if degenerate else "mixed"
    return GroupVerdict(len(values), scored, mean, std, degenerate, kind)


def _degenerate_groups(
    session: Session, p: dict[str, Any], groups: Sequence[str] | None, result: RuleResult
) -> list[Match]:
    name = str(p.get("reward_name", "final"))
    eps = float(p.get("eps", 1e-6))
    members: dict[str, list[str]] = defaultdict(list)
    query = select(Trajectory.group_id, Trajectory.id).where(Trajectory.group_id.is_not(None))
    if groups is not None:
        rows = [
            r
            for chunk in chunks(list(groups))
            for r in session.execute(query.where(Trajectory.group_id.in_(chunk)))
        ]
    else:
        rows = list(session.execute(query))
    for group_id, trajectory_id in rows:
        members[str(group_id)].append(trajectory_id)
    values = current_rewards(session, "trajectory", [t for ids in members.values() for t in ids])
    matches = []
    for group_id, ids in sorted(members.items()):
        verdict = judge_group(
            [values.get(t, {}).get(name, math.nan) for t in ids],
            eps,
            float(p.get("success_reward", 1.0)),
            float(p.get("fail_reward", 0.0)),
        )
        result.counts[verdict.kind] = result.counts.get(verdict.kind, 0) + 1
        if verdict.degenerate:
            matches.append(
                Match(
                    "group",
                    group_id,
                    None,
                    f"degenerate ({verdict.kind}): reward {name!r} std {verdict.std:.3g} < eps "
                    f"{eps:g} over {verdict.scored} rewarded of {verdict.members} members",
                )
            )
    return matches


def _predicate(store: PoolStore, p: dict[str, Any], scope: Sequence[str] | None) -> list[Match]:
    try:
        fn = resolve_predicate(str(p["function"]), store.settings.curation_predicate_modules)
    except InvalidPoolRequestError as exc:
        raise _RuleFailed(exc.message) from exc
    with store.sessions() as session:
        trajectories = _trajectories_in(session, scope)
    matches = []
    for t in trajectories:
        context = RewardContext(
            t.id, t.group_id, t.channel, dict(t.metadata_json or {}), store.steps_of(t.id)
        )
        try:
            verdict = fn(context)
        except Exception as exc:
            # The whole rule fails (apply_rules keeps its old marks and stores the error): a
            # broken predicate must neither exclude everything nor let anything through quietly.
            raise _RuleFailed(
                f"predicate {p['function']} raised on trajectory {t.id!r}: {exc!r}"
            ) from exc
        if verdict:
            reason = verdict if isinstance(verdict, str) else f"predicate {p['function']}"
            matches.append(Match("trajectory", t.id, t.id, reason))
    return matches
