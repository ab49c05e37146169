"""The prompt of an exact continuation: the turn's own tokens, then the template's suffix.

Owns: ``exact_prompt``, which splices ``S = P + R`` of the turn a call extends with the part of
the template's rendering of the whole new conversation that follows the turn's response.
Never: tokenizes or decodes; every token comes from the engine's sampling (``S``) or from the
template's own rendering of the new conversation (the suffix), so the separator after the
end-of-turn token is the template's (case C03).

The boundary (``e`` the end-of-turn token, the last token of a response that stopped on it):
with ``m`` the number of ``e`` in ``S``, the response of the turn is the ``m``-th turn the
template closes with ``e``, so the suffix is the rendering after the ``m``-th ``e`` of the
full rendering ``F`` (the new messages and the generation prompt). A response that stopped
before ``e`` (a length cut, a stop string, the end of a grammar) is closed with ``e`` as the
template closes every turn, and that close is the ``(m + 1)``-th. Counting closes, not
comparing tokens, keeps the boundary right where the template renders the earlier history
differently from ``S`` (re-serialised arguments, earlier reasoning it strips): that difference
is exactly what exact continuation keeps out of the prompt. It relies on each turn closing
with ``e`` and on ``e`` never being sampled inside a response (it ends sampling); a rendering
with fewer than ``m`` closes is no boundary (None: the call falls back to the template).

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import orjson

TOKEN_DTYPE = "<i4"  # S is kept as int32 bytes (4 bytes a token)


@dataclass(frozen=True)
class ExactPrompt:
    """``token_ids``: ``S + suffix`` (``[P']``); ``suffix_tokens``: ``len(suffix)``, the
    tokens the template rendered for this call."""

    token_ids: list[int]
    suffix_tokens: int


@dataclass(frozen=True)
class TurnPrefix:
    """``S`` closed as the template closes a turn, ready to splice: ``token_ids`` is ``S`` plus
    ``end_token`` when the response stopped before it (``closed_here`` 1, else 0), ``closes``
    the number of ``end_token`` in it (the boundary is ``F``'s ``closes``-th)."""

    token_ids: list[int]
    end_token: int
    closes: int
    closed_here: int

    def splice(self, rendered: list[int]) -> ExactPrompt | None:
        """The exact prompt for the template's rendering ``F`` (``rendered``, the list the
        render endpoint's JSON gave): ``S' + F[j + 1:]``, ``j`` the index of ``F``'s
        ``closes``-th ``end_token``. None when ``F`` closes fewer turns or nothing follows the
        boundary. ``F`` is scanned as the list it came in (``list.index`` from one close to
        the next): converting it to an array cost more than the whole search, on the exact
        stream's critical path."""
        position = -1
        try:
            for _ in range(self.closes):
                position = rendered.index(self.end_token, position + 1)
        except ValueError:  # fewer closes in F than turns in S: no boundary
            return None
        suffix = rendered[position + 1 :]
        if not suffix:
            return None
        return ExactPrompt(self.token_ids + suffix, self.closed_here + len(suffix))

    def splice_text(self, rendered: bytes) -> ExactPrompt | None:
        """``splice`` of ``F`` given as the text of its ids (``rendered``: decimal integers
        without sign or leading zeros, separated by commas, nothing else; the caller checks
        that), the same prompt ``splice`` makes of the parsed list, without parsing ``F``'s
        ids before the boundary into Python ints (at turn 200 of a coding-agent session ~20k
        of them, 0.6 ms). In such text the id ``e`` is one element exactly where ``,e,``
        stands in ``,`` + ``rendered`` + ``,``, and the ``i``-th such match (each search
        starting at the previous match's closing comma, which the next may share) is ``F``'s
        ``i``-th ``e``. Only the suffix is parsed (orjson). Raises ``orjson.JSONDecodeError``
        (a ``ValueError``) when the suffix is no JSON (a leading zero)."""
        padded = b"," + rendered + b","
        close = b",%d," % self.end_token
        position = 0
        for _ in range(self.closes):
            position = padded.find(close, position)
            if position < 0:  # fewer closes in F than turns in S: no boundary
                return None
            position += len(close) - 1
        suffix_text = padded[position + 1 : -1]
        if not suffix_text:
            return None
        suffix: list[int] = orjson.loads(b"[" + suffix_text + b"]")
        return ExactPrompt(self.token_ids + suffix, self.closed_here + len(suffix))


def turn_prefix(sequence: bytes, end_token: int) -> TurnPrefix | None:
    """The prefix of turn ``S`` (int32 bytes) for ``end_token``; None for an empty turn. Made
    while the render is on its way, so only ``TurnPrefix.splice`` waits for it."""
    ids = np.frombuffer(sequence, dtype=TOKEN_DTYPE)
    if ids.size == 0:
        return None
    closes = int(np.count_nonzero(ids == end_token))
    token_ids: list[int] = ids.tolist()
    closed_here = 0 if token_ids[-1] == end_token else 1
    if closed_here:
        token_ids.append(end_token)
    return TurnPrefix(token_ids, end_token, closes + closed_here, closed_here)


def exact_prompt(sequence: bytes, end_token: int, rendered: list[int]) -> ExactPrompt | None:
    """The exact prompt after turn ``S`` (int32 bytes) for the template's rendering ``F``
    (``rendered``) of the new conversation.

    With ``m`` the count of ``end_token`` in ``S``: when ``S`` ends with ``end_token`` (the
    response stopped on it), ``S + F[j_m + 1:]``; else (a length cut, a stop string, a grammar
    that ended) the template closes the response's turn: ``S + [end_token] + F[j_{m+1} + 1:]``,
    ``j_i`` the index of the ``i``-th ``end_token`` in ``F``. None when ``F`` closes fewer turns
    or nothing follows the boundary (``turn_prefix``, then ``TurnPrefix.splice``).
    """
    prefix = turn_prefix(sequence, end_token)
    return None if prefix is None else prefix.splice(rendered)
