"""What chat completions and completions share: vLLM answers with a ``choices`` array.

Owns: the upstream body additions (``return_token_ids``, logprobs, the usage chunk), reading
prompt IDs, sampled IDs and behaviour logprobs per choice from a unary answer and across stream
chunks (``ChoicesCapture``, reusable by a dialect that translates to chat upstream),
removing from answers and chunks what the client did not ask for, and relaying a stream chunk
by chunk (``ChoicesStream``). The two subclasses say only where their fields differ. Never:
tokenizes or decodes; an ID or logprob vLLM did not send is recorded as missing.

Field facts (vLLM 0.32, checked against the real server):

- A non-streaming chat response always carries the keys ``prompt_token_ids`` (top level),
  ``choices[i].token_ids`` and ``choices[i].logprobs``, ``null`` unless asked for; a completions
  response has ``choices[i].prompt_token_ids`` and ``choices[i].token_ids`` instead.
- So "stripping" restores ``null``, which is what vLLM returns to a client that did not ask.
- ``token_ids`` holds every sampled token, the end token and a matched stop string included.
- A stream chunk a tool or reasoning parser held text back from is ``delta: {}`` with its
  ``token_ids`` (case C05): its IDs count, though the client sees no text.

Streams hold output back in two places, both only at the very end:

- The last terminal chunk (the one that finishes the last choice) is held until the upstream's
  ``[DONE]``, so the pool commit happens before the client has the whole answer (durability).
- The gateway always asks for ``stream_options.include_usage`` (to check sampled IDs against the
  usage count). vLLM then moves ``system_fingerprint`` from every terminal chunk to the usage
  chunk; for a client that did not ask for usage, the usage chunk is dropped and the fingerprint
  is stamped back on terminal chunks. The fingerprint is learnt per upstream; until it is known,
  terminal chunks are held until the usage chunk brings it.

Otherwise each chunk is handed back for flushing as soon as it is fed in, never re-ordered or
merged (case C10). A chunk the client sees unchanged is sent as the very bytes vLLM sent; a
chunk with fields removed is re-serialised (``gateway.engine.wire.dumps``, byte for byte what
vLLM's pydantic ``model_dump_json`` writes for the same values).

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar, cast

from datapool.models import StepOutcome
from datapool.steps.records import ChoiceRecord
from gateway.capture import (
    ABORTED,
    TOOL_CALL_TRUNCATED,
    UNFINISHED,
    check_against_usage,
    integrity_flags,
    quality_flags,
)
from gateway.dialects.base import (
    Captured,
    ClientAsked,
    Dialect,
    DialectStream,
    Prepared,
    sse_event,
)
from gateway.dialects.wire import Answer, ChoiceFields, StreamedToolCall, Usage
from gateway.engine.wire import Shape, check_shape, choice_index, dumps, loads_object, token_ids
from gateway.errors import (
    InvalidRequestError,
    TrajgateError,
    read_upstream_error,
    sse_error_event,
    stream_error_status,
    upstream_envelope,
)


@dataclass
class ChoiceState:
    """One choice of a stream, accumulated across chunks."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ids_gap: bool = False  # a token-bearing chunk came without token_ids
    logprobs_gap: bool = False
    role: str | None = None
    text_parts: list[str] = field(default_factory=list)
    reasoning_parts: list[str] = field(default_factory=list)
    tool_calls: dict[int, StreamedToolCall] = field(default_factory=dict)
    finish_reason: str | None = None
    stop_reason: str | None = None
    # The last chunk that carried token ids showed the client nothing (``delta: {}``): a tool
    # or reasoning parser was holding its text back (C05) when the stream ended.
    held_back: bool = False


# The choice of a unary answer and of a stream chunk (``gateway.dialects.wire``): chat's differ
# (``message``, ``delta``), completions' are one.
AnswerChoiceT = TypeVar("AnswerChoiceT", bound=ChoiceFields)
ChunkChoiceT = TypeVar("ChunkChoiceT", bound=ChoiceFields)


