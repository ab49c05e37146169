"""Which earlier turn a call's conversation continues: the append-only test of exact continuation.

Owns: ``turn_key``, the key of a turn (a history and the response message that answered it);
``history_keys``, the keys a new call's conversation would extend and, from the same walk,
the key of the turn it becomes once answered; ``find_extension``, which
picks the latest of them that a turn in memory or in the pool answers and checks the echo;
and ``TurnMemory``, a bounded memory per trajectory of its recent turns (each ok choice of a
call: its key, the response message the gateway returned, ``S = P + R``, its token sequence).
Never: tokenizes, renders or talks to an engine (``gateway.engine.exact`` does),
reads SQL (the pool finds a stored turn by its key: ``PoolStore.find_turn``), and never
guesses: a history the client changed in any way is no extension (the call is rendered by the
template and the pool records the break, as for any call).

The conversation compared is the canonical record's (``datapool.steps.canonical``), which every
dialect writes, so an echo is judged the same way whether it came as a chat message, a
Responses item or a Messages content block. A turn with history ``C`` (``k`` canonical
messages) and response ``R`` is extended by a call whose messages are ``C``, then an echo of
``R``, then new messages. Its key is ``sha256(render key, C as JSON text, echo form of R)``:

- ``C`` must be equal message by message as JSON text (``datapool.steps.messages.message_key``),
  with one allowance for what renders the same: a content of exactly one text part is its text
  (``datapool.steps.canonical.as_rendered``: Claude Code sends a message as one text block,
  then as a string);
- the echo form of ``R`` is what ``echoes`` compares: the text (a string or its text parts
  joined, None and "" alike), each tool call's name and arguments as a JSON value (a client
  that re-serialises them sends the same call: case C08), the reasoning; tool call ids are
  left out of the key and checked after (a client may echo a call without its id);
- the render key: the body's fields besides the conversation that change what the template
  renders (``RENDER_FIELDS``).

The key is stored on the step (``steps.turn_key``), so a worker, a replica or a restarted
gateway that does not hold the turn in memory finds it in the pool by one indexed read.

Memory: per trajectory at most ``turns_per_trajectory`` turns, each its key, its response
message and ``S`` as int32 bytes (4 bytes a token); at most ``trajectories`` trajectories (LRU).

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from datapool.steps.canonical import Message, as_rendered, response_of
from datapool.steps.messages import message_key
from datapool.steps.payloads import pack_ids
from datapool.steps.store import StoredStep

# Request fields besides the conversation that change what the template renders: a call that
# sets any of them differently from the turn it extends is no extension.
RENDER_FIELDS = (
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "model",
)


@dataclass(frozen=True)
class Turn:
    """One choice of an earlier call: what the engine saw and what it sampled.

    ``key``: its ``turn_key``; ``response``: the response message the gateway returned, as a
    canonical message; ``sequence``: ``P + R`` as int32 bytes.
    """

    key: str
    response: Message
    sequence: bytes


@dataclass(frozen=True)
class Extension:
    """A call that continues ``turn``: ``new_from`` is the index of its first new message."""

    turn: Turn
    new_from: int


def render_key(body: Mapping[str, Any], *, tool_choice_none_renders: bool = True) -> str:
    """The ``RENDER_FIELDS`` of an upstream chat body as JSON text (absent fields omitted),
    and, when ``tool_choice_none_renders`` (a replica may run vLLM with
    --exclude-tools-when-tool-choice-none: ``UpstreamPool.tool_choice_none_renders``), whether
    ``tool_choice`` is "none"; another tool choice (a forced call, then an answer) renders the
    same, and so does "none" where every replica renders the tools anyway."""
    fields = {name: body[name] for name in RENDER_FIELDS if name in body}
    fields["tool_choice_none"] = tool_choice_none_renders and body.get("tool_choice") == "none"
    return json.dumps(fields)


def _text(content: Any) -> str | None:
    """A message's content as the template renders it: a string, or its text parts joined;
    None (or "") for no content; a part of another type is not text (None: never equal)."""
    if content is None or content == "":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" for part in content
    ):
        return "".join(str(part.get("text", "")) for part in content)
    return None


def _arguments(arguments: str) -> str:
    """Tool-call arguments as canonical JSON text: the same JSON value re-serialised by the
    client (spaces, key order, an object instead of its string: case C08) is the same call."""
    try:
        value: Any = json.loads(arguments)
    except ValueError:
        return "\0" + arguments  # not JSON: only the very same string matches
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def echo_form(message: Message) -> str | None:
    """What of an assistant message an echo must keep, as JSON text (see the module
    docstring); None for a message that is no assistant turn or has content that is not text
    (never an extension: the template's rendering of it is not known to be the same)."""
    text = _text(message.content)
    if message.role != "assistant" or text is None:
        return None
    calls = [[call.name, _arguments(call.arguments)] for call in message.tool_calls]
    return json.dumps([text, calls, message.reasoning or ""], ensure_ascii=False)


def echoes(returned: Message, echoed: Message) -> bool:
    """Whether the client's message ``echoed`` is the response message ``returned`` sent back:
    the same echo form (text, tool calls as JSON values, reasoning), and each tool call's id
    the same where the client kept it. Reasoning the client dropped matters (the model would
    see its reasoning the client chose to remove)."""
    form = echo_form(returned)
    if form is None or form != echo_form(echoed):
        return False
    return all(
        theirs.id is None or theirs.id == mine.id
        for mine, theirs in zip(returned.tool_calls, echoed.tool_calls, strict=True)
    )


def _history_form(message: Message) -> str:
    """``message`` as the history part of a turn key compares it: the JSON text of its
    ``as_rendered`` form (a content of one text part is its text)."""
    return message_key(as_rendered(message).to_json())


def _history_digest(body_render_key: str) -> Any:
    digest = hashlib.sha256(body_render_key.encode())
    digest.update(b"\0")
    return digest


def _with_response(digest: Any, echo: str) -> str:
    answered = digest.copy()
    answered.update(b"\0R")
    answered.update(echo.encode())
    return str(answered.hexdigest())


def turn_key(body_render_key: str, history: Sequence[Message], response: Message) -> str | None:
    """The key of the turn that answered ``history`` (a call's canonical messages) with
    ``response`` (64 hex characters); None when ``response`` can never be echoed
    (``echo_form``)."""
    echo = echo_form(response)
    if echo is None:
        return None
    digest = _history_digest(body_render_key)
    for message in history:
        digest.update(b"\0M")
        digest.update(_history_form(message).encode())
    return _with_response(digest, echo)


@dataclass(frozen=True)
class HistoryKeys:
    """What one walk over a call's canonical messages gives (``history_keys``): ``candidates``,
    ``(k, key)`` for every assistant message ``k``, the latest first (the turn the call would
    extend from there), and the digest of the whole history, from which the key of the turn
    the call itself becomes is made once its response is known (``answered_by``), so the
    history is serialised and hashed once per call, not once to find its turn and again to
    key it."""

    candidates: list[tuple[int, str]]
    digest: Any  # sha256 of the render key and every message, not yet of a response
    messages: int = 0  # how many messages the digest has taken

    def answered_by(self, response: Message) -> str | None:
        """``turn_key`` of the whole history answered by ``response`` (None when ``response``
        can never be echoed: ``echo_form``)."""
        echo = echo_form(response)
        return None if echo is None else _with_response(self.digest, echo)


def history_keys(
    body_render_key: str, messages: Sequence[Message], earlier: HistoryKeys | None = None
) -> HistoryKeys:
    """``HistoryKeys`` of ``messages`` (a new call's canonical messages): one walk, each
    message's history form serialised and hashed once. O(total message size).

    ``earlier``: the ``HistoryKeys`` of ``messages[:n]`` under the same ``body_render_key``,
    ``n`` the number of messages it was made of (``gateway.proxy.continuation.walk`` proves
    them the same): the walk goes on from its digest over ``messages[n:]`` only, O(size of the
    new messages)."""
    found: list[tuple[int, str]] = []
    if earlier is None:
        start, digest = 0, _history_digest(body_render_key)
    else:
        start, digest = earlier.messages, earlier.digest.copy()
    for k in range(start, len(messages)):
        message = messages[k]
        if message.role == "assistant":
            echo = echo_form(message)
            if echo is not None:
                found.append((k, _with_response(digest, echo)))
        digest.update(b"\0M")
        digest.update(_history_form(message).encode())
    found.reverse()
    if earlier is not None:
        found += earlier.candidates
    return HistoryKeys(found, digest, len(messages))


def candidate_keys(body_render_key: str, messages: Sequence[Message]) -> list[tuple[int, str]]:
    """``(k, key)`` for every assistant message ``k`` of ``messages`` (a new call's canonical
    messages), the latest first: the ``turn_key`` of ``messages[:k]`` answered by
    ``messages[k]``, the turn the call would extend from there (``history_keys``)."""
    return history_keys(body_render_key, messages).candidates


def find_extension(
    candidates: Sequence[tuple[int, str]],
    messages: Sequence[Message],
    lookup: Callable[[str], Turn | None],
) -> Extension | None:
    """The latest turn that ``messages`` extend among ``candidates`` (``candidate_keys`` of
    them, latest first), as ``lookup`` (a key to a turn, or None) finds it, its tool call ids
    checked (``echoes``). None when no turn is extended."""
    for k, key in candidates:
        turn = lookup(key)
        if turn is not None and echoes(turn.response, messages[k]):
            return Extension(turn, k + 1)
    return None


def stored_turn(step: StoredStep) -> Turn | None:
    """The turn a stored step answered (``PoolStore.find_turn``); None when it has no key,
    response message or token ids."""
    key, prompt, response = step.row.turn_key, step.prompt_token_ids, step.response_token_ids
    if key is None or step.row.response_message is None or prompt is None or response is None:
        return None
    return Turn(key, response_of(step.row.response_message), pack_ids([*prompt, *response]))


class TurnMemory:
    """The recent turns of at most ``trajectories`` trajectories (LRU), at most
    ``turns_per_trajectory`` each (oldest dropped first), by key."""

    def __init__(self, trajectories: int, turns_per_trajectory: int) -> None:
        self.trajectories = trajectories
        self.turns_per_trajectory = turns_per_trajectory
        self._turns: OrderedDict[str, dict[str, Turn]] = OrderedDict()

    def turns_of(self, trajectory_id: str) -> Mapping[str, Turn]:
        """The trajectory's turns by key (empty when none is held)."""
        turns = self._turns.get(trajectory_id)
        if turns is None:
            return {}
        self._turns.move_to_end(trajectory_id)
        return turns

    def add(self, trajectory_id: str, turn: Turn) -> None:
        turns = self._turns.setdefault(trajectory_id, {})
        self._turns.move_to_end(trajectory_id)
        turns.pop(turn.key, None)
        turns[turn.key] = turn
        while len(turns) > self.turns_per_trajectory:
            del turns[next(iter(turns))]
        while len(self._turns) > self.trajectories:
            self._turns.popitem(last=False)

    def forget(self, trajectory_id: str) -> None:
        self._turns.pop(trajectory_id, None)
