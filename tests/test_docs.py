"""Every setting, endpoint and CLI command or flag is documented (README.md or docs/*.md)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer.main
from fastapi.routing import APIRoute
from pydantic_settings import BaseSettings

from gateway.app import create_app
from trajgate.cli import app as cli_app
from trajgate.config import settings_classes

ROOT = Path(__file__).resolve().parent.parent
DOCS = "\n".join(
    path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
)


def _env_names(settings: type[BaseSettings]) -> list[str]:
    prefix = str(settings.model_config.get("env_prefix", ""))
    return [f"{prefix}{name}".upper() for name in settings.model_fields]


@pytest.mark.parametrize("settings", settings_classes(), ids=lambda cls: cls.__name__)
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


# Capture cases (docs/capture-cases.md): each "### Cnn — title" section defines one case and names
# the tests that pin it as `tests/<file>.py::<test function>`.
CASES_DOC = ROOT / "docs" / "capture-cases.md"
CASE_CODE = re.compile(r"\bC(\d{2})\b")
PINNING_TEST = re.compile(r"`(tests/\w+\.py)::(\w+)`")


def _case_sections() -> dict[str, str]:
    """``{case code: text of its section}`` from the headings of docs/capture-cases.md."""
    parts = re.split(r"^### (C\d{2})\b.*$", CASES_DOC.read_text(), flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_capture_case_cited_in_the_source_tests_or_docs_is_defined() -> None:
    defined = _case_sections()
    assert sorted(defined) == [f"C{n:02d}" for n in range(1, 19)]
    packages = ("gateway", "datapool", "trainer_bridge", "trajgate", "tests")
    citing = [path for package in packages for path in (ROOT / package).rglob("*.py")]
    citing += [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    undefined = sorted(
        f"C{number} in {path.relative_to(ROOT)}"
        for path in citing
        for number in set(CASE_CODE.findall(path.read_text()))
        if f"C{number}" not in defined
    )
    assert undefined == []


def test_every_library_module_that_cites_a_capture_case_points_to_its_definitions() -> None:
    packages = ("gateway", "datapool", "trainer_bridge", "trajgate")
    modules = [path for package in packages for path in (ROOT / package).rglob("*.py")]
    pointerless = sorted(
        str(path.relative_to(ROOT))
        for path in modules
        if CASE_CODE.search(text := path.read_text()) and "docs/capture-cases.md" not in text
    )
    assert pointerless == []


def test_every_capture_case_is_pinned_by_tests_that_exist() -> None:
    problems: list[str] = []
    for case, section in _case_sections().items():
        pins = PINNING_TEST.findall(section)
        if not pins:
            problems.append(f"{case}: names no test")
        for path, name in pins:
            test_file = ROOT / path
            source = test_file.read_text() if test_file.exists() else ""
            if not re.search(rf"^def {name}\(", source, flags=re.MULTILINE):
                problems.append(f"{case}: {path}::{name} does not exist")
    assert problems == []


# "issue 29 item 6" in a comment points at a tracker a reader of the repository does not have:
# the code and docs say the reason, or name the test, instead.
ISSUE_CITATION = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)


def test_no_code_or_doc_cites_an_issue_number() -> None:
    packages = ("gateway", "datapool", "trainer_bridge", "trajgate", "migrations", "scripts")
    paths = [path for package in packages for path in (ROOT / package).rglob("*.py")]
    paths += [path for path in (ROOT / "tests").glob("*.py") if path.name != "test_docs.py"]
    paths += [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "scripts").glob("*.sh")]
    citing = sorted(
        f"{path.relative_to(ROOT)}:{number}: {line.strip()[:80]}"
        for path in paths
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if ISSUE_CITATION.search(line)
    )
    assert citing == []


def test_no_doc_says_break_kinds_come_from_the_clients_body() -> None:
    # Lineage classifies a break from the canonical records (datapool/steps/lineage.py reads
    # ``canonical_keys`` and the call's ``canonical``), the same in every dialect.
    claim = re.compile(
        r"kind[^.]*\bbreak[^.]*\b(read|taken|comes?)\s+from\s+the\s+client's", re.IGNORECASE
    )
    assert [match.group(0) for match in claim.finditer(" ".join(DOCS.split()))] == []


def test_every_dialect_is_a_folder_as_the_dialects_package_says() -> None:
    from gateway import dialects

    folders = sorted(
        path.name
        for path in (ROOT / "gateway" / "dialects").iterdir()
        if (path / "__init__.py").exists()
    )
    homes = sorted(type(dialect).__module__.split(".")[2] for dialect in dialects.DIALECTS)
    assert homes == folders  # each dialect's class lives in its own folder, one per dialect
    assert all(type(d).__module__.count(".") == 3 for d in dialects.DIALECTS)  # folder.module
    assert dialects.__doc__ is not None
    assert "one folder each" in dialects.__doc__ and "one module each" not in dialects.__doc__
