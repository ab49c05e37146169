"""The emulator's weight-update endpoints, in vLLM 0.32 dev mode's shapes, failing on demand.

Owns: ``POST /pause``, ``/resume``, ``/collective_rpc`` (``reload_weights``),
``/reset_prefix_cache`` and ``/update_weight_version``, what a full-weight update of the
gateway sends (``gateway.upstream.weight_update``); the engine's weight version label, which
``/inference/v1/generate`` reports as ``weight_versions`` (``trajgate.bench.scale_out``); the
paths asked, in order; and faults: a path told to fail (``WeightEndpoints.faults``) answers
that status in vLLM's error envelope and changes nothing (a vLLM without the route answers
404; one whose reload broke, 500). Never: loads weights or freezes requests (``/pause``
answers at once: the emulator samples nothing a pause could split).
"""

from __future__ import annotations

import json
from typing import Any

PAUSE_PATH = "/pause"
RESUME_PATH = "/resume"
RELOAD_PATH = "/collective_rpc"
RESET_PATH = "/reset_prefix_cache"
LABEL_PATH = "/update_weight_version"
PATHS = (PAUSE_PATH, RESUME_PATH, RELOAD_PATH, RESET_PATH, LABEL_PATH)


class WeightEndpoints:
    """One engine's weight state: ``label`` (``"default"`` until ``/update_weight_version``
    sets one, as in vLLM), ``weights_path`` (the last reload's), ``asked`` (the paths asked, in
    order) and ``faults`` (path -> HTTP status it answers instead)."""

    def __init__(self) -> None:
        self.label = "default"
        self.weights_path: str | None = None
        self.asked: list[str] = []
        self.faults: dict[str, int] = {}

    def answer(self, path: str, raw: bytes) -> tuple[int, dict[str, Any]]:
        """The status and JSON body of a POST to ``path`` (one of ``PATHS``) with body ``raw``."""
        self.asked.append(path)
        status = self.faults.get(path)
        if status is not None:
            return status, _error(status, f"{path} failed (the emulator was told to fail it)")
        try:
            body = json.loads(raw or b"{}")
        except ValueError as exc:
            return 400, _error(400, f"body is not JSON: {exc}")
        if not isinstance(body, dict):
            return 400, _error(400, "body must be a JSON object")
        if path == LABEL_PATH:
            label = body.get("new_version")
            if not isinstance(label, str):
                return 400, _error(400, f"new_version must be a string, got {label!r}")
            self.label = label
        elif path == RELOAD_PATH:
            kwargs = body.get("kwargs")
            if body.get("method") != "reload_weights" or not isinstance(kwargs, dict):
                return 400, _error(400, "the emulator reloads only: method 'reload_weights'")
            self.weights_path = str(kwargs.get("weights_path"))
        elif path == RESET_PATH:
            return 200, {"success": True}
        return 200, {}


def _error(status: int, message: str) -> dict[str, Any]:
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}
