"""Copies of the served models' tokenizers, kept with the pool, so that a pool reopened later
(``trajgate serve --data-dir ...`` with no vLLM running) still shows its token IDs as text.

Owns: ``<data_dir>/tokenizers/``: one copy of each distinct ``tokenizer.json``, in a directory
named by the file's SHA-256 (``<sha256>/tokenizer.json``: models that share a tokenizer share a
copy), and ``models.json``, ``{served model name: sha256}``. The gateway calls ``remember``
for each model whose tokenizer it learns from a replica (``gateway.tokenizer_dirs``); the token
view reads ``directory_of`` when no replica lists the model any more.

Never: encodes or decodes (``datapool.queries.token_text`` decodes), or copies anything but
``tokenizer.json`` (all the token view reads), and then only a regular file that lies under the
model's directory (a link out of it, to ``/etc/passwd`` say, is refused; a Hugging Face cache
snapshot's links into its repository's ``blobs/`` are followed), of at most
``TOKENIZER_MAX_BYTES``, read once in chunks while it is hashed, and kept only when it loads as a
tokenizer. Files are written to a temporary name and renamed, so a reader never sees half a
copy. Gateway processes sharing one data directory merge ``models.json`` on each write (a name
written at the same instant by two of them may keep either's; both name a tokenizer that model
was served with).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"
INDEX_FILE = "models.json"
# The largest tokenizer.json copied: the largest vocabularies served today (~260k tokens) write
# 20 to 35 MB; a file many times that is not a tokenizer, and must not be read into the pool.
TOKENIZER_MAX_BYTES = 128 * 2**20
_CHUNK_BYTES = 2**20


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
            ValueError: the file is not one to copy: not a regular file under ``source_dir``,
                over ``TOKENIZER_MAX_BYTES``, or not a tokenizer (it does not load).
            OSError: the source cannot be read or the pool's directory cannot be written.
        """
        source, key = _source_file(source_dir)
        with self._lock:
            digest = self._digests.get(key)
            if digest is None or not (self.directory / digest / TOKENIZER_FILE).is_file():
                digest = self._copy(source)
                self._digests[key] = digest
            index = self._index()
            if index.get(model) != digest:
                index[model] = digest
                text = json.dumps(index, indent=1, sort_keys=True).encode()
                _write_atomically(self.directory / INDEX_FILE, text)
            return self.directory / digest

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

    def _copy(self, source: Path) -> str:
        """Stream ``source`` into the pool (hashing as it goes: one read), keep it under its
        SHA-256 if it loads as a tokenizer; returns the digest. Raises as ``remember``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = _tmp_name(self.directory / TOKENIZER_FILE)
        digest = hashlib.sha256()
        try:
            size = 0
            with source.open("rb") as reader, tmp.open("wb") as writer:
                while chunk := reader.read(_CHUNK_BYTES):
                    size += len(chunk)
                    if size > TOKENIZER_MAX_BYTES:  # grown since it was looked at
                        raise ValueError(_too_large(source))
                    digest.update(chunk)
                    writer.write(chunk)
            copy_dir = self.directory / digest.hexdigest()
            if not (copy_dir / TOKENIZER_FILE).is_file():
                _check_loads(tmp, source)
                copy_dir.mkdir(exist_ok=True)
                tmp.replace(copy_dir / TOKENIZER_FILE)
        finally:
            tmp.unlink(missing_ok=True)
        return digest.hexdigest()


def _source_file(source_dir: Path) -> tuple[Path, tuple[str, int, int]]:
    """``source_dir/tokenizer.json`` resolved, and its (path, size, mtime in ns); ValueError
    when it is not a regular file under ``source_dir`` (or, in a Hugging Face cache snapshot,
    under the snapshot's repository) or is over ``TOKENIZER_MAX_BYTES``."""
    root = source_dir.resolve(strict=True)
    # A Hugging Face cache snapshot (<repo>/snapshots/<revision>) links its files to <repo>/blobs.
    base = root.parent.parent if root.parent.name == "snapshots" else root
    source = (root / TOKENIZER_FILE).resolve(strict=True)
    if not source.is_relative_to(base):
        raise ValueError(f"{source_dir / TOKENIZER_FILE} links to {source}, outside {base}")
    info = source.stat()
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{source} is not a regular file")
    if info.st_size > TOKENIZER_MAX_BYTES:
        raise ValueError(_too_large(source))
    return source, (str(source), info.st_size, info.st_mtime_ns)


def _too_large(source: Path) -> str:
    return f"{source} is larger than {TOKENIZER_MAX_BYTES} bytes: not a tokenizer to copy"


def _check_loads(path: Path, source: Path) -> None:
    from tokenizers import Tokenizer  # lazily, as datapool.queries.token_text

    try:
        Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises its own untyped errors for any bad file
        raise ValueError(f"{source} does not load as a tokenizer: {exc}") from None


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = _tmp_name(path)
    tmp.write_bytes(data)
    tmp.replace(path)
