"""Small helpers shared by the pool tests."""

from __future__ import annotations

from trajgate.bench.gateway import free_port

__all__ = ["free_port"]
