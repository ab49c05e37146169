"""Asking vLLM for an exact continuation: render, then sample from our ids.

Owns: ``send_exact``, which answers a chat completions body as vLLM's ``/v1/chat/completions``
would, for the prompt the proxy's exact prefix builds (``ExactPrefix``: the turn's own ids,
``gateway.proxy.continuation.prompt``). vLLM renders the body
(``/v1/chat/completions/render``: the template's ids and vLLM's own sampling parameters for
it); the gateway splices the turn's own ids in; then:

- a stream goes to vLLM's chat endpoint itself with the spliced ids as forwarded prompt ids
  (``kv_transfer_params.prompt_token_ids``, disaggregated serving's decode-side reuse: vLLM
  skips only templating and tokenization, and streams as it always does, its tool and
  reasoning parsers running incrementally in the server). The answer is vLLM's chat stream,
  chunk for chunk; the version split of a kept reload is the gateway's own count, as for any
  chat stream;
- a unary call samples from ``/inference/v1/generate`` (whose answer says which weight version
  sampled each token, ``weight_versions``: a unary call split by a kept reload is then exact)
  and vLLM's derender (``/v1/chat/completions/derender``) turns the ids into the chat answer
  with the same parsers. Two of derender's ways differ from the chat endpoint's in vLLM 0.32,
  and are met here: it decodes the token that stopped sampling into the text (the gateway
  hides that token from it, ``_as_detokenized``), and it does not cut stop strings (a unary
  call with ``stop`` strings goes to the chat endpoint with forwarded ids, as a stream does).

Why not generate for streams as well: vLLM's streaming derender is stateless, so with a parser
configured every chunk's call carries the prompt and all output so far and replays the parser
from the start (O(T) transport and up to O(T^2) parsing per chunk, by vLLM's own docstring of
``DerenderStreamState``), and it leaves logprob token text empty. Never: parses a tool call or
reasoning, or decodes a token (vLLM does both).

The render is the one exchange exact mode adds before the engine samples, so it is sent as
early as it can be (``render_ahead``): as soon as the call's upstream body is final and its
trajectory has a turn in the gateway's memory, while the gateway still looks up re-sends and
the turn the call extends in the pool. ``send_exact`` uses it when the call goes to that
replica with that body; otherwise (another replica, a body that changed) it renders anew, and
a call that extends no turn discards it.

Each exchange (render, generate, derender, the unary forwarded chat call) has one overall
deadline, the unary limit's longest (``errors.limit_s``): past it ``ExchangeTimeoutError``, a
timeout as httpx's own. A stream's exchanges have none of their own: the caller's first-byte
limit bounds them. A 200 answer that is not what vLLM sends is ``UnreadableAnswerError``.

What the engine reads of the gateway is typed here, not imported: the replica
(``ExactReplica``) and the exact prefix of the turn a call extends (``ExactPrefix``), so the
engine room never imports the proxy or the replicas. What it learnt comes back as a value
(``ExactAnswer``: the answer, what built the prompt, the prompt sent and the engine's weight
version spans), which the proxy keeps with its call.

Endpoints needed: vLLM started with ``--enable-scale-out`` (``trajgate vllm start`` does), and a
chat endpoint that honours forwarded prompt ids (vLLM 0.32 does); ``gateway.engine.probe``
tells whether a replica has them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import httpx
import orjson

from gateway.engine.errors import UnreadableAnswerError, answer_object, deadline, limit_s
from gateway.engine.paths import CHAT_PATH, DERENDER_PATH, GENERATE_PATH, RENDER_PATH
from gateway.engine.wire import UNREADABLE, CheckedIds, dumps, loads, loads_object, token_ids

JSON_HEADERS = {"content-type": "application/json"}
# The prompt's last ids derender is sent (``prompt_token_ids``): vLLM 0.32 seeds its detokenizer
# from the prompt's tail alone (``convert_prompt_ids_to_tokens`` reads the last 7, and the
# field's docstring: "Only the last few IDs are read, so a suffix of the prompt is enough"), so
# sending the whole prompt (~21k ids at turn 200 of a coding-agent session) only made the
# engine parse and validate them. ``prompt_tokens`` still counts the whole prompt.
DERENDER_SEED_IDS = 64


class ExactReplica(Protocol):
    """The replica an exact continuation goes to (``gateway.upstream.replicas.Replica``)."""

    @property
    def end_token(self) -> int | None:
        """The template's end-of-turn token (``gateway.engine.probe``); None: unknown."""

    @property
    def forwards_prompt_ids(self) -> bool:
        """Whether its chat endpoint samples from forwarded prompt ids."""

    def endpoint(self, path: str) -> httpx.URL:
        """The replica's URL of ``path`` (one of ``gateway.engine.paths``)."""


