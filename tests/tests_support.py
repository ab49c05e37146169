"""Helpers every kind of test uses, kept here so that no test borrows a benchmark's internals.

Owns: ``free_port`` (a TCP port on 127.0.0.1 that nothing listens on) and ``TRAJGATE`` (this
environment's ``trajgate`` command). Never: starts servers or touches a pool; fixtures live in
``conftest.py``, gateway helpers in ``gateway_helpers.py``.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

# The `trajgate` command installed next to this interpreter, for tests that run it as a process.
TRAJGATE = str(Path(sys.executable).with_name("trajgate"))


def free_port() -> int:
    """A port on 127.0.0.1 that the OS just handed out, so nothing listens on it yet.

    The socket is closed before returning, so another process could take the port before the
    caller binds it; the OS hands ports out in turn, which makes that rare enough for tests.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
