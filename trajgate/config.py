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
ignored), raised by ``load_config_file``. The known keys are the fields of the classes named in
``SETTINGS_CLASSES``, one explicit list (tests/test_config_file.py checks that it names every
``ConfigFileSettings`` subclass), so every process checks the same keys whatever it imported.

A leaf: this module imports no trajgate package at module level; it imports the listed settings
modules by name only when a file's keys are checked. Those modules import neither torch nor
the gateway's app, so a host with the core install alone checks the ``[trainer]`` keys too.
"""

from __future__ import annotations

import importlib
import os
import tomllib
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

CONFIG_ENV = "TRAJGATE_CONFIG"

# Every settings class that reads the file, as "module:Class"; a new one goes here.
SETTINGS_CLASSES = (
    "gateway.settings:GatewaySettings",
    "datapool.settings:PoolSettings",
    "datapool.batches.settings:BatchSettings",
    "trainer_bridge.settings:TrainerSettings",
    "trainer_bridge.settings:DistributedSettings",
    "trajgate.bench.book:EmulatorSettings",
)
# Fields whose values ``describe`` never prints.
SECRET_SUFFIXES = ("token", "password", "secret", "api_key")


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
    classes = settings_classes()
    sections = sorted({c.config_section for c in classes if c.config_section is not None})
    unknown = [key for key in data if key not in sections and key not in _known(classes, None)]
    for section in sections:
        table = data.get(section, {})
        if not isinstance(table, dict):
            raise ConfigFileError(f"{CONFIG_ENV}={path_text}: [{section}] must be a table")
        unknown += [f"{section}.{key}" for key in table if key not in _known(classes, section)]
    if unknown:
        raise ConfigFileError(
            f"{CONFIG_ENV}={path_text}: unknown keys {sorted(unknown)}; the keys are the "
            "settings' environment variable names without their prefix, in lower case "
            "(docs/deployment.md)"
        )
    return data


def settings_classes() -> list[type[ConfigFileSettings]]:
    """The classes named in ``SETTINGS_CLASSES``, imported (in that order).

    Raises:
        TypeError: a name does not resolve to a ``ConfigFileSettings`` subclass.
    """
    classes = []
    for name in SETTINGS_CLASSES:
        module_name, _, class_name = name.partition(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        if not (isinstance(cls, type) and issubclass(cls, ConfigFileSettings)):
            raise TypeError(f"SETTINGS_CLASSES: expected a ConfigFileSettings subclass, got {name}")
        classes.append(cls)
    return classes


def _known(classes: list[type[ConfigFileSettings]], section: str | None) -> set[str]:
    """Field names of the classes that read ``section`` (None: top level)."""
    return {name for cls in classes if cls.config_section == section for name in cls.model_fields}


def describe(*settings: BaseSettings) -> dict[str, dict[str, Any]]:
    """The effective values of ``settings`` as JSON-ready ``{class name: {field: value}}``,
    secrets hidden: fields named ``*token``/``*password``/``*secret``/``*api_key`` and the
    password of any URL become ``"***"``. What ``--check-config`` prints."""
    described: dict[str, dict[str, Any]] = {}
    for one in settings:
        values = one.model_dump(mode="json")
        for name, value in values.items():
            if value is not None and name.endswith(SECRET_SUFFIXES):
                values[name] = "***"
            elif isinstance(value, str):
                values[name] = hide_url_password(value)
        described[type(one).__name__] = values
    return described


def hide_url_password(text: str) -> str:
    """``text`` with the password of a URL in it replaced by ``***`` (other text unchanged)."""
    if "://" not in text or "@" not in text:
        return text
    try:
        password = urlsplit(text).password
    except ValueError:  # not a URL after all
        return text
    return text.replace(f":{password}@", ":***@", 1) if password else text


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