class ChoicesDialect(Dialect, Generic[AnswerChoiceT, ChunkChoiceT]):
    """A dialect whose upstream answers carry ``choices``; subclasses name the differences.

    An answer or chunk is read through its wire type (``Answer[AnswerChoiceT]``,
    ``Answer[ChunkChoiceT]``) once ``check_shape`` has checked it against ``answer_shape`` or
    ``chunk_shape``, the same fields."""

    # The JSON type of every field read from a unary answer and a stream chunk (the dialect's
    # ``protocol`` module): a value of another kind makes the answer unreadable.
    answer_shape: ClassVar[Shape]
    chunk_shape: ClassVar[Shape]

    # -- where chat and completions differ ------------------------------------------------

    @abstractmethod
    def check_input(self, body: dict[str, Any]) -> None:
        """Check the body's input field (``messages`` or ``prompt``)."""

    @abstractmethod
    def upstream_logprobs(self, body: dict[str, Any]) -> tuple[bool, Any]:
        """Whether the client asked for logprobs, and the ``logprobs`` value sent upstream."""

    @abstractmethod
    def prompt_ids(self, answer: Answer[AnswerChoiceT] | Answer[ChunkChoiceT]) -> list[int] | None:
        """The prompt IDs ``[P]`` an answer or chunk carries, or None."""

    @abstractmethod
    def choice_logprobs(self, choice: AnswerChoiceT | ChunkChoiceT) -> list[float] | None:
        """Per-token behaviour logprobs ``[T]`` of one choice (or chunk), or None when absent."""

    @abstractmethod
    def answer_message(self, choice: AnswerChoiceT) -> dict[str, Any] | None:
        """The response message of one choice of a unary answer."""

    @abstractmethod
    def delta_text(self, choice: ChunkChoiceT) -> str:
        """The text one choice of a chunk adds."""

    @abstractmethod
    def add_delta(self, state: ChoiceState, choice: ChunkChoiceT) -> None:
        """Accumulate the message parts one choice of a chunk adds."""

    @abstractmethod
    def stream_message(self, state: ChoiceState) -> dict[str, Any]:
        """The response message reassembled from a stream's parts."""

    # -- the shared part ------------------------------------------------------------------

    def check_body(self, body: dict[str, Any]) -> None:
        """Raise ``InvalidRequestError`` when the body cannot be captured."""
        self.check_input(body)
        if "stream" in body and not isinstance(body["stream"], bool):
            raise InvalidRequestError("'stream' must be a boolean", param="stream")
        n = body.get("n", 1)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise InvalidRequestError(f"'n' must be a positive integer, got {n!r}", param="n")

    def prepare(self, body: dict[str, Any]) -> Prepared:
        """The client's body (checked: ``check_body``) with ``return_token_ids: true``,
        logprobs on and, when streaming, ``stream_options.include_usage: true`` (so sampled
        IDs can be checked against the usage count). Everything else (``top_logprobs``, tools,
        vendor fields) passes through."""
        self.check_body(body)
        upstream = dict(body)
        upstream["return_token_ids"] = True
        asked_logprobs, upstream["logprobs"] = self.upstream_logprobs(body)
        stream_options = body.get("stream_options")
        include_usage = (
            isinstance(stream_options, dict) and stream_options.get("include_usage") is True
        )
        stream = body.get("stream") is True
        if stream:
            upstream["stream_options"] = {
                **(stream_options if isinstance(stream_options, dict) else {}),
                "include_usage": True,
            }
        asked = ClientAsked(
            return_token_ids=body.get("return_token_ids") is True,
            logprobs=asked_logprobs,
            include_usage=include_usage or not stream,
        )
        return Prepared(body, upstream, asked, n_choices=int(body.get("n") or 1))

    def read_answer(self, prepared: Prepared, unread: dict[str, Any]) -> Captured:
        """Prompt IDs ``[P]`` and, per choice, sampled IDs ``[T]`` and logprobs ``[T]``.

        A choice gets ``ids_missing`` when vLLM sent no IDs or logprobs (e.g. a reasoning parser
        with ``include_reasoning: false``, case C07), and ``ids_incomplete`` when
        ``len(ids) != len(logprobs)`` or all choices' IDs do not add up to
        ``usage.completion_tokens``. Raises ``ValueError`` (one of
        ``gateway.engine.wire.UNREADABLE``) for an answer without choices or with a field of the
        wrong kind (``answer_shape``).
        """
        check_shape(unread, self.answer_shape, "answer")
        answer = cast("Answer[AnswerChoiceT]", unread)  # the shape just checked
        body = prepared.client_body
        prompt_ids = self.prompt_ids(answer)
        answer_choices = answer.get("choices")
        if not isinstance(answer_choices, list) or not answer_choices:
            # A whole answer holds one choice per sampled sequence: without any there is nothing
            # to record, and answering it as a success would leave a delivered call with no step.
            raise ValueError(
                f"expected an answer with a non-empty 'choices' list, got {answer_choices!r:.80}"
            )
        choices: list[ChoiceRecord] = []
        indices: set[int] = set()
        for position, choice in enumerate(answer_choices):
            fields: ChoiceFields = choice  # what every dialect's choice has
            index = choice_index(fields.get("index", position), prepared.n_choices)
            if index in indices:
                raise ValueError(f"expected each choice index once, got {index} twice")
            indices.add(index)
            ids = token_ids(fields.get("token_ids"))
            logprobs = self.choice_logprobs(choice)
            message = self.answer_message(choice)
            stop_reason = fields.get("stop_reason")
            finish_reason = fields.get("finish_reason")
            choices.append(
                ChoiceRecord(
                    choice_index=index,
                    response_token_ids=ids,
                    response_logprobs=logprobs,
                    response_message=message,
                    finish_reason=finish_reason,
                    flags=integrity_flags(ids, logprobs, prompt_ids)
                    + unfinished_flags(finish_reason)
                    + quality_flags(body, finish_reason, message),
                    stop_reason=None if stop_reason is None else str(stop_reason),
                )
            )
        usage: Usage = answer.get("usage") or {}
        check_against_usage(choices, usage.get("completion_tokens"))
        model = answer.get("model")
        fingerprint = answer.get("system_fingerprint")
        return Captured(
            prompt_ids,
            choices,
            usage.get("prompt_tokens"),
            model if isinstance(model, str) else None,
            system_fingerprint=fingerprint if isinstance(fingerprint, str) else None,
        )

    def client_answer(self, prepared: Prepared, answer: dict[str, Any]) -> dict[str, Any]:
        return strip_for_client(answer, prepared.asked)

    def upstream_error_body(self, status_code: int, content: bytes) -> bytes:
        """vLLM's error body with its message and param as sent, our ``type`` and string
        ``code`` (``gateway.errors.UpstreamErrorBody``); a body that is no JSON object as it
        came."""
        error = read_upstream_error(status_code, content)
        if not error.is_json:
            return content
        return dumps(upstream_envelope(error, error.param))

    def open_stream(
        self, prepared: Prepared, system_fingerprint: str | None
    ) -> ChoicesStream[AnswerChoiceT, ChunkChoiceT]:
        return ChoicesStream(self, prepared, system_fingerprint)


