"""A dialect is one module: a throw-away API defined here, registered the way a user
registers one (``create_app(..., dialects=(*DIALECTS, Toy()))``), is served, captured, rewarded
by a built-in reward function and exported as chat messages through the real vLLM, with no
change anywhere else. Its own side route (a token count) is served too.

The toy API: ``POST /v1/toy/generate`` with ``{"model", "turns": [[who, what], ...], "tools":
{name: JSON schema}, "must_call": name, "max_new": N}`` where ``who`` is ``user``, ``bot``
(``what`` a string or ``{"tool": name, "args": {...}}``) or ``tool`` (the last call's result);
it answers ``{"said": text, "calls": [{"tool", "args"}], "why": finish reason}``.
``POST /v1/toy/count`` answers ``{"tokens": N}``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
from gateway_helpers import steps_of
from tests_support import free_port
from typer.testing import CliRunner

from datapool.settings import PoolSettings
from gateway.app import create_app
from gateway.dialects import DIALECTS, Engine, Prepared, SideRoute
from gateway.dialects.base import DialectStream
from gateway.dialects.translation import (
    TranslatedPrepared,
    TranslatingDialect,
    client_asked,
    with_capture_fields,
)
from gateway.errors import InvalidRequestError
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings
from trajgate import vllm_server
from trajgate.cli import app as cli

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
    "required": ["city"],
    "additionalProperties": False,
}


def chat_of(body: dict[str, Any]) -> dict[str, Any]:
    """The toy body as a chat completions body (no capture fields yet)."""
    turns = body.get("turns")
    if not isinstance(turns, list) or not turns:
        raise InvalidRequestError("'turns' must be a non-empty list", param="turns")
    messages: list[dict[str, Any]] = []
    last_call = ""
    for position, turn in enumerate(turns):
        who, what = turn
        if who == "bot" and isinstance(what, dict):
            last_call = f"toy-{position}"
            call = {"name": what["tool"], "arguments": json.dumps(what["args"])}
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": last_call, "type": "function", "function": call}],
                }
            )
        elif who == "tool":
            messages.append({"role": "tool", "tool_call_id": last_call, "content": what})
        else:
            messages.append({"role": "assistant" if who == "bot" else "user", "content": what})
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    tools = body.get("tools") or {}
    if tools:
        chat["tools"] = [
            {"type": "function", "function": {"name": name, "strict": True, "parameters": schema}}
            for name, schema in tools.items()
        ]
    if body.get("must_call"):
        chat["tool_choice"] = {"type": "function", "function": {"name": body["must_call"]}}
    if body.get("max_new") is not None:
        chat["max_tokens"] = body["max_new"]
    return chat


async def count(body: dict[str, Any], engine: Engine) -> dict[str, Any]:
    chat = chat_of(body)
    answer = await engine.tokenize({"model": chat["model"], "messages": chat["messages"]})
    return {"tokens": answer["count"]}


class Toy(TranslatingDialect):
    name = "toy"
    client_paths = ("/toy/generate",)
    history_field = "turns"
    side_routes = (SideRoute("/toy/count", count),)

    def prepare(self, body: dict[str, Any]) -> Prepared:
        if body.get("stream"):
            raise InvalidRequestError("the toy API does not stream", param="stream")
        return TranslatedPrepared(body, with_capture_fields(chat_of(body)), client_asked(False))

    def client_answer(self, prepared: Prepared, answer: dict[str, Any]) -> dict[str, Any]:
        choice = answer["choices"][0]
        message = choice["message"]
        calls = [
            {"tool": c["function"]["name"], "args": c["function"]["arguments"]}
            for c in message.get("tool_calls") or ()
        ]
        return {"said": message.get("content"), "calls": calls, "why": choice["finish_reason"]}

    def open_stream(self, prepared: Prepared, system_fingerprint: str | None) -> DialectStream:
        raise AssertionError("prepare refuses streams")


def test_a_dialect_defined_in_a_test_is_served_captured_rewarded_and_exported(
    vllm: vllm_server.VLLMServer, sqlite_pool: PoolSettings, tmp_path: Path
) -> None:
    pool = PoolSettings(
        data_dir=sqlite_pool.data_dir,
        database_url=sqlite_pool.database_url,
        reward_functions=["tool_call_format"],
    )
    settings = GatewaySettings(upstream_url=vllm.url, port=free_port())
    server = BackgroundServer(
        create_app(settings, pool, dialects=(*DIALECTS, Toy())), port=settings.port
    ).start()
    ask = {"model": "tiny", "turns": [["user", "Weather in Paris?"]], "tools": {"weather": CITY}}
    try:
        with httpx.Client(base_url=server.url, timeout=180) as api:
            counted = api.post("/t/toy-1/v1/toy/count", json=ask)
            # vLLM forces the call under the schema (strict); 192 tokens: the tiny model pads
            # the forced call with whitespace for up to ~130 before closing it.
            forced = api.post(
                "/t/toy-1/v1/toy/generate",
                json={**ask, "must_call": "weather", "max_new": 192, "temperature": 0},
            )
            refused = api.post("/t/toy-1/v1/toy/generate", json={"model": "tiny", "turns": []})
            assert forced.status_code == 200, forced.text
            [call] = forced.json()["calls"]
            turns = [*ask["turns"], ["bot", {"tool": "weather", "args": json.loads(call["args"])}]]
            final = api.post(
                "/t/toy-1/v1/toy/generate",
                json={**ask, "turns": [*turns, ["tool", "sunny"]], "max_new": 4},
            )
            assert final.status_code == 200, final.text
            assert api.post("/api/trajectories/toy-1/complete").status_code == 200
            deadline = time.monotonic() + 60
            rewards: dict[str, float] = {}
            while time.monotonic() < deadline and not rewards:
                time.sleep(0.2)  # the complete endpoint woke the hooks; they run after it
                rewards = api.get("/api/trajectories/toy-1").json()["rewards"]
    finally:
        server.stop()

    # Served: its side route counts the translated prompt with vLLM's /tokenize.
    assert counted.status_code == 200, counted.text
    assert counted.json()["tokens"] > 0
    # Its own 400s in the default (OpenAI) envelope, nothing recorded for them.
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "turns"
    # Captured: two steps of the toy endpoint with the engine's ids, the second a child of
    # the first (found by token ids), each with its canonical record.
    first, second = steps_of(pool, "toy-1")
    assert (first.endpoint, second.endpoint) == ("toy", "toy")
    assert first.prompt_token_ids and first.response_token_ids and second.prompt_token_ids
    assert second.parent_step_id == first.id
    assert first.call is not None and first.call.tool_named("weather") is not None
    # Rewarded: the built-in reward found the one generated call in the canonical record;
    # "weather" was offered, its arguments hold the required "city" -> 1 / 1 (the same
    # trajectory reads as having no tool call, None, if the pool read the toy body).
    assert rewards == {"tool_call_format": 1.0}

    # Exported: a merged batch, as chat messages for SFT (the canonical conversation).
    db = ["--database-url", pool.resolved_database_url(), "--data-dir", str(tmp_path)]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"algorithm": "reinforce_pp", "reward_names": ["tool_call_format"]}))
    runner = CliRunner()
    created = runner.invoke(cli, ["batches", "create", "--spec", str(spec), *db])
    assert created.exit_code == 0, created.output
    batch_id = json.loads(created.output)["id"]
    out = tmp_path / "sft.jsonl"
    exported = runner.invoke(
        cli, ["batches", "export", batch_id, "--out", str(out), "--format", "messages", *db]
    )
    assert exported.exit_code == 0, exported.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) >= 1 and all(r["reward"] == 1.0 for r in records)
    last = records[-1]["messages"]
    assert [m["role"] for m in last] == ["user", "assistant", "tool", "assistant"]
    assert last[0]["content"] == "Weather in Paris?"
    assert last[1]["tool_calls"][0]["function"]["name"] == "weather"
    assert json.loads(last[1]["tool_calls"][0]["function"]["arguments"]) == json.loads(call["args"])
    assert last[2] == {"role": "tool", "content": "sunny", "tool_call_id": "toy-1"}
