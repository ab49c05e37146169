"""The writer's memory of each open trajectory's token sequences, and where a new call's steps go.

Owns: a bounded LRU of ``S_k = P_k + R_k`` per trajectory as int32 bytes; ``place``, which picks
a new call's parent over it, explains a prefix break (``datapool.steps.prefix``) and names the
call's lineage (below); ``remember``,
which takes the call's steps in; and ``rebuilt``, the memory of a trajectory from its stored
steps. The parent choice is exactly ``datapool.steps.prefix.choose_parent`` (a test checks they
agree); the comparison is a memcmp of bytes instead of a Python loop over tokens, because the
writer runs it for every step against every earlier step of the trajectory (20 turns of ~10k
tokens would otherwise cost milliseconds per step). Never: the source of truth, or reads SQL; a
trajectory that another process wrote to, or that was evicted, is rebuilt from the stored
steps that ``datapool.steps.store`` reads.

Lineages (``steps.lineage_*``, one conversation of the trajectory each): a call whose client
header names a lineage (``CallRecord.lineage``) gets its parent among that lineage's steps and
those of the side calls and compactions that came from it only (``within``), so interleaved
sub-agents never hang on each other's steps; its first call is a root. A compaction request
(kind ``compaction`` by header) starts a lineage whose parent is the one it compacts; the next
call of that lineage that does not extend it (its history is the summary) is no break but the
compaction lineage's next root, and the lineage's later calls go on there; a second
compaction request of that lineage compacts the first compaction's conversation, so its parent
is that compaction lineage (the lineages chain). Without a
header a call stays in its parent step's lineage (a fork in its twin's, a failed call in the
latest step's), and a side call (``prefix.SIDE_CALL``, also inside a named lineage) starts a new
lineage of kind ``side_call`` whose parent is the lineage it was compared with; a lineage that
starts at a call takes the id of the call's first step. The first lineage is ``main``.

Memory: a chain of extending steps shares one growing buffer, so a trajectory costs about
4 bytes per token of its longest sequence; each candidate also keeps its messages as JSON text
(``datapool.steps.messages``), a message shared with its parent being one string, so about the
size of the trajectory's distinct messages plus a pointer per message per step.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from datapool.models import Step, StepOutcome
from datapool.steps.bodies import BodyKeys, Doc, ListText, body_keys, list_text
from datapool.steps.canonical import CanonicalCall, Message
from datapool.steps.messages import (
    ParentKeys,
    RequestDelta,
    canonical_response_key,
    history_keys,
    history_of,
    message_key,
)
from datapool.steps.payloads import TOKEN_BYTES, TokenPayload, pack_ids
from datapool.steps.prefix import (
    RETOKENISED,
    SIDE_CALL,
    Lineage,
    classify_divergence,
    divergence_window,
    latest_of_tree,
)
from datapool.steps.records import (
    LINEAGE_KINDS,
    CallRecord,
    LineageKind,
    LineageRecord,
    LineageSource,
)

# Kinds of lineage that start at a call, their parent the lineage they came from.
_STARTED = ("side_call", "compaction")


@dataclass(frozen=True)
class Placement:
    """Where a new call's steps join the trajectory's tree (``TrajectoryTokens.place``)."""

    lineage: Lineage  # the parent, whether the prompt extends it, the divergence offset
    divergence_kind: str | None  # at a prefix break: ``prefix.classify_divergence``
    divergence_detail: dict[str, Any] | None  # at a prefix break: ``prefix.divergence_window``
    parent_tokens: int  # ``len(S_parent)`` when the prompt extends its parent, else 0
    # ``H_p`` and ``C_p + [R_p]`` of ``datapool.steps.messages`` when the parent is a
    # candidate, else None.
    parent_keys: ParentKeys
    # The call's lineage; ``id`` None: it starts here (``lineage_of`` names it).
    conversation: LineageRecord = field(
        default_factory=lambda: LineageRecord(None, None, "main", "inferred")
    )

    def lineage_of(self, first_step_id: str) -> LineageRecord:
        """The call's lineage with its id: a lineage that starts at the call is named after
        ``first_step_id``, the id of the call's first step."""
        if self.conversation.id is not None:
            return self.conversation
        return replace(self.conversation, id=first_step_id)

    def suffix_tokens(self, call: CallRecord) -> int | None:
        """``call.suffix_tokens`` counted from the recorded parent: ``len(P) - len(S_parent)``
        when the prompt extends it, else as the gateway counted it (None: not an exact prompt).

        The gateway counts from the turn it continued, which can be older than the parent the
        token lineage picks: a later step whose ``P + R`` the template's rendering reproduced
        but whose turn was not found (its echo or rendering fields changed, the pool read
        failed) also starts the prompt, and the longest such step is the parent. Counted from
        it, the count is the step's delta against its parent.
        """
        if call.suffix_tokens is None or call.prompt_token_ids is None:
            return call.suffix_tokens
        if not self.lineage.extends_parent or self.lineage.parent_step_id is None:
            return call.suffix_tokens
        return len(call.prompt_token_ids) - self.parent_tokens