class SplicedPrompt(Protocol):
    """An exact prompt: ``token_ids`` ``[P']`` and the ``suffix_tokens`` the template rendered,
    its last ``suffix_tokens`` ids (the rest is the turn's own, checked when it was captured)."""

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def suffix_tokens(self) -> int: ...


class ExactPrefix(Protocol):
    """The turn a call extends, closed as the template closes a turn
    (``gateway.proxy.continuation.prompt.TurnPrefix``)."""

    def splice(self, rendered: list[int]) -> SplicedPrompt | None:
        """The exact prompt for the template's rendering ``rendered`` (``[F]``), or None when
        it has no boundary (the template's own ids are then the prompt)."""

    def splice_text(self, rendered: bytes) -> SplicedPrompt | None:
        """``splice`` of ``F`` given as the JSON text of its ids between the brackets, written
        plainly (digits and commas only: ``_plain_render``)."""


Built = Literal["exact", "template"]


@dataclass(frozen=True)
class ExactAnswer:
    """What ``send_exact`` got for one attempt, as a value the proxy keeps with its call.

    ``response``: the chat answer (or the non-200 answer of the exchange that refused), as
    ``send_exact`` documents it. ``built``: what built the prompt, ``exact`` (the turn's own ids
    spliced into the template's rendering) or ``template`` (the template's own ids, or nothing
    built: a render that did not answer 200); ``suffix_tokens``: when ``exact``, how many
    tokens the template rendered for the new messages and the generation prompt, else None;
    ``prompt_token_ids``: the prompt sent to the engine (``[P]``), None when no render answered
    200; ``weight_versions``: by choice index, the engine's ``weight_versions`` spans of each
    generate choice that carried them (``[{"version", "start", "end"}, ...]`` over that
    choice's ``[T]`` output tokens), empty for an answer of the chat endpoint."""

    response: httpx.Response
    built: Built = "template"
    suffix_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    weight_versions: Mapping[int, list[Any]] = field(default_factory=dict)


@dataclass
class RenderAhead:
    """A render sent before the call knew whether it would use it (``render_ahead``): to
    ``replica`` for ``body`` (the very object, the call's upstream body)."""

    replica: ExactReplica
    body: dict[str, Any]
    content: bytes  # ``body`` as JSON, as sent
    task: asyncio.Future[httpx.Response]

    def discard(self) -> None:
        """Cancel the render, or read its outcome if it is done (so a failure it met is not
        reported as never retrieved). Idempotent."""
        if not self.task.done():
            self.task.cancel()
        elif not self.task.cancelled():
            self.task.exception()


def render_ahead(
    client: httpx.AsyncClient,
    replica: ExactReplica,
    body: dict[str, Any],
    timeout: httpx.Timeout | None,
) -> RenderAhead:
    """Send ``body``'s render to ``replica`` now, in a task; ``timeout`` as ``send_exact``
    takes it. The caller hands it to ``send_exact`` or discards it."""
    content = dumps(body)
    task = asyncio.ensure_future(_render(client, replica, content, timeout))
    return RenderAhead(replica, body, content, task)


async def _render(
    client: httpx.AsyncClient,
    replica: ExactReplica,
    content: bytes,
    timeout: httpx.Timeout | None,
) -> httpx.Response:
    limits = httpx.USE_CLIENT_DEFAULT if timeout is None else timeout
    async with deadline(limit_s(timeout), RENDER_PATH):
        return await client.post(
            replica.endpoint(RENDER_PATH), content=content, headers=JSON_HEADERS, timeout=limits
        )


# Where an exact unary answer keeps its own JSON object in its ``httpx.Response.extensions``;
# its body is left empty. The capture reads that object, and the proxy writes what the client
# is sent of it (``gateway.proxy.answer``): at turn 200 of a coding-agent session its 20k
# prompt ids were written to bytes that only a client asking for them would read.
PARSED_ANSWER = "trajgate.parsed_answer"


