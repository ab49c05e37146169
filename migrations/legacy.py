"""How rows written before a revision read: rules the pool's code held then, frozen here.

The migrations that rewrite or read old rows use these, so a later change of the pool's code
cannot change how an old row is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Before revision 0013 a stored request's history list (the one stored as a delta on the
# parent's) was its first list among these fields: chat's and the Messages API's ``messages``,
# the Responses API's ``input``.
HISTORY_FIELDS_BEFORE_0013 = ("messages", "input")


def history_field_before_0013(request: Mapping[str, Any]) -> str | None:
    """The field a request stored before revision 0013 keeps its history in, None when none."""
    for name in HISTORY_FIELDS_BEFORE_0013:
        if isinstance(request.get(name), list):
            return name
    return None
