"""The CLI coding agents that are run for real against the gateway: pinned, installed from npm.

Owns: which agents and versions (``AGENTS``), installing each into its own npm prefix under
``$TRAJGATE_HOME/agents/<name>`` with a stamp file, and finding its executable. Never: runs an
agent, installs into the machine's global npm prefix, or picks a version at run time.

Versions are the ones checked with node 20 (the machine's node; ``npm`` comes with it):

- Codex CLI (``@openai/codex``) ships a native binary per platform; it speaks only the OpenAI
  Responses API.
- Claude Code (``@anthropic-ai/claude-code``) ships a native binary too; its package asks for
  node >= 22 but only its installer runs on node. It speaks the Anthropic Messages API.
- Qwen Code (``@qwen-code/qwen-code``) is a node program speaking Chat Completions; 0.15.10 is
  its last release that runs on node 20 (0.21 and later ask for node >= 22).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from trajgate.vllm_server import trajgate_home


class AgentNotInstalledError(RuntimeError):
    """An agent's npm prefix is missing or stale; the message names the command that installs it."""


@dataclass(frozen=True)
class CliAgent:
    """One CLI agent: its npm ``package`` at ``version`` and the ``command`` it installs."""

    name: str
    package: str
    version: str
    command: str

    @property
    def spec(self) -> str:
        """The npm install spec, ``package@version``."""
        return f"{self.package}@{self.version}"


AGENTS: dict[str, CliAgent] = {
    agent.name: agent
    for agent in (
        CliAgent("codex", "@openai/codex", "0.169.0", "codex"),
        CliAgent("claude-code", "@anthropic-ai/claude-code", "2.1.328", "claude"),
        CliAgent("qwen-code", "@qwen-code/qwen-code", "0.15.10", "qwen"),
    )
}


def prefix_dir(agent: CliAgent) -> Path:
    """``$TRAJGATE_HOME/agents/<name>``: the npm prefix this agent is installed into."""
    return trajgate_home() / "agents" / agent.name


def _stamp_path(agent: CliAgent) -> Path:
    return prefix_dir(agent) / "trajgate-agent.txt"


def is_installed(agent: CliAgent) -> bool:
    stamp = _stamp_path(agent)
    return stamp.exists() and stamp.read_text().strip() == agent.spec


def executable(agent: CliAgent) -> Path:
    """The agent's command inside its prefix.

    Raises:
        AgentNotInstalledError: the pinned version is not installed there.
    """
    if not is_installed(agent):
        raise AgentNotInstalledError(
            f"{agent.spec} is not installed under {prefix_dir(agent)}; run scripts/setup.sh "
            '(or .venv/bin/python -c "from trajgate import agents; agents.install_all()")'
        )
    return prefix_dir(agent) / "node_modules" / ".bin" / agent.command


def install(agent: CliAgent, *, log: bool = True) -> Path:
    """Install ``agent`` at its pinned version unless its stamp is there; returns its prefix.

    About 10-15 s and 50-400 MB per agent the first time (the native binaries are the bulk);
    a stamp check afterwards.

    Raises:
        subprocess.CalledProcessError: npm failed, or the installed command does not run.
    """
    prefix = prefix_dir(agent)
    if is_installed(agent):
        return prefix
    out = None if log else subprocess.DEVNULL
    prefix.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", agent.spec],
        check=True,
        stdout=out,
    )
    command = prefix / "node_modules" / ".bin" / agent.command
    subprocess.run([str(command), "--version"], check=True, stdout=out)
    _stamp_path(agent).write_text(agent.spec + "\n")
    return prefix


def install_all(*, log: bool = True) -> list[Path]:
    """Install every agent in ``AGENTS``; returns their prefixes."""
    return [install(agent, log=log) for agent in AGENTS.values()]