@dataclass
class _Candidate:
    step_id: str
    buffer: bytearray  # shared with later steps that extend this one
    length_bytes: int
    # ``message_key`` of each of its request messages then of its response message (``H`` in
    # ``datapool.steps.messages``), strings shared with its parent's; None: no messages list.
    message_keys: list[str] | None = None
    # Whether it has a response message: then the last key of each list is that response.
    has_response: bool = False
    prompt_length_bytes: int = -1  # ``len(P)`` in bytes; -1: unknown (never a fork's twin)
    call: int = -1  # the call it answered: choices of one call share it
    # Its own place, repeated by a fork at the same prompt (``prefix.choose_parent`` rule 2).
    lineage: Lineage = field(default_factory=lambda: Lineage(None, None, None))
    divergence_kind: str | None = None
    divergence_detail: dict[str, Any] | None = None
    # The same as ``message_keys`` for its canonical messages then response (``C + [R]``);
    # None: no record.
    canonical_keys: list[str] | None = None
    tree: str | None = None  # the side call whose tree it is in (``prefix.Candidate.tree``)
    # Its bodies' memory for a child's field deltas (``datapool.steps.bodies``).
    bodies: Mapping[Doc, BodyKeys] = field(default_factory=dict)
    # Its lineage, id always set (``Placement.lineage_of``).
    conversation: LineageRecord = field(
        default_factory=lambda: LineageRecord(None, None, "main", "inferred")
    )
    # The ``ListText`` of ``message_keys``' and ``canonical_keys``' lists (None: not known).
    message_text: ListText | None = None
    canonical_text: ListText | None = None


