"""SmolLM2-135M-Instruct prepared from its PyPI package (trajgate/smollm2.py): the directory is
deterministic, checksummed, a plain fp32 LlamaForCausalLM the trainer's LoRA wraps, with a
hermes-format tool template. scripts/setup.sh prepares it; the tests prepare it again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trajgate import smollm2

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return smollm2.prepare()


def test_preparing_again_writes_the_same_weights_and_records_their_checksum(
    model_dir: Path, tmp_path: Path
) -> None:
    again = smollm2.prepare(tmp_path / "smollm2", force=True)
    recorded = (again / smollm2.CHECKSUM_FILE).read_text().split()
    assert recorded == [smollm2.weights_sha256(again), smollm2.WEIGHTS_FILE]
    assert smollm2.weights_sha256(again) == smollm2.weights_sha256(model_dir)
    assert (model_dir / smollm2.CHECKSUM_FILE).read_text() == (
        again / smollm2.CHECKSUM_FILE
    ).read_text()


def test_the_directory_is_a_plain_fp32_llama_that_lora_wraps(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # plain weights: vLLM and peft load them as is
    # vLLM's CPU attention supports head_dim 32, 64, 80, ...; SmolLM2: 576 / 9 = 64
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    assert 0 < trainable < 1_000_000


def test_the_chat_template_lists_tools_and_renders_calls_in_the_hermes_format(
    model_dir: Path,
) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tool = {
        "type": "function",
        "function": {
            "name": "calculate",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"x": "2*3"}}}
    text = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "What is 2 * 3?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": '{"result": 6}'},
        ],
        tools=[tool],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert '<tools>\n{"type": "function", "function": {"name": "calculate"' in text
    assert '<tool_call>\n{"name": "calculate", "arguments": {"x": "2*3"}}\n</tool_call>' in text
    assert '<tool_response>\n{"result": 6}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2


def test_the_demo_s_worked_examples_render_as_the_calls_the_hermes_parser_reads(
    model_dir: Path,
) -> None:
    """The calls the model is shown (trajgate.demo_task.calculator_shots) are the exact text
    a call must be for vLLM's hermes parser: <tool_call>, a JSON object, </tool_call>."""
    from trajgate import demo_task

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": demo_task.CALCULATOR_SYSTEM_PROMPT},
            *demo_task.calculator_shots(),
            {"role": "user", "content": "What is 59 * 63?"},
        ],
        tools=[{"type": "function", "function": {"name": "calculator", "parameters": {}}}],
        tokenize=False,
        add_generation_prompt=True,
    )
    call = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>'
    )
    assert f"<|im_start|>assistant\n{call}<|im_end|>\n" in text
    assert "<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n" in text
    assert "<|im_start|>assistant\n408<|im_end|>\n" in text
    assert text.endswith("<|im_start|>user\nWhat is 59 * 63?<|im_end|>\n<|im_start|>assistant\n")