def _error_response(answer: httpx.Response, content: bytes) -> httpx.Response:
    return httpx.Response(
        answer.status_code,
        content=content,
        headers={"content-type": answer.headers.get("content-type", "application/json")},
    )


async def send_exact(
    client: httpx.AsyncClient,
    replica: ExactReplica,
    body: dict[str, Any],
    prefix: ExactPrefix | None,
    ahead: RenderAhead | None,
    timeout: httpx.Timeout | None,
) -> ExactAnswer:
    """The chat answer to ``body`` (an upstream chat completions body) on ``replica`` with its
    prompt built from ``prefix``, the turn the call extends closed with ``replica.end_token``
    (the template's end-of-turn token, learnt by ``gateway.engine.probe``, must be known; None:
    no turn to splice, the template's own ids are the prompt), with what built the prompt,
    the prompt sent and the engine's weight version spans (``ExactAnswer``). ``ahead``: the
    render sent ahead for this call (``render_ahead``), used when it went to ``replica`` for
    this body, discarded otherwise; ``send_exact`` owns it from here. ``timeout``: the limits
    of a unary call, and each exchange's overall deadline (``limit_s``); None for a stream (the
    client's defaults: its read timeout is the silence allowed between chunks). A stream is
    returned open, as vLLM's chat endpoint answered it; a non-200 answer of any endpoint is
    returned as it came. Raises ``httpx.HTTPError`` as the HTTP client does,
    ``ExchangeTimeoutError`` (an ``httpx.TimeoutException``) past an exchange's deadline, and
    ``UnreadableAnswerError`` (an ``httpx.DecodingError``) for a 200 answer of render, generate
    or derender that is not the JSON object it should be.
    """
    assert replica.end_token is not None, "send_exact continues a turn on a probed replica"
    assert "kv_transfer_params" not in body, "plan_continuation continues no such body"
    limits = httpx.USE_CLIENT_DEFAULT if timeout is None else timeout
    ahead, content = _taken_ahead(ahead, replica, body)
    render = await (ahead.task if ahead is not None else _render(client, replica, content, timeout))
    if render.status_code != 200:
        return ExactAnswer(_error_response(render, render.content))
    request, rendered, spliced = _read_render(render, prefix)
    prompt = _prompt_of(rendered, spliced)

    def answered(response: httpx.Response, versions: Mapping[int, list[Any]]) -> ExactAnswer:
        if spliced is None:
            return ExactAnswer(response, "template", None, prompt, versions)
        return ExactAnswer(response, "exact", spliced.suffix_tokens, prompt, versions)

    stream = body.get("stream") is True
    prompt_json = dumps(prompt)  # the ~20k ids written once, for every exchange that sends them
    if samples_from_forwarded_ids(body):
        chat = client.build_request(
            "POST",
            replica.endpoint(CHAT_PATH),
            content=forwarding(content, prompt_json),
            headers=JSON_HEADERS,
            timeout=limits,
        )
        if stream:
            return answered(await client.send(chat, stream=True), {})
        async with deadline(limit_s(timeout), CHAT_PATH):
            answer = await client.send(chat, stream=True)
            try:
                await answer.aread()
            except BaseException:
                await answer.aclose()
                raise
        return answered(answer, {})
    _restate_max_tokens(request["sampling_params"], body)
    request["token_ids"] = orjson.Fragment(prompt_json)
    async with deadline(limit_s(timeout), GENERATE_PATH):
        answer = await client.post(
            replica.endpoint(GENERATE_PATH),
            content=_dumps_with(request, token_ids=prompt),
            headers=JSON_HEADERS,
            timeout=timeout,
        )
    if answer.status_code != 200:
        return answered(_error_response(answer, answer.content), {})
    generated = answer_object(answer, "generate")
    sampled = _sampled(generated)
    versions = _weight_versions(generated["choices"])
    sent = _Sent(body, content, prompt, prompt_json)
    chat_answer = await _unary(client, replica, sent, generated, sampled, timeout)
    return answered(chat_answer, versions)