@dataclass
class TrajectoryTokens:
    """Candidates (ok steps with prompt and response IDs, oldest first), the latest step, and
    the trajectory's ``call_count`` they reflect (a different count in the database means
    someone else wrote steps since)."""

    candidates: list[_Candidate] = field(default_factory=list)
    latest_step_id: str | None = None
    call_count: int = 0
    # The latest step's lineage (ok or not); None: no step yet.
    latest_conversation: LineageRecord | None = None
    # What this memory holds, estimated (``add``): the LRU's measure (``LineageCache``).
    approx_bytes: int = 0

    def within(self, lineage_id: str) -> TrajectoryTokens:
        """The candidates of lineage ``lineage_id`` and of the side calls and compactions that
        came from it (its latest step the latest): the memory a call that names its lineage is
        placed in. Another named lineage (a sub-agent) is never in it."""
        ids = {lineage_id}
        own: list[_Candidate] = []
        for c in self.candidates:  # oldest first: a lineage's parent comes before it
            line = c.conversation
            if line.kind in _STARTED and line.parent_id in ids and line.id is not None:
                ids.add(line.id)
            if line.id in ids:
                own.append(c)
        return TrajectoryTokens(own, own[-1].step_id if own else None, self.call_count)

    def choose_parent(self, prompt: bytes) -> Lineage:
        """``prefix.choose_parent`` over the candidates for ``prompt`` (int32 bytes)."""
        if not self.candidates:
            return Lineage(None, None, None)
        # Longest first, the later of equal lengths first: the first match is the parent, and
        # it is usually the latest step, so one comparison instead of one per earlier step.
        # (A stable sort of the indices latest first by length: no key tuple per candidate.)
        lengths = [candidate.length_bytes for candidate in self.candidates]
        order = sorted(range(len(lengths) - 1, -1, -1), key=lengths.__getitem__, reverse=True)
        best = next((self.candidates[i] for i in order if self._extends(prompt, i)), None)
        latest = latest_of_tree(self.candidates, None if best is None else best.tree)
        if best is not None and (best.call == latest.call or self._extends_call(prompt, latest)):
            return Lineage(best.step_id, True, None)
        for candidate in reversed(self.candidates):
            n = candidate.prompt_length_bytes
            if n == len(prompt) and candidate.buffer[:n] == prompt:
                return replace(candidate.lineage, fork_of=candidate.step_id)
        sequence = np.frombuffer(bytes(latest.buffer[: latest.length_bytes]), dtype="<i4")
        ids = np.frombuffer(prompt, dtype="<i4")
        shared = min(len(sequence), len(ids))
        differ = np.flatnonzero(sequence[:shared] != ids[:shared])
        offset = int(differ[0]) if differ.size else shared
        if best is not None:
            return Lineage(best.step_id, True, offset, latest.step_id)
        return Lineage(latest.step_id, False, offset)

    def _extends_call(self, prompt: bytes, latest: _Candidate) -> bool:
        """Whether ``prompt`` extends any candidate of ``latest``'s call (its choices) or with
        ``latest``'s very prompt (a re-send's twins: ``prefix._same_prompt``)."""
        n = latest.prompt_length_bytes
        return any(
            self._extends(prompt, i)
            for i in range(len(self.candidates) - 1, -1, -1)
            if self.candidates[i].call == latest.call
            or (
                n >= 0
                and self.candidates[i].prompt_length_bytes == n
                and self.candidates[i].buffer[:n] == latest.buffer[:n]
            )
        )

    def _extends(self, prompt: bytes, i: int) -> bool:
        candidate = self.candidates[i]
        n = candidate.length_bytes
        return n <= len(prompt) and prompt.startswith(candidate.buffer[:n])

    def sequence_of(self, step_id: str) -> bytes:
        candidate = self._candidate(step_id)
        return bytes(candidate.buffer[: candidate.length_bytes])

    def message_keys_of(self, step_id: str) -> tuple[list[str] | None, bool]:
        """``(H, has_response)`` of step ``step_id``: its messages then its response message
        as JSON text, and whether that response is there; ``(None, False)`` when it is not a
        candidate or had no messages list."""
        for candidate in reversed(self.candidates):
            if candidate.step_id == step_id:
                keys = candidate.message_keys
                return keys, keys is not None and candidate.has_response
        return None, False

    def keys_of(self, step_id: str | None) -> ParentKeys:
        """Both key lists of step ``step_id`` (``ParentKeys``; None each when it is no
        candidate)."""
        for candidate in reversed(self.candidates):
            if candidate.step_id == step_id:
                return ParentKeys(
                    candidate.message_keys,
                    candidate.canonical_keys,
                    candidate.bodies,
                    candidate.message_text,
                    candidate.canonical_text,
                )
        return ParentKeys(None, None)

    def tokens_of(self, step_id: str) -> int:
        """``len(S)`` of step ``step_id``, without copying its sequence."""
        return self._candidate(step_id).length_bytes // TOKEN_BYTES

    def _candidate(self, step_id: str) -> _Candidate:
        found = self._find(step_id)
        if found is None:
            raise KeyError(step_id)
        return found

    def _find(self, step_id: str) -> _Candidate | None:
        for candidate in reversed(self.candidates):  # parents are usually recent
            if candidate.step_id == step_id:
                return candidate
        return None

    def place(self, call: CallRecord, prompt: bytes | None) -> Placement:
        """Where ``call``'s steps go: the parent by token lineage of ``prompt`` (``pack_ids``
        bytes of ``call.prompt_token_ids``), and at a prefix break its kind and window.

        A failed or token-less call is never compared: it hangs on the latest step, without
        ``extends_parent``. A call whose header names its lineage is placed among that
        lineage's steps only (``within``); one that starts a lineage by header is a root.
        """
        named = call.lineage
        if named is not None and named.kind == "compaction" and named.id is None:
            named = self._compaction_of(named)
        view = self
        if named is not None:
            view = self.within(named.id) if named.id is not None else TrajectoryTokens()
        compared: str | None = None  # the step a side call was compared with
        if prompt is None or call.outcome != StepOutcome.OK:
            lineage = Lineage(view.latest_step_id, None, None)
            kind, detail = None, None
        else:
            lineage = view.choose_parent(prompt)
            if lineage.fork_of is not None:  # the twin's own break facts, if it had any
                twin = self._candidate(lineage.fork_of)
                kind, detail = twin.divergence_kind, twin.divergence_detail
            else:
                kind, detail = view._divergence(call, lineage)
                compacted = view._compacted(named)
                if compacted is not None and (kind == SIDE_CALL or lineage.is_break):
                    # The first call after a compaction request: its history is the summary,
                    # not a break of the lineage it compacted; it goes on in the compaction's.
                    lineage, kind, detail = Lineage(None, None, None), None, None
                    named = compacted.conversation
                elif kind == SIDE_CALL:  # a new root of the tree, not a break of the chain
                    compared = lineage.diverges_from or lineage.parent_step_id
                    lineage, detail = Lineage(None, None, None), None
        conversation = self._conversation(named, lineage, compared)
        parent = lineage.parent_step_id
        # Only a candidate's keys are known, so a failed or token-less parent gets None and the
        # messages are stored whole.
        return Placement(
            lineage,
            kind,
            detail,
            self.tokens_of(parent) if lineage.extends_parent and parent is not None else 0,
            self.keys_of(parent),
            conversation,
        )

    def _compaction_of(self, named: LineageRecord) -> LineageRecord:
        """A compaction request named by header (it starts a lineage, ``named.id`` None) whose
        header names lineage ``L``: its parent is the lineage ``L``'s calls go on in now, the
        latest compaction of ``L`` (a compaction of a compaction) or ``L`` itself, so the
        compactions of one conversation chain (``L`` <- ``c1`` <- ``c2``)."""
        if named.parent_id is None:
            return named
        for candidate in reversed(self.within(named.parent_id).candidates):
            line = candidate.conversation
            if line.id == named.parent_id or line.kind == "compaction":
                return replace(named, parent_id=line.id)
        return named

    def _compacted(self, named: LineageRecord | None) -> _Candidate | None:
        """In a named lineage's memory (``within``), its latest step outside side calls when
        that step is a compaction request (the first step of a ``compaction`` lineage)."""
        if named is None or named.id is None:
            return None
        latest = next((c for c in reversed(self.candidates) if c.tree is None), None)
        if latest is None or latest.conversation.kind != "compaction":
            return None
        return latest if latest.conversation.id == latest.step_id else None

    def _conversation(
        self, named: LineageRecord | None, lineage: Lineage, side_of: str | None
    ) -> LineageRecord:
        """The lineage of a call placed at ``lineage``: a side call (compared with step
        ``side_of``) starts its own; any other stays in its twin's, its parent's or (a failed
        call) the latest step's, except that a named call without a parent is in the lineage
        its header named."""
        if side_of is not None:
            base = self._candidate(side_of).conversation.id
            return LineageRecord(None, base, "side_call", "inferred")
        if named is not None and (named.id is None or lineage.extends_parent is None):
            return named  # starts here, or a failed call: not compared, so its header decides
        for step_id in (lineage.fork_of, lineage.parent_step_id):
            if step_id is not None:
                found = self._find(step_id)
                if found is not None:
                    return found.conversation
        if named is not None:
            return named
        if self.latest_conversation is not None:
            return self.latest_conversation
        return LineageRecord(None, None, "main", "inferred")

    def _divergence(
        self, call: CallRecord, lineage: Lineage
    ) -> tuple[str | None, dict[str, Any] | None]:
        """For a prefix break: its kind (from the messages) and a window of both sides, with
        ``step_id`` the step compared (the parent, or at a hidden break the latest step).

        The compared step's full messages and response come from its message keys here (it is
        always a candidate), not from its stored delta.
        """
        if not lineage.is_break or lineage.divergence_offset is None:
            return None, None
        compared = lineage.diverges_from or lineage.parent_step_id
        assert compared is not None and call.prompt_token_ids is not None
        candidate = self._candidate(compared)
        keys = candidate.canonical_keys
        new = call.canonical
        if keys is None or new is None or new.messages is None:
            # Either side has no conversation (a completions prompt): nothing to compare.
            kind = RETOKENISED
        else:
            has_response = candidate.has_response
            request_keys = keys[:-1] if has_response else keys
            parent = CanonicalCall(tuple(Message.from_json(json.loads(k)) for k in request_keys))
            response = Message.from_json(json.loads(keys[-1])) if has_response else None
            kind = classify_divergence(parent.messages or (), response, new.messages)
        sequence = np.frombuffer(self.sequence_of(compared), dtype="<i4")
        detail = divergence_window(
            sequence.tolist(), call.prompt_token_ids, lineage.divergence_offset
        )
        return kind, {"step_id": compared, **detail}

    def remember(
        self,
        step_ids: Sequence[str],
        call: CallRecord,
        placement: Placement,
        prompt: bytes | None,
        responses: Sequence[bytes | None],
        request: RequestDelta,
    ) -> None:
        """Take in ``call``'s steps (``step_ids`` in choice order): each choice of an ok call
        with prompt and response IDs (``responses``, int32 bytes) becomes a candidate with its
        message keys, sharing the parent's for the first ``messages_base`` (and
        ``canonical_base``) messages; the first step becomes the latest."""
        conversation = placement.lineage_of(step_ids[0]) if step_ids else placement.conversation
        if call.outcome == StepOutcome.OK and prompt is not None:
            messages = history_of(call.request, call.history_field)
            parent = placement.parent_keys
            for step_id, response, choice in zip(step_ids, responses, call.choices, strict=True):
                if response is not None:
                    keys = history_keys(
                        parent.request,
                        messages,
                        request.messages_base or 0,
                        choice.response_message,
                    )
                    answer = choice.response_message
                    response_key = None if answer is None else canonical_response_key(answer)
                    canonical_keys = history_keys(
                        parent.canonical,
                        request.canonical_messages,
                        request.canonical_base or 0,
                        response_key,
                    )
                    answered = choice.response_message is not None
                    # No text for a list that shares no leading message with the parent's
                    # (``bodies.list_text``): a replaced first message.
                    history_text = request.history_text
                    if parent.request and not request.messages_base:
                        history_text = None
                    canonical_text = request.canonical_text
                    if parent.canonical and not request.canonical_base:
                        canonical_text = None
                    texts = (
                        (
                            list_text(history_text, parent.request_text),
                            list_text(canonical_text, parent.canonical_text),
                        )
                        if answer is None
                        else (
                            list_text(history_text, parent.request_text, answer),
                            list_text(canonical_text, parent.canonical_text, response_key),
                        )
                    )
                    self.add(
                        step_id,
                        placement.lineage,
                        prompt,
                        response,
                        keys,
                        answered,
                        call=self.call_count,
                        kind=placement.divergence_kind,
                        detail=placement.divergence_detail,
                        canonical_keys=canonical_keys,
                        bodies=request.bodies,
                        conversation=conversation,
                        texts=texts,
                    )
        if step_ids:
            self.latest_step_id = step_ids[0]
            self.latest_conversation = conversation

    def add(
        self,
        step_id: str,
        parent: Lineage,
        prompt: bytes,
        response: bytes,
        message_keys: list[str] | None = None,
        has_response: bool = False,
        *,
        call: int | None = None,
        kind: str | None = None,
        detail: dict[str, Any] | None = None,
        canonical_keys: list[str] | None = None,
        bodies: Mapping[Doc, BodyKeys] | None = None,
        conversation: LineageRecord | None = None,
        texts: tuple[ListText | None, ListText | None] = (None, None),
    ) -> None:
        """Remember step ``step_id`` placed at ``parent`` with sequence ``prompt + response``
        (int32 bytes), its message keys (``datapool.steps.messages.history_keys``), the call it
        answered (its ``step_index``; choices of one call share it, None: a call of its own)
        and its break facts (``kind``, ``detail``)."""
        tree = None
        # A side call starts a tree of its own, inferred (``SIDE_CALL``) or named by a header
        # (a root of a ``side_call`` lineage): the main chain's next call is no break after it.
        aside = conversation is not None and conversation.kind == "side_call"
        if parent.parent_step_id is None and (kind == SIDE_CALL or aside):
            tree = step_id
        elif parent.parent_step_id is not None:
            tree = next(
                (c.tree for c in reversed(self.candidates) if c.step_id == parent.parent_step_id),
                None,
            )
        buffer = None
        grown = 0  # bytes this step adds to the sequences held
        if parent.extends_parent and parent.parent_step_id is not None:
            base = self._candidate(parent.parent_step_id)
            if len(base.buffer) == base.length_bytes:  # the parent is its buffer's tip
                base.buffer += prompt[base.length_bytes :]
                base.buffer += response
                buffer = base.buffer
                grown = len(buffer) - base.length_bytes
        if buffer is None:
            buffer = bytearray(prompt)
            buffer += response
            grown = len(buffer)
        slots = len(message_keys or ()) + len(canonical_keys or ())
        # The lists' texts (``bodies.ListText``): what this step added to their shared buffers.
        grown += sum(text.grown for text in texts if text is not None)
        grown += sum(text.grown for body in (bodies or {}).values() for text in body.texts.values())
        self.approx_bytes += grown + _POINTER_BYTES * slots + _CANDIDATE_BYTES
        if call is None:  # a call of its own: below every step_index
            call = -1 - len(self.candidates)
        self.candidates.append(
            _Candidate(
                step_id,
                buffer,
                len(buffer),
                message_keys,
                has_response,
                len(prompt),
                call,
                parent,
                kind,
                detail,
                canonical_keys,
                tree,
                bodies or {},
                conversation or LineageRecord(step_id, None, "main", "inferred"),
                *texts,
            )
        )


