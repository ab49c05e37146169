"""TRL 1.16 trains on episodes that ran through the real gateway and the real vLLM: the
``rollout_func`` (``PoolRollout``) runs an OpenAI-SDK agent per prompt, waits for the pool's
rewards, and TRL's ``GRPOTrainer`` updates the tiny model on the CPU from the pool's exact rows;
and the one call that tells the gateway new weights serve (``POST /admin/policy-versions``)
stamps the next steps with the new version.

SQLite only: the pool's batch path runs on both databases in tests/test_integrations.py and
tests/test_batches_gateway.py; here the CPU goes to TRL and vLLM.

Episodes (``two_turn_agent``): a user turn, 3 sampled tokens, a user turn, 3 sampled tokens, at
temperature 1 (TRL's default): a merged row is the first prompt, then R_1 (mask 1), the second
prompt's new tokens (mask 0), R_2 (mask 1).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import torch
from gateway_helpers import gateway_with, steps_of
from openai import OpenAI
from tests_support import free_port

from datapool.settings import PoolSettings
from gateway.server import BackgroundServer
from trainer_bridge.integrations.episodes import Episode, PoolEpisodes
from trajgate import vllm_server

ROOT = Path(__file__).resolve().parent.parent


def _chat_twice(base_url: str, messages: list[Any]) -> None:
    """Two calls of 3 sampled tokens at temperature 1, a user turn after each."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    for turn in range(2):
        answer = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=3, temperature=1.0
        )
        messages += [
            {"role": "assistant", "content": answer.choices[0].message.content or ""},
            {"role": "user", "content": f"tool result {turn}"},
        ]


def two_turn_agent(base_url: str, prompt: Any) -> float:
    """Two turns; reward = the trajectory's index modulo 2 (ids end in ``-<i>``), so each group
    of two consecutive prompts has rewards 0 and 1."""
    _chat_twice(base_url, [{"role": "user", "content": str(prompt)}])
    trajectory_id = base_url.split("/t/")[1].split("/")[0]
    return float(int(trajectory_id.rsplit("-", 1)[1]) % 2)


@pytest.fixture
def sqlite_gateway(
    vllm: vllm_server.VLLMServer, sqlite_pool: PoolSettings
) -> Iterator[BackgroundServer]:
    with gateway_with(sqlite_pool, free_port(), upstream_url=vllm.url) as server:
        yield server


def _load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"example_{name}", ROOT / "examples" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _expected_row(steps: list[Any]) -> tuple[list[int], list[int], list[float], list[int]]:
    """(prompt, completion, logprobs, mask) of one merged two-step trajectory, from its steps:
    the completion is R_1, the tokens the second prompt adds after P_1 + R_1, then R_2."""
    first, second = steps
    history = [*first.prompt_token_ids, *first.response_token_ids]
    assert second.prompt_token_ids[: len(history)] == history  # exact continuation: one row
    between = second.prompt_token_ids[len(history) :]
    completion = [*first.response_token_ids, *between, *second.response_token_ids]
    logprobs = [*first.response_logprobs, *[0.0] * len(between), *second.response_logprobs]
    mask = [1] * len(first.response_token_ids) + [0] * len(between)
    mask += [1] * len(second.response_token_ids)
    return first.prompt_token_ids, completion, logprobs, mask


