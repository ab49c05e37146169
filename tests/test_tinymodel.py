"""The tiny model: deterministic, vLLM-compatible shape, and a template that renders tool turns."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from trajgate import tinymodel

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def test_generating_twice_gives_identical_files(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = tinymodel.generate(tmp_path / "again", force=True)
    assert tinymodel.fingerprint(again) == tinymodel.fingerprint(tiny_model_dir)


def test_head_dim_is_one_vllm_cpu_attention_supports(tiny_model_dir: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_model_dir)
    head_dim = config.hidden_size // config.num_attention_heads  # 128 // 2 = 64
    assert head_dim == 64


def test_markup_tokens_are_single_non_special_ids(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for token in tinymodel.MARKUP_TOKENS:
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1, token
        assert tokenizer.decode(ids, skip_special_tokens=True) == token
    assert tokenizer.eos_token == "<|im_end|>"


def test_template_renders_a_tool_turn_and_drops_old_thinking(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "<think>plan</think>ok", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "user", "content": [{"type": "text", "text": "thanks"}]},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert json.dumps(TOOLS[0]) in text
    assert (
        '<|im_start|>assistant\nok\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    ) in text
    assert "<think>" not in text  # reasoning of an earlier turn is dropped (case C02)
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n")


def test_context_fits_coding_agent_prompts_with_relative_positions(tiny_model_dir: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_model_dir)
    # Claude Code's retry request: ~35k prompt tokens + max_tokens 32,000 = ~67k < 131,072.
    assert config.max_position_embeddings == 131072
    assert config.rope_parameters["rope_theta"] == 1_000_000.0


def _end_probabilities(tiny_model_dir: Path, system_words: int) -> tuple[Any, Any]:
    """p(<|im_end|>) and the most likely other token's p at the last 64 positions of a chat."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rng = random.Random(7)
    words = tinymodel._WORDS + tinymodel._AGENT_WORDS
    messages = [{"role": "user", "content": "Write hello.py and run it."}]
    if system_words:
        system = " ".join(rng.choice(words) for _ in range(system_words))
        messages.insert(0, {"role": "system", "content": system})
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    answer = " ".join(rng.choice(words) for _ in range(64))
    ids = tokenizer(prompt + answer, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        probs = torch.softmax(model(ids).logits[0, -64:], dim=-1)  # (64, V)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    end = probs[:, im_end].clone()  # (64,)
    probs[:, im_end] = 0.0
    return end, probs.max(dim=-1).values  # (64,), (64,)


@pytest.mark.parametrize("system_words", [0, 2000])
def test_a_sampled_turn_ends_within_a_few_thousand_tokens_but_greedy_does_not_stop_at_once(
    tiny_model_dir: Path, system_words: int
) -> None:
    end, best_other = _end_probabilities(tiny_model_dir, system_words)
    # p >= 0.0015 at every position: no end within 4,096 sampled tokens has odds
    # <= (1 - 0.0015) ** 4096 = e^-6.1 (0.2 %); the mean turn is <= 1 / 0.0015 = 667 tokens.
    assert end.min().item() >= 0.0015
    # Against 2,047 other tokens, <|im_end|> stays below the likeliest one: greedy decoding
    # runs on, as the tests that expect finish "length" at 12-16 tokens rely on.
    assert bool((end < best_other).all())


def test_numbers_and_whitespace_are_each_one_output_direction(tiny_model_dir: Path) -> None:
    """The demo's reward (answer with a number) is learnable as one decision because every
    number token reads residual dimension 1, and nothing else does; whitespace-only tokens read
    dimension 2 (pushed down, so greedy constrained tool calls end)."""
    spec = tinymodel.TinyModelSpec()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert model.config.tie_word_embeddings is False  # output-side features stay output-side
    head = model.lm_head.weight  # [V, H]
    numbers = tinymodel.number_token_ids(tokenizer)
    whitespace = tinymodel.whitespace_token_ids(tokenizer)
    assert len(numbers) > 100 and tokenizer.decode([numbers[0]]).strip().isdigit()
    assert whitespace and all(tokenizer.decode([i]).isspace() for i in whitespace)
    assert torch.nonzero(head[:, 1]).flatten().tolist() == numbers
    assert bool((head[numbers, 1] == spec.number_weight).all())
    assert torch.nonzero(head[:, 2]).flatten().tolist() == whitespace
    assert bool((head[whitespace, 2] == spec.whitespace_weight).all())
    # no input embedding and no layer writes the reserved dimensions (the constants aside)
    embed = model.model.embed_tokens.weight
    assert bool((embed[:, 1:3] == 0).all())
    for layer in model.model.layers:
        assert bool((layer.mlp.down_proj.weight[1:3] == 0).all())
