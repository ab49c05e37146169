"""Completion hooks: the reward functions, then the curation rules, of every completed trajectory.

Owns: running each complete trajectory's hooks once (``PoolSettings.reward_functions`` through
``rewards.run_reward_functions``, then ``PoolSettings.step_reward_functions`` once per ok step
through ``rewards.step_rewards.run_step_reward_functions``, then
``curation.apply_on_completion``), whichever way it
completed (``POST /api/trajectories/{id}/complete``, the idle timeout in the writer's upkeep, or
a direct ``lifecycle.close_trajectory``), in whichever gateway process, surviving crashes; and
the counters that say how that went (``HookStats``). Never: decides that a trajectory is
complete (``datapool.lifecycle.transitions`` does, in the closing transaction) or computes a reward
itself.

The work list is the database, not the process: ``trajectories.hooks_due_at``.

- ``lifecycle`` sets it to the completion time in the transaction that completes the trajectory,
  so no completion path can forget its hooks and a crash right after completing loses nothing.
- A runner *claims* a due trajectory (``hooks_due_at <= now``) with one conditional UPDATE that
  moves ``hooks_due_at`` to ``now + completion_hooks_lease_s`` only if it is still due. Two
  runners (or two gateway processes on one PostgreSQL) racing for a row: the first UPDATE wins;
  the second re-checks the condition on the updated row (PostgreSQL re-evaluates it after the row
  lock; SQLite serialises writers) and claims nothing.
- After the reward functions and curation rules ran, the runner sets it to NULL, only if it still
  holds its own lease (``hooks_due_at`` equals the value it wrote).
- A runner that dies mid-run leaves its lease in place; once the lease passes, the trajectory is
  due again and any runner repeats the hooks. A hook that raises (the database failed; reward
  function errors are not that: they are recorded as failed rewards) also keeps its lease, so a
  failing trajectory is retried once per lease, never in a tight loop. A runner cancelled on a
  clean stop hands its claims back (due now).

Delivery is therefore at least once, exactly once when no runner dies or overruns its lease.
A repeat appends the reward records again (append-only; the current value is the latest) and
replaces the curation marks (derived). Deliberately different from the design brief: the claim
compares ``hooks_due_at <= now`` instead of ``hooks_due_at = <value read>``; both are atomic under
the row lock, and the range form also claims rows queued by hand with SQL (whose timestamp text
SQLAlchemy may not reproduce byte for byte on SQLite).

Abandoned and failed trajectories get no hooks (as before this module); nor do trajectories
completed before migration 0006 (docs/datapool.md shows how to queue them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from datapool.curation import rules as curation
from datapool.models import Trajectory, utc_now
from datapool.rewards import step_rewards
from datapool.rewards import values as rewards
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore

log = logging.getLogger("trajgate.pool.hooks")

# What one attempt did: ran the hooks, found them taken by another runner, failed after claiming
# (retried once the lease passes), or failed to claim (the claim's transaction raised).
HookOutcome = Literal["ran", "taken", "failed", "unclaimed"]


@dataclass
class HookStats:
    """Counters of one runner (one gateway process) since it started."""

    runs: int = 0  # trajectories whose hooks ran to the end (rewards, then curation)
    failures: int = 0  # runs or claims that raised; retried once their lease passes
    lost_claims: int = 0  # due trajectories another runner claimed first
    overrun_leases: int = 0  # runs that outlasted their lease and found it taken over (repeated)
    # Reward function runs by (configured name, "ok" | "failed"); failed ones are recorded as
    # failed rewards, so without this counter nothing alerts on a broken reward model.
    reward_function_runs: dict[tuple[str, str], int] = field(default_factory=dict)
    last_error: str | None = None

    def count_reward_function(self, name: str, succeeded: bool) -> None:
        key = (name, "ok" if succeeded else "failed")
        self.reward_function_runs[key] = self.reward_function_runs.get(key, 0) + 1


def due_trajectories(
    sessions: sessionmaker[Session], limit: int, now: datetime | None = None
) -> list[str]:
    """Ids of up to ``limit`` trajectories whose hooks are due at ``now``, longest-waiting first."""
    with sessions() as session:
        return list(
            session.scalars(
                select(Trajectory.id)
                .where(Trajectory.hooks_due_at <= (now or utc_now()))
                .order_by(Trajectory.hooks_due_at, Trajectory.id)
                .limit(limit)
            )
        )


def claim(sessions: sessionmaker[Session], trajectory_id: str, lease_s: float) -> datetime | None:
    """Claim a due trajectory's hooks for ``lease_s`` seconds; returns the lease's end (the claim
    token ``settle`` needs), or None when it is not due (another runner holds it, or it ran)."""
    now = utc_now()
    lease_until = now + timedelta(seconds=lease_s)
    with sessions.begin() as session:
        claimed = session.execute(
            update(Trajectory)
            .where(Trajectory.id == trajectory_id, Trajectory.hooks_due_at <= now)
            .values(hooks_due_at=lease_until)
            .returning(Trajectory.id)
            .execution_options(synchronize_session=False)
        ).all()
    return lease_until if claimed else None


def settle(
    sessions: sessionmaker[Session],
    trajectory_id: str,
    lease_until: datetime,
    due_at: datetime | None,
) -> bool:
    """Set ``hooks_due_at`` to ``due_at`` (None: done; a time: hand back) if the lease ending at
    ``lease_until`` is still the trajectory's; False when another runner has taken it over."""
    with sessions.begin() as session:
        settled = session.execute(
            update(Trajectory)
            .where(Trajectory.id == trajectory_id, Trajectory.hooks_due_at == lease_until)
            .values(hooks_due_at=due_at)
            .returning(Trajectory.id)
            .execution_options(synchronize_session=False)
        ).all()
    return bool(settled)