def rebuilt(rows: Sequence[Step], payloads: Mapping[str, TokenPayload]) -> TrajectoryTokens:
    """The memory of a trajectory from its stored steps: ``rows`` in step then choice order,
    their requests expanded (``messages.expand_requests``), ``payloads`` by step id. Its
    ``call_count`` is left 0 for the caller to set from the trajectory row."""
    keys_of: dict[int, str] = {}  # message_key by id(): messages a step shares with its parent

    def key(message: Any) -> str:
        found = keys_of.get(id(message))
        if found is None:
            found = keys_of[id(message)] = message_key(message)
        return found

    tokens = TrajectoryTokens()
    for row in rows:
        conversation = stored_lineage(row)
        if row.choice_index == 0 or tokens.latest_step_id is None:
            tokens.latest_step_id = row.id
            tokens.latest_conversation = conversation
        payload = payloads[row.id]
        if (
            row.outcome == StepOutcome.OK
            and payload.prompt_token_ids is not None
            and payload.response_token_ids is not None
        ):
            detail = row.divergence_detail
            hidden = None  # the latest step a hidden break left (``prefix.Lineage``)
            if row.extends_parent and detail is not None:
                hidden = detail.get("step_id")
            lineage = Lineage(row.parent_step_id, row.extends_parent, row.divergence_offset, hidden)
            known = {c.step_id for c in tokens.candidates}
            if row.parent_step_id not in known:
                lineage = Lineage(None, None, None)
            messages = history_of(row.request, row.history_field)
            keys = None
            if messages is not None:
                keys = [key(m) for m in messages]
                if row.response_message is not None:
                    keys.append(key(row.response_message))
            canonical = (row.canonical or {}).get("messages")
            canonical_keys = None
            if isinstance(canonical, list):
                canonical_keys = [key(m) for m in canonical]
                if row.response_message is not None:
                    canonical_keys.append(message_key(canonical_response_key(row.response_message)))
            deltas = row.body_deltas or {}
            bodies: dict[Doc, BodyKeys] = {
                "request": body_keys(
                    _without(row.request, row.history_field), deltas.get("request"), key
                )
            }
            if row.upstream_request_patch is None and row.upstream_request is not None:
                bodies["upstream"] = body_keys(row.upstream_request, deltas.get("upstream"), key)
            if row.canonical is not None:
                bodies["canonical"] = body_keys(
                    _without(row.canonical, "messages"), deltas.get("canonical"), key
                )
            tokens.add(
                row.id,
                lineage,
                pack_ids(payload.prompt_token_ids),
                pack_ids(payload.response_token_ids),
                keys,
                row.response_message is not None,
                call=row.step_index,
                kind=row.divergence_kind,
                detail=detail,
                canonical_keys=canonical_keys,
                bodies=bodies,
                conversation=conversation,
            )
    return tokens


