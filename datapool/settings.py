"""Settings of the data pool, read from ``TRAJGATE_*`` environment variables.

Owns: where the pool lives. Never: opens connections (see ``datapool.db``).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class PoolSettings(BaseSettings):
    """Where the pool's SQL state and files live."""

    model_config = SettingsConfigDict(env_prefix="TRAJGATE_", extra="ignore")

    data_dir: Path = Field(
        default=Path(".trajgate"),
        description="Directory of the embedded pool: the SQLite file and, later, Parquet payloads.",
    )
    database_url: str | None = Field(
        default=None,
        description=(
            "SQLAlchemy URL of the pool's database. Unset means SQLite at "
            "<data_dir>/pool.sqlite3 (WAL mode): zero set-up, one writer at a time. Use "
            "postgresql+psycopg://... for several gateway processes or heavy concurrent load."
        ),
    )

    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'pool.sqlite3').resolve()}"
