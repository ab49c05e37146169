"""Token payloads: how a step's prompt IDs, response IDs and logprobs are stored and read back.

Owns: the binary encoding of recent payloads (``step_payloads`` rows; ``encode_payload`` on the
write path), the prompt delta, the compaction of recent payloads into Parquet files on any
pyarrow filesystem, and exact reconstruction (``reconstruct``, ``prompts_of``, through the
delta-chain walk of ``datapool.steps.chain``). Never: tokenizes or decodes; every number stored
is the engine's own.

Shapes (``P`` prompt tokens, ``R`` response tokens, ``D`` delta tokens):

- A step's prompt ``[P]`` is stored as ``prompt_base_tokens`` = b and a delta ``[D]``: the prompt
  is ``S_parent[:b] + delta`` with ``S_parent = P_parent + R_parent``. When the prompt extends its
  parent, ``b = len(S_parent)``; at a prefix break, ``b`` = the divergence offset (the shared
  head is still not stored twice). b = 0 or None: the delta is the whole prompt.
- Recent payloads (``step_payloads``) are blobs: int32 little-endian IDs; logprobs as one width
  byte ``b"4"``/``b"8"`` then float32/float64 little-endian. float32 is used only when every
  value round-trips exactly (vLLM's logprobs are float32 numbers), else float64.
- Parquet files (zstd, byte-stream-split) have one row per step: ``step_id`` string,
  ``trajectory_id`` string, ``step_index`` int32, ``choice_index`` int32, ``prompt_delta``
  list<int32>, ``response_token_ids`` list<int32>, ``response_logprobs`` list<float64>; sorted by
  trajectory so a trajectory's reads touch few row groups.
"""

from __future__ import annotations

import contextlib
import struct
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from datapool.db import chunks
from datapool.errors import PoolError
from datapool.models import PayloadFile, Step, StepPayload
from datapool.steps import chain
from datapool.steps.prefix import Lineage
from datapool.steps.records import ChoiceRecord

IntArray = npt.NDArray[np.int32]
FloatArray = npt.NDArray[np.float64]
PAYLOAD_FILE_PREFIX = "payloads-"

PARQUET_SCHEMA = pa.schema(
    [
        ("step_id", pa.string()),
        ("trajectory_id", pa.string()),
        ("step_index", pa.int32()),
        ("choice_index", pa.int32()),
        ("prompt_delta", pa.list_(pa.int32())),
        ("response_token_ids", pa.list_(pa.int32())),
        ("response_logprobs", pa.list_(pa.float64())),
    ]
)


def encode_ids(ids: Sequence[int] | IntArray | None) -> bytes | None:
    """``[T]`` IDs as int32 little-endian bytes (4 T bytes); None stays None.

    Raises ``ValueError`` when an ID does not fit int32 (no vocabulary is that large).
    """
    if ids is None:
        return None
    array = np.asarray(ids, dtype=np.int64)
    if array.size and (array.min() < -(2**31) or array.max() >= 2**31):
        raise ValueError(f"token ids must fit int32; got range {array.min()}..{array.max()}")
    return array.astype("<i4").tobytes()


def decode_ids(blob: bytes | None) -> IntArray | None:
    if blob is None:
        return None
    return np.frombuffer(blob, dtype="<i4").astype(np.int32)


def encode_logprobs(values: Sequence[float] | None) -> bytes | None:
    """float32 with width byte ``4`` when every value round-trips exactly, else float64 (``8``)."""
    if values is None:
        return None
    wide = np.asarray(values, dtype=np.float64)
    narrow = wide.astype(np.float32)
    if np.array_equal(narrow.astype(np.float64), wide, equal_nan=True):
        return b"4" + narrow.astype("<f4").tobytes()
    return b"8" + wide.astype("<f8").tobytes()


def decode_logprobs(blob: bytes | None) -> FloatArray | None:
    if blob is None:
        return None
    width, body = blob[:1], blob[1:]
    if width == b"4":
        return np.frombuffer(body, dtype="<f4").astype(np.float64)
    if width == b"8":
        return np.frombuffer(body, dtype="<f8").astype(np.float64)
    raise ValueError(f"logprobs blob width byte must be b'4' or b'8', got {width!r}")


