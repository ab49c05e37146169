"""Training rows from stored steps, assembled with numpy into Arrow columns.

Owns: reading the exact token payloads of many steps as arrays (no Python lists), cutting a
trajectory's trainable steps into *segments*, and assembling segments into the token columns of
a batch. Never: tokenizes, or crosses a prefix break: a segment only grows by a step whose
parent is the segment's last step and whose prompt starts with that step's prompt + response
(checked token by token, not only by the stored ``extends_parent``). Conversations that
interleave in one trajectory (a main agent and its sub-agents, side calls, two chats taking
turns) each grow their own segment: one row per conversation, rows ordered by first step.

Shape legend: ``P`` prompt tokens, ``R`` response tokens, ``T`` tokens of a row, ``N`` tokens of
all rows. A segment of steps ``s_1..s_m`` becomes one row:

    input_ids  = P_1 + R_1 + E_2 + R_2 + ... + E_m + R_m      (E_k = P_k[len(P_{k-1} + R_{k-1}):])
    loss_mask  = 0..0  1..1  0..0  1..1 ...                   (1 exactly on sampled tokens)
    behaviour_logprobs = 0 where the mask is 0, the engine's logprob of each sampled token else

which equals ``P_m + R_m``. In the ``per_step`` layout every segment is one step
(``P + R``, mask ``0^P 1^R``).

Each row also carries the temperature its behaviour logprobs are at (``temperature``: the
trainer divides its logits by it; a merged row only joins steps of one temperature), each
step's sampling record (``sampling_json``), and ``policy_version_spans``: ``[start, end)`` of
the row's token positions with the policy version that sampled them, one span per step's
version span (a step sampled across a kept full-weight update has several).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import pyarrow as pa
from sqlalchemy.orm import Session

from datapool.batches.spec import LAYOUTS
from datapool.models import Step
from datapool.steps.payloads import StepRef, prompts_of
from datapool.steps.store import PoolStore

IntArray = npt.NDArray[np.int32]
# A row's ``policy_version_spans``: [start, end) of its token positions and the version.
VERSION_SPANS = pa.list_(
    pa.struct([("version", pa.int32()), ("start", pa.int32()), ("end", pa.int32())])
)
FloatArray = npt.NDArray[np.float32]
Item = TypeVar("Item")  # what a row is made of: ``StepTokens``, or a ``Step`` for a view


@dataclass(frozen=True)
class StepTokens:
    """One step's exact arrays: prompt ``[P]``, response ``[R]``, logprobs ``[R]`` (float32)."""

    row: Step
    prompt: IntArray
    response: IntArray
    logprobs: FloatArray

    @property
    def tokens(self) -> int:
        return len(self.prompt) + len(self.response)

    @property
    def temperature(self) -> float:
        """The temperature the stored logprobs are at (1.0 for steps recorded before it was)."""
        return temperature_of(self.row)

    def version_spans(self) -> list[tuple[int | None, int, int]]:
        """``(version, start, end)`` over the response tokens, in order (one span when the
        step was sampled by one version)."""
        spans = self.row.policy_version_spans
        if not spans:
            return [(self.row.policy_version, 0, len(self.response))]
        return [(int(v), int(start), int(end)) for v, start, end in spans]


def load_tokens(
    store: PoolStore, session: Session, steps: Sequence[Step]
) -> dict[str, StepTokens | None]:
    """Exact arrays of ``steps`` (whole trajectories, in step order); None for a step whose
    prompt, response or logprobs the engine did not report, or whose lengths disagree."""
    refs = [
        StepRef(s.id, s.trajectory_id, s.parent_step_id, s.prompt_base_tokens, s.payload_file_id)
        for s in steps
    ]
    stored = store.payloads.load(session, refs)
    prompts = prompts_of(stored)
    result: dict[str, StepTokens | None] = {}
    for step in steps:
        entry = stored.get(step.id)
        if entry is None:
            result[step.id] = None
            continue
        prompt, response, logprobs = (
            prompts[step.id],
            entry.response_token_ids,
            entry.response_logprobs,
        )
        if prompt is None or response is None or logprobs is None or len(response) != len(logprobs):
            result[step.id] = None
            continue
        result[step.id] = StepTokens(step, prompt, response, logprobs.astype(np.float32))
    return result


def temperature_of(step: Step) -> float:
    """The temperature step ``step``'s stored logprobs are at (1.0 for steps recorded before
    it was)."""
    sampling = step.sampling
    return 1.0 if not sampling else float(sampling.get("logprobs_temperature", 1.0))


def continues(tail: Step, step: Step) -> bool:
    """Whether ``step`` may grow a merged row ending at ``tail`` by what the pool stored: its
    parent is ``tail``, its prompt extends ``tail``'s ``P + R`` (``extends_parent``, judged by
    tokens when it was written), at the same temperature. ``segments`` also checks the tokens."""
    return (
        step.parent_step_id == tail.id
        and bool(step.extends_parent)
        and temperature_of(step) == temperature_of(tail)
    )


def _extends(tail: StepTokens, step: StepTokens) -> bool:
    n = tail.tokens
    return (
        continues(tail.row, step.row)
        and len(step.prompt) >= n
        and np.array_equal(step.prompt[: len(tail.prompt)], tail.prompt)
        and np.array_equal(step.prompt[len(tail.prompt) : n], tail.response)
    )


