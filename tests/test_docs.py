"""Every setting, endpoint and CLI command or flag is documented (README.md or docs/*.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer.main
from fastapi.routing import APIRoute
from pydantic_settings import BaseSettings

from datapool.batches.settings import BatchSettings
from datapool.settings import PoolSettings
from gateway.app import create_app
from gateway.settings import GatewaySettings
from trainer_bridge.distributed import DistributedSettings
from trainer_bridge.trainer import TrainerSettings
from trajgate.bench.emulator import EmulatorSettings
from trajgate.cli import app as cli_app

ROOT = Path(__file__).resolve().parent.parent
DOCS = "\n".join(
    path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
)


def _env_names(settings: type[BaseSettings]) -> list[str]:
    prefix = str(settings.model_config.get("env_prefix", ""))
    return [f"{prefix}{name}".upper() for name in settings.model_fields]


@pytest.mark.parametrize(
    "settings",
    [
        GatewaySettings,
        PoolSettings,
        EmulatorSettings,
        BatchSettings,
        TrainerSettings,
        DistributedSettings,
    ],
)
def test_every_setting_is_documented(settings: type[BaseSettings]) -> None:
    missing = [name for name in _env_names(settings) if name not in DOCS]
    assert missing == []


def test_every_endpoint_is_documented() -> None:
    paths = {
        route.path
        for route in create_app().routes
        if isinstance(route, APIRoute) and not route.path.startswith(("/docs", "/openapi"))
    }
    missing = sorted(path for path in paths if path not in DOCS)
    assert missing == []


def _commands(group: Any, prefix: str) -> list[tuple[str, Any]]:
    """``(full name, command)`` of every leaf command (Typer ships its own click types)."""
    found: list[tuple[str, Any]] = []
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            found += _commands(command, f"{prefix} {name}")
        else:
            found.append((f"{prefix} {name}", command))
    return found


def test_every_cli_command_and_flag_is_documented() -> None:
    missing: list[str] = []
    for name, command in _commands(typer.main.get_command(cli_app), "trajgate"):
        if f"`{name}" not in DOCS:
            missing.append(name)
        for parameter in command.params:
            flags = [flag for flag in getattr(parameter, "opts", []) if flag.startswith("--")]
            if flags and not any(flag in DOCS for flag in flags):
                missing.append(f"{name} {flags[0]}")
    assert missing == []
