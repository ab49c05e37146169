"""CPU of the pool writer's per-call body work as a coding-agent session grows.

Records one 200-turn session per dialect (``trajgate bench horizon``'s bodies:
``trajgate.bench.agent_session``, each turn's prompt extending the previous call's prompt and
answer) through ``PoolStore.record_call`` on SQLite in a temporary directory, timing
``messages.request_delta`` and ``PoolStore._steps_of_call`` on every call (thread CPU,
``time.thread_time``). Prints one JSON line per dialect: the median µs per call of each over
the turns around 20 and around 200 (turns 15-24 and 190-199). Run it from two trees in turns
to compare them:

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_request_delta.py [--turns 200]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from datapool import db
from datapool.db import make_engine
from datapool.settings import PoolSettings
from datapool.steps import store as store_module
from datapool.steps.records import CallRecord, ChoiceRecord
from datapool.steps.store import PoolStore
from gateway.dialects import Dialect
from gateway.dialects.chat_completions import ChatCompletions
from gateway.dialects.messages import Messages
from trajgate.bench import agent_session
from trajgate.bench.continuation import emulator_answer

RESPONSE_TOKENS = 40
PROMPT_TOKENS_PER_TURN = 120


def session_calls(dialect: Dialect, name: agent_session.Dialect, turns: int) -> list[CallRecord]:
    """The session's calls as the gateway records them (one translation, one record each)."""
    answer = emulator_answer(RESPONSE_TOKENS)
    calls = []
    for turn in range(turns):
        body = agent_session.body(
            name,
            0,
            turn,
            answer,
            stream=False,
            response_tokens=RESPONSE_TOKENS,
            tool_result_chars=450,
        )
        prepared = dialect.prepare(body)
        prompt = list(range(200 + turn * (PROMPT_TOKENS_PER_TURN + RESPONSE_TOKENS)))
        response = list(range(len(prompt), len(prompt) + RESPONSE_TOKENS))
        message = {"role": "assistant", "content": answer}
        calls.append(
            CallRecord(
                request=body,
                upstream_request=prepared.upstream_body,
                model="emulated",
                upstream="http://up",
                policy_version=0,
                latency_ms=1.0,
                prompt_token_ids=prompt,
                prompt_tokens=len(prompt),
                choices=[ChoiceRecord(0, response, [-0.5] * RESPONSE_TOKENS, message, "stop")],
                endpoint=dialect.name,
                canonical=dialect.canonical(prepared.upstream_body),
                history_field=dialect.history_field,
                sampling={"temperature": 1.0, "max_tokens": RESPONSE_TOKENS},
            )
        )
    return calls


def timed(samples: list[float], function: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            samples.append(time.thread_time() - start)

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    args = parser.parse_args()
    delta_s: list[float] = []
    steps_s: list[float] = []
    store_module.request_delta = timed(delta_s, store_module.request_delta)  # type: ignore[attr-defined]
    original_steps = PoolStore._steps_of_call
    PoolStore._steps_of_call = staticmethod(timed(steps_s, original_steps))  # type: ignore[method-assign]
    for dialect, name in ((ChatCompletions(), "chat"), (Messages(), "messages")):
        calls = session_calls(dialect, name, args.turns)  # type: ignore[arg-type]
        with tempfile.TemporaryDirectory() as tmp:
            url = f"sqlite:///{tmp}/pool.sqlite3"
            db.upgrade(url)
            settings = PoolSettings(data_dir=Path(tmp) / "data", database_url=url)
            store = PoolStore(make_engine(url), settings)
            delta_s.clear()
            steps_s.clear()
            gc.collect()
            for call in calls:
                store.record_call("t", call)
            store.engine.dispose()

        def us(samples: list[float], turn: int) -> float:
            return round(statistics.median(samples[turn - 5 : turn + 5]) * 1e6, 1)

        last = args.turns - 5
        print(
            json.dumps(
                {
                    "dialect": name,
                    "request_delta_us_turn_20": us(delta_s, 20),
                    f"request_delta_us_turn_{args.turns}": us(delta_s, last),
                    "steps_of_call_us_turn_20": us(steps_s, 20),
                    f"steps_of_call_us_turn_{args.turns}": us(steps_s, last),
                }
            )
        )


if __name__ == "__main__":
    main()