def conversation_rows(
    items: Sequence[Item], row_of: Callable[[Item], Step], extends: Callable[[Item, Item], bool]
) -> list[list[Item]]:
    """Merged rows of one trajectory's trainable ``items`` (in step order), ordered by their
    first step: each item grows the open row whose last item is its parent (``row_of``) when
    ``extends(last, item)``, whatever items of other conversations came in between (a
    sub-agent's, a side call's); else it starts a row. A second child of one step (a fork)
    starts its own row: the first child took the row. One row per conversation that goes on
    exactly, so a row never crosses lineages."""
    result: list[list[Item]] = []
    open_by_tail: dict[str, list[Item]] = {}  # a row by its last step's id
    for item in items:
        step = row_of(item)
        row = open_by_tail.get(step.parent_step_id) if step.parent_step_id else None
        if row is not None and extends(row[-1], item):
            del open_by_tail[row_of(row[-1]).id]
            row.append(item)
        else:
            row = [item]
            result.append(row)
        open_by_tail[step.id] = row
    return result


def segments(
    steps: Sequence[StepTokens], layout: str, max_tokens_per_row: int | None
) -> tuple[list[list[StepTokens]], int]:
    """Cut a trajectory's trainable ``steps`` (in order) into rows, ordered by their first step;
    returns ``(segments, steps dropped because a single step exceeds max_tokens_per_row)``.

    ``merged`` is ``conversation_rows`` with the tokens checked (``_extends``): a prefix break,
    a fork, a dropped parent, another temperature start a new segment; a merged row is its last
    step's ``P + R``, so the cap on each step holds for the row. ``per_step`` is one step each.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    kept = [s for s in steps if max_tokens_per_row is None or s.tokens <= max_tokens_per_row]
    if layout == "merged":
        return conversation_rows(kept, _row_of, _extends), len(steps) - len(kept)
    return [[s] for s in kept], len(steps) - len(kept)


def _row_of(step: StepTokens) -> Step:
    return step.row


def segment_tokens(segment: Sequence[StepTokens]) -> int:
    """Tokens of the row a segment becomes (its last step's ``P + R``)."""
    return segment[-1].tokens


@dataclass(frozen=True)
class TokenColumns:
    """The token columns of ``B`` rows as Arrow list arrays, plus per-row counts ``[B]``."""

    input_ids: pa.Array
    loss_mask: pa.Array
    behaviour_logprobs: pa.Array
    position_ids: pa.Array
    step_ids: pa.Array
    policy_version_spans: pa.Array
    temperature: npt.NDArray[np.float32]
    num_tokens: npt.NDArray[np.int32]
    num_loss_tokens: npt.NDArray[np.int32]
    prompt_tokens: npt.NDArray[np.int32]


def assemble(rows: Sequence[Sequence[StepTokens]]) -> TokenColumns:
    """Token columns of ``rows`` (segments); one concatenation per column, no per-token Python."""
    id_pieces: list[IntArray] = []
    piece_lengths: list[int] = []
    logprob_pieces: list[FloatArray] = []
    row_lengths = np.zeros(len(rows), dtype=np.int64)  # [B]
    loss_lengths = np.zeros(len(rows), dtype=np.int32)  # [B]
    first_prompt = np.zeros(len(rows), dtype=np.int32)  # [B]
    step_ids: list[str] = []
    steps_per_row = np.zeros(len(rows), dtype=np.int32)  # [B]
    temperature = np.ones(len(rows), dtype=np.float32)  # [B]
    spans: list[list[dict[str, int | None]]] = []
    for i, segment in enumerate(rows):
        covered = 0
        row_spans: list[dict[str, int | None]] = []
        for step in segment:
            start = len(step.prompt)  # the response's first position in the row
            row_spans += [
                {"version": version, "start": start + begin, "end": start + end}
                for version, begin, end in step.version_spans()
            ]
            environment = step.prompt[covered:]  # [E]: the tokens the next prompt adds
            id_pieces += (environment, step.response)
            piece_lengths += (len(environment), len(step.response))
            logprob_pieces.append(step.logprobs)
            covered = step.tokens
            loss_lengths[i] += len(step.response)
            step_ids.append(step.row.id)
        row_lengths[i] = covered
        first_prompt[i] = len(segment[0].prompt)
        steps_per_row[i] = len(segment)
        temperature[i] = segment[0].temperature
        spans.append(row_spans)
    total = int(row_lengths.sum())
    values = np.concatenate(id_pieces) if id_pieces else np.zeros(0, np.int32)  # [N]
    pattern = np.tile(np.array([0, 1], dtype=np.int8), len(piece_lengths) // 2)
    mask = np.repeat(pattern, piece_lengths)  # [N]
    logprobs = np.zeros(total, dtype=np.float32)  # [N]
    if logprob_pieces:
        logprobs[mask.astype(bool)] = np.concatenate(logprob_pieces)
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)  # [B + 1]
    np.cumsum(row_lengths, out=offsets[1:])
    positions = (np.arange(total, dtype=np.int64) - np.repeat(offsets[:-1], row_lengths)).astype(
        np.int32
    )  # [N]
    arrow_offsets = pa.array(offsets.astype(np.int32))
    step_offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(steps_per_row, out=step_offsets[1:])
    return TokenColumns(
        input_ids=pa.ListArray.from_arrays(arrow_offsets, pa.array(values.astype(np.int32))),
        loss_mask=pa.ListArray.from_arrays(arrow_offsets, pa.array(mask)),
        behaviour_logprobs=pa.ListArray.from_arrays(arrow_offsets, pa.array(logprobs)),
        position_ids=pa.ListArray.from_arrays(arrow_offsets, pa.array(positions)),
        step_ids=pa.ListArray.from_arrays(pa.array(step_offsets), pa.array(step_ids, pa.string())),
        policy_version_spans=pa.array(spans, VERSION_SPANS),
        temperature=temperature,
        num_tokens=row_lengths.astype(np.int32),
        num_loss_tokens=loss_lengths,
        prompt_tokens=first_prompt,
    )
