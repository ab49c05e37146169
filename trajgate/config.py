"""One configuration file for every component: ``TRAJGATE_CONFIG=path.toml``.

Owns: ``ConfigFileSettings``, the base of every settings class (gateway, pool, batches,
trainer, distributed trainer, emulator), which reads the TOML file named by ``TRAJGATE_CONFIG``
after the environment. Never: writes the file or reads any other path.

The file says what the environment would say, with the same names less the prefix, in lower
case. Settings whose variables start with ``TRAJGATE_`` (gateway, pool, batches) are top-level
keys; ``TRAJGATE_TRAINER_*`` settings live under ``[trainer]`` and ``TRAJGATE_EMULATOR_*`` under
``[emulator]``::

    database_url = "postgresql+psycopg://trajgate@db/trajgate"   # TRAJGATE_DATABASE_URL
    upstream_url = "http://vllm-0:8000,http://vllm-1:8000"       # TRAJGATE_UPSTREAM_URL

    [trainer]
    model_dir = "/models/qwen"                                   # TRAJGATE_TRAINER_MODEL_DIR

Precedence, highest first: values passed in code (CLI flags), environment variables, the file,
defaults. A key no settings class knows is an error (a typo would otherwise be silently
ignored), raised by ``load_config_file``.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, ClassVar

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

CONFIG_ENV = "TRAJGATE_CONFIG"
SECTIONS = ("trainer", "emulator")


class ConfigFileError(ValueError):
    """The config file is unreadable, not TOML, or has keys no setting knows."""


def load_config_file() -> dict[str, Any]:
    """The parsed ``TRAJGATE_CONFIG`` file, or ``{}`` when the variable is unset.

    Raises:
        ConfigFileError: missing file, invalid TOML, or unknown keys (listed).
    """
    path_text = os.environ.get(CONFIG_ENV)
    if not path_text:
        return {}
    path = Path(path_text)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigFileError(f"{CONFIG_ENV}={path_text}: {exc}") from exc
    unknown = [f"{key}" for key in data if key not in SECTIONS and key not in _known(None)]
    for section in SECTIONS:
        table = data.get(section, {})
        if not isinstance(table, dict):
            raise ConfigFileError(f"{CONFIG_ENV}={path_text}: [{section}] must be a table")
        unknown += [f"{section}.{key}" for key in table if key not in _known(section)]
    if unknown:
        raise ConfigFileError(
            f"{CONFIG_ENV}={path_text}: unknown keys {sorted(unknown)}; the keys are the "
            "settings' environment variable names without their prefix, in lower case "
            "(docs/deployment.md)"
        )
    return data


def _known(section: str | None) -> set[str]:
    """Field names of every settings class that reads ``section`` (None: top level)."""
    _import_all_settings()
    names: set[str] = set()
    for cls in _subclasses(ConfigFileSettings):
        if cls.config_section == section:
            names.update(cls.model_fields)
    return names


def _subclasses(cls: type[ConfigFileSettings]) -> list[type[ConfigFileSettings]]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


def _import_all_settings() -> None:
    """Every settings class registers as a subclass on import; unknown-key checks need all."""
    import trainer_bridge.distributed
    import trainer_bridge.trainer  # noqa: F401


class _ConfigFileSource(PydanticBaseSettingsSource):
    """The ``TRAJGATE_CONFIG`` file's values for one settings class."""

    def __init__(self, settings_cls: type[BaseSettings], section: str | None) -> None:
        super().__init__(settings_cls)
        self.section = section

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError  # __call__ is overridden; pydantic-settings never calls this

    def __call__(self) -> dict[str, Any]:
        data = load_config_file()
        table = data.get(self.section, {}) if self.section else data
        fields = self.settings_cls.model_fields
        return {key: value for key, value in table.items() if key in fields}


class ConfigFileSettings(BaseSettings):
    """A settings class that also reads the ``TRAJGATE_CONFIG`` file (below the environment)."""

    config_section: ClassVar[str | None] = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (
            init_settings,
            env_settings,
            dotenv_settings,
            _ConfigFileSource(settings_cls, cls.config_section),
            file_secret_settings,
        )
