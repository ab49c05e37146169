"""Settings of batches and leases, read from ``TRAJGATE_*`` environment variables.

Owns: where materialised batches go and the bounds of a lease. Never: opens files.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from trajgate.config import ConfigFileSettings


class BatchSettings(ConfigFileSettings):
    """Where batch files live and how long consumers may hold them."""

    model_config = SettingsConfigDict(env_prefix="TRAJGATE_", extra="ignore")

    batch_uri: str | None = Field(
        default=None,
        description=(
            "Where materialised batches go (rows.parquet and manifest.json per batch): a local "
            "directory or a pyarrow filesystem URI (s3://bucket/prefix). Unset means "
            "<data_dir>/batches."
        ),
    )
    lease_default_s: float = Field(
        default=600.0,
        gt=0,
        description=(
            "Lease length when a consumer gives none. Longer survives slow updates; shorter "
            "returns a crashed consumer's batch sooner."
        ),
    )
    lease_max_s: float = Field(
        default=86_400.0, gt=0, description="Longest lease a consumer may ask for."
    )

    def resolved_batch_uri(self, data_dir: Path) -> str:
        if self.batch_uri:
            return self.batch_uri.rstrip("/")
        return str((data_dir / "batches").resolve())
