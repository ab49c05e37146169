"""A tiny Qwen2 chat model generated locally, deterministically, with no download.

Owns: the tokenizer corpus, the byte-level BPE tokenizer, the ChatML chat template (tools,
tool responses, thinking) and the randomly initialised ``Qwen2ForCausalLM`` that the tests, the
demo and the CPU vLLM serve. Never: downloads weights or data, or depends on the wall clock.

Notable choices:

- head_dim = hidden_size / num_attention_heads = 128 / 2 = 64, because vLLM's CPU attention
  supports head_dim in {32, 64, 80, ...} only (head_dim 16 starts, then dies on its first request).
- ``<tool_call>``, ``</tool_call>``, ``<think>``, ``</think>``, ``<tool_response>`` and
  ``</tool_response>`` are added tokens that are *not* special, so they survive
  ``skip_special_tokens`` and vLLM's hermes tool parser can find them in the text it parses.
- The template drops ``<think>…</think>`` from assistant turns that come before the last user turn
  (as Qwen3's does), so multi-turn prompts show the "history rewritten" prefix break (case C02).
- Random weights produce nonsense text; that is enough for plumbing and for showing RL moving the
  policy.

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

MODEL_FORMAT_VERSION = "5"  # bump when anything below changes the generated files

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKUP_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<tool_response>",
    "</tool_response>",
]

CHAT_TEMPLATE = r"""{%- macro render_content(content) -%}
{%- if content is none -%}
{%- elif content is string -%}{{ content }}
{%- else -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}{%- if message.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages[0].role == 'system' -%}{{- render_content(messages[0].content) + '\n\n' -}}{%- endif -%}
{{- '# Tools\n\nYou may call one or more functions. Function signatures are inside <tools></tools>:\n<tools>\n' -}}
{%- for tool in tools -%}{{- tool | tojson -}}{{- '\n' -}}{%- endfor -%}
{{- '</tools>\n\nReturn each call as <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}
{{- '<|im_start|>user\n' + render_content(message.content) + '<|im_end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{%- set text = render_content(message.content) -%}
{%- if loop.index0 < ns.last_user and '</think>' in text -%}{%- set text = text.split('</think>')[-1].lstrip('\n') -%}{%- endif -%}
{{- '<|im_start|>assistant\n' + text -}}
{%- if message.tool_calls -%}
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if text or not loop.first -%}{{- '\n' -}}{%- endif -%}
{{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{{- '<|im_start|>user\n<tool_response>\n' + render_content(message.content) + '\n</tool_response><|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
"""

_WORDS = (
    "the agent reads a task calls a tool gets a result and answers the user weather city paris "
    "london tokyo berlin rome temperature sunny rainy cloudy add multiply numbers sum total answer "
    "is search file code test pass fail step reward policy think plan check result value list item "
    "open close read write run python function return true false none error ok done next first "
    "last one two three four five six seven eight nine ten yes no because so then please thanks"
).split()


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the generated model. Defaults run fast on 2 CPU cores under vLLM's CPU backend."""

    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    max_position_embeddings: int = 4096
    # The Hugging Face default (0.02) makes every logit ~0: the output is uniform within 0.02
    # nats of log(V), and with tied embeddings that small no LoRA can concentrate it (measured:
    # no reward gain in 12 GRPO updates). 0.1 leaves room for RL to move the policy.
    initializer_range: float = 0.1
    seed: int = 0


def _corpus(seed: int) -> list[str]:
    """Synthetic text shaped like agent traffic: chat, JSON tool calls, numbers, code."""
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(4000):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 16)))
        lines.append(words.capitalize() + rng.choice([".", "?", "!", ":"]))
    for _ in range(1500):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        lines.append(f"What is {a} + {b}? The answer is {a + b}.")
        args = {"city": rng.choice(["Paris", "London", "Tokyo"]), "unit": "celsius"}
        lines.append(json.dumps({"name": "get_weather", "arguments": args}))
        lines.append(json.dumps(args, separators=(",", ":")))
        lines.append(f"def f{a}(x):\n    return x * {b}\n")
    return lines


def build_tokenizer(spec: TinyModelSpec) -> object:
    """Train a byte-level BPE tokenizer on the synthetic corpus and wrap it for transformers.

    Returns a ``PreTrainedTokenizerFast`` whose vocabulary is exactly ``spec.vocab_size`` ids or
    fewer, with the ChatML special tokens and the (non-special) markup tokens added.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(SPECIAL_TOKENS) - len(MARKUP_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.add_tokens(MARKUP_TOKENS, special_tokens=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def generate(out_dir: Path, spec: TinyModelSpec | None = None, *, force: bool = False) -> Path:
    """Write the tiny model to ``out_dir`` and return it; reuse it when it is already complete.

    Reuse is decided by a stamp file holding the spec and format version, so a changed spec or
    generator regenerates. Writes into a temporary sibling directory and renames it at the end, so
    an interrupted run never leaves a half-written model behind.

    Raises:
        RuntimeError: the generated tokenizer does not fit the model's vocabulary.
    """
    spec = spec or TinyModelSpec()
    stamp = json.dumps({"format": MODEL_FORMAT_VERSION, **spec.__dict__}, sort_keys=True)
    stamp_path = out_dir / "trajgate-model.json"
    if not force and stamp_path.exists() and stamp_path.read_text() == stamp:
        return out_dir

    import shutil

    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(spec)
    vocab = len(tokenizer)  # type: ignore[arg-type]
    if vocab > spec.vocab_size:
        raise RuntimeError(f"tokenizer has {vocab} ids, expected <= {spec.vocab_size}")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")  # type: ignore[attr-defined]
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")  # type: ignore[attr-defined]

    torch.manual_seed(spec.seed)
    config = Qwen2Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        initializer_range=spec.initializer_range,
        eos_token_id=im_end,
        pad_token_id=pad,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        eos_token_id=im_end, pad_token_id=pad
    )

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)  # type: ignore[attr-defined]
    (tmp / "trajgate-model.json").write_text(stamp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def fingerprint(model_dir: Path) -> str:
    """SHA-256 over the generated files (names and bytes), to check determinism."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.iterdir()):
        if path.is_file():
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()