def stored_lineage(row: Step) -> LineageRecord:
    """The lineage stored with step ``row`` (every row has one since migration 0016)."""
    kind: LineageKind = "main"
    for known in LINEAGE_KINDS:
        if row.lineage_kind == known:
            kind = known
    source: LineageSource = "headers" if row.lineage_source == "headers" else "inferred"
    return LineageRecord(row.lineage_id or row.id, row.lineage_parent_id, kind, source)


def _without(body: Mapping[str, Any], name: str | None) -> dict[str, Any]:
    """``body`` without its history list ``name`` (another delta stores it)."""
    return {key: value for key, value in body.items() if key != name or not isinstance(value, list)}


# ``TrajectoryTokens.approx_bytes``: a list slot (a message key shared with the parent's list),
# and what a step adds besides its tokens and slots (its record, its own new keys, its bodies'
# keys): fitted to tracemalloc on a chat session of 20 to 200 turns (the estimate is 0.96 to 1.01
# of what dropping the memory frees; tests/test_pool_store.py checks 60 turns).
_POINTER_BYTES = 10
_CANDIDATE_BYTES = 5120


class LineageCache:
    """An LRU of ``TrajectoryTokens``: at most ``max_trajectories`` trajectories and
    ``max_bytes`` bytes (``TrajectoryTokens.approx_bytes``, re-read at each ``get`` and ``put``:
    an entry grows in place as its trajectory's steps are added). The entry just asked for is
    never the one dropped, so one trajectory larger than ``max_bytes`` is still kept alone."""

    def __init__(self, max_trajectories: int, max_bytes: int | None = None) -> None:
        self.max_trajectories = max_trajectories
        self.max_bytes = max_bytes
        self.total_bytes = 0
        self._entries: OrderedDict[str, TrajectoryTokens] = OrderedDict()
        self._sizes: dict[str, int] = {}  # approx_bytes of each entry when last measured

    def get(self, trajectory_id: str) -> TrajectoryTokens | None:
        entry = self._entries.get(trajectory_id)
        if entry is not None:
            self._entries.move_to_end(trajectory_id)
            self._measure(trajectory_id, entry)
        return entry

    def put(self, trajectory_id: str, entry: TrajectoryTokens) -> None:
        self.forget(trajectory_id)
        self._entries[trajectory_id] = entry
        self._measure(trajectory_id, entry)

    def forget(self, trajectory_id: str) -> None:
        if self._entries.pop(trajectory_id, None) is not None:
            self.total_bytes -= self._sizes.pop(trajectory_id)

    def clear(self) -> None:
        self._entries.clear()
        self._sizes.clear()
        self.total_bytes = 0

    def _measure(self, trajectory_id: str, entry: TrajectoryTokens) -> None:
        """Count ``entry``'s growth since it was last measured, then drop the least recently
        used others while over either bound."""
        self.total_bytes += entry.approx_bytes - self._sizes.get(trajectory_id, 0)
        self._sizes[trajectory_id] = entry.approx_bytes
        while len(self._entries) > 1 and (
            len(self._entries) > self.max_trajectories
            or (self.max_bytes is not None and self.total_bytes > self.max_bytes)
        ):
            oldest = next(iter(self._entries))
            self.forget(oldest)
