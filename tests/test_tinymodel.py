"""The tiny model: deterministic, vLLM-compatible shape, and a template that renders tool turns."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

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
