"""Running the gateway app in a background thread of the current process (demo and tests).

Owns: a uvicorn server bound to a real TCP port, started and stopped on demand. Never: used by
``trajgate serve``, which runs uvicorn in the foreground.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI

from gateway.http_protocol import server_protocol


class BackgroundServer:
    """A uvicorn server for ``app`` on ``host:port`` in a daemon thread.

    Raises:
        RuntimeError: from ``start`` when the server did not come up within ``timeout_s``.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 8000) -> None:
        # Keep-alive longer than clients' idle timeout (httpx: 5 s): the server must not close a
        # connection a client is about to reuse (under load that race reset connections).
        # The gateway's protocol as its settings pick it (gateway.http_protocol); an app without
        # the gateway's settings (a helper server of a test or bench) gets uvicorn's own.
        settings = getattr(app.state, "settings", None)
        http: Any = "httptools" if settings is None else server_protocol(settings)
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            lifespan="on",
            timeout_keep_alive=75,
            http=http,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self.app = app
        self.url = f"http://{host}:{port}"

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
