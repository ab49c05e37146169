"""Which earlier turn a call's conversation continues: the append-only test of exact continuation.

Owns: ``TurnMemory``, a bounded memory per trajectory of its recent turns (each ok choice of a
call: the conversation it was asked, the response message the gateway returned, ``S = P + R``,
its token sequence), and ``find_extension``, which finds the turn whose conversation plus
response message a new call's conversation starts with, followed by new messages only.
Never: tokenizes, renders or talks to an engine (``gateway.proxy.continuation.engine`` does), and
never guesses: a history the client changed in any way is no extension (the call is rendered by
the template and the pool records the break, as for any call).

The conversation compared is the engine's (the chat messages sent upstream, every dialect
translating to them), so an echo is judged on the same form as the response message the pool
stores. ``T`` below is one turn's sequence length in tokens.

Memory: per trajectory at most ``turns_per_trajectory`` turns, each its messages as JSON text
and ``S`` as int32 bytes (4 bytes a token); at most ``trajectories`` trajectories (LRU).

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Request fields besides ``messages`` that change what the template renders: a call that sets
# any of them differently from the turn it extends is no extension.
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

    ``message_keys``: each upstream message as JSON text; ``response``: the response message the
    gateway returned, in the common form (``content``, ``tool_calls``, ``reasoning``);
    ``render_key``: the ``RENDER_FIELDS`` of its body as JSON text; ``sequence``: ``P + R`` as
    int32 bytes.
    """

    message_keys: tuple[str, ...]
    response: Mapping[str, Any]
    render_key: str
    sequence: bytes


@dataclass(frozen=True)
class Extension:
    """A call that continues ``turn``: ``new_from`` is the index of its first new message."""

    turn: Turn
    new_from: int


def render_key(body: Mapping[str, Any]) -> str:
    """The ``RENDER_FIELDS`` of an upstream chat body as JSON text (absent fields omitted),
    and whether ``tool_choice`` is "none" (vLLM can leave the tools out of the rendering
    then); another tool choice (a forced call, then an answer) renders the same."""
    fields = {name: body[name] for name in RENDER_FIELDS if name in body}
    fields["tool_choice_none"] = body.get("tool_choice") == "none"
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


def _arguments(arguments: Any) -> str | None:
    """Tool-call arguments as canonical JSON text: the same JSON value re-serialised by the
    client (spaces, key order, an object instead of its string: case C08) is the same call."""
    if isinstance(arguments, str):
        try:
            value: Any = json.loads(arguments)
        except ValueError:
            return "\0" + arguments  # not JSON: only the very same string matches
    else:
        value = arguments
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _calls(message: Mapping[str, Any]) -> list[tuple[Any, Any, str | None]] | None:
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        return None
    found = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            return None
        function = call["function"]
        found.append((call.get("id"), function.get("name"), _arguments(function.get("arguments"))))
    return found


def echoes(returned: Mapping[str, Any], echoed: Any) -> bool:
    """Whether the client's message ``echoed`` is the response message ``returned`` sent back:
    an assistant message with the same text, the same tool calls (id, name, arguments as JSON
    values) and the same reasoning. Fields a client adds empty (``refusal: null``,
    ``annotations: []``) do not matter; reasoning the client dropped does (the model would see
    its reasoning the client chose to remove)."""
    if not isinstance(echoed, dict) or echoed.get("role") != "assistant":
        return False
    text = _text(echoed.get("content"))
    if text is None or text != _text(returned.get("content")):
        return False
    mine, theirs = _calls(returned), _calls(echoed)
    if mine is None or theirs is None or len(mine) != len(theirs):
        return False
    for (id_a, name_a, args_a), (id_b, name_b, args_b) in zip(mine, theirs, strict=True):
        if name_a != name_b or args_a != args_b or (id_b is not None and id_a != id_b):
            return False
    reasoning = returned.get("reasoning") or returned.get("reasoning_content") or ""
    echoed_reasoning = echoed.get("reasoning") or echoed.get("reasoning_content") or ""
    return bool(reasoning == echoed_reasoning)


def find_extension(
    turns: Sequence[Turn], messages: Sequence[Any], body_render_key: str
) -> Extension | None:
    """The turn that ``messages`` (the new call's upstream messages) extend, longest first.

    A turn with conversation ``M`` (``k`` messages) and response ``R`` is extended when
    ``messages[:k]`` equals ``M`` as JSON text, ``messages[k]`` echoes ``R`` (``echoes``), and
    the call renders with the same fields (``body_render_key``
    equals the turn's ``render_key``). None when no turn is extended.
    """
    keys: list[str] | None = None
    best: Extension | None = None
    for turn in reversed(turns):  # the latest turn is the usual answer
        k = len(turn.message_keys)
        if k + 1 > len(messages) or turn.render_key != body_render_key:
            continue
        if best is not None and k + 1 <= best.new_from:
            continue
        if keys is None:
            keys = [json.dumps(message) for message in messages]
        if tuple(keys[:k]) == turn.message_keys and echoes(turn.response, messages[k]):
            best = Extension(turn, k + 1)
    return best


class TurnMemory:
    """The recent turns of at most ``trajectories`` trajectories (LRU), at most
    ``turns_per_trajectory`` each (oldest dropped first)."""

    def __init__(self, trajectories: int, turns_per_trajectory: int) -> None:
        self.trajectories = trajectories
        self.turns_per_trajectory = turns_per_trajectory
        self._turns: OrderedDict[str, list[Turn]] = OrderedDict()

    def turns_of(self, trajectory_id: str) -> list[Turn]:
        turns = self._turns.get(trajectory_id)
        if turns is None:
            return []
        self._turns.move_to_end(trajectory_id)
        return turns

    def add(self, trajectory_id: str, turn: Turn) -> None:
        turns = self._turns.setdefault(trajectory_id, [])
        self._turns.move_to_end(trajectory_id)
        turns.append(turn)
        del turns[: -self.turns_per_trajectory]
        while len(self._turns) > self.trajectories:
            self._turns.popitem(last=False)

    def forget(self, trajectory_id: str) -> None:
        self._turns.pop(trajectory_id, None)
