"""The data pool's exception tree; the gateway maps each class to one HTTP status.

PoolError                          (500)
 ├── TrajectoryClosedError         409: a call arrived after its trajectory closed
 ├── UnknownTargetError            404: a reward or action names no stored step/trajectory
 ├── InvalidPoolRequestError       400: a value the pool cannot accept (says expected vs got)
 ├── VersionConflictError          409: a policy version is already registered with other
 │                                      fields (one version, one weight set)
 ├── CurationRuleFailedError       409: a curation rule cannot be evaluated (stored params no
 │                                      longer valid, its predicate raises), so a batch that
 │                                      re-applies the rules is not formed
 ├── PoolUnavailableError          503: the database cannot take writes now (disk full,
 │                                      locked past its timeout, unreachable)
 └── payload.PayloadMissingError   500 (code payload_missing): a step's stored payload or
                                        its Parquet file is gone (lost data, named)
"""

from __future__ import annotations


class PoolError(Exception):
    """Base of every error the pool raises on purpose."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class TrajectoryClosedError(PoolError):
    """A step for a trajectory that is complete, abandoned or failed (counted, never stored)."""

    def __init__(self, trajectory_id: str, status: str, *, refused: str = "this call") -> None:
        """``refused``: what was refused, as a noun phrase ("this call", "the final reward")."""
        super().__init__(
            f"refused {refused}: trajectory {trajectory_id!r} is already {status}; only an open "
            "trajectory accepts it",
            param="trajectory_id",
        )
        self.trajectory_id = trajectory_id
        self.status = status


class UnknownTargetError(PoolError):
    """A step or trajectory id that the pool does not hold."""


class InvalidPoolRequestError(PoolError):
    """A request the pool understood but cannot accept."""


class TrajectoryExistsError(PoolError):
    """A trajectory registered again under an id the pool already holds."""


class VersionConflictError(PoolError):
    """A policy version registered again with another model name or weights location."""


class CurationRuleFailedError(PoolError):
    """Curation rules that failed when applied (each named with its error; stored on it too)."""


class PoolUnavailableError(PoolError):
    """The database refused or failed a write; nothing was half-written.

    ``reason`` is a ``datapool.steps.faults.FaultReason`` (``disk_full``, ``locked``,
    ``unreachable``,
    ...); ``retry_after_s`` is when the gateway expects to try the database again.
    """

    def __init__(self, message: str, *, reason: str = "other", retry_after_s: float = 1.0):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s
