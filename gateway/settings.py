"""Settings of the gateway, read from ``TRAJGATE_*`` environment variables and CLI flags.

Owns: how the proxy reaches its upstreams, its time limits, and its security posture, validated
at start-up. Never: holds state. Binding beyond loopback without an admin token is refused.
"""

from __future__ import annotations

import ipaddress

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from trajgate.config import ConfigFileSettings


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class GatewaySettings(ConfigFileSettings):
    """How the gateway listens, where it forwards, its limits and its keys."""

    model_config = SettingsConfigDict(env_prefix="TRAJGATE_", extra="ignore")

    upstream_url: str = Field(
        default="http://127.0.0.1:8100",
        description=(
            "Base URL of the vLLM OpenAI server (without /v1); several replicas comma-separated. "
            "Calls go to the least-loaded healthy replica, sticky per trajectory."
        ),
    )
    host: str = Field(default="127.0.0.1", description="Address the gateway binds to.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port the gateway binds to.")
    policy_version: int = Field(
        default=0,
        ge=0,
        description="Policy version stamped on steps while no registered version is active.",
    )
    policy_alias: str = Field(
        default="policy",
        description="Model name that resolves to the active policy version's upstream model.",
    )
    policy_refresh_s: float = Field(
        default=2.0,
        gt=0,
        description="Seconds between re-reads of the active policy (several gateway processes).",
    )
    upstream_connect_timeout_s: float = Field(
        default=10.0, gt=0, description="Seconds to open a connection to an upstream replica."
    )
    upstream_first_byte_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description=(
            "Streaming: seconds until the first chunk (queueing and prefill included). "
            "Then 504, upstream aborted, step recorded as upstream_timeout."
        ),
    )
    upstream_between_chunks_timeout_s: float = Field(
        default=60.0, gt=0, description="Streaming: longest silence between two chunks."
    )
    upstream_total_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Seconds one upstream call may take in all (non-streaming: until the answer).",
    )
    upstream_max_attempts: int = Field(
        default=3,
        ge=1,
        description=(
            "Tries per call across replicas on connection errors and 502/503/504 answers. Only "
            "before any byte reached the client, and never after a timeout (tokens may have been "
            "generated)."
        ),
    )
    upstream_retry_backoff_ms: float = Field(
        default=50.0, ge=0, description="Pause before a retry, doubled each attempt."
    )
    health_check_interval_s: float = Field(
        default=5.0, gt=0, description="Seconds between health checks of every replica."
    )
    resend_window_s: float = Field(
        default=600.0,
        ge=0,
        description=(
            "A request identical to an earlier one of the same trajectory within this window is "
            "linked to it as a re-send (same call id, flag 'resend'); 0 turns detection off."
        ),
    )
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024,
        gt=0,
        description="Largest request body accepted; larger ones get 413 and nothing is recorded.",
    )
    admin_token: str | None = Field(
        default=None,
        description="Bearer token for /admin endpoints. Required when bound beyond loopback.",
    )
    require_api_key: bool | None = Field(
        default=None,
        description=(
            "Require an agent API key (Authorization: Bearer tg-...) on OpenAI routes. "
            "Default: off on loopback, on otherwise."
        ),
    )

    @model_validator(mode="after")
    def _refuse_insecure_exposure(self) -> GatewaySettings:
        if not is_loopback(self.host):
            if not self.admin_token:
                raise ValueError(
                    f"binding to {self.host} (not loopback) requires TRAJGATE_ADMIN_TOKEN"
                )
            if self.require_api_key is False:
                raise ValueError(
                    f"binding to {self.host} (not loopback) requires agent API keys; "
                    "unset TRAJGATE_REQUIRE_API_KEY"
                )
        return self

    @property
    def upstream_urls(self) -> list[str]:
        return [url.strip().rstrip("/") for url in self.upstream_url.split(",") if url.strip()]

    @property
    def api_key_required(self) -> bool:
        if self.require_api_key is None:
            return not is_loopback(self.host)
        return self.require_api_key