class CompletionHooks:
    """Runs due completion hooks of the pool: woken by ``wake()`` or every
    ``completion_hooks_interval_s``, up to ``completion_hooks_concurrency`` trajectories at once.
    """

    def __init__(self, store: PoolStore, settings: PoolSettings | None = None) -> None:
        self.store = store
        self.settings = settings or store.settings
        self.stats = HookStats()
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Check for due hooks now (call it from the event loop the runner runs on)."""
        self._wake.set()

    async def run_forever(self) -> None:
        """Run due hooks, then sleep until woken or the interval passes; until cancelled."""
        while True:
            self._wake.clear()
            try:
                await self.run_due()
            except Exception as exc:  # the database is down: say why, try again next round
                self.stats.last_error = repr(exc)
                log.error("completion hooks round failed: %r", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.completion_hooks_interval_s)

    async def run_due(self) -> int:
        """Claim and run due hooks until none is due; returns how many runs finished here."""
        finished = 0
        while True:
            due = await asyncio.to_thread(
                due_trajectories, self.store.sessions, self.settings.completion_hooks_concurrency
            )
            if not due:
                return finished
            outcomes = await asyncio.gather(*(self.run_one(t) for t in due))
            finished += outcomes.count("ran")
            # Every outcome but a failed claim takes the row out of the due set (leased or
            # done); a round of only failed claims would find the same rows again at once.
            if all(outcome == "unclaimed" for outcome in outcomes):
                return finished

    async def run_one(self, trajectory_id: str) -> HookOutcome:
        """Claim one trajectory's hooks and run them (see ``HookOutcome``)."""
        lease_s = self.settings.completion_hooks_lease_s
        # The claim commits in its thread even when this task is cancelled while it waits, so
        # a stop then must wait for it and hand a claim it got back (else it stays leased).
        claiming = asyncio.ensure_future(
            asyncio.to_thread(claim, self.store.sessions, trajectory_id, lease_s)
        )
        try:
            lease_until = await asyncio.shield(claiming)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                claimed = await claiming
                if claimed is not None:
                    await asyncio.to_thread(
                        settle, self.store.sessions, trajectory_id, claimed, utc_now()
                    )
            raise
        except Exception as exc:
            self._failed(trajectory_id, exc)
            return "unclaimed"
        if lease_until is None:
            self.stats.lost_claims += 1
            return "taken"
        try:
            if self.settings.reward_functions:
                await rewards.run_reward_functions(
                    self.store,
                    trajectory_id,
                    self.settings.reward_functions,
                    on_outcome=self.stats.count_reward_function,
                )
            if self.settings.step_reward_functions:
                await step_rewards.run_step_reward_functions(
                    self.store,
                    trajectory_id,
                    self.settings.step_reward_functions,
                    on_outcome=self.stats.count_reward_function,
                )
            # After the reward functions: rules such as reward_threshold read their rewards.
            await asyncio.to_thread(curation.apply_on_completion, self.store, trajectory_id)
        except asyncio.CancelledError:  # a clean stop: hand the claim back, due now
            await asyncio.to_thread(
                settle, self.store.sessions, trajectory_id, lease_until, utc_now()
            )
            raise
        except Exception as exc:  # keeps the lease: retried once it passes
            self._failed(trajectory_id, exc)
            return "failed"
        if await asyncio.to_thread(settle, self.store.sessions, trajectory_id, lease_until, None):
            self.stats.runs += 1
        else:
            self.stats.overrun_leases += 1
            log.warning(
                "completion hooks of %s outlasted their %.0f s lease; another runner may repeat "
                "them (raise completion_hooks_lease_s)",
                trajectory_id,
                lease_s,
            )
        return "ran"

    def _failed(self, trajectory_id: str, exc: Exception) -> None:
        self.stats.failures += 1
        self.stats.last_error = repr(exc)
        log.error("completion hooks of %s failed: %r", trajectory_id, exc)
