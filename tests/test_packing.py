"""Packed micro-batches (rows end to end, position ids restarting per row, no padding) give the
update the padded micro-batches give: the same loss, normalised over the whole batch, and the same
gradients, on the tiny Qwen2 model through transformers' own packed-row masking."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer_bridge.collate import Row, collate
from trainer_bridge.packing import fed_tokens, pack, plan_micro_batches, unpack
from trainer_bridge.settings import TrainerSettings
from trainer_bridge.trainer import PolicyTrainer, TrainBatch, UpdateMetrics

# float32 sums in another order (other kernels' shapes); the update's gradients are ~1e-2
GRAD_TOLERANCE = 2e-5


def test_first_fit_decreasing_fills_each_budget_and_gives_a_long_row_its_own_pass() -> None:
    # lengths 9, 7, 5, 4, 3 into 12 tokens: 9 (+3 = 12) | 7 (+5 = 12) | 4; 20 > 12 alone
    assert plan_micro_batches([5, 9, 3, 7, 4], rows=2, tokens=12) == [[1, 2], [3, 0], [4]]
    assert plan_micro_batches([20, 3], rows=2, tokens=12) == [[0], [1]]
    assert plan_micro_batches([5, 9, 3], rows=2, tokens=None) == [[0, 1], [2]]


def test_pack_restarts_positions_per_row_and_unpack_restores_the_padded_layout() -> None:
    ids = torch.tensor([[1, 2, 3], [4, 5, 0]])  # [2, 3], row 1 padded
    packed, positions = pack(ids, [3, 2])
    assert packed.tolist() == [[1, 2, 3, 4, 5]]
    assert positions.tolist() == [[0, 1, 2, 0, 1]]
    assert unpack(packed.float(), [3, 2], 3).tolist() == [[1, 2, 3], [4, 5, 0]]


def test_fed_tokens_count_padding_to_each_micro_batch_longest_row() -> None:
    # padded [9, 3] and [7]: 2 x 9 + 1 x 7 = 25 fed for 19 tokens; packed: 19
    assert fed_tokens([9, 3, 7], [[0, 1], [2]], packed=False) == 25
    assert fed_tokens([9, 3, 7], [[0, 1], [2]], packed=True) == 19


def _batch() -> TrainBatch:
    """Eight rows of 6 to 33 tokens: a prompt (mask 0) and a response (mask 1)."""
    generator = torch.Generator().manual_seed(3)
    rows = []
    for i, length in enumerate([33, 6, 21, 14, 9, 27, 12, 17]):
        prompt = length // 3
        ids = torch.randint(10, 2000, (length,), generator=generator).tolist()
        behaviour = (-torch.rand(length, generator=generator) * 6).tolist()
        rows.append(
            Row(
                ids,
                [0] * prompt + [1] * (length - prompt),
                [0.0] * prompt + behaviour[prompt:],
                1.0 if i % 2 else -1.0,
            )
        )
    return collate(rows, pad_token_id=0)


def _update(model_dir: Path, **settings: object) -> tuple[UpdateMetrics, dict[str, torch.Tensor]]:
    trainer = PolicyTrainer(
        TrainerSettings(model_dir=model_dir, device="cpu", learning_rate=1e-3, **settings)
    )
    metrics = trainer.update(_batch())
    grads = {
        name: p.grad.clone()
        for name, p in trainer.model.named_parameters()
        if p.requires_grad and p.grad is not None
    }
    return metrics, grads


@pytest.mark.parametrize(
    ("lora_rank", "aggregation"),
    [(0, "token_mean"), (4, "seq_mean")],
    ids=["full-token_mean", "lora-seq_mean"],
)
def test_packed_and_padded_micro_batches_give_the_whole_batch_loss_and_gradients(
    tiny_model_dir: Path, lora_rank: int, aggregation: str
) -> None:
    common = {"lora_rank": lora_rank, "aggregation": aggregation}
    # one padded pass over all 8 rows: the loss as the variant defines it over the whole batch
    whole, whole_grads = _update(tiny_model_dir, micro_batch_rows=8, **common)
    padded, padded_grads = _update(tiny_model_dir, micro_batch_rows=3, **common)
    packed, packed_grads = _update(tiny_model_dir, micro_batch_tokens=40, **common)
    assert packed.loss == pytest.approx(whole.loss, abs=1e-6)
    assert padded.loss == pytest.approx(whole.loss, abs=1e-6)
    assert packed.tokens == padded.tokens == whole.tokens
    assert sorted(packed_grads) == sorted(whole_grads) and len(whole_grads) > 0
    largest = max(float(g.abs().max()) for g in whole_grads.values())
    assert largest > 1e-3  # gradients worth comparing
    for name, grad in whole_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=GRAD_TOLERANCE, rtol=0)
        torch.testing.assert_close(padded_grads[name], grad, atol=GRAD_TOLERANCE, rtol=0)
    # lengths 33, 27, 21, 17, 14, 12, 9, 6 = 139 tokens. One pass: 8 x 33 = 264 fed, 1 - 139/264;
    # rows of 3: 3 x 33 + 3 x 17 + 2 x 9 = 168 fed, 1 - 139/168; packed: nothing but tokens
    assert whole.padding_fraction == pytest.approx(1 - 139 / 264)
    assert padded.padding_fraction == pytest.approx(1 - 139 / 168)
    assert packed.padding_fraction == 0.0
