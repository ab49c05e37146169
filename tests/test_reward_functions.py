"""The built-in reward functions (``datapool.rewards.functions``) on SQLite and PostgreSQL:
exact match of the final answer, the tool-call format share, a reward model over HTTP (a real
local server: the reward model is an edge trajgate does not own), each failure recorded with its
error and a null value, and all three named by entry point through a real gateway and vLLM."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from batch_helpers import make_store
from fastapi import FastAPI, Request, Response
from gateway_helpers import WEATHER_TOOL
from pydantic import ValidationError
from sqlalchemy import select
from tests_support import free_port

from datapool.errors import InvalidPoolRequestError
from datapool.lifecycle import transitions as lifecycle
from datapool.models import Reward, TrajectoryStatus
from datapool.rewards.functions import normalize_answer
from datapool.rewards.values import current_rewards, run_reward_functions
from datapool.settings import PoolSettings
from datapool.steps.records import CallRecord, ChoiceRecord
from datapool.steps.store import PoolStore
from gateway.app import create_app
from gateway.dialects.chat_completions import ChatCompletions
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings
from trajgate.vllm_server import VLLMServer

LOOKUP_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}},
}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


# -- helpers ----------------------------------------------------------------------------------


def record(
    store: PoolStore,
    trajectory_id: str,
    response: dict[str, Any] | None,
    *,
    messages: list[dict[str, Any]] = QUESTION,
    tools: list[dict[str, Any]] | None = None,
    outcome: str = "ok",
    choices: int = 1,
) -> None:
    """One call as the gateway records it: ``choices`` copies of ``response`` (None: failed)."""
    request: dict[str, Any] = {"model": "tiny", "messages": messages}
    if tools is not None:
        request["tools"] = tools
    ids = None if response is None else [11, 12]
    store.record_call(
        trajectory_id,
        CallRecord(
            request=request,
            upstream_request=request,
            canonical=ChatCompletions().canonical(request),
            history_field="messages",
            model="tiny",
            upstream="http://up",
            policy_version=0,
            latency_ms=1.0,
            prompt_token_ids=[1, 2, 3],
            prompt_tokens=3,
            choices=[
                ChoiceRecord(i, ids, None if ids is None else [-0.5, -0.5], response, "stop")
                for i in range(choices)
            ],
            outcome=outcome,
            error=None if outcome == "ok" else "upstream answered 503",
        ),
    )


def answer(content: str | None, *tool_calls: tuple[str, str]) -> dict[str, Any]:
    """An assistant message with ``content`` and tool calls ``(name, arguments string)``."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [
            {"id": f"call-{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(tool_calls)
        ]
    return message


def create(store: PoolStore, trajectory_id: str, metadata: dict[str, Any] | None = None) -> None:
    lifecycle.create_trajectory(store.sessions, trajectory_id, metadata=metadata)


def complete(store: PoolStore, trajectory_id: str, *names: str) -> None:
    """Complete the trajectory and run ``names`` on it, as its completion hooks would."""
    lifecycle.close_trajectory(store.sessions, trajectory_id, TrajectoryStatus.COMPLETE)
    asyncio.run(run_reward_functions(store, trajectory_id, names))


def records(store: PoolStore, trajectory_id: str) -> list[tuple[str, float | None, str | None]]:
    """``(name, value, error)`` of every reward record of the trajectory, oldest first."""
    with store.sessions() as session:
        return [
            (r.name, r.value, r.error)
            for r in session.scalars(
                select(Reward).where(Reward.trajectory_id == trajectory_id).order_by(Reward.id)
            )
        ]


def current(store: PoolStore, trajectory_id: str) -> dict[str, float]:
    with store.sessions() as session:
        return current_rewards(session, "trajectory", [trajectory_id]).get(trajectory_id, {})


# -- what run_reward_functions records --------------------------------------------------------


