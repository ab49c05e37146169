"""docker-compose.yml as data: its services with variables interpolated the way Compose does
(``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}``) from .env.example, so tests can run the very
commands and environments the file gives the containers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:-|:\?)([^}]*))?\}")


def env_example() -> dict[str, str]:
    values: dict[str, str] = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def interpolate(value: Any, variables: dict[str, str]) -> Any:
    """Compose's interpolation of one YAML value (recursively); raises KeyError for ``:?``."""
    if isinstance(value, dict):
        return {key: interpolate(item, variables) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, variables) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        name, operator, argument = match.groups()
        current = variables.get(name, "")
        if operator == ":?" and not current:
            raise KeyError(f"{name}: {argument}")
        if operator == ":-" and not current:
            return argument
        return current

    return _VARIABLE.sub(substitute, value)


def compose() -> dict[str, Any]:
    """The whole file, anchors merged, variables from .env.example."""
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    return dict(interpolate(raw, env_example()))


def compose_service_env(service: str, overrides: dict[str, str]) -> dict[str, str]:
    """``service``'s environment with ``overrides`` (host-specific values) applied.

    Raises KeyError when an override names a variable the service does not set: a test must not
    quietly exercise a setting the compose file does not use.
    """
    environment = {
        key: str(value) for key, value in compose()["services"][service]["environment"].items()
    }
    unknown = sorted(set(overrides) - set(environment))
    if unknown:
        raise KeyError(f"{service} in docker-compose.yml does not set {unknown}")
    return {**environment, **overrides}
