"""Stored token IDs turned back into text for people to read (the pool API and the inspector).

Owns: loading a tokenizer directory's ``tokenizer.json`` (``TRAJGATE_TOKENIZER_DIR``, or the one
the gateway learnt from vLLM for the step's model; the last few loaded stay cached), decoding
with it, and naming its special tokens. Never: encodes text
into token IDs; the IDs a trainer sees are always the ones the engine reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any


@lru_cache(maxsize=4)
def _tokenizer(tokenizer_dir: str) -> Any:
    from tokenizers import Tokenizer  # lazily: only pools with a tokenizer configured need it

    return Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))


def decode(tokenizer_dir: Path, ids: Sequence[int]) -> str:
    """The text of ``ids`` as one string, special tokens kept."""
    text: str = _tokenizer(str(tokenizer_dir)).decode(list(ids), skip_special_tokens=False)
    return text


def decode_each(tokenizer_dir: Path, ids: Sequence[int]) -> list[str]:
    """The text of each ID decoded alone (``len(ids)`` strings), special tokens kept."""
    texts: list[str] = _tokenizer(str(tokenizer_dir)).decode_batch(
        [[i] for i in ids], skip_special_tokens=False
    )
    return texts


def special_ids(tokenizer_dir: Path) -> frozenset[int]:
    """IDs of the tokenizer's added tokens (chat markers such as ``<|im_start|>``,
    ``<tool_call>``): never produced by splitting text, so the token view marks them."""
    added = _tokenizer(str(tokenizer_dir)).get_added_tokens_decoder()
    return frozenset(int(i) for i in added)
