"""The CLI coding agents themselves, run headless against the gateway in front of the real vLLM.

Each agent is the pinned npm release that ``scripts/setup.sh`` installs (``trajgate.agents``),
run as a subprocess in a temporary HOME and work directory, attributed by the ``/t/<id>`` base
URL. The tiny model's answers are nonsense; what is tested is the protocol: the agent exits 0
(its streams were read to the end without error), and every call it made is a complete step of
that one trajectory whose prompt ids are vLLM's own tokenization of the request sent upstream
(or, where a call continues the previous turn, that turn's ids followed by the template's
rendering of the new messages: exact continuation, the default).

The tiny model never calls a tool by itself, so each agent's first call that offers tools is
steered (``ToolCallSteering``, a transport between the gateway and vLLM): vLLM's structured
output (``structured_outputs.regex``, which leaves the prompt as rendered) makes it write one
well-formed call of a harmless tool of that agent's own list, in the hermes format its tool
parser reads. The agent runs the tool and calls again (unsteered); the pool's built-in
``tool_call_format`` must find that call in the canonical record whatever the dialect (when it
read the client's body instead: a Messages ``tool_use`` or a Responses ``function_call``
counted as malformed, 0.0). The steered call is written as compact JSON
(``{"name":"Glob","arguments":{...}}``), a formatting the chat template never renders (it
writes ``", "`` and ``": "``), as a policy exploring its outputs does: the call that carries the
tool's result must continue that turn's own ids exactly (exact continuation), where the template's
rendering of the same history would not extend them (a prefix break at every tool turn).

Their requests are large (Qwen Code ~28k prompt tokens with the tiny model's tokenizer, Claude
Code ~17k plus ``max_tokens`` 32,000, Codex ~10k), which is why the tiny model has 131,072
positions; it ends a sampled turn after ~300 tokens on average, so each agent's answer is
complete. Wall time per agent on 2 CPU cores: 1-70 s, mostly decoding (the prompt prefill takes
1-3 s, then prefix caching).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_helpers import gateway_with, steps_of
from sqlalchemy import func, select
from test_body_storage import step_bytes
from tests_support import free_port

from datapool import db
from datapool.batches.build import build_rows
from datapool.batches.spec import BatchSpec
from datapool.curation.rules import INTEGRITY_FLAGS
from datapool.lifecycle.transitions import close_trajectory
from datapool.models import JsonBlob, Step, TrajectoryStatus
from datapool.settings import PoolSettings
from datapool.steps.bodies import blob_shas
from datapool.steps.store import PoolStore, StoredStep
from gateway.app import create_app
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings
from trajgate import agents
from trajgate.vllm_server import VLLMServer

AGENT_TIMEOUT_S = 600.0
# Tools the steered call may name, first found first (read-only, or a harmless command), and
# the literal each required argument gets: a string, or a list of strings.
SAFE_TOOLS = ("Glob", "Read", "list_directory", "glob", "read_file", "shell", "view_image")
STRING_ARGUMENT = "hello.py"
COMMAND_ARGUMENT = ["ls"]


class ToolCallSteering(httpx.AsyncBaseTransport):
    """Between the gateway and vLLM: a chat call that offers tools and has no tool call in its
    history yet (an agent's first turn) gets ``structured_outputs.regex`` for one hermes tool
    call of the first of ``SAFE_TOOLS`` it offers whose required arguments are all strings
    or lists of strings. Everything else, and every answer, passes unchanged; the gateway
    records the body it sent (without the regex), and the prompt is the same."""

    def __init__(
        self,
        first: dict[str, dict[str, str]] | None = None,
        max_steered: int | None = None,
        follow_ups: bool = False,
    ) -> None:
        self.network = httpx.AsyncHTTPTransport()
        self.steered: list[str] = []  # the tool named in each steered call
        # At most this many calls are steered (None: every first turn of a conversation; a
        # compacted history has no tool result either, and steering it again never ends).
        self.max_steered = max_steered
        # Steer calls that carry a tool result too (up to ``max_steered``): more tool turns.
        self.follow_ups = follow_ups
        # Tools to steer one call to before ``SAFE_TOOLS``, with their arguments (a sub-agent's
        # spawn).
        self.first = first or {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path == "/v1/chat/completions":
            body = json.loads(await request.aread())
            regex = self.tool_call_regex(body)
            if regex is not None:
                body["structured_outputs"] = {"regex": regex}
                request = httpx.Request(
                    "POST",
                    request.url,
                    headers={"content-type": "application/json"},
                    content=json.dumps(body).encode(),
                    extensions=request.extensions,
                )
        return await self.network.handle_async_request(request)

    def tool_call_regex(self, body: dict[str, Any]) -> str | None:
        messages = body.get("messages") or []
        answered = any(m.get("role") == "tool" for m in messages)
        if not body.get("tools") or (answered and not self.follow_ups):
            return None
        if self.max_steered is not None and len(self.steered) >= self.max_steered:
            return None
        offered = {t["function"]["name"]: t["function"] for t in body["tools"]}
        for name in (*self.first, *SAFE_TOOLS):
            arguments = self.first.get(name) if name in offered else None
            if arguments is not None:
                self.first = {}  # once: the sub-agent it spawns is steered to a safe tool
            arguments = arguments or _literal_arguments(offered.get(name))
            if arguments is not None:
                self.steered.append(name)
                # Compact, unlike the template's rendering of the same call.
                call = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
                literal = re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", call)
                return "<tool_call>\\n" + literal + "\\n</tool_call>"
        return None

    async def aclose(self) -> None:
        await self.network.aclose()


def _literal_arguments(function: dict[str, Any] | None) -> dict[str, Any] | None:
    """Each required argument of ``function`` as ``STRING_ARGUMENT`` or ``COMMAND_ARGUMENT``;
    None when one is of another type (or there is no such function)."""
    if function is None:
        return None
    parameters = function.get("parameters") or {}
    properties = parameters.get("properties") or {}
    arguments: dict[str, Any] = {}
    for key in parameters.get("required") or []:
        kind = properties.get(key, {})
        if kind.get("type") == "string":
            arguments[key] = STRING_ARGUMENT
        elif kind.get("type") == "array" and (kind.get("items") or {}).get("type") == "string":
            arguments[key] = COMMAND_ARGUMENT
        else:
            return None
    return arguments or None


@pytest.fixture
def pool_settings(tmp_path: Path) -> PoolSettings:
    """A SQLite pool (the protocol is what is under test, not the backend) that runs the
    built-in ``tool_call_format`` on every completed trajectory."""
    url = f"sqlite:///{tmp_path / 'pool.sqlite3'}"
    db.upgrade(url)
    return PoolSettings(
        data_dir=tmp_path / "data", database_url=url, reward_functions=["tool_call_format"]
    )


@pytest.fixture
def steering() -> ToolCallSteering:
    return ToolCallSteering()


@pytest.fixture
def gateway(
    vllm: VLLMServer, pool_settings: PoolSettings, steering: ToolCallSteering
) -> Iterator[BackgroundServer]:
    settings = GatewaySettings(upstream_url=vllm.url, port=free_port())
    app = create_app(settings, pool_settings, upstream_transport=steering)
    server = BackgroundServer(app, port=settings.port).start()
    yield server
    server.stop()


def _assert_tool_calls_rewarded(
    gateway: BackgroundServer, steering: ToolCallSteering, trajectory_id: str
) -> None:
    """The steered call is in the trajectory, and the pool's ``tool_call_format`` finds it
    well-formed: it names an offered tool and its arguments hold every required key -> 1/1
    (an unsteered call of the tiny model never parses as a tool call)."""
    assert steering.steered, "the agent offered none of the tools the test can steer"
    with httpx.Client(base_url=gateway.url, timeout=60) as api:
        assert api.post(f"/api/trajectories/{trajectory_id}/complete").status_code == 200
        rewards: dict[str, float] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not rewards:
            time.sleep(0.2)  # the complete endpoint woke the hooks; they run after it
            rewards = api.get(f"/api/trajectories/{trajectory_id}").json()["rewards"]
    assert rewards == {"tool_call_format": 1.0}, (steering.steered, rewards)


def _assert_the_tool_turn_continues_exactly(vllm: VLLMServer, steps: list[StoredStep]) -> None:
    """Each call that carries the steered tool call's result extends the steered step as one
    token sequence: built ``exact``, the steered step's prompt and sampled ids (compact JSON)
    followed by the template's tail, no prefix break; while the template's rendering of that
    call's history does not start with those ids (template mode would break there)."""
    by_id = {step.id: step for step in steps}
    answered = 0
    for step in steps:
        parent = by_id.get(step.parent_step_id or "")
        call = step.call
        if parent is None or call is None or not parent.response.tool_calls:
            continue
        call_ids = {tool_call.id for tool_call in parent.response.tool_calls}
        if not any(m.role == "tool" and m.tool_call_id in call_ids for m in call.messages or ()):
            continue  # not the tool turn (e.g. a side call rooted elsewhere)
        answered += 1
        where = (step.step_index, step.endpoint)
        assert (step.continuation, step.extends_parent, step.divergence_kind) == (
            "exact",
            True,
            None,
        ), (where, step.divergence_detail)
        turn = parent.prompt_token_ids + parent.response_token_ids
        assert step.prompt_token_ids[: len(turn)] == turn, where
        rendered = _vllm_tokenize(vllm, step.upstream_request)
        assert rendered[: len(turn)] != turn, (where, "the template renders the call as sampled")
    assert answered, "no call carried the steered tool call's result"


def _agent_command(name: str) -> str:
    agent = agents.AGENTS[name]
    try:
        return str(agents.executable(agent))
    except agents.AgentNotInstalledError as exc:
        pytest.fail(str(exc), pytrace=False)


def _home(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose HOME and work directory are fresh: no user config, no history."""
    home = tmp_path / "home"
    work = tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "TMPDIR": str(tmp_path),
        "LANG": "C.UTF-8",
        "NO_COLOR": "1",
        "CI": "1",
    }
    return env, work


def _run_agent(argv: list[str], env: dict[str, str], cwd: Path) -> float:
    """Run the agent to its end and return its wall time (s); fail with its output if not 0."""
    started = time.monotonic()
    try:
        done = subprocess.run(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=AGENT_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{argv[0]} ran past {AGENT_TIMEOUT_S:.0f} s:\n{exc.stderr!r}", pytrace=False)
    wall_s = time.monotonic() - started
    print(f"{Path(argv[0]).name}: exit {done.returncode} after {wall_s:.1f} s")
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{done.stdout}\n{done.stderr}"
    return wall_s


def _vllm_tokenize(vllm: VLLMServer, upstream_request: dict[str, Any]) -> list[int]:
    """vLLM's own ids for the chat request the gateway sent upstream (its messages and tools)."""
    payload: dict[str, Any] = {"model": upstream_request["model"]}
    for key in ("messages", "tools", "chat_template_kwargs"):
        if upstream_request.get(key):
            payload[key] = upstream_request[key]
    response = httpx.post(f"{vllm.url}/tokenize", json=payload, timeout=60)
    assert response.status_code == 200, response.text
    tokens: list[int] = response.json()["tokens"]
    return tokens


def _assert_one_complete_trajectory(
    vllm: VLLMServer, pool_settings: PoolSettings, trajectory_id: str
) -> list[StoredStep]:
    """Every call landed, complete and with exact ids, in ``trajectory_id`` and nowhere else."""
    steps = steps_of(pool_settings, trajectory_id)
    assert steps, "the agent's calls did not reach the pool"
    engine = db.make_engine(pool_settings.resolved_database_url())
    try:
        with engine.connect() as conn:
            every_step = conn.execute(select(func.count()).select_from(Step)).scalar_one()
    finally:
        engine.dispose()
    assert every_step == len(steps)  # one trajectory holds every call
    assert [step.step_index for step in steps] == list(range(len(steps)))
    for step in steps:
        where = (step.step_index, step.endpoint)
        # "ok": the upstream answered and the client read the stream to its end (a client
        # that hangs up leaves "client_disconnect").
        assert step.outcome == "ok", (where, step.outcome, step.error)
        assert not set(INTEGRITY_FLAGS) & set(step.flags), (where, step.flags)
        assert step.prompt_token_ids, where
        assert step.response_token_ids, where
        assert step.response_logprobs is not None, where
        assert len(step.response_logprobs) == len(step.response_token_ids), where
        assert step.upstream_request is not None, where
        rendered = _vllm_tokenize(vllm, step.upstream_request)
        if step.continuation == "exact":  # the parent's ids, then the template's new tail
            suffix = step.suffix_tokens
            assert suffix and step.extends_parent, where
            assert step.prompt_token_ids[-suffix:] == rendered[-suffix:], where
        else:
            assert step.prompt_token_ids == rendered, where
    print(
        f"{trajectory_id}: {len(steps)} steps, prompt tokens {[s.prompt_tokens for s in steps]}, "
        f"completion tokens {[s.completion_tokens for s in steps]}"
    )
    return steps


def test_qwen_code_headless_lands_as_one_complete_trajectory(
    vllm: VLLMServer,
    gateway: BackgroundServer,
    pool_settings: PoolSettings,
    steering: ToolCallSteering,
    tmp_path: Path,
) -> None:
    """Qwen Code speaks Chat Completions: OPENAI_BASE_URL at the gateway, ``qwen -p``."""
    env, work = _home(tmp_path)
    env.update(
        OPENAI_BASE_URL=f"{gateway.url}/t/qwen-code-1/v1",
        OPENAI_API_KEY="unused",
        OPENAI_MODEL=vllm.served_model_name,
    )
    _run_agent([_agent_command("qwen-code"), "-p", "Write hello.py that prints hi."], env, work)
    steps = _assert_one_complete_trajectory(vllm, pool_settings, "qwen-code-1")
    assert {step.endpoint for step in steps} == {"chat.completions"}
    _assert_tool_calls_rewarded(gateway, steering, "qwen-code-1")
    _assert_the_tool_turn_continues_exactly(vllm, steps)


def test_codex_exec_lands_as_one_complete_trajectory(
    vllm: VLLMServer,
    gateway: BackgroundServer,
    pool_settings: PoolSettings,
    steering: ToolCallSteering,
    tmp_path: Path,
) -> None:
    """Codex speaks the Responses API only: a model provider whose base URL is the gateway."""
    env, work = _home(tmp_path)
    codex_home = tmp_path / "codex-home"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        f'model = "{vllm.served_model_name}"\n'
        'model_provider = "trajgate"\n'
        "[model_providers.trajgate]\n"
        'name = "trajgate"\n'
        f'base_url = "{gateway.url}/t/codex-1/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "TRAJGATE_API_KEY"\n'
    )
    env.update(CODEX_HOME=str(codex_home), TRAJGATE_API_KEY="unused")
    argv = [_agent_command("codex"), "exec", "--skip-git-repo-check", "Write hello.py."]
    _run_agent(argv, env, work)
    steps = _assert_one_complete_trajectory(vllm, pool_settings, "codex-1")
    assert {step.endpoint for step in steps} == {"responses"}
    _assert_tool_calls_rewarded(gateway, steering, "codex-1")
    _assert_the_tool_turn_continues_exactly(vllm, steps)


def test_claude_code_print_mode_lands_as_one_complete_trajectory(
    vllm: VLLMServer,
    gateway: BackgroundServer,
    pool_settings: PoolSettings,
    steering: ToolCallSteering,
    tmp_path: Path,
) -> None:
    """Claude Code speaks the Anthropic Messages API: ANTHROPIC_BASE_URL at the gateway."""
    env, work = _home(tmp_path)
    env.update(
        ANTHROPIC_BASE_URL=f"{gateway.url}/t/claude-code-1",
        ANTHROPIC_API_KEY="unused",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_AUTOUPDATER="1",
    )
    argv = [
        _agent_command("claude-code"),
        "-p",
        "Write hello.py.",
        "--model",
        vllm.served_model_name,
    ]
    _run_agent(argv, env, work)
    steps = _assert_one_complete_trajectory(vllm, pool_settings, "claude-code-1")
    assert {step.endpoint for step in steps} == {"messages"}
    _assert_tool_calls_rewarded(gateway, steering, "claude-code-1")
    _assert_the_tool_turn_continues_exactly(vllm, steps)


# Claude Code's sub-agent tool (``Agent``; ``Task`` in older releases) and a sub-agent that exists
# in every installation.
SPAWN = {
    "description": "Find hello.py",
    "prompt": "Find hello.py.",
    "subagent_type": "general-purpose",
}
SPAWN_TOOLS = ("Agent", "Task")


def test_claude_code_with_a_sub_agent_is_exact_unbroken_and_one_row_per_conversation(
    vllm: VLLMServer, pool_settings: PoolSettings, tmp_path: Path
) -> None:
    """Claude Code's first call is steered to its Agent tool: it spawns a sub-agent (its own
    conversation, first call ``[system, user, system]``) whose first call is steered to a safe
    tool; both go on. Before lineages: every step after the sub-agent's first call was flagged
    ``system_changed`` and the merged export gave one row per step."""
    steering = ToolCallSteering(dict.fromkeys(SPAWN_TOOLS, SPAWN))
    with gateway_with(pool_settings, free_port(), upstream_url=vllm.url, transport=steering) as gw:
        env, work = _home(tmp_path)
        env.update(
            ANTHROPIC_BASE_URL=f"{gw.url}/t/claude-sub",
            ANTHROPIC_API_KEY="unused",
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
            DISABLE_AUTOUPDATER="1",
        )
        argv = [_agent_command("claude-code"), "-p", "Write hello.py."]
        _run_agent([*argv, "--model", vllm.served_model_name], env, work)
    steps = _assert_one_complete_trajectory(vllm, pool_settings, "claude-sub")
    roots = [s for s in steps if s.parent_step_id is None]
    flagged = [(s.step_index, s.divergence_kind) for s in steps if "prefix_break" in s.flags]
    store = PoolStore(db.make_engine(pool_settings.resolved_database_url()), pool_settings)
    close_trajectory(store.sessions, "claude-sub", TrajectoryStatus.COMPLETE, final_reward=1.0)
    rows = build_rows(store, BatchSpec(algorithm="sft", layout="merged"))[0].to_pylist()
    print(
        f"claude-sub: steered {steering.steered}, roots {len(roots)}, prefix_break {flagged}, "
        f"continuation {[s.continuation for s in steps]}, "
        f"merged rows (steps each) {[len(r['step_ids']) for r in rows]}"
    )
    assert steering.steered[:2] in (["Agent", "Read"], ["Task", "Read"]), steering.steered
    assert len(roots) == 2 and flagged == []  # the main agent's conversation and its sub-agent's
    assert all(s.continuation == "exact" for s in steps if s.parent_step_id is not None)
    assert [r["step_ids"][0] for r in rows] == [s.id for s in roots]
    # Each conversation is the lineage Claude Code's headers name: the main agent's by
    # ``x-claude-code-session-id`` (the session its body's metadata names too), the sub-agent's
    # by ``x-claude-code-agent-id``, its parent the session.
    main, sub = roots
    session = json.loads(main.request["metadata"]["user_id"])["session_id"]
    assert (main.lineage_id, main.lineage_parent_id, main.lineage_kind) == (session, None, "main")
    assert (sub.lineage_parent_id, sub.lineage_kind) == (session, "subagent")
    assert sub.lineage_id not in (None, session)
    assert {s.lineage_source for s in steps} == {"headers"}
    by_id = {s.id: s for s in steps}
    for step in steps:
        root = step
        while root.parent_step_id is not None:
            root = by_id[root.parent_step_id]
        assert step.lineage_id == root.lineage_id
    assert [r["lineage_id"] for r in rows] == [session, sub.lineage_id]


# Codex compacts its history mid-turn when a call that asks for a follow-up (a tool call) ends
# with the conversation past this many tokens. Its first call is ~10.4k prompt tokens with the
# tiny model's tokenizer and is steered to a tool call, so it compacts right after it.
COMPACT_TOKEN_LIMIT = 10_000


def test_codex_compacting_mid_session_completes_with_the_compaction_call_recorded(
    vllm: VLLMServer, pool_settings: PoolSettings, tmp_path: Path
) -> None:
    """Codex with ``model_auto_compact_token_limit`` low enough to compact mid-session: its
    compaction request (a Responses body with ``tools: []`` and ``tool_choice: "auto"``,
    which vLLM refuses with a tool_choice and no tools) goes through the gateway, reaches vLLM
    and is a recorded step, and the session goes on after it. Before, the gateway
    passed the tool_choice on, vLLM answered 400 and Codex exited 1. One call is steered: the
    compacted history holds no tool result, and steering it again would compact forever."""
    steering = ToolCallSteering(max_steered=1)
    with gateway_with(pool_settings, free_port(), upstream_url=vllm.url, transport=steering) as gw:
        env, work = _home(tmp_path)
        codex_home = tmp_path / "codex-home"
        codex_home.mkdir()
        (codex_home / "config.toml").write_text(
            f'model = "{vllm.served_model_name}"\n'
            'model_provider = "trajgate"\n'
            f"model_auto_compact_token_limit = {COMPACT_TOKEN_LIMIT}\n"
            "[model_providers.trajgate]\n"
            'name = "trajgate"\n'
            f'base_url = "{gw.url}/t/codex-compact/v1"\n'
            'wire_api = "responses"\n'
            'env_key = "TRAJGATE_API_KEY"\n'
        )
        env.update(CODEX_HOME=str(codex_home), TRAJGATE_API_KEY="unused")
        argv = [_agent_command("codex"), "exec", "--skip-git-repo-check", "Write hello.py."]
        _run_agent(argv, env, work)
    steps = _assert_one_complete_trajectory(vllm, pool_settings, "codex-compact")
    compactions = [s for s in steps if s.request is not None and s.request.get("tools") == []]
    print(
        f"codex-compact: steered {steering.steered}, compaction steps "
        f"{[s.step_index for s in compactions]}, continuation {[s.continuation for s in steps]}, "
        f"kinds {[s.divergence_kind for s in steps]}, flags {[s.flags for s in steps]}"
    )
    # One compaction, right after the steered call (the only call that asked for a follow-up
    # past the limit), then the follow-up call on the compacted history.
    assert [s.step_index for s in compactions] == [1] and len(steps) >= 3
    steered, compaction, after = steps[0], steps[1], steps[2]
    assert compaction.request is not None and compaction.request["tool_choice"] == "auto"
    assert compaction.upstream_request is not None
    assert "tool_choice" not in compaction.upstream_request  # dropped, as OpenAI does
    # What it compacted: the history with the steered call and its result, then Codex's
    # compaction prompt (a user message).
    call_id = steered.response.tool_calls[0].id
    items = compaction.request["input"]
    kinds = [(item.get("type"), item.get("call_id")) for item in items]
    assert ("function_call", call_id) in kinds and ("function_call_output", call_id) in kinds
    assert items[-1]["role"] == "user"
    # The answer vLLM gave it is the summary the next call starts from, in place of the tool
    # turn (Codex's compacted history holds the user messages and the summary).
    summary = (compaction.response_message or {}).get("content")
    assert isinstance(summary, str) and summary.strip()
    assert after.request is not None
    rest = after.request["input"]
    assert all(item.get("type") == "message" for item in rest)
    assert summary.strip() in rest[-1]["content"][0]["text"]


def test_claude_code_with_its_billing_line_continues_exactly_and_stores_what_changed(
    vllm: VLLMServer, pool_settings: PoolSettings, tmp_path: Path
) -> None:
    """Claude Code believing it talks to Anthropic (``_CLAUDE_CODE_ASSUME_FIRST_PARTY_BASE_URL``)
    puts ``x-anthropic-billing-header: ...; cch=<hex>;`` in system block 0, a new ``cch`` on
    every request; vLLM strips that line before rendering. Four calls steered to a tool (three
    tool turns): every continuation is exact (0 of 2 before, ``system_changed`` breaks),
    and no continuation stores the system prompt or its history again (before, each stored a
    new system blob, its upstream messages as a new blob and its canonical messages whole, tens
    of KB growing with the turns)."""
    steering = ToolCallSteering(max_steered=STEERED_TURNS, follow_ups=True)
    with gateway_with(pool_settings, free_port(), upstream_url=vllm.url, transport=steering) as gw:
        env, work = _home(tmp_path)
        env.update(
            ANTHROPIC_BASE_URL=f"{gw.url}/t/claude-cch",
            ANTHROPIC_API_KEY="unused",
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
            DISABLE_AUTOUPDATER="1",
            _CLAUDE_CODE_ASSUME_FIRST_PARTY_BASE_URL="1",
        )
        argv = [_agent_command("claude-code"), "-p", "Write hello.py."]
        _run_agent([*argv, "--model", vllm.served_model_name], env, work)
    steps = _assert_one_complete_trajectory(vllm, pool_settings, "claude-cch")
    stored = _stored_bytes(pool_settings, "claude-cch")
    print(
        f"claude-cch: steered {steering.steered}, continuation "
        f"{[s.continuation for s in steps]}, flags {[s.flags for s in steps]}, stored bytes "
        f"per step {[b for b, _ in stored]}, new blobs {[n for _, n in stored]}"
    )
    assert len(steering.steered) == STEERED_TURNS
    cch = [_billing_cch(step.request) for step in steps]
    assert None not in cch and len(set(cch)) == len(cch), cch  # a new cch on every call
    continuations = [s for s in steps if s.parent_step_id is not None]
    assert len(continuations) >= STEERED_TURNS
    for step in continuations:
        where = step.step_index
        assert (step.continuation, step.extends_parent, step.flags) == ("exact", True, []), where
    # The system prompt (its blocks after the billing line) and the tool list are stored by the
    # first call only: a continuation adds no blob, and its row holds no copy of the prompt.
    request = steps[0].request or {}
    prompt = json.dumps(request["system"][-1]["text"])[1:201]  # as a JSON string holds it
    for step, (_, new_blobs) in zip(steps, stored, strict=True):
        if step.parent_step_id is not None:
            assert new_blobs == 0, step.step_index
            assert prompt not in _row_text(pool_settings, step.id), step.step_index
    # Steps 2 and 3 each add a steered tool turn of the same shape: the same bytes, give or take
    # ids (before, the later one stored one tool turn more of history again).
    assert stored[3][0] <= 1.1 * stored[2][0], stored


# Calls steered to a tool in the billing-line test: the first, then three that carry a result.
STEERED_TURNS = 4
CCH = re.compile(r"^x-anthropic-billing-header:.*\bcch=([0-9a-f]+);")


def _billing_cch(request: dict[str, Any] | None) -> str | None:
    """The ``cch`` of a Messages request's system block 0, None without a billing line."""
    system = (request or {}).get("system")
    if not isinstance(system, list) or not system:
        return None
    found = CCH.match(system[0].get("text", ""))
    return found.group(1) if found else None


def _row_text(pool_settings: PoolSettings, step_id: str) -> str:
    """A step row's stored bodies as the database holds them (JSON text)."""
    engine = db.make_engine(pool_settings.resolved_database_url())
    try:
        with engine.connect() as conn:
            row = conn.execute(
                select(Step.request, Step.upstream_request, Step.canonical).where(
                    Step.id == step_id
                )
            ).one()
    finally:
        engine.dispose()
    return json.dumps(list(row))


def _stored_bytes(pool_settings: PoolSettings, trajectory_id: str) -> list[tuple[int, int]]:
    """Per step (step order): the bytes its ``steps`` and ``step_payloads`` rows and the
    ``json_blobs`` rows it refers to first hold (as ``tests/test_body_storage.py`` counts
    them), and how many such blobs."""
    engine = db.make_engine(pool_settings.resolved_database_url())
    try:
        with engine.connect() as conn:
            blobs = dict(conn.execute(select(JsonBlob.sha256, func.length(JsonBlob.body))).all())
            deltas = conn.execute(
                select(Step.body_deltas)
                .where(Step.trajectory_id == trajectory_id)
                .order_by(Step.step_index)
            ).scalars()
            seen: set[str] = set()
            firsts: list[tuple[int, int]] = []
            for spec in deltas:
                new = blob_shas(spec) - seen
                seen |= new
                firsts.append((sum(blobs[sha] for sha in new), len(new)))
    finally:
        engine.dispose()
    store = PoolStore(db.make_engine(pool_settings.resolved_database_url()), pool_settings)
    rows = step_bytes(store, trajectory_id)
    store.engine.dispose()
    return [(row + blob, count) for row, (blob, count) in zip(rows, firsts, strict=True)]
