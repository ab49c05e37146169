"""Copies of the served models' tokenizers, kept with the pool, so that a pool reopened later
(``trajgate serve --data-dir ...`` with no vLLM running) still shows its token IDs as text.

Owns: ``<data_dir>/tokenizers/``: one copy of each distinct ``tokenizer.json``, in a directory
named by the file's SHA-256 (``<sha256>/tokenizer.json``: models that share a tokenizer share a
copy), and ``models.json``, ``{served model name: sha256}``. The gateway calls ``remember``
for each model whose tokenizer it learns from a replica (``gateway.tokenizer_dirs``); the token
view reads ``directory_of`` when no replica lists the model any more.

Never: encodes or decodes (``datapool.queries.token_text`` decodes), or copies anything but
``tokenizer.json`` (all the token view reads). Files are written to a temporary name and
renamed, so a reader never sees half a copy. Gateway processes sharing one data directory
merge ``models.json`` on each write (a name written at the same instant by two of them may
keep either's; both name a tokenizer that model was served with).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"
INDEX_FILE = "models.json"


class TokenizerCopies:
    """The pool's remembered tokenizers under ``directory`` (``<data_dir>/tokenizers``)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        # (source file, its size and mtime in ns) -> its sha256: a source read once per change
        self._digests: dict[tuple[str, int, int], str] = {}

    def remember(self, model: str, source_dir: Path) -> Path:
        """Copy ``source_dir/tokenizer.json`` (once per distinct file) and record it as
        ``model``'s; returns the copy's directory.

        Raises:
            OSError: the source cannot be read or the pool's directory cannot be written.
        """
        source = source_dir / TOKENIZER_FILE
        with self._lock:
            digest = self._digest(source)
            copy_dir = self.directory / digest
            if not (copy_dir / TOKENIZER_FILE).is_file():
                copy_dir.mkdir(parents=True, exist_ok=True)
                _write_atomically(copy_dir / TOKENIZER_FILE, source.read_bytes())
            index = self._index()
            if index.get(model) != digest:
                index[model] = digest
                text = json.dumps(index, indent=1, sort_keys=True).encode()
                _write_atomically(self.directory / INDEX_FILE, text)
            return copy_dir

    def directory_of(self, model: str) -> Path | None:
        """The copy recorded for ``model``, if there is one on disk."""
        digest = self._index().get(model)
        if digest is None or not (self.directory / digest / TOKENIZER_FILE).is_file():
            return None
        return self.directory / digest

    def shared_directory(self) -> Path | None:
        """The one copy every remembered model uses, if they all use the same one."""
        digests = set(self._index().values())
        if len(digests) != 1:
            return None
        (digest,) = digests
        return self.directory / digest if (self.directory / digest).is_dir() else None

    def _index(self) -> dict[str, str]:
        try:
            index = json.loads((self.directory / INDEX_FILE).read_text())
        except (OSError, ValueError):  # nothing remembered yet (or an unreadable file: start over)
            return {}
        if not isinstance(index, dict):
            return {}
        return {k: v for k, v in index.items() if isinstance(k, str) and isinstance(v, str)}

    def _digest(self, source: Path) -> str:
        stat = source.stat()
        key = (str(source.resolve()), stat.st_size, stat.st_mtime_ns)
        if key not in self._digests:
            self._digests[key] = hashlib.sha256(source.read_bytes()).hexdigest()
        return self._digests[key]


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