def strip_for_client(response: dict[str, Any], asked: ClientAsked) -> dict[str, Any]:
    """The upstream response (or one stream chunk) as vLLM would have answered the client.

    Restores ``null`` for ``prompt_token_ids`` (top level and per choice), ``token_ids`` and
    ``logprobs`` the client did not ask for; keeps keys and their order. Returns ``response``
    itself when nothing is hidden.
    """
    if asked.return_token_ids and asked.logprobs:
        return response
    stripped = dict(response)
    if not asked.return_token_ids and stripped.get("prompt_token_ids") is not None:
        stripped["prompt_token_ids"] = None
    if "choices" in stripped:
        new_choices = []
        for choice in stripped["choices"]:
            choice = dict(choice)
            if not asked.return_token_ids:
                for key in ("token_ids", "prompt_token_ids"):
                    if choice.get(key) is not None:
                        choice[key] = None
            if not asked.logprobs and choice.get("logprobs") is not None:
                choice["logprobs"] = None
            new_choices.append(choice)
        stripped["choices"] = new_choices
    return stripped


class ChoicesCapture(Generic[AnswerChoiceT, ChunkChoiceT]):
    """The capture of a stream of ``choices`` chunks: feed parsed chunks in order with ``add``.

    ``dialect`` says where the fields are; ``body`` is the client's (for quality flags);
    ``n_choices`` the request's ``n``.
    """

    def __init__(
        self,
        dialect: ChoicesDialect[AnswerChoiceT, ChunkChoiceT],
        body: dict[str, Any],
        n_choices: int,
    ) -> None:
        self.dialect = dialect
        self.body = body
        self.n_choices = n_choices
        self.prompt_ids: list[int] | None = None
        self.usage: Usage | None = None
        self.model: str | None = None
        self.first_token_seen = False
        self.states: dict[int, ChoiceState] = {}

    def add(self, unread: dict[str, Any]) -> None:
        """Accumulate one chunk (a usage chunk, or choices with their deltas and token ids).
        Raises ``ValueError`` (one of ``gateway.engine.wire.UNREADABLE``) for a field of the wrong
        kind (the dialect's ``chunk_shape``), before anything of the chunk is kept."""
        dialect = self.dialect
        check_shape(unread, dialect.chunk_shape, "chunk")
        chunk = cast("Answer[ChunkChoiceT]", unread)  # the shape just checked
        self.model = chunk.get("model", self.model)
        prompt_ids = dialect.prompt_ids(chunk)
        if prompt_ids is not None:
            self.prompt_ids = prompt_ids
        states = self.states
        for choice in chunk.get("choices") or []:
            fields: ChoiceFields = choice  # what every dialect's choice has
            index = choice_index(fields.get("index", 0), self.n_choices)
            state = states.get(index)
            if state is None:  # not setdefault: that builds a state per chunk to throw away
                state = states[index] = ChoiceState()
            ids = token_ids(fields.get("token_ids"))
            logprobs = dialect.choice_logprobs(choice)
            carries_tokens = bool(ids) or bool(dialect.delta_text(choice))
            if ids is not None:
                state.ids.extend(ids)
                self.first_token_seen = self.first_token_seen or bool(ids)
            elif carries_tokens:
                state.ids_gap = True
            if logprobs is not None:
                state.logprobs.extend(logprobs)
            elif carries_tokens:
                state.logprobs_gap = True
            dialect.add_delta(state, choice)
            finish_reason = fields.get("finish_reason")
            if finish_reason is not None:
                state.finish_reason = finish_reason
                stop = fields.get("stop_reason")
                state.stop_reason = None if stop is None else str(stop)
        usage = chunk.get("usage")
        if usage is not None and not chunk.get("choices"):
            self.usage = usage

    def captured(
        self,
        abort_reason: str | None,
        *,
        error: dict[str, Any] | None = None,
        system_fingerprint: str | None = None,
    ) -> Captured:
        """The capture so far (see ``DialectStream.captured`` for ``abort_reason``), with the
        error object the upstream sent inside its stream, if any: that ended the stream early,
        so a choice it left without a finish reason gets ``upstream_error`` and ``aborted``."""
        if error is not None and abort_reason is None:
            abort_reason = StepOutcome.UPSTREAM_ERROR
        return Captured(
            self.prompt_ids,
            self.choices(abort_reason),
            self.prompt_tokens,
            self.model,
            error=error,
            system_fingerprint=system_fingerprint,
        )

    def sampled_counts(self) -> dict[int, int]:
        """Sampled tokens read so far, by choice index."""
        return {index: len(state.ids) for index, state in self.states.items()}

    def all_finished(self) -> bool:
        finished = sum(1 for s in self.states.values() if s.finish_reason is not None)
        return finished >= self.n_choices

    @property
    def prompt_tokens(self) -> int | None:
        """``usage.prompt_tokens`` when the usage chunk came, else the prompt IDs counted."""
        if self.usage:
            tokens = self.usage.get("prompt_tokens")
            return tokens if isinstance(tokens, int) else None
        return None if self.prompt_ids is None else len(self.prompt_ids)

    def choices(self, abort_reason: str | None = None) -> list[ChoiceRecord]:
        """One record per choice (see ``DialectStream.captured`` for ``abort_reason``)."""
        indices = sorted(self.states) or list(range(self.n_choices))
        records: list[ChoiceRecord] = []
        for index in indices:
            state = self.states.get(index, ChoiceState())
            ids = None if state.ids_gap else state.ids
            logprobs = None if state.logprobs_gap else state.logprobs
            message = self.dialect.stream_message(state)
            finish_reason = state.finish_reason
            flags = integrity_flags(ids, logprobs, self.prompt_ids)
            if finish_reason is None and abort_reason is not None:
                finish_reason = abort_reason
                flags.append(ABORTED)
            flags += unfinished_flags(finish_reason)
            flags += quality_flags(self.body, finish_reason, message)
            if TOOL_CALL_TRUNCATED not in flags and tool_call_cut(self.body, finish_reason, state):
                flags.append(TOOL_CALL_TRUNCATED)
            records.append(
                ChoiceRecord(
                    choice_index=index,
                    response_token_ids=ids,
                    response_logprobs=logprobs,
                    response_message=message,
                    finish_reason=finish_reason,
                    flags=flags,
                    stop_reason=state.stop_reason,
                )
            )
        if abort_reason is None:
            check_against_usage(records, (self.usage or {}).get("completion_tokens"))
        return records