def test_reward_function_returning_nan_is_recorded_as_failed_and_the_others_still_land(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    create(store, "nan")
    record(store, "nan", answer("Sunny."))
    complete(store, "nan", "pool_reward_fns:not_a_number", "pool_reward_fns:steps_times_half")
    [nan, half] = records(store, "nan")
    assert nan[:2] == ("not_a_number", None)
    assert nan[2] is not None and "expected a finite number" in nan[2]
    assert half == ("steps_times_half", 0.5, None)  # 0.5 * 1 step


# -- exact_match ------------------------------------------------------------------------------


def test_normalize_answer_strips_casefolds_and_collapses_whitespace() -> None:
    assert normalize_answer("  The\tCity  of\nLIGHT \r\n") == "the city of light"
    assert normalize_answer("Straße") == normalize_answer("STRASSE")  # casefold, not lower
    assert normalize_answer("Paris, France.") == "paris, france."  # punctuation is kept


def test_exact_match_rewards_one_for_an_expected_answer_and_zero_otherwise(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    cases = {  # id: (metadata answer, final content, expected reward)
        "right": ("Paris", "  paris \n", 1.0),
        "wrong": ("Paris", "London", 0.0),
        "one-of-a-list": (["Paris", "City of Light"], "city  of\tLIGHT", 1.0),
        "none-of-a-list": (["Paris", "Lyon"], "Paris, France", 0.0),  # punctuation is kept
    }
    for trajectory_id, (expected, content, _) in cases.items():
        create(store, trajectory_id, {"answer": expected})
        record(store, trajectory_id, answer("thinking", ("get_weather", '{"city": "Paris"}')))
        record(store, trajectory_id, answer(content))  # the final message is the last ok one
        complete(store, trajectory_id, "exact_match")
    for trajectory_id, (_, _, reward) in cases.items():
        assert records(store, trajectory_id) == [("exact_match", reward, None)], trajectory_id


def test_exact_match_without_what_it_compares_is_recorded_as_failed_never_zero(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    create(store, "no-answer", {"task": "weather"})
    record(store, "no-answer", answer("Paris"))
    create(store, "list-of-numbers", {"answer": [1, 2]})
    record(store, "list-of-numbers", answer("1"))
    create(store, "no-final-message", {"answer": "Paris"})
    record(store, "no-final-message", None, outcome="upstream_error")
    create(store, "only-tool-calls", {"answer": "Paris"})
    record(store, "only-tool-calls", answer(None, ("get_weather", '{"city": "Paris"}')))
    create(store, "two-final-choices", {"answer": "Paris"})
    record(store, "two-final-choices", answer("Paris"), choices=2)
    expected_errors = {
        "no-answer": "needs metadata['answer'], a string or a non-empty list of strings, "
        "got no 'answer' key",
        "list-of-numbers": "got [1, 2]",
        "no-final-message": "has no ok step with a generated message",
        "only-tool-calls": "has no text content (expected a string, got None",
        "two-final-choices": "sampled 2 choices; expected one final answer (n=1)",
    }
    for trajectory_id, error in expected_errors.items():
        complete(store, trajectory_id, "exact_match")
        [(name, value, recorded_error)] = records(store, trajectory_id)
        assert (name, value) == ("exact_match", None), trajectory_id
        assert recorded_error is not None and "RewardInputError" in recorded_error
        assert error in recorded_error, recorded_error
        assert current(store, trajectory_id) == {}  # unrewarded, not 0.0


# -- tool_call_format -------------------------------------------------------------------------


def test_tool_call_format_is_the_share_of_offered_tools_called_with_json_object_arguments(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    create(store, "tools")
    offered = [WEATHER_TOOL]
    record(
        store,
        "tools",
        answer(
            None,
            ("get_weather", '{"city": "Paris"}'),  # 1 well-formed
            ("get_time", "{}"),  # 2 not offered in this step
            ("get_weather", '{"city": "Par'),  # 3 not JSON (cut at max_tokens)
        ),
        tools=offered,
    )
    record(
        store,
        "tools",
        answer(
            "",
            ("get_weather", '["Paris"]'),  # 4 JSON, not an object
            ("get_weather", '{"town": "Paris"}'),  # 5 lacks the required "city"
            ("lookup", "{}"),  # 6 well-formed: lookup requires nothing
        ),
        tools=[WEATHER_TOOL, LOOKUP_TOOL],
    )
    record(store, "tools", answer(None, ("get_weather", '{"city": "Paris"}')))  # 7 no tools offered
    record(store, "tools", None, tools=offered, outcome="upstream_error")  # no message: not counted
    complete(store, "tools", "tool_call_format")
    # 7 generated calls, 2 of them (1 and 6) well-formed: 2 / 7.
    [(name, value, error)] = records(store, "tools")
    assert (name, error) == ("tool_call_format", None)
    assert value == pytest.approx(2 / 7)


def test_tool_call_format_of_a_trajectory_without_tool_calls_leaves_it_unrewarded(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    create(store, "plain")
    record(store, "plain", answer("It is sunny."), tools=[WEATHER_TOOL])
    complete(store, "plain", "tool_call_format")
    assert records(store, "plain") == []  # no record at all: neither 0.0 nor a failure
    assert current(store, "plain") == {}


# -- http_reward_model ------------------------------------------------------------------------


class RewardModel:
    """A reward model on a local port: each path answers one way; keeps the bodies it got."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        app = FastAPI()

        @app.post("/score")
        async def score(request: Request) -> dict[str, Any]:
            self.bodies.append(await request.json())
            return {"reward": 0.75, "explanation": "ignored"}

        @app.post("/named")
        async def named(request: Request) -> dict[str, Any]:
            self.bodies.append(await request.json())
            return {"rewards": {"helpful": 0.5, "harmless": -1}}

        @app.post("/crash")
        async def crash() -> Response:
            return Response("model crashed", status_code=500)

        @app.post("/malformed")
        async def malformed() -> dict[str, Any]:
            return {"score": 0.9}

        @app.post("/slow")
        async def slow() -> dict[str, Any]:
            await asyncio.sleep(6)  # far beyond the 2 s timeout the tests set
            return {"reward": 1.0}

        self.server = BackgroundServer(app, port=free_port())

    def bodies_of(self, trajectory_id: str) -> list[dict[str, Any]]:
        return [body for body in self.bodies if body["trajectory_id"] == trajectory_id]


@pytest.fixture(scope="module")
def reward_model_server() -> Iterator[RewardModel]:
    model = RewardModel()
    model.server.start()
    yield model
    model.server.stop()


@pytest.fixture
def reward_model(reward_model_server: RewardModel) -> RewardModel:
    """The module's reward model, with no bodies from earlier tests (same ids, other backend)."""
    reward_model_server.bodies.clear()
    return reward_model_server


def judged_store(pool_settings: PoolSettings, url: str) -> PoolStore:
    return make_store(
        # 2 s: a loaded CI machine must never time out a healthy answer (0.3 s once did).
        pool_settings.model_copy(update={"reward_model_url": url, "reward_model_timeout_s": 2.0})
    )


def test_http_reward_model_records_the_models_reward_for_the_final_step_it_was_sent(
    pool_settings: PoolSettings, reward_model: RewardModel
) -> None:
    store = judged_store(pool_settings, f"{reward_model.server.url}/score")
    create(store, "judged", {"answer": "Paris", "source": "eval-set-3"})
    record(store, "judged", answer("Let me check.", ("get_weather", '{"city": "Paris"}')))
    final_messages = [*QUESTION, {"role": "tool", "tool_call_id": "call-0", "content": "sunny"}]
    record(store, "judged", answer("Sunny in Paris."), messages=final_messages)
    complete(store, "judged", "http_reward_model")
    assert records(store, "judged") == [("http_reward_model", 0.75, None)]
    assert reward_model.bodies_of("judged") == [
        {
            "trajectory_id": "judged",
            "group_id": None,
            "channel": "train",
            "metadata": {"answer": "Paris", "source": "eval-set-3"},
            # the final step's request messages, then its generated message
            "messages": [*final_messages, {"role": "assistant", "content": "Sunny in Paris."}],
        }
    ]


def test_http_reward_model_records_each_reward_the_model_names(
    pool_settings: PoolSettings, reward_model: RewardModel
) -> None:
    store = judged_store(pool_settings, f"{reward_model.server.url}/named")
    create(store, "named")
    record(store, "named", answer("Sunny."))
    complete(store, "named", "http_reward_model")
    assert records(store, "named") == [("helpful", 0.5, None), ("harmless", -1.0, None)]


@pytest.mark.parametrize(
    ("path", "error"),
    [
        (
            "/crash",
            'expected HTTP 2xx with {"reward": number} or {"rewards": {"name": '
            "number, ...}}, got HTTP 500: model crashed",
        ),
        (
            "/malformed",
            'expected a JSON object {"reward": number} or {"rewards": {"name": '
            'number, ...}} with finite numbers, got {"score":0.9}',
        ),
        ("/slow", "did not answer within 2 s (reward_model_timeout_s)"),
        (None, "is unreachable: ConnectError"),  # a port nothing listens on
    ],
    ids=["500", "malformed", "timeout", "unreachable"],
)
def test_http_reward_model_failure_is_recorded_with_what_it_expected_and_got(
    pool_settings: PoolSettings, reward_model: RewardModel, path: str | None, error: str
) -> None:
    url = f"{reward_model.server.url}{path}" if path else f"http://127.0.0.1:{free_port()}/x"
    store = judged_store(pool_settings, url)
    create(store, "failed")
    record(store, "failed", answer("Sunny."))
    complete(store, "failed", "http_reward_model")
    [(name, value, recorded_error)] = records(store, "failed")
    assert (name, value) == ("http_reward_model", None)
    assert recorded_error is not None and "RewardModelError" in recorded_error
    assert error in recorded_error, recorded_error
    assert current(store, "failed") == {}  # unrewarded, not 0.0


def test_http_reward_model_without_a_url_or_within_the_lease_is_refused_at_start_up() -> None:
    with pytest.raises(ValidationError, match="set TRAJGATE_REWARD_MODEL_URL"):
        PoolSettings(reward_functions=["http_reward_model"])
    with pytest.raises(ValidationError, match=r"reward_model_timeout_s \(300\) must be below"):
        PoolSettings(
            reward_functions=["datapool.rewards.functions:http_reward_model"],
            reward_model_url="http://judge:8000/score",
            reward_model_timeout_s=300,
        )
    with pytest.raises(ValidationError, match="must start with http:// or https://"):
        PoolSettings(reward_model_url="judge:8000/score")


# -- end to end -------------------------------------------------------------------------------


def test_builtin_reward_functions_named_by_entry_point_reward_a_trajectory_completed_by_api(
    vllm: VLLMServer,
    pool_settings: PoolSettings,
    reward_model: RewardModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The names resolve through the installed package's entry points (pyproject.toml).
    monkeypatch.setenv(
        "TRAJGATE_REWARD_FUNCTIONS", '["exact_match", "tool_call_format", "http_reward_model"]'
    )
    monkeypatch.setenv("TRAJGATE_REWARD_MODEL_URL", f"{reward_model.server.url}/score")
    pool = PoolSettings(data_dir=pool_settings.data_dir, database_url=pool_settings.database_url)
    settings = GatewaySettings(upstream_url=vllm.url, port=free_port())
    server = BackgroundServer(create_app(settings, pool), port=settings.port).start()
    try:
        with httpx.Client(base_url=server.url, timeout=120) as api:
            created = api.post(
                "/api/trajectories",
                json={"id": "e2e-1", "metadata": {"answer": ["paris", "Paris, France"]}},
            )
            assert created.status_code == 201, created.text
            forced = api.post(
                "/t/e2e-1/v1/chat/completions",
                json={
                    "model": "tiny",
                    "messages": QUESTION,
                    "tools": [WEATHER_TOOL],
                    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                    "max_tokens": 192,  # the forced call pads with whitespace for up to ~130
                    "temperature": 0,
                    "seed": 3,
                },
            )
            assert forced.status_code == 200, forced.text
            [tool_call] = forced.json()["choices"][0]["message"]["tool_calls"]
            final_messages = [
                *QUESTION,
                {"role": "assistant", "content": "", "tool_calls": [tool_call]},
                {"role": "tool", "tool_call_id": tool_call["id"], "content": "sunny, 21 C"},
            ]
            final = api.post(
                "/t/e2e-1/v1/chat/completions",
                json={
                    "model": "tiny",
                    "messages": final_messages,
                    # vLLM's structured output: the random tiny model can only answer "Paris".
                    # No tools: with a strict tool offered, this vLLM sometimes samples under
                    # the tool-call grammar instead ("<tool_call>\n{..." cut at max_tokens).
                    "structured_outputs": {"choice": ["Paris"]},
                    "max_tokens": 8,
                },
            )
            assert final.status_code == 200, final.text
            assert final.json()["choices"][0]["message"]["content"] == "Paris"
            completed = api.post("/api/trajectories/e2e-1/complete")
            assert completed.status_code == 200, completed.text
            deadline = time.monotonic() + 60
            rewards: dict[str, float] = {}
            while time.monotonic() < deadline and len(rewards) < 3:
                time.sleep(0.2)  # the complete endpoint woke the hooks; they run after it
                rewards = api.get("/api/trajectories/e2e-1").json()["rewards"]
            history = api.get("/api/rewards", params={"trajectory_id": "e2e-1"}).json()
    finally:
        server.stop()
    # exact_match: "Paris" normalises to "paris", the first accepted answer -> 1.0.
    # tool_call_format: 1 generated call, get_weather was offered, its arguments are a JSON
    # object with the required "city" (vLLM constrained them to the schema) -> 1 / 1.
    # http_reward_model: the local model's fixed 0.75.
    assert rewards == {"exact_match": 1.0, "tool_call_format": 1.0, "http_reward_model": 0.75}
    assert [r["error"] for r in history] == [None, None, None]
    assert json.loads(tool_call["function"]["arguments"])["city"] in {"Paris", "London", "Tokyo"}
    [sent] = reward_model.bodies_of("e2e-1")
    assert sent["metadata"] == {"answer": ["paris", "Paris, France"]}
    # The judge reads the canonical conversation, not the client's body: empty
    # assistant content beside tool calls is no content (None), whatever the dialect sent.
    canonical_messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        final_messages[-1],
    ]
    assert sent["messages"][:-1] == canonical_messages
    assert sent["messages"][-1]["content"] == "Paris"


def test_gateway_refuses_to_start_with_a_reward_function_that_does_not_resolve(
    tmp_path: Path,
) -> None:
    env = {
        **os.environ,
        "TRAJGATE_REWARD_FUNCTIONS": '["exact_match", "exact_mach"]',
        "TRAJGATE_DATA_DIR": str(tmp_path / "data"),
    }
    trajgate = str(Path(sys.executable).with_name("trajgate"))
    done = subprocess.run(
        [trajgate, "serve", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2  # click's usage error, before anything listens
    assert "exact_mach" in done.stderr
    assert "trajgate.rewards" in done.stderr  # says where names are looked up
    with pytest.raises(InvalidPoolRequestError, match="exact_mach"):
        create_app(
            GatewaySettings(),
            PoolSettings(data_dir=tmp_path / "data", reward_functions=["exact_mach"]),
        )


def test_gateway_refuses_to_start_with_a_step_reward_function_that_does_not_resolve(
    tmp_path: Path,
) -> None:
    # Looked up in the step functions' own group: a trajectory function's name is not one.
    for name in ("tool_call_fromat", "exact_match", "no.such.module:fn"):
        with pytest.raises(InvalidPoolRequestError, match=name.replace(".", r"\.")):
            create_app(
                GatewaySettings(),
                PoolSettings(data_dir=tmp_path / "data", step_reward_functions=[name]),
            )
    create_app(  # the built-in step function resolves
        GatewaySettings(),
        PoolSettings(data_dir=tmp_path / "data", step_reward_functions=["tool_call_format"]),
    )
