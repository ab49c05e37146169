"""Settings of the data pool, read from ``TRAJGATE_*`` environment variables.

Owns: where the pool lives and how its write path trades latency, durability and file size.
Never: opens connections (see ``datapool.db``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from trajgate.config import ConfigFileSettings

WriteFailureMode = Literal["refuse", "serve"]
# The names under which reward_functions can run datapool.rewards.functions.http_reward_model
# (by entry point, by module path); it needs reward_model_url.
HTTP_REWARD_MODEL_NAMES = frozenset(
    {"http_reward_model", "datapool.rewards.functions:http_reward_model"}
)
# ... and under which step_reward_functions can run http_step_reward_model (step_reward_model_url).
HTTP_STEP_REWARD_MODEL_NAMES = frozenset(
    {"http_step_reward_model", "datapool.rewards.functions:http_step_reward_model"}
)


def sqlalchemy_url(database_url: str) -> str:
    """``database_url`` as SQLAlchemy takes it: ``postgres://`` and driverless
    ``postgresql://`` (as Heroku-style and libpq URLs are written) mean PostgreSQL through
    psycopg 3, the driver installed; any other URL unchanged."""
    for prefix in ("postgres://", "postgresql://"):
        if database_url.startswith(prefix):
            return "postgresql+psycopg://" + database_url.removeprefix(prefix)
    return database_url


class PoolSettings(ConfigFileSettings):
    """Where the pool's SQL state and files live, and how steps reach them."""

    model_config = SettingsConfigDict(env_prefix="TRAJGATE_", extra="ignore")

    data_dir: Path = Field(
        default=Path(".trajgate"),
        description="Directory of the embedded pool: the SQLite file and the Parquet payloads.",
    )
    database_url: str | None = Field(
        default=None,
        description=(
            "SQLAlchemy URL of the pool's database. Unset means SQLite at "
            "<data_dir>/pool.sqlite3 (WAL mode): zero set-up, one writer at a time. Use "
            "postgresql+psycopg://... for several gateway processes or heavy concurrent load. "
            "A URL whose dialect or driver SQLAlchemy cannot load is refused at start."
        ),
    )
    payload_uri: str | None = Field(
        default=None,
        description=(
            "Where compacted Parquet payload files go: a local directory or any URI a pyarrow "
            "filesystem understands (s3://bucket/prefix, gs://...). Unset means "
            "<data_dir>/payloads."
        ),
    )
    compaction_min_steps: int = Field(
        default=20_000,
        gt=0,
        description=(
            "Compact recent payloads into one Parquet file once this many wait in the SQL "
            "table. Larger files read faster and compress better; the SQL table stays bigger."
        ),
    )
    compaction_max_steps: int = Field(
        default=200_000, gt=0, description="Most step payloads written into one Parquet file."
    )
    compaction_interval_s: float = Field(
        default=30.0,
        ge=0,
        description="Seconds between the writer's checks for compaction; 0 turns them off.",
    )
    parquet_row_group_steps: int = Field(
        default=4096,
        gt=0,
        description="Steps per Parquet row group: smaller groups make point reads cheaper.",
    )
    write_batch_max_calls: int = Field(
        default=512,
        gt=0,
        description=(
            "Most calls committed in one transaction (group commit). Calls that arrive while a "
            "commit runs wait for the next one, so latency stays about one commit."
        ),
    )
    write_queue_max_calls: int = Field(
        default=20_000,
        gt=0,
        description="Calls waiting to be committed before record() refuses with 503.",
    )
    on_write_failure: WriteFailureMode = Field(
        default="refuse",
        description=(
            "When the database cannot take a step (disk full, locked past the timeout, "
            "unreachable): 'refuse' answers the client 503 so it retries and nothing is lost "
            "silently; 'serve' answers anyway without a step id, logs and counts the lost call."
        ),
    )
    write_failure_backoff_s: float = Field(
        default=2.0,
        ge=0,
        description=(
            "With on_write_failure='refuse': after a failed commit, new calls are answered 503 "
            "(Retry-After) before reaching vLLM for this long, so no tokens are sampled that "
            "could not be kept; the first call after it tests the database again. 0: never "
            "refuse up front."
        ),
    )
    database_lock_timeout_ms: int = Field(
        default=10_000,
        gt=0,
        description=(
            "How long the gateway's database statements wait for another connection's lock "
            "before failing as 'locked' (and on_write_failure applies): SQLite's busy timeout, "
            "PostgreSQL's lock_timeout. Longer rides out a slow CLI write or migration; "
            "shorter answers clients sooner."
        ),
    )
    orphan_payload_min_age_s: float = Field(
        default=3600.0,
        gt=0,
        description=(
            "Upkeep deletes Parquet files under payload_uri that no database row registers "
            "(left by a compaction that crashed between writing the file and committing) once "
            "they are this old; younger ones may belong to a compaction still committing."
        ),
    )
    trajectory_idle_timeout_s: float = Field(
        default=3600.0,
        ge=0,
        description=(
            "An open trajectory without a new step for this long is completed, unless a call "
            "of this gateway is in flight for it; other gateways' calls are not seen, so with "
            "several gateways keep it far above the longest call. 0: never."
        ),
    )
    lineage_cache_trajectories: int = Field(
        default=4096,
        gt=0,
        description=(
            "Open trajectories whose token sequences the writer keeps in memory to find a new "
            "step's parent without reading payloads back (about 4 bytes per token each)."
        ),
    )
    lineage_cache_mb: int = Field(
        default=1024,
        gt=0,
        description=(
            "MiB (estimated, all trajectories) the writer's lineage memory may hold: a long "
            "session costs its sequence (4 bytes per token), its steps' message keys (about 10 "
            "bytes per message per step), its lists' JSON texts (once per chain of steps that "
            "extend each other) and about 5 KiB per step: 2.5 MiB for 200 turns at 60k tokens; "
            "the least recently used trajectories are dropped past it (and read back on their "
            "next call)."
        ),
    )
    known_closed_trajectories: int = Field(
        default=65536,
        gt=0,
        description=(
            "Closed trajectories the writer remembers (LRU, about 150 bytes each: 10 MB at "
            "the default), so a call to one is refused with 409 before it reaches the engine; "
            "a trajectory closed by another gateway process, or evicted, is still refused, "
            "but only at commit time, after sampling."
        ),
    )
    reward_functions: list[str] = Field(
        default_factory=list,
        description=(
            "Reward functions run on every completed trajectory: names of entry points in the "
            "group 'trajgate.rewards' or module paths 'pkg.mod:fn'."
        ),
    )
    curation_predicate_modules: list[str] = Field(
        default_factory=list,
        description=(
            "Modules whose functions a 'predicate' curation rule may name ('pkg.mod' allows "
            "'pkg.mod:fn'; 'pkg.*' allows every module under 'pkg'). A rule is declared over "
            "the API, so without this list any caller could make the gateway import a module "
            "of its choice and call one of its functions; empty (the default): no predicate "
            "rule can be declared or applied."
        ),
    )
    reward_model_url: str | None = Field(
        default=None,
        description=(
            "Where the built-in reward function http_reward_model POSTs each completed "
            "trajectory (its final step's messages, id, metadata) and reads "
            '{"reward": number} or {"rewards": {name: number}} back. Required when '
            "reward_functions names http_reward_model."
        ),
    )
    step_reward_functions: list[str] = Field(
        default_factory=list,
        description=(
            "Step reward functions run once per ok step of every completed trajectory (process "
            "rewards, after the reward_functions): names of entry points in the group "
            "'trajgate.step_rewards' or module paths 'pkg.mod:fn'."
        ),
    )
    step_reward_model_url: str | None = Field(
        default=None,
        description=(
            "Where the built-in step reward function http_step_reward_model POSTs each ok step "
            "(a process reward model or judge service; one request per step) and reads "
            '{"reward": number} or {"rewards": {name: number}} back. Required when '
            "step_reward_functions names http_step_reward_model; waits reward_model_timeout_s."
        ),
    )
    reward_model_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description=(
            "How long http_reward_model waits for the reward model's whole answer before the "
            "reward is recorded as failed. Keep it below completion_hooks_lease_s: a run that "
            "outlasts its lease may be repeated by another gateway, judging the trajectory twice."
        ),
    )
    completion_hooks_interval_s: float = Field(
        default=5.0,
        gt=0,
        description=(
            "Seconds between a gateway's checks for completed trajectories whose hooks (reward "
            "functions, then curation rules) are due. The explicit complete endpoint wakes the "
            "check at once; this bounds the delay after an idle-timeout completion or a crash."
        ),
    )
    completion_hooks_lease_s: float = Field(
        default=300.0,
        gt=0,
        description=(
            "How long a claim on a trajectory's hooks lasts. A runner that dies mid-run loses "
            "them for this long, then another runs them again; a run longer than this may be "
            "repeated by another gateway. Set it above your slowest reward function."
        ),
    )
    completion_hooks_concurrency: int = Field(
        default=8,
        gt=0,
        description=(
            "Trajectories whose hooks one gateway runs at once (reward functions that call a "
            "reward model are I/O-bound; each run also takes database transactions)."
        ),
    )
    tokenizer_dir: Path | None = Field(
        default=None,
        description=(
            "A Hugging Face tokenizer directory used only to decode stored IDs into text for "
            "/api/steps; unset, the API returns IDs without text. Text is never encoded."
        ),
    )

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str | None) -> str | None:
        """Refuse a database URL SQLAlchemy cannot use (unparsable, an unknown dialect, a driver
        not installed) here, so ``serve --check-config`` refuses what ``serve`` would die on.
        Loads the dialect and its driver module; opens no connection."""
        if not value:
            return value
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError, NoSuchModuleError

        expected = "expected postgresql+psycopg://user:password@host:5432/name or sqlite:///path"
        try:
            url = make_url(sqlalchemy_url(value))
        except ArgumentError as exc:
            raise ValueError(f"not a SQLAlchemy URL; {expected}") from exc
        try:
            dialect = url.get_dialect()
        except NoSuchModuleError as exc:
            raise ValueError(f"SQLAlchemy has no dialect {url.drivername!r}; {expected}") from exc
        try:
            dialect.import_dbapi()
        except ImportError as exc:
            raise ValueError(
                f"the driver of {url.drivername!r} is not installed ({exc}); use "
                "postgresql+psycopg://... (installed) or install the driver"
            ) from exc
        return value

    @model_validator(mode="after")
    def _check_reward_model(self) -> PoolSettings:
        if self.reward_model_url is not None and not self.reward_model_url.startswith(
            ("http://", "https://")
        ):
            raise ValueError(
                "reward_model_url must start with http:// or https://, "
                f"got {self.reward_model_url!r}"
            )
        if self.step_reward_model_url is not None and not self.step_reward_model_url.startswith(
            ("http://", "https://")
        ):
            raise ValueError(
                "step_reward_model_url must start with http:// or https://, "
                f"got {self.step_reward_model_url!r}"
            )
        if HTTP_STEP_REWARD_MODEL_NAMES & set(self.step_reward_functions) and (
            self.step_reward_model_url is None
        ):
            raise ValueError(
                "step_reward_functions names http_step_reward_model but step_reward_model_url "
                "is unset: set TRAJGATE_STEP_REWARD_MODEL_URL to the service's URL"
            )
        if not HTTP_REWARD_MODEL_NAMES & set(self.reward_functions):
            return self
        if self.reward_model_url is None:
            raise ValueError(
                "reward_functions names http_reward_model but reward_model_url is unset: set "
                "TRAJGATE_REWARD_MODEL_URL to the reward model's URL (http://host:port/path)"
            )
        if self.reward_model_timeout_s >= self.completion_hooks_lease_s:
            raise ValueError(
                f"reward_model_timeout_s ({self.reward_model_timeout_s:g}) must be below "
                f"completion_hooks_lease_s ({self.completion_hooks_lease_s:g}), or a slow reward "
                "model's trajectories are claimed again mid-run and judged twice: lower "
                "TRAJGATE_REWARD_MODEL_TIMEOUT_S or raise TRAJGATE_COMPLETION_HOOKS_LEASE_S"
            )
        return self

    def resolved_database_url(self) -> str:
        """The SQLAlchemy URL (``sqlalchemy_url``), SQLite under ``data_dir`` when unset."""
        if self.database_url:
            return sqlalchemy_url(self.database_url)
        return f"sqlite:///{(self.data_dir / 'pool.sqlite3').resolve()}"

    def resolved_payload_uri(self) -> str:
        if self.payload_uri:
            return self.payload_uri
        return str((self.data_dir / "payloads").resolve())
