"""The engine's list of the models it serves now (``GET /v1/models``), read.

Owns: ``model_entries`` (one replica's list, each asked within one overall deadline),
``served_models`` (the union over replicas: which model names may be served),
``base_models_everywhere`` (the base models every answering replica serves: which names a
full-weight reload may replace), ``listed_ids`` (per replica: every id, its base models or
its LoRA adapters) and ``models_answer`` (the list as vLLM answered it, for the
gateway's own ``/v1/models``).
vLLM lists each model with ``id`` and ``root`` (the path it loaded the weights and tokenizer
from) and each loaded LoRA adapter with ``parent`` (its base model).
Never: decides what a listing means for a call (``gateway.api.admin``, ``gateway.tokenizer_dirs``,
``gateway.engine.admin.listed_adapters`` do).
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import httpx

from gateway.engine.errors import deadline
from gateway.engine.paths import MODELS_PATH


async def models_answer(client: httpx.AsyncClient, url: str) -> httpx.Response:
    """The replica at ``url``'s model list as it answered it, whatever its status, under the
    client's limits. Raises ``httpx.HTTPError`` as the client does."""
    return await client.get(f"{url}{MODELS_PATH}")


async def served_models(
    client: httpx.AsyncClient, urls: list[str], timeout_s: float
) -> set[str] | None:
    """The model names the replicas at ``urls`` serve now: the union of their ``MODELS_PATH``
    lists (an adapter loaded into one replica is served by that one), each asked within
    ``timeout_s``. None when no replica answered a list: unknown, so nothing may be refused on
    it."""
    answers = (await listed_ids(client, urls, timeout_s, "all")).values()
    return set().union(*answers) if answers else None


async def base_models_everywhere(
    client: httpx.AsyncClient, urls: list[str], timeout_s: float
) -> set[str] | None:
    """The base models (entries without ``parent``: not LoRA adapters) that every replica at
    ``urls`` answering its ``MODELS_PATH`` list serves, each asked within ``timeout_s``: the
    names a full-weight reload, sent to every replica, may replace. None when no replica
    answered a list (unknown, so nothing may be refused on it)."""
    answers = list((await listed_ids(client, urls, timeout_s, "bases")).values())
    return set.intersection(*answers) if answers else None


async def listed_ids(
    client: httpx.AsyncClient,
    urls: list[str],
    timeout_s: float,
    kind: Literal["all", "bases", "adapters"],
) -> dict[str, set[str]]:
    """Per replica URL, the ids its ``MODELS_PATH`` list names now, each asked within
    ``timeout_s``: every entry (``all``), the base models (``bases``: no ``parent``) or the
    LoRA adapters (``adapters``: with a ``parent``). A replica that does not answer a list is
    left out."""

    async def listed(url: str) -> set[str] | None:
        entries = await model_entries(client, url, timeout_s)
        if entries is None:
            return None
        return {
            e["id"]
            for e in entries
            if kind == "all" or bool(e.get("parent")) == (kind == "adapters")
        }

    answers = await asyncio.gather(*map(listed, urls))
    return {url: names for url, names in zip(urls, answers, strict=True) if names is not None}


async def model_entries(
    client: httpx.AsyncClient, url: str, timeout_s: float
) -> list[dict[str, Any]] | None:
    """The entries of the replica at ``url``'s ``MODELS_PATH`` list that have a string ``id``,
    asked within ``timeout_s`` in all; None when it answered no such list (an error, a timeout,
    a non-200 or a body of another shape)."""
    try:
        async with deadline(timeout_s, MODELS_PATH):
            answer = await client.get(f"{url}{MODELS_PATH}", timeout=timeout_s)
        entries = answer.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    if answer.status_code != 200 or not isinstance(entries, list):
        return None
    return [e for e in entries if isinstance(e, dict) and isinstance(e.get("id"), str)]