def _read_render(
    render: httpx.Response, prefix: ExactPrefix | None
) -> tuple[dict[str, Any], list[Any], SplicedPrompt | None]:
    """render's 200 answer: its object (``GenerateRequest``), the template's ids ``[F]`` (left
    unparsed, ``[]``, when the turn's ids were spliced into their text: ``_plain_render``) and
    the exact prompt ``prefix`` makes of them (None: no prefix, or no boundary in ``F``). Raises
    ``UnreadableAnswerError`` for an answer that is no JSON object, or has no ids, unreadable
    ids or no ``sampling_params``; the ids are checked by ``_prompt_of``."""
    spliced: SplicedPrompt | None = None
    plain = None if prefix is None else _plain_render(render)
    if prefix is not None and plain is not None:
        request, text = plain
        spliced = _read(prefix.splice_text, text, "render's token_ids")
        rendered: Any = []
        if spliced is None:
            rendered = _read(loads, b"[" + text + b"]", "render's token_ids")
    else:
        request = answer_object(render, "render")
        rendered = request.get("token_ids")
    if (
        not isinstance(rendered, list)
        or (not rendered and spliced is None)
        or not isinstance(request.get("sampling_params"), dict)
    ):
        raise UnreadableAnswerError(
            f"vLLM's render answered without token ids and sampling_params: {render.content[:80]!r}"
        )
    if prefix is not None and plain is None:
        spliced = prefix.splice(rendered)
    return request, rendered, spliced


def _prompt_of(rendered: list[Any], spliced: SplicedPrompt | None) -> CheckedIds:
    """The prompt sent to the engine: ``spliced`` when the turn's ids were spliced in, else
    the template's ``rendered`` ids (``[F]``), every id the engine is handed checked as
    ``token_ids`` checks ids. Raises ``UnreadableAnswerError`` for one that is no int32 id.

    Of a spliced prompt ``S' + F[j + 1:]`` only the render's part, ``F[j + 1:]`` (the last
    ``suffix_tokens`` ids, the end token the template closes a turn with among them), is
    read from this answer: ``S'`` is the turn's own ids, read and checked when its call was
    captured (``gateway.proxy.continuation.prompt.turn_prefix``, int32 bytes of a checked
    prompt and checked sampled ids), and ``F[: j + 1]`` is dropped, never sent. So the check
    walks the new part, not the ~20k ids of a long session's whole rendering (1 ms a call at
    turn 200). An id of the wrong kind in the dropped part can at worst move the boundary
    (``list.index`` compares by value), and the prompt is still made only of checked ids;
    the step records that prompt, the one the engine sampled from."""
    if spliced is None:
        return CheckedIds(_read(token_ids, rendered, "render's token_ids"))
    ids = spliced.token_ids
    _read(token_ids, ids[len(ids) - spliced.suffix_tokens :], "render's token_ids")
    return CheckedIds(ids)


# How render's JSON names its ids: found once in the answer's text, never inside a string (a
# string writes each '"' as '\"', so '":[' cannot follow a key's letters there).
_RENDER_IDS = b'"token_ids":['
_PLAIN_ID_TEXT = b"0123456789,"


def _plain_render(render: httpx.Response) -> tuple[dict[str, Any], bytes] | None:
    """render's answer as its JSON object with ``token_ids`` read as ``[]``, and the text of
    its ids between the brackets, when they are written plainly: the answer names
    ``token_ids`` once, at the top level, and its list is digits and commas only (JSON's
    non-negative integers: no sign, exponent, fraction, space or other value; ``,,`` and a
    comma at either end are refused too). None otherwise: the caller parses the answer whole,
    as before, and refuses what is not vLLM's. So an exact prompt's splice counts the closes
    in the text (``ExactPrefix.splice_text``) and parses only the suffix it keeps; the ids
    before the boundary are replaced by the turn's own and never sent. Raises
    ``UnreadableAnswerError`` when the rest of the answer is no JSON object."""
    content = render.content
    start = content.find(_RENDER_IDS)
    if start < 0 or content.find(_RENDER_IDS, start + 1) >= 0:
        return None
    first = start + len(_RENDER_IDS)
    end = content.find(b"]", first)
    text = content[first:end]
    if (
        end < 0
        or not text
        or text.translate(None, _PLAIN_ID_TEXT)
        or text.startswith(b",")
        or text.endswith(b",")
        or b",," in text
    ):
        return None
    try:
        request = loads_object(content[:first] + content[end:])
    except UNREADABLE as exc:
        raise UnreadableAnswerError(f"vLLM's render answered unreadably: {exc!r}") from exc
    if request.get("token_ids") != []:  # the name was not the top level's
        return None
    return request, text


