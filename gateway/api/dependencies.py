"""The dependency aliases the ``/api`` routes (and the inspector's) declare to get the pool, and
the one the ``/admin`` routes declare to get the gateway behind its admin token.

Owns: ``StoreDep`` (the app's ``PoolStore``), ``WriterDep`` (its ``PoolWriter``, told what
the routes close), ``SessionsDep`` (its session factory, to hand to ``datapool`` functions),
``BatchSettingsDep`` and ``AdminDep`` (the ``GatewayState``, once the request's admin token
checked). Never: opens a session or runs a query; route functions pass what they get here to
``datapool`` functions.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from datapool.batches.settings import BatchSettings
from datapool.db import Sessions
from datapool.steps.store import PoolStore
from datapool.steps.writer import PoolWriter
from gateway.auth import check_admin_token
from gateway.state import GatewayState, StateDep


def admin_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    check_admin_token(request, state.settings.admin_token)
    return state


def pool_store(state: StateDep) -> PoolStore:
    return state.store


def pool_writer(state: StateDep) -> PoolWriter:
    assert state.writer is not None, "the lifespan starts the pool writer"
    return state.writer


def pool_sessions(state: StateDep) -> Sessions:
    # The one place the gateway touches the factory: it only passes it on to the data pool.
    return state.store.sessions


def batch_settings(request: Request) -> BatchSettings:
    settings = getattr(request.app.state, "batch_settings", None)
    if settings is None:  # read once per app, validated on first use
        settings = request.app.state.batch_settings = BatchSettings()
    return settings


StoreDep = Annotated[PoolStore, Depends(pool_store)]
WriterDep = Annotated[PoolWriter, Depends(pool_writer)]
SessionsDep = Annotated[Sessions, Depends(pool_sessions)]
BatchSettingsDep = Annotated[BatchSettings, Depends(batch_settings)]
AdminDep = Annotated[GatewayState, Depends(admin_state)]