TOKEN_BYTES = 4  # one int32 ID in a blob


def pack_ids(ids: Sequence[int]) -> bytes:
    """``[T]`` token IDs as int32 little-endian bytes (4 T bytes), the blob format of
    ``encode_ids``, for the writer's Python lists: ``struct`` packs a list about 3x faster
    than numpy converts one, and the writer packs every prompt.

    Raises ``ValueError`` when an ID is not an integer that fits int32.
    """
    try:
        return struct.pack(f"<{len(ids)}i", *ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers that fit int32: {exc}") from None


@dataclass(frozen=True)
class CallPayload:
    """A call's payloads as its rows store them: one prompt delta for every choice (they share
    the prompt), one response and logprobs blob per choice (None where the engine gave none)."""

    prompt_base_tokens: int | None  # b; None when the call has no prompt IDs
    prompt_delta: bytes | None  # ``P[b:]`` as int32 bytes
    responses: list[bytes | None]  # ``[R]`` as int32 bytes, per choice
    logprobs: list[bytes | None]  # ``encode_logprobs``, per choice


def encode_payload(
    prompt: bytes | None,
    lineage: Lineage,
    parent_tokens: int,
    choices: Sequence[ChoiceRecord],
) -> CallPayload:
    """Encode a call's payload for its place in the trajectory (module docstring): b =
    ``parent_tokens`` (``len(S_parent)``) when ``prompt`` (``pack_ids`` bytes) extends its
    parent, the divergence offset at a prefix break, 0 without a parent."""
    base_tokens = 0
    if lineage.parent_step_id is not None:
        if lineage.extends_parent:
            base_tokens = parent_tokens
        elif lineage.divergence_offset:
            base_tokens = lineage.divergence_offset
    return CallPayload(
        None if prompt is None else base_tokens,
        None if prompt is None else prompt[base_tokens * TOKEN_BYTES :],
        [None if c.response_token_ids is None else pack_ids(c.response_token_ids) for c in choices],
        [encode_logprobs(c.response_logprobs) for c in choices],
    )


@dataclass(frozen=True)
class StoredPayload:
    """A step's payload as stored: delta form (see the module docstring)."""

    step_id: str
    parent_step_id: str | None
    prompt_base_tokens: int | None
    prompt_delta: IntArray | None
    response_token_ids: IntArray | None
    response_logprobs: FloatArray | None


@dataclass(frozen=True)
class TokenPayload:
    """A step's exact payload: ``[P]`` prompt IDs, ``[R]`` response IDs, ``[R]`` logprobs."""

    prompt_token_ids: list[int] | None
    response_token_ids: list[int] | None
    response_logprobs: list[float] | None


class CompactionRaceError(RuntimeError):
    """Another process compacted some of the same payloads first; this round's file is deleted
    and nothing changed (normal with several gateways on one database)."""


class PayloadMissingError(PoolError, LookupError):
    """A step's payload, or the parent payload its prompt delta needs, is not stored."""


def reconstruct(
    stored: Mapping[str, StoredPayload], step_ids: Sequence[str] | None = None
) -> dict[str, TokenPayload]:
    """Exact payloads of ``step_ids`` (default: every step in ``stored``, which must hold each
    one's base chain), by step id.

    Only the steps asked for become Python lists: reading one late step of a long session
    builds its ancestors' prompts as arrays on the way, never as ``[P]`` lists each.
    Raises ``PayloadMissingError`` when a delta's parent is absent or shorter than its base.
    """
    wanted = list(stored) if step_ids is None else list(step_ids)
    prompts = prompts_of(stored, wanted)
    result: dict[str, TokenPayload] = {}
    for step_id in wanted:
        entry = stored[step_id]
        prompt = prompts[step_id]
        result[step_id] = TokenPayload(
            None if prompt is None else prompt.tolist(),
            None if entry.response_token_ids is None else entry.response_token_ids.tolist(),
            None if entry.response_logprobs is None else entry.response_logprobs.tolist(),
        )
    return result


def prompts_of(
    stored: Mapping[str, StoredPayload], step_ids: Iterable[str] | None = None
) -> dict[str, IntArray | None]:
    """Exact prompts ``[P]`` of ``step_ids`` (default: every step in ``stored``, which must
    hold each one's base chain) and of the ancestors they needed, by step id, through the one
    delta-chain walk (``datapool.steps.chain``); None for a step without prompt IDs.

    Raises ``PayloadMissingError`` when a delta's parent is absent or shorter than its base.
    """

    def apply(entry: StoredPayload, prompts: Mapping[str, IntArray | None]) -> IntArray | None:
        return _prompt(entry, prompts, stored)

    wanted = stored if step_ids is None else step_ids
    return chain.resolve(wanted, stored, _based_on, apply, _payload_missing)


def _based_on(entry: StoredPayload) -> str | None:
    """The step whose sequence ``entry``'s prompt is a delta on; None when stored whole."""
    return entry.parent_step_id if entry.prompt_base_tokens else None


def _payload_missing(step_id: str) -> PayloadMissingError:
    return PayloadMissingError(f"payload of step {step_id} is not stored")


def _prompt(
    entry: StoredPayload,
    prompts: Mapping[str, IntArray | None],
    stored: Mapping[str, StoredPayload],
) -> IntArray | None:
    """``S_parent[:b] + delta`` (see the module docstring); the parent prompt is in ``prompts``."""
    if entry.prompt_delta is None:
        return None
    base = entry.prompt_base_tokens or 0
    if base == 0:
        return entry.prompt_delta
    parent_id = entry.parent_step_id
    parent_prompt = prompts.get(parent_id) if parent_id is not None else None
    if parent_id is None or parent_prompt is None:
        raise PayloadMissingError(
            f"step {entry.step_id} stores a delta on parent {parent_id}, whose prompt is missing"
        )
    sequence = full_sequence(parent_prompt, stored[parent_id].response_token_ids)
    if len(sequence) < base:
        raise PayloadMissingError(
            f"step {entry.step_id} needs {base} tokens of its parent's sequence, "
            f"which has {len(sequence)}"
        )
    return np.concatenate([sequence[:base], entry.prompt_delta])


def full_sequence(prompt: IntArray, response: IntArray | None) -> IntArray:
    """``P + R`` as one int32 array ``[P + R]``."""
    if response is None:
        return prompt
    return np.concatenate([prompt, response])


@dataclass(frozen=True)
class StepRef:
    """What reading a step's payload needs from its SQL row."""

    step_id: str
    trajectory_id: str
    parent_step_id: str | None
    prompt_base_tokens: int | None
    payload_file_id: str | None


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path


class PayloadFiles:
    """Reads recent payloads from SQL and compacted ones from Parquet; compacts the former.

    ``root_uri`` is where new Parquet files go (a local directory or a pyarrow filesystem URI);
    reading uses each file's own stored URI, so moving the root never loses older files.
    """

    def __init__(self, sessions: sessionmaker[Session], root_uri: str) -> None:
        self.sessions = sessions
        self.root_uri = root_uri.rstrip("/")

    def load(self, session: Session, refs: Sequence[StepRef]) -> dict[str, StoredPayload]:
        """Stored payloads of ``refs`` (callers pass whole base chains, e.g. a trajectory)."""
        by_id = {ref.step_id: ref for ref in refs}
        result = self._load_recent(session, [r.step_id for r in refs if r.payload_file_id is None])
        missing = [step_id for step_id in by_id if step_id not in result]
        if missing:
            # Compacted (possibly between our SELECT of the step rows and now): ask again.
            files: dict[str, str | None] = {}
            for chunk in chunks(missing):
                rows = session.execute(
                    select(Step.id, Step.payload_file_id).where(Step.id.in_(chunk))
                )
                files.update({step_id: file_id for step_id, file_id in rows})
            by_file: dict[str, list[str]] = {}
            for step_id in missing:
                file_id = files.get(step_id)
                if file_id is not None:
                    by_file.setdefault(file_id, []).append(step_id)
            for file_id, step_ids in by_file.items():
                result.update(self._load_file(session, file_id, step_ids, by_id))
        return result

    def _load_recent(self, session: Session, step_ids: Sequence[str]) -> dict[str, StoredPayload]:
        result: dict[str, StoredPayload] = {}
        if not step_ids:
            return result
        for chunk in chunks(step_ids):
            rows = session.execute(
                select(
                    StepPayload.step_id,
                    Step.parent_step_id,
                    Step.prompt_base_tokens,
                    StepPayload.prompt_delta,
                    StepPayload.response_token_ids,
                    StepPayload.response_logprobs,
                )
                .join(Step, Step.id == StepPayload.step_id)
                .where(StepPayload.step_id.in_(chunk))
            )
            for step_id, parent_id, base, delta, response, logprobs in rows:
                result[step_id] = StoredPayload(
                    step_id,
                    parent_id,
                    base,
                    decode_ids(delta),
                    decode_ids(response),
                    decode_logprobs(logprobs),
                )
        return result

    def _load_file(
        self,
        session: Session,
        file_id: str,
        step_ids: Sequence[str],
        refs: Mapping[str, StepRef],
    ) -> dict[str, StoredPayload]:
        uri = session.scalar(select(PayloadFile.uri).where(PayloadFile.id == file_id))
        if uri is None:
            raise PayloadMissingError(f"payload file {file_id} is not registered")
        trajectories = sorted({refs[s].trajectory_id for s in step_ids})
        fs, path = _filesystem(uri)
        try:
            table = pq.read_table(
                path,
                filesystem=fs,
                filters=[("trajectory_id", "in", trajectories)],
            )
        except FileNotFoundError as exc:
            # Lost data, not a storage outage: only the steps in this file are affected.
            raise PayloadMissingError(
                f"payload file {uri} (registered as {file_id}) is missing: {exc}"
            ) from exc
        table = table.filter(pc.is_in(table["step_id"], value_set=pa.array(list(step_ids))))
        result: dict[str, StoredPayload] = {}
        columns = table.to_pydict()
        for i, step_id in enumerate(columns["step_id"]):
            ref = refs[step_id]
            result[step_id] = StoredPayload(
                step_id,
                ref.parent_step_id,
                ref.prompt_base_tokens,
                _int_array(columns["prompt_delta"][i]),
                _int_array(columns["response_token_ids"][i]),
                None
                if columns["response_logprobs"][i] is None
                else np.asarray(columns["response_logprobs"][i], dtype=np.float64),
            )
        return result

    def pending_steps(self) -> int:
        """Payloads still in the SQL table (not yet compacted)."""
        with self.sessions() as session:
            return int(session.scalar(select(func.count()).select_from(StepPayload)) or 0)

    def compact(self, max_steps: int, row_group_steps: int = 4096) -> PayloadFile | None:
        """Move up to ``max_steps`` oldest recent payloads into one new Parquet file.

        Order: write the file, then in one transaction register it, point the steps at it and
        delete their SQL payloads. A crash between the two leaves an unregistered file (harmless,
        never read); a concurrent compactor that took some of the same rows makes this
        transaction roll back and the file is deleted.
        """
        with self.sessions() as session:
            rows = session.execute(
                select(
                    StepPayload.step_id,
                    Step.trajectory_id,
                    Step.step_index,
                    Step.choice_index,
                    StepPayload.prompt_delta,
                    StepPayload.response_token_ids,
                    StepPayload.response_logprobs,
                )
                .join(Step, Step.id == StepPayload.step_id)
                .order_by(StepPayload.created_at)
                .limit(max_steps)
            ).all()
        if not rows:
            return None
        table = _payload_table(rows)
        file_id = str(uuid.uuid4())
        uri = f"{self.root_uri}/{PAYLOAD_FILE_PREFIX}{file_id}.parquet"
        fs, path = _filesystem(uri)
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        try:
            with fs.open_output_stream(path) as sink:
                pq.write_table(
                    table,
                    sink,
                    compression="zstd",
                    row_group_size=row_group_steps,
                    use_dictionary=["step_id", "trajectory_id"],
                    use_byte_stream_split=[
                        "prompt_delta.list.element",
                        "response_token_ids.list.element",
                        "response_logprobs.list.element",
                    ],
                )
        except BaseException:
            # Disk full or the store failed mid-file: no truncated file stays behind, and the
            # payloads stay in SQL for the next round.
            _delete_quietly(fs, path)
            raise
        size_bytes = fs.get_file_info(path).size or 0
        step_ids = [row[0] for row in rows]
        record = PayloadFile(id=file_id, uri=uri, steps=len(rows), size_bytes=size_bytes)
        try:
            with self.sessions.begin() as session:
                session.add(record)
                deleted = 0
                for chunk in chunks(step_ids):
                    session.execute(
                        update(Step).where(Step.id.in_(chunk)).values(payload_file_id=file_id)
                    )
                    result: Any = session.execute(
                        delete(StepPayload).where(StepPayload.step_id.in_(chunk))
                    )
                    deleted += int(result.rowcount)
                if deleted != len(step_ids):
                    raise CompactionRaceError(
                        f"compaction raced another compactor: expected to move {len(step_ids)} "
                        f"payloads, {deleted} were still there"
                    )
        except BaseException:
            _delete_quietly(fs, path)
            raise
        return record

    def delete_orphans(self, min_age_s: float) -> list[str]:
        """Delete payload files under ``root_uri`` that no ``payload_files`` row registers and
        that were last modified more than ``min_age_s`` seconds ago; returns their URIs.

        Such files come from a compaction that died between writing its file and committing
        (``compact``'s order makes them harmless: never read). The age guard keeps a file that a
        concurrent compactor is about to register. Files not named ``payloads-*.parquet`` are
        never touched.
        """
        fs, root = _filesystem(self.root_uri)
        listing = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
        candidates = {
            info.path: info
            for info in listing
            if info.type == pafs.FileType.File
            and info.base_name.startswith(PAYLOAD_FILE_PREFIX)
            and info.base_name.endswith(".parquet")
        }
        if not candidates:
            return []
        with self.sessions() as session:
            registered = {_filesystem(uri)[1] for uri in session.scalars(select(PayloadFile.uri))}
        cutoff = time.time() - min_age_s
        deleted: list[str] = []
        for path, info in sorted(candidates.items()):
            modified = info.mtime.timestamp() if info.mtime is not None else None
            if path in registered or modified is None or modified > cutoff:
                continue
            _delete_quietly(fs, path)
            deleted.append(f"{self.root_uri}/{info.base_name}")
        return deleted


def _delete_quietly(fs: pafs.FileSystem, path: str) -> None:
    """Delete ``path`` if it exists; a failure to clean up must not hide the error being
    raised (the file is then an orphan for ``delete_orphans``)."""
    with contextlib.suppress(OSError):
        fs.delete_file(path)


def _payload_table(rows: Sequence[Any]) -> pa.Table:
    """The Parquet table (``PARQUET_SCHEMA``) of ``compact``'s rows ``(step_id, trajectory_id,
    step_index, choice_index, prompt_delta, response_token_ids, response_logprobs)``, sorted by
    trajectory, step and choice so a trajectory's reads touch few row groups."""
    rows = sorted(rows, key=lambda row: (row[1], row[2], row[3]))
    return pa.table(
        {
            "step_id": [row[0] for row in rows],
            "trajectory_id": [row[1] for row in rows],
            "step_index": pa.array([row[2] for row in rows], pa.int32()),
            "choice_index": pa.array([row[3] for row in rows], pa.int32()),
            "prompt_delta": _list_column([decode_ids(row[4]) for row in rows], pa.int32()),
            "response_token_ids": _list_column([decode_ids(row[5]) for row in rows], pa.int32()),
            "response_logprobs": _list_column(
                [decode_logprobs(row[6]) for row in rows], pa.float64()
            ),
        },
        schema=PARQUET_SCHEMA,
    )


def _int_array(values: list[int] | None) -> IntArray | None:
    return None if values is None else np.asarray(values, dtype=np.int32)


def _list_column(arrays: Sequence[npt.NDArray[Any] | None], value_type: pa.DataType) -> pa.Array:
    """A list<value_type> column from numpy arrays (None = null) without per-element Python."""
    lengths = np.array([0 if a is None else len(a) for a in arrays], dtype=np.int64)
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    present = [a for a in arrays if a is not None]
    dtype = np.int32 if value_type == pa.int32() else np.float64
    values = np.concatenate(present).astype(dtype) if present else np.zeros(0, dtype=dtype)
    mask = pa.array([a is None for a in arrays], pa.bool_())
    return pa.ListArray.from_arrays(
        pa.array(offsets, pa.int32()), pa.array(values, value_type), mask=mask
    )