@dataclass(frozen=True)
class _Sent:
    """What an exact unary call sent: the chat ``body`` and its JSON ``content`` (as the
    render got it), the ``prompt`` ids ``[P]`` and their JSON ``prompt_json`` (as generate got
    them), so derender's request is written from these pieces (the body's JSON, the prompt's
    last ``DERENDER_SEED_IDS``), not serialised again."""

    body: dict[str, Any]
    content: bytes
    prompt: list[int]
    prompt_json: bytes


def _dumps_with(value: dict[str, Any], **fragments: Any) -> bytes:
    """``dumps(value)``, where ``value`` holds ``orjson.Fragment`` s (JSON written before) at
    the keys named in ``fragments``; ``fragments`` gives each key's value, for the stdlib's
    fallback (``capture.dumps``: an integer past 64 bits, a lone surrogate elsewhere)."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return dumps({**value, **fragments})


@dataclass(frozen=True)
class _Sampled:
    """One choice as generate reported it: what the step records of it comes from here."""

    token_ids: list[int]  # [T], never empty
    logprobs: list[float] | None  # [T], None when generate sent none
    finish_reason: str | None
    stop_reason: int | str | None


def _sampled(generated: dict[str, Any]) -> dict[int, _Sampled]:
    """generate's choices by index. Raises ``UnreadableAnswerError`` (an unreadable answer,
    ``upstream_error``) unless ``choices`` is a non-empty list of objects, each with its own
    integer ``index``, a non-empty list of int32 ``token_ids``, logprobs (when sent) one number
    per token, a string or null ``finish_reason`` and ``stop_reason`` an integer, string or
    null: vLLM's ``GenerateTokensChoice``."""
    choices = generated.get("choices")
    if not isinstance(choices, list) or not choices:
        raise UnreadableAnswerError(f"generate answered no choices list: {choices!r:.80}")
    sampled: dict[int, _Sampled] = {}
    for choice in choices:
        if not isinstance(choice, dict) or type(choice.get("index")) is not int:
            raise UnreadableAnswerError(f"generate answered a choice without index: {choice!r:.80}")
        ids = _read(token_ids, choice.get("token_ids"), "generate's token_ids")
        logprobs = _read(_logprobs_of, choice.get("logprobs"), "generate's logprobs")
        finish, stop = choice.get("finish_reason"), choice.get("stop_reason")
        if (
            not ids
            or choice["index"] in sampled
            or (logprobs is not None and len(logprobs) != len(ids))
            or not isinstance(finish, str | None)
            or not isinstance(stop, int | str | None)
            or isinstance(stop, bool)
        ):
            raise UnreadableAnswerError(f"generate answered an unreadable choice: {choice!r:.120}")
        sampled[choice["index"]] = _Sampled(ids, logprobs, finish, stop)
    return sampled


def _logprobs_of(value: Any) -> list[float] | None:
    """generate's ``logprobs`` ``{"content": [{"logprob": x, ...}, ...]}`` as ``[T]`` numbers.
    Raises ``ValueError`` for another shape."""
    if value is None:
        return None
    content = value.get("content") if isinstance(value, dict) else None
    if not isinstance(content, list) or not all(
        isinstance(entry, dict) and type(entry.get("logprob")) in (int, float) for entry in content
    ):
        raise ValueError(f"expected logprobs content, got {value!r:.80}")
    return [float(entry["logprob"]) for entry in content]


def _read(reader: Any, value: Any, what: str) -> Any:
    """``reader(value)``, its ``ValueError`` an unreadable answer (``UnreadableAnswerError``)."""
    try:
        return reader(value)
    except ValueError as exc:
        raise UnreadableAnswerError(f"vLLM's {what} are unreadable: {exc}") from exc


