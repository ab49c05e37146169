"""Advantage estimators (numpy, in the pool) and policy losses (torch, in the trainer) against
values derived by hand."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import pytest
import torch
from pydantic import ValidationError

from datapool.batches.advantages import (
    ALGORITHMS,
    ESTIMATORS,
    discounted_returns,
    estimate_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from datapool.batches.spec import BatchSpec
from datapool.errors import InvalidPoolRequestError
from datapool.rewards.group_stats import group_stats
from trainer_bridge.losses import LossConfig, aggregate, policy_loss

NAN = float("nan")


def _a(*values: float) -> npt.NDArray[np.float64]:
    return np.array(values, dtype=np.float64)


def _ids(*values: int) -> npt.NDArray[np.int64]:
    return np.array(values, dtype=np.int64)


def _close(actual: npt.NDArray[np.floating], expected: list[float]) -> None:
    assert actual.dtype == np.float64, actual.dtype
    assert np.allclose(actual, _a(*expected), atol=1e-6, equal_nan=True), actual


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_grpo_divides_by_the_unbiased_group_std() -> None:
    # rewards [1, 0, 0, 1]: mean 0.5, std = sqrt(4 * 0.25 / 3) = 0.57735; A = ±0.5 / 0.57735
    advantages = grpo_advantages(_a(1, 0, 0, 1), _ids(7, 7, 7, 7))
    _close(advantages, [0.866025, -0.866025, -0.866025, 0.866025])


def test_dr_grpo_leaves_out_the_std() -> None:
    advantages = grpo_advantages(_a(1, 0, 0, 1), _ids(1, 1, 1, 1), scale_by_std=False)
    _close(advantages, [0.5, -0.5, -0.5, 0.5])


def test_groups_are_normalised_separately() -> None:
    # group 1: [2, 4] -> mean 3, std sqrt(2); group 2: [10, 10] -> degenerate -> 0
    advantages = grpo_advantages(_a(2, 4, 10, 10), _ids(1, 1, 2, 2))
    _close(advantages, [-1 / math.sqrt(2), 1 / math.sqrt(2), 0, 0])


@pytest.mark.parametrize("magnitude", [1e308, 1.0, 1e-300])
def test_grpo_and_reinforce_pp_normalise_huge_and_tiny_rewards_exactly(magnitude: float) -> None:
    # [m, -m]: mean 0, std = sqrt((m^2 + m^2) / 1) = sqrt(2) m, so A = ±m / (sqrt(2) m) =
    # ±1/sqrt(2) = ±0.7071 whatever m (eps ~0 here: with eps 1e-6 a tiny group is all eps).
    # Unscaled, m^2 overflowed at 1e308 (A came out ±0.556) and underflowed to 0 at 1e-300.
    rewards, ids = _a(magnitude, -magnitude), _ids(3, 3)
    half_sqrt2 = 1 / math.sqrt(2)
    _close(grpo_advantages(rewards, ids, eps=1e-320), [half_sqrt2, -half_sqrt2])
    _close(reinforce_pp_advantages(rewards, eps=1e-320), [half_sqrt2, -half_sqrt2])
    stats = group_stats(rewards, ids)
    assert float(stats.mean[0]) == 0.0
    assert float(stats.std[0]) == pytest.approx(math.sqrt(2) * magnitude, rel=1e-12)
    assert not stats.degenerate[0] or magnitude < 1e-6  # a tiny spread is below degenerate_eps


def test_grpo_of_rewards_whose_spread_passes_the_float_range_stays_finite() -> None:
    # [M, -M, -M] with M = 1.7e308: mean -M/3, std = sqrt(((4M/3)^2 + 2 (2M/3)^2) / 2)
    # = M sqrt(12/9) = 1.1547 M (past the float range: inf), A = (4M/3) / (1.1547 M) = 1.1547
    # and (-2M/3) / (1.1547 M) = -0.57735: finite, computed on the rewards divided by 2^1023.
    m = 1.7e308
    advantages = grpo_advantages(_a(m, -m, -m), _ids(0, 0, 0))
    _close(advantages, [2 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)])
    assert math.isinf(float(group_stats(_a(m, -m, -m), _ids(0, 0, 0)).std[0]))


def test_rloo_of_huge_rewards_is_each_minus_the_others_mean() -> None:
    # [1.5, 1.5, 0.5] x 1e308 (their sum, 3.5e308, passes the float range; it came out inf):
    # 1.5 - (1.5 + 0.5)/2 = 0.5 twice, and 0.5 - (1.5 + 1.5)/2 = -1.0, times 1e308
    advantages = rloo_advantages(_a(1.5e308, 1.5e308, 0.5e308), _ids(1, 1, 1))
    _close(advantages, [0.5e308, 0.5e308, -1e308])


def test_c16_unrewarded_members_are_left_out_of_the_baseline_not_zeroed() -> None:
    # two rewarded -1.0, two never rewarded: baseline over the two, scored size 2
    rewards = _a(-1, -1, NAN, NAN)
    stats = group_stats(rewards, _ids(0, 0, 0, 0))
    assert stats.scored_size.tolist() == [2]
    _close(stats.mean, [-1.0])
    advantages = grpo_advantages(rewards, _ids(0, 0, 0, 0))
    _close(advantages, [0, 0, NAN, NAN])  # had NaN been 0.0, the mean would be -0.5


@pytest.mark.parametrize(
    ("rewards", "eps", "degenerate"),
    [
        ([0.6, 0.6, 0.6, 0.6], 1e-6, True),
        # std of [0.6, 0.6, 0.6, 0.6000001] = 0.5e-7 < 1e-6: still degenerate
        ([0.6, 0.6, 0.6, 0.6000001], 1e-6, True),
        ([0.6, 0.6, 0.6, 0.6000001], 1e-9, False),
        ([0.0, 1.0, 1.0, 1.0], 1e-6, False),
    ],
)
def test_c17_degenerate_groups_are_flagged_with_a_configurable_epsilon(
    rewards: list[float], eps: float, degenerate: bool
) -> None:
    stats = group_stats(_a(*rewards), _ids(0, 0, 0, 0), degenerate_eps=eps)
    assert bool(stats.degenerate[0]) is degenerate
    assert float(stats.mean[0]) == pytest.approx(sum(rewards) / 4)


def test_rloo_subtracts_the_mean_of_the_others() -> None:
    # [1, 0, 0, 1]: A_0 = 1 - (0 + 0 + 1) / 3 = 2/3; A_1 = 0 - (1 + 0 + 1) / 3 = -2/3
    advantages = rloo_advantages(_a(1, 0, 0, 1), _ids(0, 0, 0, 0))
    _close(advantages, [2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_rloo_skips_unrewarded_members_and_has_no_baseline_alone() -> None:
    # group 0: [1, 0, NaN] -> A = [1 - 0, 0 - 1, NaN]; group 1: a single member -> NaN
    advantages = rloo_advantages(_a(1, 0, NAN, 5), _ids(0, 0, 0, 1))
    _close(advantages, [1, -1, NAN, NAN])


def test_reinforce_pp_uses_the_batch_baseline() -> None:
    # [1, 2, 3]: mean 2, std 1 -> [-1, 0, 1]
    _close(reinforce_pp_advantages(_a(1, 2, 3)), [-1, 0, 1])


def test_discounted_returns_credit_earlier_steps_less() -> None:
    # final reward 1 over 3 steps, gamma 0.9: [0.81, 0.9, 1]
    _close(discounted_returns(_a(0, 0, 1), 0.9), [0.81, 0.9, 1.0])
    with pytest.raises(ValueError, match="gamma"):
        discounted_returns(_a(1), 1.5)


def test_estimators_keep_a_float32_input_in_float32() -> None:
    # [1, 0] in one group: mean 0.5, std sqrt(0.5) = 0.7071; A = ±0.5 / 0.7071 = ±0.7071
    rewards = np.array([1.0, 0.0], dtype=np.float32)
    for advantages in (
        grpo_advantages(rewards, _ids(0, 0)),
        rloo_advantages(rewards, _ids(0, 0)),  # ±(1 - 0)
        reinforce_pp_advantages(rewards),  # same as grpo: one batch, one group
    ):
        assert advantages.dtype == np.float32
    assert grpo_advantages(rewards, _ids(0, 0)).tolist() == pytest.approx([0.7071, -0.7071], 1e-4)


def test_every_algorithm_of_a_spec_has_one_registered_estimator() -> None:
    assert set(ESTIMATORS) == set(ALGORITHMS) == {"grpo", "rloo", "reinforce_pp", "sft"}
    assert {name for name, e in ESTIMATORS.items() if e.group_relative} == {"grpo", "rloo"}
    rewards, groups = _a(1, 0, NAN), _ids(0, 0, 0)
    # sft: 1.0 everywhere, NaN reward or not
    _close(estimate_advantages("sft", rewards, groups), [1, 1, 1])
    # grpo through the registry passes the spec's options: Dr. GRPO [1, 0] -> ±0.5
    _close(estimate_advantages("grpo", rewards, groups, scale_by_std=False), [0.5, -0.5, NAN])
    with pytest.raises(InvalidPoolRequestError, match=r"one of \('grpo'.*got 'dpo'"):
        estimate_advantages("dpo", rewards, groups)


def test_a_spec_naming_ppo_is_refused_with_the_valid_algorithms() -> None:
    # PPO needs a critic and GAE, which the trainer does not have: nothing accepts it
    with pytest.raises(ValidationError, match="'grpo', 'rloo', 'reinforce_pp' or 'sft'"):
        BatchSpec(algorithm="ppo")  # type: ignore[arg-type]
    with pytest.raises(InvalidPoolRequestError, match="got 'ppo'"):
        estimate_advantages("ppo", _a(1, 0), _ids(0, 0))


def test_on_policy_loss_is_minus_the_masked_advantage_under_each_aggregation() -> None:
    logprobs = torch.full((2, 3), -1.0, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    advantages = _t(1, -2)
    # per-token loss at ratio 1 is -A: row 0 -> [-1, -1], row 1 -> [2]
    expected = {
        "token_mean": (-1 - 1 + 2) / 3,
        "seq_mean": (-1 + 2) / 2,
        "seq_sum_token_mean": (-2 / 3 + 2 / 3) / 2,
    }
    for aggregation, value in expected.items():
        config = LossConfig(aggregation=aggregation)  # type: ignore[arg-type]
        out = policy_loss(logprobs, logprobs.detach(), advantages, mask, config)
        assert float(out.loss.detach()) == pytest.approx(value)
        assert out.clip_fraction == 0.0 and out.ratio_mean == pytest.approx(1.0)


def test_ratio_is_clipped_for_positive_advantages_and_clip_higher_widens_it() -> None:
    behaviour = torch.zeros((1, 1), dtype=torch.float64)
    logprobs = torch.full((1, 1), 0.5, dtype=torch.float64)  # ratio e^0.5 = 1.6487
    mask = torch.ones((1, 1))
    symmetric = policy_loss(logprobs, behaviour, _t(1), mask, LossConfig())
    assert float(symmetric.loss) == pytest.approx(-1.2) and symmetric.clip_fraction == 1.0
    higher = policy_loss(logprobs, behaviour, _t(1), mask, LossConfig(clip_high=0.28))
    assert float(higher.loss) == pytest.approx(-1.28)
    negative = policy_loss(logprobs, behaviour, _t(-1), mask, LossConfig())
    assert float(negative.loss) == pytest.approx(math.exp(0.5))  # pessimistic: not clipped
    assert negative.clip_fraction == 0.0


def test_truncated_importance_weight_caps_the_sampler_mismatch() -> None:
    # trainer's old logprob - behaviour logprob = ln 3 -> weight min(3, 2) = 2; ratio 1
    old = torch.full((1, 1), math.log(3.0), dtype=torch.float64)
    out = policy_loss(
        old.clone(),
        torch.zeros((1, 1), dtype=torch.float64),
        _t(1),
        torch.ones((1, 1)),
        LossConfig(tis_cap=2.0),
        old_logprobs=old,
    )
    assert out.tis_weight_mean == pytest.approx(2.0)
    assert float(out.loss) == pytest.approx(-2.0)


def test_k3_kl_to_the_reference_is_added_with_its_weight() -> None:
    # ref - logp = ln 2: k3 = 2 - ln 2 - 1 = 0.306853; loss = -A + 0.5 * k3 at ratio 1
    logprobs = torch.zeros((1, 1), dtype=torch.float64)
    ref = torch.full((1, 1), math.log(2.0), dtype=torch.float64)
    out = policy_loss(
        logprobs, logprobs, _t(1), torch.ones((1, 1)), LossConfig(kl_coef=0.5), ref_logprobs=ref
    )
    assert out.kl == pytest.approx(1 - math.log(2))
    assert float(out.loss) == pytest.approx(-1 + 0.5 * (1 - math.log(2)))


def test_k3_kl_counts_only_loss_tokens_and_its_gradient_pulls_toward_the_reference() -> None:
    # ratio 1 and A = 0, so the loss is kl_coef * KL alone. d = ref - logp on the loss tokens:
    # row 0: ln 2 -> k3 = 2 - ln 2 - 1 = 1 - ln 2 = 0.306853; -ln 2 -> 1/2 + ln 2 - 1 = 0.193147
    # row 1: ln 3 -> k3 = 3 - ln 3 - 1 = 2 - ln 3 = 0.901388
    # The masked positions (ref 1000.0, 7.0) must be zeroed before exp: e^1000 is inf, and
    # inf * 0 is NaN, so masking only in the average would not do; e^7 - 8 = 1088.6 if counted.
    logprobs = torch.zeros((2, 3), dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    ref = torch.tensor(
        [[1000.0, math.log(2.0), -math.log(2.0)], [0.0, math.log(3.0), 7.0]], dtype=torch.float64
    )
    expected = {
        "token_mean": (0.5 + 2 - math.log(3)) / 3,  # (0.306853 + 0.193147 + 0.901388) / 3
        "seq_mean": (0.25 + 2 - math.log(3)) / 2,  # row means 0.5 / 2 and 0.901388
    }
    for aggregation, kl in expected.items():
        config = LossConfig(aggregation=aggregation, kl_coef=0.1)  # type: ignore[arg-type]
        out = policy_loss(logprobs, logprobs.detach(), _t(0, 0), mask, config, ref_logprobs=ref)
        assert out.kl == pytest.approx(kl)  # 0.467129 and 0.575694
        assert float(out.loss.detach()) == pytest.approx(0.1 * kl)
    # d k3 / d logp = 1 - e^d, times kl_coef / 3 loss tokens under token_mean:
    # ln 2 -> 0.1 * (1 - 2) / 3 = -0.033333, -ln 2 -> 0.1 * 0.5 / 3, ln 3 -> 0.1 * (1 - 3) / 3;
    # negative where pi_ref > pi, so gradient descent raises logp toward the reference.
    config = LossConfig(kl_coef=0.1)
    policy_loss(
        logprobs, logprobs.detach(), _t(0, 0), mask, config, ref_logprobs=ref
    ).loss.backward()
    assert logprobs.grad is not None
    expected_grad = [[0.0, -0.1 / 3, 0.05 / 3], [0.0, -0.2 / 3, 0.0]]
    assert torch.allclose(logprobs.grad, torch.tensor(expected_grad, dtype=torch.float64))


def test_bad_configurations_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="token_mean, seq_mean or seq_sum_token_mean"):
        LossConfig(aggregation="sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ref_logprobs"):
        x = torch.zeros((1, 1))
        policy_loss(x, x, torch.zeros(1), x, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="must be"):
        aggregate(torch.zeros((1, 1)), torch.ones((1, 1)), "max", None)  # type: ignore[arg-type]
