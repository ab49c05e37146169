"""Which tokenizer each served model uses, learnt from vLLM, so people read token IDs as text.

Owns: ``TokenizerDirs``, a map from a served model's name to the directory whose
``tokenizer.json`` decodes its IDs, learnt from every replica's ``GET /v1/models``: vLLM lists
each model with ``root`` (the path it loaded the weights and tokenizer from) and each LoRA
adapter with ``parent`` (its base model, whose tokenizer it shares). Re-learnt at most every
``refresh_s`` seconds, when the token view asks and every ``refresh_s`` in the background
(``gateway.app``). Each tokenizer learnt is also copied into the pool
(``datapool.tokenizer_copies``), so a pool reopened when no replica lists the model any more
still decodes. ``TRAJGATE_TOKENIZER_DIR`` overrides it all.

Never: decodes by itself (``datapool.queries.token_text`` does, display only) or encodes text.
Why not vLLM's ``/detokenize``: it takes one sequence per call, so decoding each of a step's
thousands of tokens alone would cost thousands of calls per view; the tokenizer on disk decodes
them in one batch in milliseconds. A vLLM on another machine (``root`` not on this disk) leaves
the view showing IDs, and ``note`` says which path to set.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from datapool.tokenizer_copies import TokenizerCopies
from gateway.engine.models import model_entries

log = logging.getLogger("trajgate.tokenizer_dirs")

TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class TokenizerChoice:
    """The directory to decode with, and where it came from (shown to people)."""

    directory: Path
    source: str


@dataclass
class TokenizerDirs:
    """Served model name -> tokenizer directory, learnt from the replicas' ``/v1/models``."""

    refresh_s: float = 10.0
    directories: dict[str, Path] = field(default_factory=dict)
    # model name -> why it has no directory here (its root is not on this disk)
    missing: dict[str, str] = field(default_factory=dict)
    learnt_at: float | None = None
    # the pool's copies: written for each model learnt, read when no replica lists a model
    copies: TokenizerCopies | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def learn(self, client: httpx.AsyncClient, urls: list[str], timeout_s: float) -> None:
        """Ask every replica for its models (``gateway.engine.models.model_entries``, each
        within ``timeout_s``), unless the last answer is under ``refresh_s`` old. A replica
        that does not answer keeps what was learnt from it before."""
        async with self._lock:
            now = time.monotonic()
            if self.learnt_at is not None and now - self.learnt_at < self.refresh_s:
                return
            for url in urls:
                listed = await model_entries(client, url, timeout_s)
                if listed is None:
                    log.info("no model list from %s for the token view", url)
                    continue
                # off the event loop: a first copy into the pool reads a few megabytes
                await asyncio.to_thread(self._add, listed)
            self.learnt_at = time.monotonic()

    def _add(self, listed: list[Any]) -> None:
        entries = {
            e["id"]: e for e in listed if isinstance(e, dict) and isinstance(e.get("id"), str)
        }
        for name, entry in entries.items():
            for candidate in (entry, entries.get(entry.get("parent") or "")):
                root = candidate.get("root") if candidate else None
                if isinstance(root, str) and (Path(root) / TOKENIZER_FILE).is_file():
                    self.directories[name] = Path(root)
                    self.missing.pop(name, None)
                    self._remember(name, Path(root))
                    break
            else:
                root = entry.get("root")
                # A server that is not vLLM (or an old one) lists no root: say so, not "None".
                self.missing[name] = (
                    f"vLLM serves {name!r} from {root!r}, which has no {TOKENIZER_FILE} on the "
                    "gateway's machine"
                    if isinstance(root, str)
                    else f"the model list names no directory (root) for {name!r}"
                )

    def _remember(self, model: str, root: Path) -> None:
        if self.copies is None:
            return
        try:
            self.copies.remember(model, root)
        except (OSError, ValueError) as exc:  # the live view still decodes; a reopened pool not
            log.warning("could not keep a copy of %s's tokenizer in the pool: %s", model, exc)

    def choose(self, model: str | None, override: Path | None) -> TokenizerChoice | None:
        """The tokenizer for IDs produced by ``model``: ``override`` when set; the learnt
        directory of ``model``; the pool's copy of ``model``'s; None for a listed model whose
        root is not on this disk; else the one directory every learnt model shares (an adapter
        unloaded since keeps its base model's tokenizer); else the one copy every model the
        pool remembers shares; else None."""
        if override is not None:
            return TokenizerChoice(override, "TRAJGATE_TOKENIZER_DIR")
        if model is not None and model in self.directories:
            return TokenizerChoice(self.directories[model], f"vLLM /v1/models root of {model!r}")
        copy = self.copies.directory_of(model) if self.copies and model is not None else None
        if copy is not None:
            return TokenizerChoice(copy, f"the pool's copy of the tokenizer of {model!r}")
        if model is not None and model in self.missing:
            return None  # served from elsewhere: another model's tokenizer would misread it
        shared = set(self.directories.values())
        if len(shared) == 1:
            (directory,) = shared
            return TokenizerChoice(directory, "vLLM /v1/models root of the only served model")
        copy = self.copies.shared_directory() if self.copies else None
        if copy is not None:
            return TokenizerChoice(copy, "the pool's copy of the only tokenizer it remembers")
        return None

    def note(self, model: str | None) -> str:
        """Why ``choose`` found nothing for ``model`` (shown where the text would be)."""
        if model is not None and model in self.missing:
            return self.missing[model] + "; set TRAJGATE_TOKENIZER_DIR to a copy of it"
        if not self.directories and not self.missing:
            return "no replica listed its models yet; set TRAJGATE_TOKENIZER_DIR to decode"
        return (
            f"no tokenizer known for model {model!r} (served: {sorted(self.directories)}); "
            "set TRAJGATE_TOKENIZER_DIR to decode"
        )