def _taken_ahead(
    ahead: RenderAhead | None, replica: ExactReplica, body: dict[str, Any]
) -> tuple[RenderAhead | None, bytes]:
    """``ahead``, the render sent ahead for this call, when it went to ``replica`` for this body
    (the very object, or one of the same JSON: a re-send's body prepared again; one that did
    not is discarded), and the body's JSON, dumped at most once."""
    if ahead is None:
        return None, dumps(body)
    content = ahead.content if ahead.body is body else dumps(body)
    if ahead.replica is replica and content == ahead.content:
        return ahead, content
    ahead.discard()
    return None, content


def forwarding(content: bytes, prompt_json: bytes) -> bytes:
    """The chat body ``content`` (JSON of an object, as sent to render) with the prompt ids
    ``prompt_json`` (JSON of a list) as the prompt vLLM's chat endpoint samples from instead
    of rendering the messages (``kv_transfer_params.prompt_token_ids``), written by appending
    the key to the JSON text rather than serialising the conversation again.
    ``plan_continuation`` continues no body that has ``kv_transfer_params`` of its own, so the
    key is new."""
    return content[:-1] + b',"kv_transfer_params":{"prompt_token_ids":' + prompt_json + b"}}"


# ``SamplingParams.max_tokens``' default in vLLM 0.32: its msgspec struct omits fields equal to
# their default (``omit_defaults=True``), so render's JSON has no ``max_tokens`` when it is 16.
SAMPLING_PARAMS_DEFAULT_MAX_TOKENS = 16


def _restate_max_tokens(params: dict[str, Any], body: dict[str, Any]) -> None:
    """Make the rendered ``sampling_params``' ``max_tokens`` mean for generate what the chat
    endpoint would apply to the spliced prompt.

    Generate treats an absent ``max_tokens`` as unset and samples to the end of the context
    (found in the SmolLM2 demo: a turn that asked for 16 tokens took 3,690). So a limit the
    client set (``max_completion_tokens``, else ``max_tokens``, the chat endpoint's order) is
    written out, 16 where render omitted it. Without one, render's default was computed for
    the template's prompt ``F``; it is dropped so generate computes the same default
    (``get_max_tokens``) for the prompt it samples from."""
    limit = body.get("max_completion_tokens")
    if limit is None:
        limit = body.get("max_tokens")
    if limit is None:
        params.pop("max_tokens", None)
    else:
        params.setdefault("max_tokens", SAMPLING_PARAMS_DEFAULT_MAX_TOKENS)


def _weight_versions(choices: Any) -> dict[int, list[Any]]:
    """The ``weight_versions`` of each generate choice that carries them, by choice index
    (vLLM sets them on a choice's final output only)."""
    versions: dict[int, list[Any]] = {}
    for choice in choices if isinstance(choices, list) else []:
        if not isinstance(choice, dict) or not isinstance(choice.get("weight_versions"), list):
            continue
        index = choice.get("index", 0)
        if type(index) is int:
            versions[index] = choice["weight_versions"]
    return versions


async def _unary(
    client: httpx.AsyncClient,
    replica: ExactReplica,
    sent: _Sent,
    generated: dict[str, Any],
    sampled: dict[int, _Sampled],
    timeout: httpx.Timeout | None,
) -> httpx.Response:
    """The chat answer: derender's text, tool calls and token strings, with generate's ids,
    logprobs, finish and stop reasons (derender's own are only a re-telling of them). Raises
    ``UnreadableAnswerError`` when derender answers other choices than generate sampled (their
    number, an index, or a finish reason differs) or other logprob entries than tokens: text
    that may not be of these tokens is no answer to record."""
    body, prompt = sent.body, sent.prompt
    request = {
        "model": body.get("model"),
        "generate_response": _as_detokenized(generated, body),
        "chat_request": orjson.Fragment(sent.content),
        "prompt_token_ids": prompt[-DERENDER_SEED_IDS:],
        "prompt_tokens": len(prompt),
    }
    async with deadline(limit_s(timeout), DERENDER_PATH):
        derender = await client.post(
            replica.endpoint(DERENDER_PATH),
            content=_dumps_with(request, chat_request=body),
            headers=JSON_HEADERS,
            timeout=timeout,
        )
    if derender.status_code != 200:
        return _error_response(derender, derender.content)
    answer = answer_object(derender, "derender")
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != len(sampled):
        raise UnreadableAnswerError(
            f"derender answered {choices!r:.80} for the {len(sampled)} choices generate sampled"
        )
    # What the chat endpoint adds for ``return_token_ids`` (the gateway always asks): the
    # prompt at the top level, the sampled ids per choice.
    answer["prompt_token_ids"] = prompt
    asked_top = bool(body.get("top_logprobs"))
    completion_tokens = 0
    for choice in choices:
        own = _derendered(choice, sampled)
        choice["token_ids"] = own.token_ids
        choice["stop_reason"] = own.stop_reason
        completion_tokens += len(own.token_ids)
        if own.logprobs is None:
            choice["logprobs"] = None  # none sampled: the capture records them as missing
            continue
        for entry, logprob in zip(choice["logprobs"]["content"], own.logprobs, strict=True):
            entry["logprob"] = logprob
            if not asked_top:
                entry["top_logprobs"] = []
    usage = answer.get("usage")
    if isinstance(usage, dict):  # every sampled token, the stop token _as_detokenized hid too
        usage["completion_tokens"] = completion_tokens
        usage["total_tokens"] = len(prompt) + completion_tokens
    return httpx.Response(200, headers=JSON_HEADERS, extensions={PARSED_ANSWER: answer})


