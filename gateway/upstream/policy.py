"""The policy version registry: which weights serve the agents now, and which produced a step.

Owns: the mapping from what an agent asks for (a model name, or the alias ``policy``) to the
upstream model name (base model or LoRA adapter) and the policy version to stamp on the step.
A switch is one reference assignment, so a request resolves against exactly one version: calls
in flight finish on the version they started with and say so (``x-trajgate-policy-version``).
Several gateway processes converge by re-reading the active row (``refresh``).
Never: loads weights; the trainer bridge pushes them into vLLM and then registers them here.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from datapool import policy_versions
from datapool.db import Sessions
from datapool.models import PolicyVersion
from gateway.errors import InvalidRequestError, NotFoundError


@dataclass(frozen=True)
class ActivePolicy:
    """The version stamped on steps and the upstream model name the alias resolves to."""

    version: int
    model_name: str | None


@dataclass(frozen=True)
class Resolution:
    upstream_model: Any
    policy_version: int


def serving_versions(rows: list[PolicyVersion]) -> dict[str, int]:
    """The version each registered model name serves: for a name several versions share (full
    weights reloaded in place under one name), the active one, else the one activated last,
    else (none ever activated) the highest; for a LoRA adapter, its one version."""

    def rank(row: PolicyVersion) -> tuple[bool, bool, datetime, int]:
        activated = row.activated_at or datetime.min.replace(tzinfo=UTC)
        return (row.active, row.activated_at is not None, activated, row.version)

    serving: dict[str, PolicyVersion] = {}
    for row in rows:
        current = serving.get(row.model_name)
        if current is None or rank(row) > rank(current):
            serving[row.model_name] = row
    return {name: row.version for name, row in serving.items()}


class PolicyRegistry:
    """In-memory view of ``policy_versions`` with atomic switches."""

    def __init__(self, sessions: Sessions, *, alias: str, default_version: int) -> None:
        self._sessions = sessions
        self.alias = alias
        self._default = ActivePolicy(default_version, None)
        self.active = self._default
        self._version_by_model: dict[str, int] = {}

    def refresh(self) -> None:
        """Re-read the registry from the database (start-up, and periodically)."""
        rows = policy_versions.list_versions(self._sessions)
        self._version_by_model = serving_versions(rows)
        active = [row for row in rows if row.active]
        self.active = (
            ActivePolicy(active[-1].version, active[-1].model_name) if active else self._default
        )

    def resolve(self, requested_model: Any) -> Resolution:
        """Map the request's ``model`` to what goes upstream and the version to stamp.

        The alias: the active version. A registered model name: the version serving under that
        name (``serving_versions``). Anything else: passed through, stamped with the active
        version.

        Raises:
            InvalidRequestError: the alias was asked for but no policy version is active.
        """
        active = self.active  # one read: the whole call uses this snapshot
        if requested_model == self.alias:
            if active.model_name is None:
                raise InvalidRequestError(
                    f"model {self.alias!r} is the current policy, but no policy version is "
                    "active; register one with POST /admin/policy-versions",
                    param="model",
                )
            return Resolution(active.model_name, active.version)
        if isinstance(requested_model, str) and requested_model in self._version_by_model:
            return Resolution(requested_model, self._version_by_model[requested_model])
        return Resolution(requested_model, active.version)

    def register(
        self, version: int, model_name: str, weights_location: str | None, activate: bool
    ) -> tuple[PolicyVersion, bool]:
        """Add a version (idempotent for identical fields); optionally make it active.

        Returns:
            (the stored row, True when this call inserted it).

        Raises:
            VersionConflictError: the version exists with another model name or weights
                location (409; ``datapool.policy_versions.register``).
        """
        row, created = policy_versions.register(
            self._sessions, version, model_name, weights_location
        )
        if activate:
            return self.activate(version), created
        self.refresh()
        return row, created

    def unregister_unused(self, version: int) -> None:
        """Give back a version this gateway claimed for a publish that failed (kept if it was
        ever activated)."""
        policy_versions.unregister_unused(self._sessions, version)
        self.refresh()

    def activate(self, version: int) -> PolicyVersion:
        """Make ``version`` the one the alias serves; every other version becomes inactive.

        Raises:
            NotFoundError: no such version.
        """
        row = policy_versions.activate(self._sessions, version)
        if row is None:
            raise NotFoundError(f"policy version {version} is not registered", param="version")
        self.refresh()
        return row

    def list(self) -> list[PolicyVersion]:
        return policy_versions.list_versions(self._sessions)
