"""The engine room holds every exchange with vLLM: no module outside ``gateway/engine/`` writes
one of vLLM's endpoint paths (``gateway.engine.paths``) itself.

The check parses every ``.py`` of the packages with ``ast`` and looks at each string constant
(an f-string's literal parts included): one equal to an endpoint path, or starting with one
followed by a query, a further path or the end of a message word (``/pause?mode=keep``,
``/v1/models:``), names it. A module that must talk to vLLM imports the constant, or asks the
engine room. The import contracts (``.importlinter``, ``lint-imports``) keep the room from
importing the proxy, the dialects or the replicas.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gateway.engine.paths import ENGINE_PATHS

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("gateway", "datapool", "trainer_bridge", "trajgate")
ENGINE_ROOM = Path("gateway/engine")

# Modules that may write vLLM's paths themselves, and why.
EXEMPT_MODULES = {
    # It is an emulated vLLM server: it routes requests on these paths.
    "trajgate/bench/emulator.py",
    # It starts vLLM and waits for it to serve, before any gateway exists.
    "trajgate/vllm_server.py",
}
# Strings equal to a vLLM path that name the gateway's own route instead (the gateway serves
# vLLM's API under vLLM's paths), and why.
GATEWAY_ROUTES = {
    # The gateway serves its own /v1/models (vLLM's list, passed through) to clients.
    ("gateway/proxy/routes.py", "/v1/models"),
    # The gateway's own liveness probe.
    ("gateway/app.py", "/health"),
    # The benchmarks are the gateway's clients: they call its routes
    # (``/t/<trajectory>/v1/chat/completions``) and wait for the gateways and emulators they
    # started to answer ``/health``.
    ("trajgate/bench/fleet.py", "/health"),
    ("trajgate/bench/fleet.py", "/v1/chat/completions"),
    ("trajgate/bench/gateway.py", "/health"),
    ("trajgate/bench/weight_updates.py", "/v1/chat/completions"),
}


def engine_paths_named(source: str) -> list[str]:
    """The string constants of ``source`` (a module's text) that name a vLLM endpoint path."""
    found = []
    for node in ast.walk(ast.parse(source)):
        text = node.value if isinstance(node, ast.Constant) else None
        if isinstance(text, str) and any(_names(text, path) for path in ENGINE_PATHS):
            found.append(text)
    return found


def _names(text: str, path: str) -> bool:
    if not text.startswith(path):
        return False
    rest = text[len(path) :]
    return not rest or not (rest[0].isalnum() or rest[0] in "_-")


def _modules() -> list[Path]:
    modules = [
        module.relative_to(ROOT)
        for package in SCANNED
        for module in sorted((ROOT / package).rglob("*.py"))
    ]
    return [module for module in modules if not module.is_relative_to(ENGINE_ROOM)]


def test_no_module_outside_the_engine_room_names_a_vllm_endpoint_path() -> None:
    named = {}
    for module in _modules():
        if module.as_posix() in EXEMPT_MODULES:
            continue
        strings = engine_paths_named((ROOT / module).read_text())
        own = [s for s in strings if (module.as_posix(), s) not in GATEWAY_ROUTES]
        if own:
            named[module.as_posix()] = own
    assert named == {}, "use gateway.engine.paths, or move the exchange into gateway/engine/"


def test_the_exemptions_name_modules_that_exist() -> None:
    # A renamed module would leave its exemption behind, silently exempting nothing.
    for module in EXEMPT_MODULES | {module for module, _ in GATEWAY_ROUTES}:
        assert (ROOT / module).is_file(), module


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ('URL = "/v1/models"', ["/v1/models"]),
        ('url = f"{base}/inference/v1/generate"', ["/inference/v1/generate"]),
        ('path = "/pause?mode=keep"', ["/pause?mode=keep"]),
        ('error = f"{url}/v1/unload_lora_adapter -> {status}"', ["/v1/unload_lora_adapter -> "]),
        ('"""Asks /health, then /v1/models."""', []),  # prose that mentions a path
        ('route = "/t/{trajectory_id}/v1/models"', []),  # the gateway's own routes
        ('route = "/healthz"', []),  # another word
        ("from gateway.engine.paths import MODELS_PATH\nurl = f'{base}{MODELS_PATH}'", []),
    ],
)
def test_the_check_finds_a_path_written_as_a_string_and_only_then(
    source: str, found: list[str]
) -> None:
    assert engine_paths_named(source) == found


@pytest.mark.anyio
async def test_an_exchange_past_its_deadline_raises_a_timeout_the_attempts_classify() -> None:
    # httpx.MockTransport honours no timeout, so only the exchange's own deadline can end the
    # render: 0.05 s (the unary limits' longest) of a 10 s answer.
    import asyncio

    import httpx

    from gateway.engine.errors import ExchangeTimeoutError
    from gateway.engine.exact import _render
    from gateway.upstream.replicas import Replica

    async def slow_engine(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(10)
        return httpx.Response(200, json={})

    limits = httpx.Timeout(0.05, connect=0.01)
    async with httpx.AsyncClient(transport=httpx.MockTransport(slow_engine)) as client:
        with pytest.raises(ExchangeTimeoutError) as raised:
            await asyncio.wait_for(_render(client, Replica("http://r"), b"{}", limits), 5)
    # What gateway.proxy.attempts records as upstream_timeout (not upstream_unreachable).
    assert isinstance(raised.value, httpx.TimeoutException)
    assert not isinstance(raised.value, httpx.ConnectTimeout)
    assert "within 0.05 s" in str(raised.value)


@pytest.mark.anyio
async def test_a_200_answer_that_is_no_json_object_is_unreadable_as_httpx_decoding_error() -> None:
    import httpx

    from gateway.engine.errors import UnreadableAnswerError
    from gateway.engine.tokenize import Refused, tokenize

    def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize" and b"refuse" in request.content:
            return httpx.Response(400, content=b'{"error": "no"}')
        return httpx.Response(200, content=b"[1, 2]")

    async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
        refused = await tokenize(client, "http://r", {"refuse": True})
        assert refused == Refused(400, b'{"error": "no"}')
        with pytest.raises(UnreadableAnswerError) as raised:
            await tokenize(client, "http://r", {"model": "m"})
    assert isinstance(raised.value, httpx.DecodingError)  # recorded as upstream_error
