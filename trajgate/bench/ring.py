"""Sticky routing for the bench's fleet balancer: which gateway a call belongs to.

Owns: ``routing_key`` (the trajectory a raw HTTP request head names: the id in a ``/t/<id>/``
path, else the ``X-Trajgate-Trajectory`` header, else the API key of ``Authorization`` or
``x-api-key``; the same order as deploy/nginx.conf's ``map``) and ``HashRing`` (consistent
hashing: each backend owns ``POINTS_PER_BACKEND`` points on a 64-bit ring; a key belongs to the
first point at or after its hash, and when that backend is down, to the next backend along the
ring, so removing one backend moves only its own keys).

Never: used by the gateway itself (any gateway serves any call; stickiness only spares them
rebuilding a trajectory's lineage from the pool, docs/deployment.md).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

B = TypeVar("B", bound=Hashable)

POINTS_PER_BACKEND = 160  # as ketama and nginx's `hash ... consistent`: an even share per backend
_KEY_HEADERS = (b"x-trajgate-trajectory", b"authorization", b"x-api-key")


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def routing_key(head: bytes) -> bytes | None:
    """The routing key of one HTTP/1.x request head (request line and headers, up to the blank
    line), or None when it names no trajectory and no key (such a call may go anywhere).

    ``POST /t/abc/v1/chat/completions`` → ``b"abc"``; else the value of
    ``X-Trajgate-Trajectory``; else that of ``Authorization``, then ``x-api-key``.
    """
    request_line, _, header_block = head.partition(b"\r\n")
    parts = request_line.split(b" ")
    path = parts[1] if len(parts) >= 2 else b""
    if path.startswith(b"/t/"):
        trajectory_id, slash, _ = path[3:].partition(b"?")[0].partition(b"/")
        if trajectory_id and slash:  # as nginx.conf's ~^/t/([^/]+)/
            return trajectory_id
    headers: dict[bytes, bytes] = {}
    for line in header_block.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if sep:
            headers.setdefault(name.strip().lower(), value.strip())
    for name in _KEY_HEADERS:
        if headers.get(name):
            return headers[name]
    return None


class HashRing(Generic[B]):
    """Consistent hashing of keys over ``backends`` (any hashable with a stable ``str``)."""

    def __init__(self, backends: Sequence[B], points_per_backend: int = POINTS_PER_BACKEND):
        if not backends:
            raise ValueError("expected at least one backend, got none")
        self.backends = list(backends)
        points = sorted(
            (_hash64(f"{backend}#{i}".encode()), n)
            for n, backend in enumerate(self.backends)
            for i in range(points_per_backend)
        )
        self._hashes = [point for point, _ in points]
        self._owners = [owner for _, owner in points]

    def order(self, key: bytes) -> list[B]:
        """Every backend, in the order ``key`` tries them: its owner first, then the next
        distinct backends along the ring (where its calls go while the owner is down)."""
        start = bisect.bisect_left(self._hashes, _hash64(key))
        seen: list[int] = []
        for i in range(len(self._owners)):
            owner = self._owners[(start + i) % len(self._owners)]
            if owner not in seen:
                seen.append(owner)
                if len(seen) == len(self.backends):
                    break
        return [self.backends[n] for n in seen]