def tool_call_cut(body: dict[str, Any], finish_reason: str | None, state: ChoiceState) -> bool:
    """Whether a streamed choice cut at ``max_tokens`` was cut inside a tool call (C18).

    ``quality_flags`` reads an unclosed ``<tool_call>`` from the message text, which a stream's
    message never has: vLLM's streaming tool parser holds back the tag and every text after it,
    streaming only the call's name and arguments. So, with tools offered and ``finish_reason``
    ``length``, a stream was cut in a call when it had started one (its arguments may be whole
    JSON with the closing tag not yet sampled) or when its last token-bearing chunks showed
    nothing (the parser held back a ``<tool_call>`` tag, a name not yet complete, or the tag's
    end). Read once per choice at the end: the per-chunk cost is one assignment.

    Flagged too, where the unary text says otherwise: a complete call followed by more sampled
    text (held back after a call, never sent), and text ending in a prefix of ``<tool_call>``
    (``<``, ``<tool``), which the parser holds back in case a call starts.
    """
    if finish_reason != "length" or not body.get("tools"):
        return False
    return state.held_back or bool(state.tool_calls)


def unfinished_flags(finish_reason: Any) -> list[str]:
    """``unfinished`` when the engine gave a choice no finish reason (``finish_reason`` None):
    a stream that ended early or a unary ``null``; the tokens may be a prefix of the sample."""
    return [UNFINISHED] if finish_reason is None else []


