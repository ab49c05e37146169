"""The emulator's weight-update endpoints, in vLLM 0.32 dev mode's shapes, failing on demand.

Owns: ``POST /pause``, ``/resume``, ``/collective_rpc`` (``reload_weights``),
``/reset_prefix_cache`` and ``/update_weight_version``, what a full-weight update of the
gateway sends (``gateway.engine.admin``); the engine's weight version label, which
``/inference/v1/generate`` reports as ``weight_versions`` (``trajgate.bench.scale_out``); the
paths asked, in order (faults included: the emulator's ``EmulatorThread.fail`` answers a
path told to fail before it gets here). Never: loads weights or freezes requests (``/pause``
answers at once: the emulator samples nothing a pause could split).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.engine.paths import (
    COLLECTIVE_RPC_PATH,
    RESET_PREFIX_CACHE_PATH,
    UPDATE_WEIGHT_VERSION_PATH,
)
from gateway.engine.paths import PAUSE_PATH as PAUSE_PATH
from gateway.engine.paths import RESUME_PATH as RESUME_PATH

# The paths it serves: the gateway's own constants, so the emulator answers where it asks.
RELOAD_PATH = COLLECTIVE_RPC_PATH
RESET_PATH = RESET_PREFIX_CACHE_PATH
LABEL_PATH = UPDATE_WEIGHT_VERSION_PATH
PATHS = (PAUSE_PATH, RESUME_PATH, RELOAD_PATH, RESET_PATH, LABEL_PATH)


class WeightEndpoints:
    """One engine's weight state: ``label`` (``"default"`` until ``/update_weight_version``
    sets one, as in vLLM), ``weights_path`` (the last reload's) and ``asked`` (the paths asked,
    in order, appended by the emulator)."""

    def __init__(self) -> None:
        self.label = "default"
        self.weights_path: str | None = None
        self.asked: list[str] = []

    def answer(self, path: str, raw: bytes) -> tuple[int, dict[str, Any]]:
        """The status and JSON body of a POST to ``path`` (one of ``PATHS``) with body ``raw``."""
        try:
            body = json.loads(raw or b"{}")
        except ValueError as exc:
            return 400, error_body(400, f"body is not JSON: {exc}")
        if not isinstance(body, dict):
            return 400, error_body(400, "body must be a JSON object")
        if path == LABEL_PATH:
            label = body.get("new_version")
            if not isinstance(label, str):
                return 400, error_body(400, f"new_version must be a string, got {label!r}")
            self.label = label
        elif path == RELOAD_PATH:
            kwargs = body.get("kwargs")
            if body.get("method") != "reload_weights" or not isinstance(kwargs, dict):
                return 400, error_body(400, "the emulator reloads only: method 'reload_weights'")
            self.weights_path = str(kwargs.get("weights_path"))
        elif path == RESET_PATH:
            return 200, {"success": True}
        return 200, {}


def error_body(status: int, message: str) -> dict[str, Any]:
    """vLLM's error envelope for ``status``."""
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}
