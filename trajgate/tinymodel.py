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
- 131,072 positions with RoPE base 1e6, so the requests of the CLI coding agents fit with what
  they ask to generate. With this tokenizer: Claude Code sends 48 KB (~17k tokens) and asks for
  ``max_tokens`` 32,000 (49k in all), 78 KB (~35k, 67k in all) after an error; Qwen Code 66 KB
  (~28k); Codex 39 KB (~10k).
  Nothing is trained, so no length is "trained for"; attention is relative (RoPE) either way.
- The turn ends on its own: residual dimension 0 is reserved for a constant "end of turn" feature
  (the last attention layer's value bias writes it; no other weight writes to it), and
  ``<|im_end|>``'s output row is that dimension alone, so its logit hardly depends on the
  context: a turn of a few hundred tokens on average, and ``<|im_end|>`` below the likeliest
  other token at every position, so greedy decoding runs on. Random weights alone give turns
  longer than any limit, which clients such as Codex treat as an error (``response.incomplete``).
- Numbers are one direction: residual dimension 1 is reserved the same way for a constant that
  only the number tokens' output rows read (``_add_number_feature``), as number tokens share
  output directions in any pretrained LM. The demo's reward (answer with a number) is then
  learnable as one decision rather than 156 separate tokens (docs/demo.md has the figures).
  Dimension 2 does the same for whitespace-only tokens, pushed down, so a greedy constrained
  tool call ends instead of padding its JSON with whitespace until ``max_tokens``.
- Input and output embeddings are untied, so these output-side features do not enter the
  residual stream when the tokens are read back.

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

MODEL_FORMAT_VERSION = "7"  # bump when anything below changes the generated files

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

# The words of coding-agent prompts (instructions, tool schemas, shell and code): with them the
# tokenizer packs such prompts at ~2.5 characters per token instead of ~1.5 (measured on Qwen
# Code's 66 KB first request: 27,000 tokens instead of 43,000).
_AGENT_WORDS = (
    "a about above after again all also always an and any are as ask at available avoid based be "
    "before being below best between both but by can cannot case change changes clear command "
    "commands complete content context could create current data default describe description "
    "details directory do does each edit else empty ensure example existing explain files find "
    "follow following for format found from full get given go good has have help here how if "
    "implement important in include information input instead into it its just keep know like "
    "line lines look make many may message more most must need never not note now number of on "
    "only or order other output over path paths perform prefer project provide relevant request "
    "required response return safe see should show similar some specific start state string such "
    "sure system task tasks text than that their them there these they this those through time to "
    "tools type under understand until update use used user using values verify via want way well "
    "what when where whether which while will with within without work working you your "
    "npm git node json yaml bash shell cd ls rm mkdir cat grep sed import export class def async "
    "await const let var null undefined try catch except raise throw object array number integer "
    "boolean properties required items enum minimum maximum additionalProperties anyOf schema "
    "name arguments parameters file_path old_string new_string pattern glob todo status pending "
    "in_progress completed id limit offset timeout workspace src tests README md py ts js http url"
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
    max_position_embeddings: int = 131072
    rope_theta: float = 1_000_000.0
    # The Hugging Face default (0.02) makes every logit ~0: the output is uniform within 0.02
    # nats of log(V), and with tied embeddings that small no LoRA can concentrate it (measured:
    # no reward gain in 12 GRPO updates). 0.1 leaves room for RL to move the policy.
    initializer_range: float = 0.1
    # The end-of-turn feature (value bias, residual units) and <|im_end|>'s weight on it; their
    # product sets p(<|im_end|>): 2.0 x 2.75 gives ~0.003 per token; 2.0 x 4.0 makes it the
    # greedy choice at most positions (measured with the Hugging Face model).
    turn_end_feature: float = 2.0
    turn_end_weight: float = 2.75
    # The number feature (residual dimension 1): a constant of ``number_feature`` units that
    # only number tokens read, with weight ``number_weight`` in their output rows. It makes
    # "a number" one direction of the model, as it is in any pretrained LM, so RL can move the
    # whole class at once (docs/demo.md). 0.5 x 2.0 puts ~10% of the answer's mass on numbers.
    number_feature: float = 0.5
    number_weight: float = 2.0
    # Whitespace-only tokens (residual dimension 2), pushed down: constrained JSON (a forced
    # tool call) allows whitespace between tokens, and the random model padded greedy calls
    # with it until max_tokens, so the call never completed. -1.0 x 3.0 lowers their logits.
    whitespace_feature: float = -1.0
    whitespace_weight: float = 3.0
    seed: int = 0


def _corpus(seed: int) -> list[str]:
    """Synthetic text shaped like agent traffic: chat, JSON tool calls, numbers, code, and the
    instructions and tool schemas of coding-agent prompts."""
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
    vocabulary = sorted(set(_WORDS) | set(_AGENT_WORDS))
    types = ["string", "number", "integer", "boolean", "array", "object"]
    for _ in range(6000):
        text = " ".join(rng.choice(vocabulary) for _ in range(rng.randint(3, 20)))
        lead = rng.choice(["", "- ", "## ", "1. ", "  "])
        lines.append(lead + text.capitalize() + rng.choice([".", ",", "?", ":", ";", " `x`."]))
    for _ in range(1500):  # function tools as agents declare them
        properties = {
            rng.choice(vocabulary): {
                "type": rng.choice(types),
                "description": " ".join(rng.choice(vocabulary) for _ in range(6)).capitalize()
                + ".",
            }
            for _ in range(rng.randint(1, 3))
        }
        name = f"{rng.choice(vocabulary)}_{rng.choice(vocabulary)}"
        schema = {"type": "object", "properties": properties, "required": list(properties)[:1]}
        lines.append(json.dumps({"type": "function", "name": name, "parameters": schema}))
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
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        # Untied: the output rows carry the turn-end and number features without the same
        # features entering the residual stream from the input side.
        tie_word_embeddings=False,
        initializer_range=spec.initializer_range,
        eos_token_id=im_end,
        pad_token_id=pad,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
    _add_turn_end_feature(model, spec, im_end)
    _add_class_feature(
        model, spec, 1, number_token_ids(tokenizer), spec.number_feature, spec.number_weight
    )
    _add_class_feature(
        model,
        spec,
        2,
        whitespace_token_ids(tokenizer),
        spec.whitespace_feature,
        spec.whitespace_weight,
    )
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


def _reserve_dimension(model: object, dimension: int) -> None:
    """Zero every writer into residual ``dimension`` (input embeddings, attention output and MLP
    down projections of every layer), so only what the caller adds writes there."""
    import torch

    with torch.no_grad():
        model.model.embed_tokens.weight[:, dimension] = 0.0  # type: ignore[attr-defined]
        for layer in model.model.layers:  # type: ignore[attr-defined]
            layer.self_attn.o_proj.weight[dimension, :] = 0.0
            layer.mlp.down_proj.weight[dimension, :] = 0.0


def _constant_feature(model: object, spec: TinyModelSpec, dimension: int, value: float) -> None:
    """After the last attention layer, residual ``dimension`` holds ``value`` at every position.

    Value dimension ``dimension`` of every kv head is its bias alone, and output projection row
    ``dimension`` averages the heads' copies of it: the softmax weights sum to 1, so the average
    is the constant, whatever the context.
    """
    import torch

    last = model.model.layers[-1].self_attn  # type: ignore[attr-defined]
    head_dim = spec.hidden_size // spec.num_attention_heads
    with torch.no_grad():
        for kv_head in range(spec.num_key_value_heads):
            last.v_proj.weight[kv_head * head_dim + dimension, :] = 0.0
            last.v_proj.bias[kv_head * head_dim + dimension] = value
        for head in range(spec.num_attention_heads):
            last.o_proj.weight[dimension, head * head_dim + dimension] = (
                1.0 / spec.num_attention_heads
            )


def _add_turn_end_feature(model: object, spec: TinyModelSpec, im_end: int) -> None:
    """Reserve residual dimension 0 for a constant that only ``<|im_end|>`` reads.

    x[0] = ``turn_end_feature`` after the last attention layer at every position, and
    ``<|im_end|>``'s output row is that dimension alone (weight ``turn_end_weight``), so
    logit(<|im_end|>) = weight x x[0] / rms(x): it varies only with the residual's norm.
    """
    import torch

    _reserve_dimension(model, 0)
    _constant_feature(model, spec, 0, spec.turn_end_feature)
    head = model.lm_head.weight  # type: ignore[attr-defined]
    with torch.no_grad():
        head[:, 0] = 0.0
        head[im_end] = 0.0
        head[im_end, 0] = spec.turn_end_weight


def number_token_ids(tokenizer: object) -> list[int]:
    """Ids whose text is digits only (``"7"``, ``" 21"``): the class the number feature lifts."""
    ids = []
    for token_id in range(len(tokenizer)):  # type: ignore[arg-type]
        text = tokenizer.decode([token_id]).strip()  # type: ignore[attr-defined]
        if text and text.isascii() and text.isdigit():
            ids.append(token_id)
    return ids


def whitespace_token_ids(tokenizer: object) -> list[int]:
    """Ids whose text is whitespace only (``" "``, ``"\\n  "``)."""
    ids = []
    for token_id in range(len(tokenizer)):  # type: ignore[arg-type]
        text = tokenizer.decode([token_id])  # type: ignore[attr-defined]
        if text and text.isspace():
            ids.append(token_id)
    return ids


def _add_class_feature(
    model: object,
    spec: TinyModelSpec,
    dimension: int,
    ids: list[int],
    feature: float,
    weight: float,
) -> None:
    """Reserve residual ``dimension`` for one class of tokens: x[dimension] = ``feature`` at
    every position, read by the output rows of ``ids`` only (weight ``weight``), so their logits
    move together by ``feature x weight / rms(x)``.

    In a pretrained LM, tokens of one kind (numbers, whitespace) share directions of the output
    embedding; random weights have none, so a reward on answering with a number could only be
    learned token by token (156 separate tokens here). With this direction, one change to
    x[dimension] moves every token of the class by the same amount: LoRA's output and value
    projections can write it (their adapters start at 0, so the untrained policy is this model
    exactly).
    """
    import torch

    _reserve_dimension(model, dimension)
    _constant_feature(model, spec, dimension, feature)
    head = model.lm_head.weight  # type: ignore[attr-defined]
    with torch.no_grad():
        head[:, dimension] = 0.0
        head[ids, dimension] = weight


def fingerprint(model_dir: Path) -> str:
    """SHA-256 over the generated files (names and bytes), to check determinism."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.iterdir()):
        if path.is_file():
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()