def test_trl_grpo_trainer_updates_on_agent_episodes_exactly_as_the_pool_recorded_them(
    sqlite_gateway: BackgroundServer,
    sqlite_pool: PoolSettings,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    from trl import GRPOTrainer

    example = _load_example("trl_grpo")
    seen: list[dict[str, Any]] = []

    class Recording(GRPOTrainer):  # what TRL built from each rollout, as its loss reads it
        def _generate_and_score_completions(self, inputs: Any) -> Any:
            out = super()._generate_and_score_completions(inputs)
            seen.append(out)
            return out

    args = example.arguments(
        [
            "--gateway-url",
            sqlite_gateway.url,
            "--model",
            str(tiny_model_dir),
            "--output-dir",
            str(tmp_path / "trl"),
            "--max-steps",
            "2",
            "--cpu",
            "--learning-rate",
            "1e-2",
        ]
    )
    trainer, rollout = example.build(args, agent=two_turn_agent, trainer_class=Recording)
    # as if TRL had pushed each step's weights into vLLM (use_vllm needs TRL's own vLLM
    # server, a GPU's): the rollout registers version 1 before step 2's episodes
    rollout.policy_model_name = "tiny"
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.train()
    rollout.episodes.close()

    assert torch.isfinite(torch.tensor(result.training_loss))
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)]
    assert changed, "no weight changed"
    assert len(seen) == 2  # one rollout per step: 4 prompts, 2 groups of 2
    for call, out in enumerate(seen):
        for i in range(4):
            trajectory_id = f"{rollout.run_id}-c{call}-p0-{i}"
            steps = steps_of(sqlite_pool, trajectory_id)
            prompt, completion, logprobs, mask = _expected_row(steps)
            n = len(completion)
            assert out["completion_ids"][i][:n].tolist() == completion
            assert out["sampling_per_token_logps"][i][:n].tolist() == pytest.approx(logprobs, abs=0)
            assert out["tool_mask"][i][:n].tolist() == mask
            assert out["prompt_ids"][i][-len(prompt) :].tolist() == prompt
            # the version hook: step 1's episodes ran before any registration (version 0),
            # step 2's after the rollout registered version 1
            assert {s.policy_version for s in steps} == {call}
        # TRL's advantages from the agents' rewards (0, 1 | 0, 1): +-0.5 / (std 0.7071 + 1e-4)
        expected = [-0.7070, 0.7070, -0.7070, 0.7070]
        assert out["advantages"].tolist() == pytest.approx(expected, abs=1e-3)
    assert rollout.registered_version == 1


def test_one_admin_call_stamps_the_next_steps_with_the_new_policy_version(
    sqlite_gateway: BackgroundServer, sqlite_pool: PoolSettings
) -> None:
    episodes = PoolEpisodes(sqlite_gateway.url, two_turn_agent)
    try:
        episodes.play([Episode("before-0", "g", "hi")])
        episodes.register_policy_version(7, "tiny", "/weights/v7")
        episodes.play([Episode("after-1", "g", "hi")])
        with pytest.raises(Exception, match="409"):  # v7 is the weights at /weights/v7
            episodes.register_policy_version(7, "tiny", "/weights/other")
    finally:
        episodes.close()
    assert [s.policy_version for s in steps_of(sqlite_pool, "before-0")] == [0, 0]
    assert [s.policy_version for s in steps_of(sqlite_pool, "after-1")] == [7, 7]
    active = httpx.get(f"{sqlite_gateway.url}/admin/policy-versions").json()
    assert [(v["version"], v["active"]) for v in active if v["active"]] == [(7, True)]


def test_episodes_refuse_to_hand_over_a_trajectory_that_never_gets_a_reward(
    sqlite_gateway: BackgroundServer,
) -> None:
    from trainer_bridge.integrations.episodes import EpisodeError

    def unrewarded_agent(base_url: str, prompt: Any) -> None:
        two_turn_agent(base_url, prompt)
        return None  # and no reward function on this gateway: missing stays missing

    episodes = PoolEpisodes(sqlite_gateway.url, unrewarded_agent, ready_timeout_s=1.0)
    try:
        with pytest.raises(EpisodeError, match="unrewarded"):
            episodes.run([Episode("never-rewarded-0", "g", "hi")])
    finally:
        episodes.close()


def verl_agent(base_url: str, prompt: Any) -> float:
    """verl hands the sample's ``raw_prompt`` (chat messages); two turns, reward 0.25."""
    _chat_twice(base_url, list(prompt))
    return 0.25


