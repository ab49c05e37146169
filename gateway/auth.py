"""API keys for agents and the admin token for management endpoints.

Owns: issuing keys (shown once, stored as SHA-256 hashes), reading an agent's key from
``Authorization: Bearer`` or ``x-api-key`` (``api_key``), checking it, and the
trajectory/channel a key is bound to. Keys are 32 random bytes: a fast hash is the
standard for high-entropy tokens (a slow password hash such as argon2 adds nothing against
guessing 256-bit secrets and would cost milliseconds per call). Comparison of the admin token is
constant-time. Verified keys and failed lookups are cached for ``CACHE_TTL_S``, at most
``CACHE_MAX_ENTRIES`` of them (least recently used out first): random keys tried cannot grow
memory. A lookup the cache cannot answer reads the database in a worker thread
(``KeyRing.verify`` is a coroutine): the event loop serves other calls meanwhile. Never: stores
or logs a key in clear.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from fastapi import Request

from datapool import api_keys
from datapool.db import Sessions
from datapool.models import ApiKey
from gateway.errors import AuthenticationError, NotFoundError

KEY_PREFIX = "tg-"
CACHE_TTL_S = 5.0  # how long a revoked key may still pass on a gateway that checked it recently
CACHE_MAX_ENTRIES = 10_000  # keys (good or bad) remembered; about 2 MB at most


@dataclass(frozen=True)
class KeyGrant:
    """What a valid key allows: a fixed trajectory and/or channel, or anything (None)."""

    key_id: str
    name: str
    trajectory_id: str | None
    channel: str | None


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def api_key(request: Request) -> str | None:
    """The key an agent sent: ``Authorization: Bearer <key>`` (the OpenAI SDKs), else
    ``x-api-key: <key>`` (the Anthropic SDK and Claude Code); None when neither is there.
    Management endpoints take the admin token as a bearer token only (``check_admin_token``)."""
    token = bearer_token(request)
    if token is not None:
        return token
    key = request.headers.get("x-api-key", "").strip()
    return key or None


class KeyRing:
    """API keys in the pool's database, with a short, bounded in-process cache of lookups."""

    def __init__(self, sessions: Sessions, cache_max_entries: int = CACHE_MAX_ENTRIES) -> None:
        self._sessions = sessions
        self._cache_max_entries = cache_max_entries
        self._cache: OrderedDict[str, tuple[float, KeyGrant | None]] = OrderedDict()

    @property
    def cached_entries(self) -> int:
        """Lookups (valid keys and failed ones) the cache holds now."""
        return len(self._cache)

    def issue(self, name: str, trajectory_id: str | None, channel: str | None) -> tuple[str, str]:
        """Create a key; returns ``(key_id, key)``. The key itself is never stored."""
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        key_id = str(uuid.uuid4())
        api_keys.add_key(self._sessions, key_id, name, hash_key(key), trajectory_id, channel)
        return key_id, key

    def revoke(self, key_id: str) -> None:
        """Raises ``NotFoundError`` for an unknown id."""
        if not api_keys.revoke_key(self._sessions, key_id):
            raise NotFoundError(f"no API key with id {key_id!r}", param="key_id")
        self._cache.clear()

    def list(self) -> list[ApiKey]:
        return api_keys.list_keys(self._sessions)

    async def verify(self, key: str) -> KeyGrant:
        """The grant of a valid, unrevoked key. Raises ``AuthenticationError`` otherwise.

        A key checked within ``CACHE_TTL_S`` is answered from the cache; any other is looked up
        in the database in asyncio's default executor (a thread), never on the event loop: a
        slow database (PostgreSQL across a network, SQLite behind a writer) would stall every
        call of the process. Two calls with the same new key may both look it up (both find the
        same row: nothing to undo)."""
        digest = hash_key(key)
        entry = self._cached(digest)
        if entry is None:
            loop = asyncio.get_running_loop()
            grant = await loop.run_in_executor(None, self._lookup, digest)
            self._remember(digest, grant)
        else:
            grant = entry[1]
        if grant is None:
            raise AuthenticationError("invalid or revoked API key", code="invalid_api_key")
        return grant

    def _cached(self, digest: str) -> tuple[float, KeyGrant | None] | None:
        """The cache's fresh entry for ``digest`` (moved to the recent end), or None."""
        cached = self._cache.get(digest)
        if cached is None or time.monotonic() - cached[0] >= CACHE_TTL_S:
            return None
        self._cache.move_to_end(digest)
        return cached

    def _lookup(self, digest: str) -> KeyGrant | None:
        """The grant of the active key hashed to ``digest`` (a database read), or None."""
        row = api_keys.active_key(self._sessions, digest)
        return None if row is None else KeyGrant(row.id, row.name, row.trajectory_id, row.channel)

    def _remember(self, digest: str, grant: KeyGrant | None) -> None:
        self._cache[digest] = (time.monotonic(), grant)
        self._cache.move_to_end(digest)
        while len(self._cache) > self._cache_max_entries:
            self._cache.popitem(last=False)


def check_admin_token(request: Request, admin_token: str | None) -> None:
    """Raises ``AuthenticationError`` unless the bearer token equals ``admin_token`` (when set)."""
    if admin_token is None:
        return
    token = bearer_token(request) or ""
    if not hmac.compare_digest(token.encode(), admin_token.encode()):
        raise AuthenticationError("admin token required", code="invalid_admin_token")
