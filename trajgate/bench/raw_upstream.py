"""A replica on a real socket that sends whatever bytes it is given: for upstream answers that
break HTTP itself, or are too long to build in memory (``httpx.MockTransport`` frames its
answers properly, and vLLM never sends these). Used by ``tests/test_upstream_faults.py`` and
``scripts/upstream_memory.py``.

It answers ``GET`` (the health checks) with ``200 ok`` and every ``POST`` with the bytes
``answer()`` yields, then closes the connection. Never: reads the request's body or parses
HTTP beyond finding the head's end.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator


class RawUpstream:
    """Serves on ``127.0.0.1`` on a free port (``url``), one thread per connection."""

    def __init__(self, answer: Callable[[], Iterator[bytes]]) -> None:
        self._answer = answer
        self._socket = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._handle, args=(connection,), daemon=True).start()

    def _handle(self, connection: socket.socket) -> None:
        with connection:
            head = b""
            while b"\r\n\r\n" not in head:
                data = connection.recv(65536)
                if not data:
                    return
                head += data
            try:
                if head.startswith(b"GET"):
                    connection.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    return
                for piece in self._answer():
                    connection.sendall(piece)
            except OSError:
                return  # the gateway closed the connection: it refused the answer

    def close(self) -> None:
        self._socket.close()
