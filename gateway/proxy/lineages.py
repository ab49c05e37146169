"""Which conversation of its trajectory a call belongs to, as its client's headers say.

Owns: reading a call's lineage (``datapool.steps.records.LineageRecord``: id, parent lineage,
kind) from the headers a coding agent sends, and from trajgate's own ``X-Trajgate-Lineage``
headers for agents it does not know. Never: infers a lineage from the messages (the pool does
that for a call without these headers: ``datapool.steps.lineage``), or reads the body.

In order, the first that applies (the lineage id, its parent lineage, its kind):

- any client: ``X-Trajgate-Lineage`` (the id), ``X-Trajgate-Lineage-Parent``,
  ``X-Trajgate-Lineage-Kind`` (else ``subagent`` with a parent, ``main`` without);
- Claude Code: the id is ``x-claude-code-agent-id`` (sub-agents), else
  ``x-claude-code-session-id``; a sub-agent's parent is ``x-claude-code-parent-agent-id``, else
  the session; the kind is ``x-claude-code-request-class`` (``CLAUDE_CODE_CLASSES``), else
  ``subagent`` with an agent id, ``main`` without;
- Codex: the id is ``thread-id``, else ``session-id`` (or the same in ``x-codex-turn-metadata``);
  the kind ``compaction`` by the metadata's ``request_kind``, ``main`` for ``agent_name``
  ``/root`` or none, else ``subagent`` whose parent is the session when it differs;
- OpenCode: the id is ``x-session-id``, the parent ``x-parent-session-id`` (then ``subagent``,
  else ``main``).

A ``side_call`` or ``compaction`` lineage starts at its call (its id is the call's first step
id) with the named lineage as its parent: each title, summary or compaction request is a
conversation of its own. A client's own header that cannot be an id (empty, over 200
characters, not printable ASCII) is ignored and the next rule applies; trajgate's own headers
are checked: a malformed one is a 400 in the call's dialect (``InvalidRequestError``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from datapool.steps.records import LINEAGE_KINDS, LineageKind, LineageRecord
from gateway.errors import InvalidRequestError

LINEAGE_HEADER = "x-trajgate-lineage"
LINEAGE_PARENT_HEADER = "x-trajgate-lineage-parent"
LINEAGE_KIND_HEADER = "x-trajgate-lineage-kind"
# Our own ids: the trajectory id syntax (``gateway.proxy.attribution``).
LINEAGE_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}")
# A client's ids (UUIDs, agent names): any printable ASCII without spaces, 1-200 characters.
_CLIENT_ID_PATTERN = re.compile(r"[\x21-\x7e]{1,200}")
# Kinds that start a lineage at their call instead of naming one.
_STARTS_HERE: tuple[LineageKind, ...] = ("side_call", "compaction")
# Claude Code's ``x-claude-code-request-class`` values and the lineage kind each is.
CLAUDE_CODE_CLASSES: dict[str, LineageKind] = {
    "main": "main",
    "subagent": "subagent",
    "workflow": "subagent",
    "compaction": "compaction",
    "auxiliary": "side_call",
    "side_reply": "side_call",
}


def lineage_of(headers: Mapping[str, str]) -> LineageRecord | None:
    """The lineage the call's headers name (keys lower-case, as Starlette's ``Headers``), or
    None when none does (the pool infers it). Raises ``InvalidRequestError`` for a malformed
    ``X-Trajgate-Lineage*`` header."""
    return _trajgate(headers) or _claude_code(headers) or _codex(headers) or _opencode(headers)


def _trajgate(headers: Mapping[str, str]) -> LineageRecord | None:
    lineage = _own_id(headers, LINEAGE_HEADER)
    parent = _own_id(headers, LINEAGE_PARENT_HEADER)
    kind_text = headers.get(LINEAGE_KIND_HEADER)
    if lineage is None and parent is None and kind_text is None:
        return None
    kind: LineageKind | None = None
    if kind_text is not None:
        kind = next((k for k in LINEAGE_KINDS if k == kind_text), None)
        if kind is None:
            raise InvalidRequestError(
                f"X-Trajgate-Lineage-Kind must be one of {', '.join(LINEAGE_KINDS)}; "
                f"got {kind_text[:80]!r}",
                param="X-Trajgate-Lineage-Kind",
            )
    if lineage is not None and lineage == parent:
        raise InvalidRequestError(
            f"X-Trajgate-Lineage-Parent must name another lineage than X-Trajgate-Lineage; "
            f"both are {lineage!r}",
            param="X-Trajgate-Lineage-Parent",
        )
    if lineage is None:
        if kind not in _STARTS_HERE:
            raise InvalidRequestError(
                "X-Trajgate-Lineage-Parent or X-Trajgate-Lineage-Kind without "
                "X-Trajgate-Lineage: only a lineage that starts at this call "
                f"(kind {' or '.join(_STARTS_HERE)}) needs no id; got kind {kind_text!r}",
                param="X-Trajgate-Lineage",
            )
        return LineageRecord(None, parent, kind)
    if kind is None:
        kind = "main" if parent is None else "subagent"
    if kind in _STARTS_HERE:  # a new lineage whose parent is the one named
        return LineageRecord(None, lineage, kind)
    return LineageRecord(lineage, parent, kind)


def _own_id(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        return None
    if not LINEAGE_ID_PATTERN.fullmatch(value):
        raise InvalidRequestError(
            f"{_title(name)} must be 1-200 characters of letters, digits, '.', '_', ':' or '-' "
            f"starting with a letter or digit; got {value[:80]!r}",
            param=_title(name),
        )
    return value


def _title(name: str) -> str:
    return "-".join("X" if part == "x" else part.capitalize() for part in name.split("-"))


def _client_id(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None or not _CLIENT_ID_PATTERN.fullmatch(value):
        return None
    return value


def _claude_code(headers: Mapping[str, str]) -> LineageRecord | None:
    session = _client_id(headers, "x-claude-code-session-id")
    agent = _client_id(headers, "x-claude-code-agent-id")
    if session is None and agent is None:
        return None
    parent_agent = _client_id(headers, "x-claude-code-parent-agent-id")
    request_class = headers.get("x-claude-code-request-class")
    kind = CLAUDE_CODE_CLASSES.get(request_class or "")
    if kind is None:
        kind = "main" if agent is None else "subagent"
    lineage = agent or session
    parent = parent_agent if agent is not None else None
    if agent is not None and parent is None and session != agent:
        parent = session
    if kind in _STARTS_HERE:
        return LineageRecord(None, lineage, kind)
    return LineageRecord(lineage, parent if kind != "main" else None, kind)


def _codex(headers: Mapping[str, str]) -> LineageRecord | None:
    session = _client_id(headers, "session-id")
    thread = _client_id(headers, "thread-id")
    metadata = _turn_metadata(headers.get("x-codex-turn-metadata"))
    if session is None:
        session = _client_text(metadata.get("session_id"))
    if thread is None:
        thread = _client_text(metadata.get("thread_id"))
    lineage = thread or session
    if lineage is None:
        return None
    if metadata.get("request_kind") == "compaction":
        return LineageRecord(None, lineage, "compaction")
    agent = metadata.get("agent_name")
    if agent in (None, "/root"):
        return LineageRecord(lineage, None, "main")
    parent = session if session is not None and session != lineage else None
    return LineageRecord(lineage, parent, "subagent")


def _turn_metadata(text: str | None) -> dict[str, object]:
    """Codex's ``x-codex-turn-metadata`` as a JSON object ({} when absent or not one)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _client_text(value: object) -> str | None:
    if isinstance(value, str) and _CLIENT_ID_PATTERN.fullmatch(value):
        return value
    return None


def _opencode(headers: Mapping[str, str]) -> LineageRecord | None:
    session = _client_id(headers, "x-session-id")
    if session is None:
        return None
    parent = _client_id(headers, "x-parent-session-id")
    if parent == session:
        parent = None
    return LineageRecord(session, parent, "main" if parent is None else "subagent")