def _derendered(choice: Any, sampled: dict[int, _Sampled]) -> _Sampled:
    """The generate choice derender's ``choice`` tells. Raises ``UnreadableAnswerError`` when it
    names no sampled choice, another finish reason, or other logprob entries than tokens."""
    index = choice.get("index") if isinstance(choice, dict) else None
    own = sampled.get(index) if type(index) is int else None
    if own is None or choice.get("finish_reason") != own.finish_reason:
        raise UnreadableAnswerError(
            f"derender answered a choice generate did not sample: {choice!r:.120}"
        )
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if own.logprobs is not None and not (
        isinstance(content, list)
        and len(content) == len(own.logprobs)
        and all(isinstance(entry, dict) for entry in content)
    ):
        raise UnreadableAnswerError(
            f"derender answered {logprobs!r:.80} for the {len(own.logprobs)} tokens sampled"
        )
    return own


def continues_exactly(replica: ExactReplica, body: dict[str, Any]) -> bool:
    """Whether ``replica`` serves an exact continuation of ``body``: its end token is known
    (probed), and it samples from forwarded prompt ids where ``body`` needs them."""
    return replica.end_token is not None and (
        replica.forwards_prompt_ids or not samples_from_forwarded_ids(body)
    )


def samples_from_forwarded_ids(body: dict[str, Any]) -> bool:
    """Whether an exact continuation of ``body`` samples through the chat endpoint with
    forwarded prompt ids (a replica must honour them: ``Replica.forwards_prompt_ids``): a
    stream, or a unary call with stop strings, which the chat endpoint cuts from the text and
    vLLM 0.32's derender does not. Other unary calls use generate and derender."""
    return body.get("stream") is True or bool(body.get("stop"))


def _as_detokenized(generated: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """generate's answer as derender must read it to write the chat endpoint's text: each
    choice that stopped on a token (the end token, or one of ``stop_token_ids``: finish reason
    ``stop`` with no stop string) without that token in its ``token_ids``, its logprobs whole.
    vLLM 0.32's engine leaves the token that stopped sampling out of the text
    (``IncrementalDetokenizer``: ``stop_terminated``), but its derender decodes every id it is
    given, and with a tool or reasoning parser it keeps special tokens, so the end token's text
    ended up in the content (``"3354<|im_end|>"``, tests/test_exact_continuation.py). With
    ``include_stop_str_in_output`` the engine keeps that token's text, and so does this. A
    choice that is the stop token alone is left whole (derender refuses an empty one)."""
    if body.get("include_stop_str_in_output") is True:
        return generated
    choices = []
    for choice in generated.get("choices") or ():
        if isinstance(choice, dict):
            ids = choice.get("token_ids")
            stopped_on_token = choice.get("finish_reason") == "stop" and not isinstance(
                choice.get("stop_reason"), str
            )
            if isinstance(ids, list) and len(ids) > 1 and stopped_on_token:
                choice = {**choice, "token_ids": ids[:-1]}
        choices.append(choice)
    return {**generated, "choices": choices}
