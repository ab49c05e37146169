"""Releasing LoRA adapters: ``POST /admin/adapter-releases`` unloads a run's adapters from every
replica, so the trainer's last exchange with the engine goes through the gateway as its
publishes do (``trainer_bridge.sync.WeightSync.release_adapters``).

Owns: which adapters a release selects (those the replicas list whose name starts with
``adapter_prefix``), the refusal of the active policy's adapter (409 ``lora_adapter_active``
unless ``include_active``), and what the answer says was released, per replica. The list and
the unloads are the engine room's (``gateway.engine.admin``: ``listed_adapters``,
``unload_adapters``).

Why: vLLM reloads an evicted adapter from its directory, and one whose directory is gone kills
the engine when it is asked for again; a run that deletes its adapter directories must first
unload them. The active adapter is what the alias serves: unloaded, every call for the alias
fails in vLLM until the next publish, so that takes ``include_active`` (the end of a run).

A release runs between this process's weight updates (``WeightGate.exclusive``, as a LoRA
publish does): it never unloads an adapter an update in flight is loading, nor reads the active
version before that update activated its own. An update through another gateway process is not
ordered with it (as a LoRA publish is not).

Never: loads adapters or registers, activates or forgets policy versions (``gateway.api.admin``);
the versions stay registered, and a call naming a released adapter fails in vLLM.
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from gateway.api.bodies import PoolRoute, StrictBody
from gateway.api.dependencies import AdminDep
from gateway.engine.admin import listed_adapters, unload_adapters
from gateway.errors import ConflictError, UpstreamError

router = APIRouter(prefix="/admin", tags=["admin"], route_class=PoolRoute)


class AdapterReleaseCreate(StrictBody):
    adapter_prefix: str = Field(
        min_length=1,
        max_length=200,
        description="Release every adapter the replicas list whose name starts with this "
        "(a run's adapters are <adapter_prefix>-v<version>: send 'run7-v' so that run7's "
        "release leaves run70's adapters loaded).",
    )
    include_active: bool = Field(
        default=False,
        description="Also release the adapter of the active policy version (the alias then "
        "fails in vLLM until the next publish); false: such a release is refused (409).",
    )


class AdapterReleasePublic(BaseModel):
    adapter_prefix: str
    released: dict[str, list[str]] = Field(
        description="Per replica (its URL), the selected adapters it no longer serves: "
        "unloaded now, or already gone (vLLM's 404)."
    )


@router.post("/adapter-releases")
async def release_adapters(body: AdapterReleaseCreate, state: AdminDep) -> AdapterReleasePublic:
    """Unload from every replica the adapters any replica lists whose name starts with
    ``adapter_prefix``; 200 with what each replica released (none selected: empty lists).

    409 ``lora_adapter_active`` when the active policy version's model is one of them and
    ``include_active`` is false (nothing released). 502 ``lora_release_failed`` when no replica
    answered its model list (nothing released), or when a replica failed an unload (each other
    unload is still tried; the message names each replica and adapter that failed, and what was
    released). Each list and unload ends within ``weight_update_exchange_timeout_s``.
    """
    urls = [replica.url for replica in state.upstreams.replicas]
    timeout_s = state.settings.weight_update_exchange_timeout_s
    async with state.upstreams.gate.exclusive():  # never across a weight update's load
        listed = await listed_adapters(state.client, urls, timeout_s)
        if not listed:
            raise UpstreamError(
                f"no replica of {urls} answered its model list: the adapters starting with "
                f"{body.adapter_prefix!r} are unknown, nothing was released; release again",
                code="lora_release_failed",
            )
        served = {name for names in listed.values() for name in names}
        selected = sorted(name for name in served if name.startswith(body.adapter_prefix))
        # The database's active row, not this process's copy: another process may have switched.
        active = [row for row in await run_in_threadpool(state.policy.list) if row.active]
        serving = [(row.version, row.model_name) for row in active if row.model_name in selected]
        if serving and not body.include_active:
            version, name = serving[0]
            raise ConflictError(
                f"adapter {name} serves the active policy version {version}: releasing it would "
                "fail every call for the alias; send include_active: true to release it anyway "
                "(the end of a run), or publish or activate another version first; nothing "
                "was released",
                code="lora_adapter_active",
            )
        released: dict[str, list[str]] = {}
        failed: list[str] = []
        for url in urls:  # every replica: one that answered no list may still serve them
            unloads = await unload_adapters(state.client, url, selected, timeout_s)
            released[url] = unloads.unloaded
            failed += [
                f"replica {url}, adapter {name}: {why}" for name, why in unloads.failed.items()
            ]
    if failed:
        raise UpstreamError(
            f"a replica failed an unload ({'; '.join(failed)}); released so far, per replica: "
            f"{released}; the adapters that failed may still be loaded: release again",
            code="lora_release_failed",
        )
    return AdapterReleasePublic(adapter_prefix=body.adapter_prefix, released=released)