def test_verl_runs_the_trajgate_agent_loop_through_the_gateway_into_its_data_proto(
    sqlite_gateway: BackgroundServer,
    sqlite_pool: PoolSettings,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    import asyncio

    from test_integrations import verl_samples, verl_worker

    length = 128
    loop = {
        "name": "trajgate",
        "_target_": "trainer_bridge.integrations.verl.PoolAgentLoop",
        "gateway_url": sqlite_gateway.url,
        "agent": f"{__name__}:verl_agent",
    }
    worker = verl_worker(tiny_model_dir, tmp_path, [loop], length)
    proto = asyncio.run(worker.generate_sequences(verl_samples("trajgate", ["u1", "u1"])))
    batch = proto.batch
    trajectory_ids = list(proto.non_tensor_batch["trajectory_id"])
    assert len(set(trajectory_ids)) == 2
    for i, trajectory_id in enumerate(trajectory_ids):
        prompt, completion, logprobs, mask = _expected_row(steps_of(sqlite_pool, trajectory_id))
        n, p = len(completion), len(prompt)
        assert batch["prompts"][i, length - p :].tolist() == prompt
        assert batch["responses"][i, :n].tolist() == completion
        assert batch["response_mask"][i].tolist() == mask + [0] * (length - n)
        assert batch["rollout_log_probs"][i, :n].tolist() == pytest.approx(logprobs, abs=0)
        assert batch["rm_scores"][i].nonzero().flatten().tolist() == [n - 1]
        assert batch["rm_scores"][i, n - 1].item() == 0.25
        assert proto.non_tensor_batch["group_id"][i] == "u1"  # verl's uid: its GRPO group
        trajectory = httpx.get(f"{sqlite_gateway.url}/api/trajectories/{trajectory_id}").json()
        assert trajectory["group_id"] == "u1"


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def test_episodes_raise_at_once_on_a_trajectory_excluded_by_curation(
    sqlite_gateway: BackgroundServer,
) -> None:
    from trainer_bridge.integrations.episodes import EpisodeError

    episodes = PoolEpisodes(sqlite_gateway.url, two_turn_agent, ready_timeout_s=600.0)
    try:
        episodes.play([Episode("excluded-0", "g", "hi")])
        label = httpx.post(
            f"{sqlite_gateway.url}/api/labels",
            json={"target": "trajectory", "target_id": "excluded-0", "decision": "exclude"},
        )
        assert label.status_code == 201, label.text
        started = time.monotonic()
        with pytest.raises(EpisodeError, match="excluded by label"):
            episodes.wait_ready(["excluded-0"])
        assert time.monotonic() - started < 60  # not the 600 s timeout: the reason stays
    finally:
        episodes.close()


def rewriting_agent(base_url: str, prompt: Any) -> float:
    """Two calls; the second rewrites the first user turn: a prefix break, so two merged rows."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    for content in ("first version", "rewritten version"):
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": content}],
            max_tokens=3,
            temperature=1.0,
        )
    return 1.0


def test_verl_agent_loop_returns_every_row_of_a_split_trajectory_only_when_asked(
    sqlite_gateway: BackgroundServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import asyncio

    from test_integrations import verl_worker
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap

    from trainer_bridge.integrations.verl import PoolAgentLoop

    worker = verl_worker(tiny_model_dir, tmp_path, [], 64)

    def loop(outputs: str) -> PoolAgentLoop:  # as verl's worker instantiates it
        return PoolAgentLoop(
            trainer_config=DictConfigWrap(config=worker.config),
            server_manager=None,
            tokenizer=worker.tokenizer,
            processor=None,
            dataset_cls=worker.dataset_cls,
            data_config=DictConfigWrap(worker.config.data),
            agent=f"{__name__}:rewriting_agent",
            gateway_url=sqlite_gateway.url,
            outputs=outputs,
        )

    sample = {"raw_prompt": [{"role": "user", "content": "hi"}], "uid": "u9"}
    with pytest.raises(ValueError, match="has 2 rows"):
        asyncio.run(loop("one").run({}, **sample))
    both = asyncio.run(loop("all").run({}, **sample))
    assert isinstance(both, list) and len(both) == 2
    assert len({o.extra_fields["trajectory_id"] for o in both}) == 1  # one trajectory, 2 rows
    assert both[0].prompt_ids != both[1].prompt_ids  # each row starts at its own prompt
    assert [o.reward_score for o in both] == [1.0, 1.0]
    assert all(o.extra_fields["reward_extra_info"] == {} for o in both)
