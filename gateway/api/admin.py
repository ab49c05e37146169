"""Management endpoints under ``/admin``: policy versions and agent API keys.

Owns: the HTTP surface of the policy registry and the key ring, behind the admin token.
Never: serves agents; OpenAI routes live in ``gateway.proxy``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from datapool.models import INTEGER_MAX
from gateway.api.bodies import PoolRoute
from gateway.auth import check_admin_token
from gateway.state import GatewayState


def _admin_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    check_admin_token(request, state.settings.admin_token)
    return state


AdminDep = Annotated[GatewayState, Depends(_admin_state)]
router = APIRouter(prefix="/admin", tags=["admin"], route_class=PoolRoute)


class PolicyVersionCreate(BaseModel):
    version: int = Field(
        ge=0, le=INTEGER_MAX, description="Integer id of the weights; bumps on each sync."
    )
    model_name: str = Field(
        min_length=1, description="Upstream model name serving it (base model or LoRA adapter)."
    )
    weights_location: str | None = Field(
        default=None, description="LoRA directory or checkpoint the weights were loaded from."
    )
    activate: bool = Field(default=True, description="Make it the version the alias serves.")


class PolicyVersionPublic(BaseModel):
    version: int
    model_name: str
    weights_location: str | None
    active: bool
    created_at: datetime
    activated_at: datetime | None


class ApiKeyCreate(BaseModel):
    name: str = Field(min_length=1, max_length=200)
    trajectory_id: str | None = Field(default=None, description="Bind the key to a trajectory.")
    channel: str | None = Field(default=None, description="Bind the key to a channel.")


class ApiKeyIssued(BaseModel):
    id: str
    name: str
    key: str = Field(description="Shown once; only its hash is stored.")


class ApiKeyPublic(BaseModel):
    id: str
    name: str
    trajectory_id: str | None
    channel: str | None
    created_at: datetime
    revoked_at: datetime | None


def _public(row: Any) -> PolicyVersionPublic:
    return PolicyVersionPublic.model_validate(row, from_attributes=True)


@router.get("/policy-versions")
async def list_policy_versions(state: AdminDep) -> list[PolicyVersionPublic]:
    return [_public(row) for row in await run_in_threadpool(state.policy.list)]


@router.post("/policy-versions", status_code=201)
async def register_policy_version(
    body: PolicyVersionCreate, state: AdminDep
) -> PolicyVersionPublic:
    """Register a version (and by default switch agents asking for the alias to it)."""
    row = await run_in_threadpool(
        state.policy.register, body.version, body.model_name, body.weights_location, body.activate
    )
    return _public(row)


@router.post("/policy-versions/{version}/activate")
async def activate_policy_version(
    version: Annotated[int, Path(ge=0, le=INTEGER_MAX)], state: AdminDep
) -> PolicyVersionPublic:
    return _public(await run_in_threadpool(state.policy.activate, version))


@router.post("/api-keys", status_code=201)
async def issue_api_key(body: ApiKeyCreate, state: AdminDep) -> ApiKeyIssued:
    key_id, key = await run_in_threadpool(
        state.keys.issue, body.name, body.trajectory_id, body.channel
    )
    return ApiKeyIssued(id=key_id, name=body.name, key=key)


@router.get("/api-keys")
async def list_api_keys(state: AdminDep) -> list[ApiKeyPublic]:
    rows = await run_in_threadpool(state.keys.list)
    return [ApiKeyPublic.model_validate(row, from_attributes=True) for row in rows]


@router.delete("/api-keys/{key_id}", status_code=204)
async def revoke_api_key(key_id: str, state: AdminDep) -> None:
    await run_in_threadpool(state.keys.revoke, key_id)