class ChoicesStream(DialectStream, Generic[AnswerChoiceT, ChunkChoiceT]):
    """Relays vLLM's own chunks to the client, hiding what it did not ask for (module docstring:
    what is held back and why)."""

    def __init__(
        self,
        dialect: ChoicesDialect[AnswerChoiceT, ChunkChoiceT],
        prepared: Prepared,
        system_fingerprint: str | None,
    ) -> None:
        self.capture = ChoicesCapture(dialect, prepared.client_body, prepared.n_choices)
        self.asked = prepared.asked
        self.fingerprint = system_fingerprint
        self.error: dict[str, Any] | None = None
        self._held: list[dict[str, Any]] = []

    def feed(self, data: bytes) -> list[bytes]:
        if self.error is not None:
            return []  # the error event was the last one (vLLM still sends its [DONE])
        chunk = loads_object(data)  # raises UNREADABLE: the proxy ends the stream in error
        if "error" in chunk and "choices" not in chunk:
            self.error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk}
            # vLLM's message and param, our type and code (as for its unstreamed errors)
            error = read_upstream_error(stream_error_status(self.error), data)
            return [*self._release(), sse_event(dumps(upstream_envelope(error, error.param)))]
        capture = self.capture
        capture.add(chunk)
        self.first_token_seen = capture.first_token_seen
        choices = chunk.get("choices")
        if chunk.get("usage") is not None and not choices:
            self.fingerprint = chunk.get("system_fingerprint", self.fingerprint)
            if self.asked.include_usage:
                self._held.append(chunk)
            return []
        terminal = _is_terminal(choices)
        needs_fingerprint = not self.asked.include_usage and self.fingerprint is None
        if self._held or (terminal and (capture.all_finished() or needs_fingerprint)):
            self._held.append(chunk)
            return []
        # sse_event, inlined: this is the per-chunk path
        return [b"data: " + self._for_client(chunk, data, terminal) + b"\n\n"]

    def closing(self) -> list[bytes]:
        if self.error is not None:
            # Ended by vLLM's error event, as a stream the gateway ends in error: no [DONE]
            # (vLLM sends one after its error event; the OpenAI SDKs raise at the error).
            return []
        return [*self._release(), b"data: [DONE]\n\n"]

    def error_event(self, error: TrajgateError) -> bytes:
        return sse_error_event(error)

    def sampled_counts(self) -> dict[int, int]:
        return self.capture.sampled_counts()

    def captured(self, abort_reason: str | None) -> Captured:
        return self.capture.captured(
            abort_reason, error=self.error, system_fingerprint=self.fingerprint
        )

    def _release(self) -> list[bytes]:
        released = [
            sse_event(self._for_client(chunk, None, _is_terminal(chunk.get("choices"))))
            for chunk in self._held
        ]
        self._held = []
        return released

    def _for_client(self, chunk: dict[str, Any], raw: bytes | None, terminal: bool) -> bytes:
        """The chunk's JSON as the client sees it: ``raw`` (vLLM's bytes) when unchanged."""
        client = strip_for_client(chunk, self.asked)
        if terminal and not self.asked.include_usage and self.fingerprint is not None:
            client = dict(client)
            client["system_fingerprint"] = self.fingerprint
        if client is chunk and raw is not None:
            return raw
        return dumps(client)


def _is_terminal(choices: list[ChoiceFields] | None) -> bool:
    """Whether a chunk's ``choices`` finish one (its ``finish_reason`` is set); the chunk's
    shape checked by the capture's ``add``."""
    if not choices:
        return False
    return any(c.get("finish_reason") is not None for c in choices)
