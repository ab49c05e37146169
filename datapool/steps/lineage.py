"""The writer's memory of each open trajectory's token sequences, to find a new step's parent.

Owns: a bounded LRU of ``S_k = P_k + R_k`` per trajectory as int32 bytes, and the fast parent
choice over it. The contract is exactly ``datapool.steps.prefix.choose_parent`` (a test checks they
agree); the comparison is a memcmp of bytes instead of a Python loop over tokens, because the
writer runs it for every step against every earlier step of the trajectory (20 turns of ~10k
tokens would otherwise cost milliseconds per step). Never: the source of truth; a trajectory
that another process wrote to, or that was evicted, is rebuilt from the stored payloads.

Memory: a chain of extending steps shares one growing buffer, so a trajectory costs about
4 bytes per token of its longest sequence; each candidate also keeps its messages as JSON text
(``datapool.steps.messages``), a message shared with its parent being one string, so about the
size of the trajectory's distinct messages plus a pointer per message per step.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from datapool.steps.prefix import Lineage

TOKEN_BYTES = 4


def pack_ids(ids: Sequence[int]) -> bytes:
    """``[T]`` token IDs as int32 little-endian bytes (4 T bytes), the blob format of
    ``payload.encode_ids``, for the writer's Python lists: ``struct`` packs a list about 3x faster
    than numpy converts one, and the writer packs every prompt.

    Raises ``ValueError`` when an ID is not an integer that fits int32.
    """
    try:
        return struct.pack(f"<{len(ids)}i", *ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers that fit int32: {exc}") from None


@dataclass
class _Candidate:
    step_id: str
    buffer: bytearray  # shared with later steps that extend this one
    length_bytes: int
    # ``message_key`` of each of its request messages then of its response message (``H`` in
    # ``datapool.steps.messages``), strings shared with its parent's; None: no messages list.
    message_keys: list[str] | None = None
    has_response: bool = False  # whether the last message key is its response message


@dataclass
class TrajectoryTokens:
    """Candidates (ok steps with prompt and response IDs, oldest first), the latest step, and
    the trajectory's ``call_count`` they reflect (a different count in the database means
    someone else wrote steps since)."""

    candidates: list[_Candidate] = field(default_factory=list)
    latest_step_id: str | None = None
    call_count: int = 0

    def choose_parent(self, prompt: bytes) -> Lineage:
        """``prefix.choose_parent`` over the candidates for ``prompt`` (int32 bytes)."""
        if not self.candidates:
            return Lineage(None, None, None)
        # Longest first, the later of equal lengths first: the first match is the parent, and
        # it is usually the latest step, so one comparison instead of one per earlier step.
        order = sorted(
            range(len(self.candidates)),
            key=lambda i: (self.candidates[i].length_bytes, i),
            reverse=True,
        )
        for i in order:
            candidate = self.candidates[i]
            n = candidate.length_bytes
            if n <= len(prompt) and prompt.startswith(candidate.buffer[:n]):
                return Lineage(candidate.step_id, True, None)
        latest = self.candidates[-1]
        sequence = np.frombuffer(bytes(latest.buffer[: latest.length_bytes]), dtype="<i4")
        ids = np.frombuffer(prompt, dtype="<i4")
        shared = min(len(sequence), len(ids))
        differ = np.flatnonzero(sequence[:shared] != ids[:shared])
        offset = int(differ[0]) if differ.size else shared
        return Lineage(latest.step_id, False, offset)

    def sequence_of(self, step_id: str) -> bytes:
        candidate = self._candidate(step_id)
        return bytes(candidate.buffer[: candidate.length_bytes])

    def message_keys_of(self, step_id: str) -> tuple[list[str] | None, bool]:
        """``(H, has_response)`` of step ``step_id``: its messages then its response message
        as JSON text, and whether that response is there; ``(None, False)`` when it is not a
        candidate or had no messages list."""
        for candidate in reversed(self.candidates):
            if candidate.step_id == step_id:
                return candidate.message_keys, candidate.has_response
        return None, False

    def tokens_of(self, step_id: str) -> int:
        """``len(S)`` of step ``step_id``, without copying its sequence."""
        return self._candidate(step_id).length_bytes // TOKEN_BYTES

    def _candidate(self, step_id: str) -> _Candidate:
        for candidate in reversed(self.candidates):  # parents are usually recent
            if candidate.step_id == step_id:
                return candidate
        raise KeyError(step_id)

    def add(
        self,
        step_id: str,
        parent: Lineage,
        prompt: bytes,
        response: bytes,
        message_keys: list[str] | None = None,
        has_response: bool = False,
    ) -> None:
        """Remember step ``step_id`` with sequence ``prompt + response`` (int32 bytes) and
        its message keys (``datapool.steps.messages.history_keys``)."""
        if parent.extends_parent and parent.parent_step_id is not None:
            base = self._candidate(parent.parent_step_id)
            if len(base.buffer) == base.length_bytes:  # the parent is its buffer's tip
                base.buffer += prompt[base.length_bytes :]
                base.buffer += response
                self.candidates.append(
                    _Candidate(step_id, base.buffer, len(base.buffer), message_keys, has_response)
                )
                return
        buffer = bytearray(prompt)
        buffer += response
        self.candidates.append(_Candidate(step_id, buffer, len(buffer), message_keys, has_response))


class LineageCache:
    """An LRU of ``TrajectoryTokens`` for at most ``max_trajectories`` trajectories."""

    def __init__(self, max_trajectories: int) -> None:
        self.max_trajectories = max_trajectories
        self._entries: OrderedDict[str, TrajectoryTokens] = OrderedDict()

    def get(self, trajectory_id: str) -> TrajectoryTokens | None:
        entry = self._entries.get(trajectory_id)
        if entry is not None:
            self._entries.move_to_end(trajectory_id)
        return entry

    def put(self, trajectory_id: str, entry: TrajectoryTokens) -> None:
        self._entries[trajectory_id] = entry
        self._entries.move_to_end(trajectory_id)
        while len(self._entries) > self.max_trajectories:
            self._entries.popitem(last=False)

    def forget(self, trajectory_id: str) -> None:
        self._entries.pop(trajectory_id, None)

    def clear(self) -> None:
        self._entries.clear()
