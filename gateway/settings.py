"""Settings of the gateway, read from ``TRAJGATE_*`` environment variables and CLI flags.

Owns: how the proxy reaches its upstream and what it accepts. Never: holds state.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class GatewaySettings(BaseSettings):
    """How the gateway listens, where it forwards, and its limits."""

    model_config = SettingsConfigDict(env_prefix="TRAJGATE_", extra="ignore")

    upstream_url: str = Field(
        default="http://127.0.0.1:8100",
        description="Base URL of the vLLM OpenAI server (without /v1).",
    )
    host: str = Field(default="127.0.0.1", description="Address the gateway binds to.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port the gateway binds to.")
    policy_version: int = Field(
        default=0,
        ge=0,
        description="Policy version stamped on every step until a weight sync registers another.",
    )
    upstream_connect_timeout_s: float = Field(
        default=10.0, gt=0, description="Seconds to open a connection to the upstream."
    )
    upstream_total_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Seconds a non-streaming upstream call may take; then 504, step recorded.",
    )
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024,
        gt=0,
        description="Largest request body accepted; larger ones get 413 and nothing is recorded.",
    )
