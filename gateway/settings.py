"""Settings of the gateway, read from ``TRAJGATE_*`` environment variables and CLI flags.

Owns: how the proxy reaches its upstreams, its time limits, its security posture and the
sampling defaults per channel, validated at start-up. Never: holds state. Binding beyond
loopback without an admin token, or with a weak one (``check_admin_token_strength``), is
refused; a sampling default vLLM would refuse is refused here first.
"""

from __future__ import annotations

import ipaddress
import math
import re
import string
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from trajgate.config import ConfigFileSettings


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})
# An admin token beyond loopback: at least this long, this many different characters, and this
# many bits by the size of the character classes it uses (``check_admin_token_strength``).
ADMIN_TOKEN_MIN_CHARS = 16
ADMIN_TOKEN_MIN_DISTINCT = 8
ADMIN_TOKEN_MIN_BITS = 80
_CHARACTER_CLASSES = (string.ascii_lowercase, string.ascii_uppercase, string.digits)


def check_admin_token_strength(token: str) -> None:
    """Raise ``ValueError`` unless ``token`` could be a random secret: no whitespace, at least
    ``ADMIN_TOKEN_MIN_CHARS`` characters, ``ADMIN_TOKEN_MIN_DISTINCT`` different ones, and
    ``len × log2(alphabet) >= ADMIN_TOKEN_MIN_BITS``, where the alphabet is the sum of the
    classes used (26 lower, 26 upper, 10 digits, 33 other printable ASCII characters).

    Examples: ``secrets.token_urlsafe(32)`` (43 characters, about 256 bits) and
    ``openssl rand -hex 16`` (32 characters of 16: the estimate says 165 bits) pass; ``"s3cret"``,
    32 times ``"a"`` and anything with a space fail. A floor against mistakes, not a judge of
    chosen passwords: a long dictionary phrase without spaces passes it.
    """
    problem = None
    if any(c.isspace() for c in token):
        problem = "it contains whitespace"
    elif len(token) < ADMIN_TOKEN_MIN_CHARS:
        problem = f"it has {len(token)} characters, fewer than {ADMIN_TOKEN_MIN_CHARS}"
    elif len(set(token)) < ADMIN_TOKEN_MIN_DISTINCT:
        problem = (
            f"it has {len(set(token))} different characters, fewer than {ADMIN_TOKEN_MIN_DISTINCT}"
        )
    else:
        alphabet = sum(len(c) for c in _CHARACTER_CLASSES if any(ch in c for ch in token))
        alphabet += 33 if any(not any(ch in c for c in _CHARACTER_CLASSES) for ch in token) else 0
        bits = len(token) * math.log2(alphabet)
        if bits < ADMIN_TOKEN_MIN_BITS:
            problem = f"it holds about {bits:.0f} bits, fewer than {ADMIN_TOKEN_MIN_BITS}"
    if problem is not None:
        raise ValueError(
            f"TRAJGATE_ADMIN_TOKEN is too weak for binding beyond loopback: {problem}; "
            "use a random one, e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )


# Sampling fields a default may set, with the values vLLM 0.32 accepts for each (its
# ``SamplingParams`` checks): (integer only, lowest, lowest is allowed, highest or None).
SAMPLING_RANGES: dict[str, tuple[bool, float, bool, float | None]] = {
    "temperature": (False, 0.0, True, None),
    "top_p": (False, 0.0, False, 1.0),
    "top_k": (True, -1, True, None),
    "min_p": (False, 0.0, True, 1.0),
    "max_tokens": (True, 1, True, None),
    "presence_penalty": (False, -2.0, True, 2.0),
    "frequency_penalty": (False, -2.0, True, 2.0),
    "repetition_penalty": (False, 0.0, False, None),
    "seed": (True, -(2**63), True, 2**63 - 1),
}
# What a channel does with sampling fields that narrow the distribution (gateway.proxy.sampling).
SamplingPolicy = Literal["flag", "override", "enforce", "refuse"]
SAMPLING_POLICIES: tuple[str, ...] = get_args(SamplingPolicy)
# vLLM's --logprobs-mode values trajgate knows how to train from (gateway.proxy.sampling).
LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]
LOGPROBS_MODES: tuple[str, ...] = get_args(LogprobsMode)
# vLLM's --tool-strict-level values: when tool calls are sampled under a grammar.
ToolStrictLevel = Literal["auto", "function", "parameter"]
TOOL_STRICT_LEVELS: tuple[str, ...] = get_args(ToolStrictLevel)
# How a full-weight update treats the calls in flight (gateway.upstream.weight_update).
UpdateMode = Literal["keep", "drain"]
UPDATE_MODES: tuple[str, ...] = get_args(UpdateMode)
# The transport under upstream calls to http:// replicas (gateway.upstream.transport, or httpx's).
UpstreamTransportKind = Literal["own", "httpx"]
UPSTREAM_TRANSPORTS: tuple[str, ...] = get_args(UpstreamTransportKind)
# The HTTP/1.1 protocol the gateway serves with (gateway.http_protocol, or uvicorn's own two).
HttpProtocolKind = Literal["own", "httptools", "h11"]
HTTP_PROTOCOLS: tuple[str, ...] = get_args(HttpProtocolKind)
# A channel name as the attribution checks it, or ``*`` for every channel.
_CHANNEL_KEY = re.compile(r"^(\*|[A-Za-z0-9][A-Za-z0-9._:-]{0,99})$")


def check_sampling_value(name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is a value vLLM accepts for sampling field
    ``name`` (one of ``SAMPLING_RANGES``), stating the range expected and the value got."""
    if name not in SAMPLING_RANGES:
        raise ValueError(
            f"unknown sampling field {name!r}; valid: {', '.join(sorted(SAMPLING_RANGES))}"
        )
    integer, lowest, lowest_allowed, highest = SAMPLING_RANGES[name]
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    if (integer and not isinstance(value, int)) or not math.isfinite(value):
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    number = float(value)
    below = number < lowest if lowest_allowed else number <= lowest
    if below or (highest is not None and number > highest):
        low = f"{'>=' if lowest_allowed else '>'} {lowest:g}"
        high = "" if highest is None else f" and <= {highest:g}"
        raise ValueError(f"{name} must be {low}{high}, got {value!r}")


def check_http_url(url: str) -> None:
    """Raise ``ValueError`` unless ``url`` is an absolute http:// or
    https:// URL with a host (and a valid port, if any)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  # raises ValueError on a port that is not a number in range
    except ValueError as exc:
        raise ValueError(f"not a URL ({exc})") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            "expected an http:// or https:// URL with a host, such as http://127.0.0.1:8100"
        )


class GatewaySettings(ConfigFileSettings):
    """How the gateway listens, where it forwards, its limits and its keys."""

    model_config = SettingsConfigDict(env_prefix="TRAJGATE_", extra="ignore")

    upstream_url: str = Field(
        default="http://127.0.0.1:8100",
        description=(
            "Base URL of the vLLM OpenAI server (without /v1; http:// or https:// with a host); "
            "several replicas comma-separated. "
            "Calls go to the least-loaded healthy replica, sticky per trajectory."
        ),
    )
    host: str = Field(default="127.0.0.1", description="Address the gateway binds to.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port the gateway binds to.")
    liveness_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description=(
            "Port of a second GET /health, on the same host, answered by a thread from the event "
            "loop's heartbeat: prompt however busy the loop is (the main port's /health waits "
            "behind every stream), 503 once the loop has not turned for 30 s. Point liveness "
            "probes here. 0: off."
        ),
    )
    workers: int = Field(
        default=1,
        ge=1,
        le=256,
        description=(
            "Worker processes of `trajgate serve` sharing the port (uvicorn's pre-fork; the "
            "kernel spreads connections). Each has its own event loop, pool writer and caches; "
            "all share the pool's database, /metrics merges them and the liveness port answers "
            "for the slowest. Full-weight updates (POST /admin/weight-updates) are refused with "
            "more than one: the pause would hold only the worker that received it."
        ),
    )
    policy_version: int = Field(
        default=0,
        ge=0,
        description="Policy version stamped on steps while no registered version is active.",
    )
    policy_alias: str = Field(
        default="policy",
        description="Model name that resolves to the active policy version's upstream model.",
    )
    policy_refresh_s: float = Field(
        default=2.0,
        gt=0,
        description="Seconds between re-reads of the active policy (several gateway processes).",
    )
    upstream_connect_timeout_s: float = Field(
        default=10.0, gt=0, description="Seconds to open a connection to an upstream replica."
    )
    upstream_first_byte_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description=(
            "Streaming: seconds until the first chunk (queueing and prefill included). "
            "Then 504, upstream aborted, step recorded as upstream_timeout."
        ),
    )
    upstream_between_chunks_timeout_s: float = Field(
        default=60.0, gt=0, description="Streaming: longest silence between two chunks."
    )
    upstream_total_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Seconds one upstream call may take in all (non-streaming: until the answer).",
    )
    upstream_max_attempts: int = Field(
        default=3,
        ge=1,
        description=(
            "Tries per call across replicas on connection errors and 502/503/504 answers. Only "
            "before any byte reached the client, and never after a timeout (tokens may have been "
            "generated)."
        ),
    )
    upstream_retry_backoff_ms: float = Field(
        default=50.0, ge=0, description="Pause before a retry, doubled each attempt."
    )
    upstream_transport: UpstreamTransportKind = Field(
        default="own",
        description=(
            "What carries upstream calls to http:// replicas. 'own': trajgate's HTTP/1.1 "
            "transport (gateway.upstream.transport), about 1 ms of CPU less per unary call and "
            "half the CPU per streamed call (trajgate bench gateway --layers). 'httpx': httpx's "
            "default transport (httpcore and h11), the library it replaces, to rule it out when "
            "something breaks. Both keep every upstream limit (answer bytes, connect, read, "
            "total). https:// replicas always use httpx's."
        ),
    )
    upstream_max_answer_bytes: int = Field(
        default=256 * 1024 * 1024,
        gt=0,
        description=(
            "Most bytes of one upstream answer (a unary body, a whole stream, an error body). "
            "Past it the call ends as upstream_error (502, or the stream's error event), step "
            "recorded and flagged. 256 MiB holds a 131,072-token answer with 20 top logprobs per "
            "token (about 1.2 KiB a token streamed); a unary answer is held whole while it is "
            "read, so this is also the memory one call may take for its body."
        ),
    )
    upstream_max_event_bytes: int = Field(
        default=16 * 1024 * 1024,
        gt=0,
        description=(
            "Most bytes of one server-sent event of an upstream stream (its data lines, or a line "
            "not ended yet). Past it the stream ends as upstream_error. vLLM's largest event is "
            "the first, with the prompt's ids (about 7 bytes a token: 1 MiB for 131,072 tokens); "
            "prompt_logprobs on a long prompt need more."
        ),
    )
    weight_update_drain_timeout_s: float = Field(
        default=30.0,
        ge=0,
        description=(
            "Full-weight update in mode 'drain' (POST /admin/weight-updates): seconds the calls "
            "in flight get to finish sampling while new calls are held; those still sampling "
            "then are aborted (503 aborted_for_weight_update, step kept out of training), so "
            "that no step mixes two policies. Longer: fewer aborted calls, a longer pause for "
            "every agent."
        ),
    )
    weight_update_exchange_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description=(
            "Full-weight update: the overall deadline (seconds) of each pause, prefix cache "
            "reset, label and resume exchange with a replica, however its bytes trickle in (and "
            "of each LoRA list and unload, in publishes and adapter releases); "
            "the reload itself gets upstream_total_timeout_s. Past it the replica has failed "
            "that step (502 weight_update_failed, or a resume retried). Bounds how long calls "
            "are held by a replica that does not answer its pause."
        ),
    )
    weight_update_mode: UpdateMode = Field(
        default="keep",
        description=(
            "Full-weight update: 'keep' pauses vLLM keeping the calls in flight (POST "
            "/pause?mode=keep), reloads, and resumes them on the new weights: nothing aborted, "
            "each streamed or exactly continued step records which tokens each version "
            "sampled (policy_version_spans), a unary call through the chat endpoint sampling "
            "across it is flagged policy_version_split_unknown (not trained on). 'drain' "
            "waits for the calls in "
            "flight up to weight_update_drain_timeout_s and aborts the rest."
        ),
    )
    lora_adapters_kept: int = Field(
        default=2,
        ge=2,
        description=(
            "LoRA update (POST /admin/weight-updates, weight_format 'lora'): how many of this "
            "registry's adapters stay loaded in the replicas, the newest versions (the active "
            "one always stays); older ones are unloaded after each switch. At least 2: a gateway "
            "process that has not refreshed its registry yet still routes the alias to the "
            "previous adapter. More: older versions stay callable by name, and each loaded "
            "adapter's directory must stay on disk (vLLM reloads an evicted adapter from it)."
        ),
    )
    health_check_interval_s: float = Field(
        default=5.0, gt=0, description="Seconds between health checks of every replica."
    )
    resend_window_s: float = Field(
        default=600.0,
        ge=0,
        description=(
            "A request identical to an earlier one of the same trajectory within this window is "
            "linked to it as a re-send (same call id, flag 'resend'); 0 turns detection off."
        ),
    )
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024,
        gt=0,
        description="Largest request body accepted; larger ones get 413 and nothing is recorded.",
    )
    max_metadata_bytes: int = Field(
        default=64 * 1024,
        gt=0,
        le=1 << 30,
        description=(
            "Largest metadata of a trajectory registered with POST /api/trajectories, in bytes "
            "of its compact UTF-8 JSON; larger is a 400 and nothing is registered (every "
            "listing page returns each trajectory's metadata whole)."
        ),
    )
    max_trajectory_tags: int = Field(
        default=256,
        gt=0,
        le=1 << 20,
        description="Most tags POST /api/trajectories accepts for one trajectory; more is a 400.",
    )
    max_tag_chars: int = Field(
        default=128,
        gt=0,
        le=1 << 20,
        description="Longest tag, in characters, POST /api/trajectories accepts; longer is a 400.",
    )
    max_body_bytes_in_flight: int = Field(
        default=64 * 1024 * 1024,
        gt=0,
        description=(
            "Bytes of request bodies and of the upstream answers read whole (unary calls, "
            "error bodies; not streams) one gateway process works on at once, counted as they "
            "are read (a body after the API key check; never the declared length), each held "
            "until its call's answer is complete. A piece that does not fit waits, unread, "
            "oldest request first; requests without a body never wait. Calls that fill it "
            "while each waits for room let the oldest past it, so at most this plus "
            "max_body_bytes plus upstream_max_answer_bytes is held. A call holds its body "
            "about 12 times over while it is processed, an answer about 7 (docs/gateway.md, "
            "'Large bodies'), so this bounds that memory; at least max_body_bytes (one "
            "largest body must fit)."
        ),
    )
    request_head_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description=(
            "Seconds a client has to send a request's head (request line and headers) from its "
            "first byte, or from opening the connection: past it the connection gets 408 "
            "request_timeout and is closed, before any key is checked. Guards against heads "
            "dripped byte by byte (slowloris); real clients send theirs in milliseconds."
        ),
    )
    request_body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description=(
            "Seconds a client has to send a request's whole body once its head arrived: past "
            "it 408 request_timeout, the connection closed, nothing recorded. At the default "
            "body limit (16 MiB) the default asks for at least 0.56 MB/s; raise it for large "
            "bodies over slow links. Time the gateway itself has not read is not counted."
        ),
    )
    http_protocol: HttpProtocolKind = Field(
        default="own",
        description=(
            "The HTTP/1.1 protocol the gateway serves clients with. 'own': uvicorn's httptools "
            "protocol with the head and body deadlines (gateway.http_protocol). 'httptools' or "
            "'h11': uvicorn's own protocols unchanged, to rule ours out when something breaks; "
            "request_body_timeout_s is then kept by the edge guard (408, connection closed), "
            "but request_head_timeout_s is NOT: uvicorn bounds only the idle time between "
            "requests, so a client dripping its head holds a connection as long as it likes."
        ),
    )
    allow_client_kv_transfer_params: bool = Field(
        default=False,
        description=(
            "Accept a chat or completions body that carries kv_transfer_params of its own "
            "(disaggregated serving: a router hands the decode instance the prefill's KV and, "
            "in vLLM 0.32, the prompt's token ids). Such a body chooses the prompt vLLM samples "
            "from, and so the prompt ids its step records (an empty list gave an ok step with "
            "none), so by default it is a 400; the gateway's own exact continuation never needs "
            "a client to send it."
        ),
    )
    max_choices: int = Field(
        default=128,
        ge=1,
        description=(
            "Most choices one call may ask for (n, best_of): each is a sampled sequence and a "
            "step. Larger values get 400 before vLLM is asked."
        ),
    )
    max_output_tokens: int = Field(
        default=262_144,
        ge=1,
        description=(
            "Most tokens one call may ask to sample (max_tokens, max_completion_tokens, "
            "min_tokens; the Responses API's max_output_tokens). vLLM still refuses what "
            "exceeds the model's context; this refuses absurd values (10**30) before it is asked."
        ),
    )
    max_top_logprobs: int = Field(
        default=20,
        ge=0,
        description=(
            "Most alternatives per token a call may ask for (top_logprobs, prompt_logprobs, "
            "completions' integer logprobs); 20 is OpenAI's limit and vLLM's default "
            "max_logprobs."
        ),
    )
    admin_token: str | None = Field(
        default=None,
        description=(
            "Bearer token for /admin and /api. Required when bound beyond loopback, and then "
            f"random-looking: no whitespace, at least {ADMIN_TOKEN_MIN_CHARS} characters, "
            f"{ADMIN_TOKEN_MIN_DISTINCT} different ones, about {ADMIN_TOKEN_MIN_BITS} bits."
        ),
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description=(
            "Host names the gateway answers (the Host header, port ignored), comma-separated; "
            "'*' for any. Always added: localhost, 127.0.0.1, ::1 and the bound host. Bound to "
            "a wildcard address (0.0.0.0, ::) and left empty: any name (the admin token and "
            "API keys guard it). A foreign name gets 400: DNS-rebinding defence."
        ),
    )
    require_api_key: bool | None = Field(
        default=None,
        description=(
            "Require an agent API key (Authorization: Bearer tg-...) on OpenAI routes. "
            "Default: off on loopback, on otherwise."
        ),
    )

    sampling_defaults: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description=(
            "Sampling fields a client omits, per channel, as JSON: "
            '{"*": {"temperature": 1.0, "max_tokens": 4096}, "eval": {"temperature": 0}}. '
            "A call gets the '*' entry overlaid with its channel's (the X-Trajgate-Channel "
            "header or its key's channel, else 'train'); a field the client sent (in any "
            "dialect) is never replaced. Applied to the upstream body, so the step records "
            f"them. Fields: {', '.join(SAMPLING_RANGES)}; a value vLLM would refuse is refused "
            "at start-up."
        ),
    )

    continuation: Literal["exact", "template"] = Field(
        default="exact",
        description=(
            "How a call's prompt is built when its conversation extends an earlier turn of its "
            "trajectory (docs/gateway.md, 'Exact continuation'). 'exact': the turn's own prompt "
            "and sampled ids, then the template's rendering of only the new messages (one "
            "token sequence per trajectory; needs vLLM with --enable-scale-out, else 'template' "
            "with a log line). 'template': the chat template renders the whole conversation on "
            "every call, as a deployment would (a sampled text the template renders otherwise "
            "is a prefix break). Per channel: continuation_channels."
        ),
    )
    continuation_channels: dict[str, Literal["exact", "template"]] = Field(
        default_factory=dict,
        description=(
            'The continuation per channel, as JSON: {"eval": "template"}; a channel not named '
            "gets 'continuation'."
        ),
    )
    continuation_memory_trajectories: int = Field(
        default=4096,
        ge=1,
        description=(
            "Exact continuation: trajectories whose recent turns the gateway keeps in memory "
            "(LRU; ~4 bytes per token of each kept turn plus its messages as JSON). A call of "
            "a trajectory evicted, or served by another gateway replica, is rendered by the "
            "template (a recorded break when the text differs)."
        ),
    )
    continuation_history_memory_mb: int = Field(
        default=256,
        ge=0,
        description=(
            "Exact continuation: memory (MiB, all trajectories together, LRU) for the last "
            "walk over each trajectory's history (its messages' canonical forms and keys), so "
            "that a call that re-sends its history reads only the messages it added (CPU per "
            "call flat in the history); an entry counts its messages' JSON size twice. A "
            "trajectory not held (evicted, another replica's, a history larger than the whole "
            "memory) is walked whole, as with 0, which keeps nothing."
        ),
    )
    gc_young_threshold: int = Field(
        default=10_000,
        ge=0,
        description=(
            "The garbage collector's youngest-generation threshold (allocations of container "
            "objects between collections; the interpreter's default is 700) set while the "
            "gateway runs, after its start-up objects are frozen out of every collection "
            "(gc.freeze). A call at turn 200 of a long session holds lists of ~20k prompt ids "
            "that each young collection walks item by item: at 700 such a collection ran about "
            "once per call at 0.6 to 0.8 ms (docs/gateway.md, 'What a call costs as its history "
            "grows'). Higher: fewer collections, more cyclic garbage held between them. 0 "
            "leaves the interpreter's thresholds and freezes nothing."
        ),
    )
    sampling_policy: dict[str, SamplingPolicy] = Field(
        default_factory=dict,
        description=(
            "What each channel does with sampling fields that narrow the distribution beyond "
            "its temperature (top_p < 1, top_k, min_p, penalties, min_tokens, logit_bias, "
            'allowed_token_ids, bad_words; greedy), as JSON {"*": "flag", "train": "override"}: '
            "'flag' (default) passes them and flags the step 'narrowed'; 'override' resets them "
            "to neutral values; 'enforce' makes the channel's sampling_defaults replace the "
            "client's values; 'refuse' answers 400 (sampling_refused). Tools marked 'strict' "
            "(the OpenAI Agents SDK's default) make vLLM sample tool calls under a grammar "
            "(flagged constrained): 'override' removes 'strict' where it alone does that "
            "(tool_choice auto), 'refuse' refuses it. What was replaced is recorded on the "
            "step (sampling.replaced)."
        ),
    )
    upstream_logprobs_mode: LogprobsMode = Field(
        default="processed_logprobs",
        description=(
            "The --logprobs-mode the vLLM replicas run with (server-wide): "
            "'processed_logprobs' (what `trajgate vllm start` passes) reports logprobs of the "
            "distribution that sampled (temperature, penalties, top-k/top-p masks applied); "
            "'raw_logprobs' (vLLM's own default) reports temperature 1, so steps sampled at "
            "another temperature are flagged raw_logprobs and never trained on. Must match "
            "the server: the step records it and the trainer divides by its temperature."
        ),
    )

    upstream_tool_strict_level: ToolStrictLevel = Field(
        default="auto",
        description=(
            "The --tool-strict-level the vLLM replicas run with (server-wide; 'auto' is vLLM's "
            "default and what `trajgate vllm start` runs; a parser whose own default is "
            "stricter, such as glm47's 'function', counts as that). 'auto': with tool_choice "
            "auto, tool calls are sampled under a grammar only for strict tools or "
            "parallel_tool_calls false; 'function' or 'parameter': every tool call is. Steps "
            "with a tool call sampled under a grammar are flagged constrained, so it must not "
            "be lower than the server's."
        ),
    )

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_allowed_hosts(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @field_validator("upstream_url")
    @classmethod
    def _check_upstream_urls(cls, value: str) -> str:
        urls = [url.strip() for url in value.split(",") if url.strip()]
        if not urls:
            raise ValueError("upstream_url names no replica; expected e.g. http://127.0.0.1:8100")
        for url in urls:
            check_http_url(url)
        return value

    @field_validator("sampling_defaults")
    @classmethod
    def _check_sampling_defaults(
        cls, value: dict[str, dict[str, Any]]
    ) -> dict[str, dict[str, Any]]:
        for channel, fields in value.items():
            if not _CHANNEL_KEY.match(channel):
                raise ValueError(
                    f"sampling_defaults: channel {channel!r} must be '*' or 1-100 of letters, "
                    "digits, '.', '_', ':' or '-' starting with a letter or digit"
                )
            for name, field_value in fields.items():
                try:
                    check_sampling_value(name, field_value)
                except ValueError as exc:
                    raise ValueError(f"sampling_defaults[{channel!r}]: {exc}") from exc
        return value

    @field_validator("sampling_policy")
    @classmethod
    def _check_sampling_policy(cls, value: dict[str, SamplingPolicy]) -> dict[str, SamplingPolicy]:
        for channel in value:
            if not _CHANNEL_KEY.match(channel):
                raise ValueError(
                    f"sampling_policy: channel {channel!r} must be '*' or 1-100 of letters, "
                    "digits, '.', '_', ':' or '-' starting with a letter or digit"
                )
        return value

    @model_validator(mode="after")
    def _largest_body_fits_the_budget(self) -> GatewaySettings:
        if self.max_body_bytes_in_flight < self.max_body_bytes:
            raise ValueError(
                f"max_body_bytes_in_flight ({self.max_body_bytes_in_flight}) must be at least "
                f"max_body_bytes ({self.max_body_bytes}): a body of the largest accepted size "
                "would wait forever"
            )
        return self

    @model_validator(mode="after")
    def _defaults_within_limits(self) -> GatewaySettings:
        limits = self.generation_limits
        for channel, fields in self.sampling_defaults.items():
            for name, value in fields.items():
                if name in limits and value > limits[name][0]:
                    raise ValueError(
                        f"sampling_defaults[{channel!r}]: {name} {value} exceeds "
                        f"{limits[name][1]} {limits[name][0]}"
                    )
        return self

    @property
    def generation_limits(self) -> dict[str, tuple[int, str]]:
        """Upstream (chat or completions) field → (the most a call may ask for, the setting)."""
        choices = (self.max_choices, "max_choices")
        tokens = (self.max_output_tokens, "max_output_tokens")
        alternatives = (self.max_top_logprobs, "max_top_logprobs")
        return {
            "n": choices,
            "best_of": choices,
            "max_tokens": tokens,
            "max_completion_tokens": tokens,
            "min_tokens": tokens,
            "top_logprobs": alternatives,
            "prompt_logprobs": alternatives,
            "logprobs": alternatives,  # completions' integer; chat's boolean is not a count
        }

    def continuation_for(self, channel: str | None) -> Literal["exact", "template"]:
        """The continuation of a call on ``channel`` (None: the pool's default channel)."""
        return self.continuation_channels.get(channel or "train", self.continuation)

    def sampling_policy_for(self, channel: str | None) -> SamplingPolicy:
        """The sampling policy of a call on ``channel`` (None: 'train'): the channel's own,
        else the '*' entry, else 'flag'."""
        return self.sampling_policy.get(channel or "train", self.sampling_policy.get("*", "flag"))

    def sampling_defaults_for(self, channel: str | None) -> dict[str, Any]:
        """The defaults of a call on ``channel`` (None: the pool's default channel 'train'):
        the '*' entry overlaid with the channel's own."""
        return {
            **self.sampling_defaults.get("*", {}),
            **self.sampling_defaults.get(channel or "train", {}),
        }

    @model_validator(mode="after")
    def _refuse_insecure_exposure(self) -> GatewaySettings:
        if not is_loopback(self.host):
            if not self.admin_token:
                raise ValueError(
                    f"binding to {self.host} (not loopback) requires TRAJGATE_ADMIN_TOKEN"
                )
            check_admin_token_strength(self.admin_token)
            if self.require_api_key is False:
                raise ValueError(
                    f"binding to {self.host} (not loopback) requires agent API keys; "
                    "unset TRAJGATE_REQUIRE_API_KEY"
                )
        return self

    @property
    def upstream_urls(self) -> list[str]:
        return [url.strip().rstrip("/") for url in self.upstream_url.split(",") if url.strip()]

    @property
    def api_key_required(self) -> bool:
        if self.require_api_key is None:
            return not is_loopback(self.host)
        return self.require_api_key


def allowed_host_names(settings: GatewaySettings) -> frozenset[str] | None:
    """The lower-case host names the gateway answers (``allowed_hosts``, the loopback names and
    the bound host), or None for any: ``'*'`` listed, or a wildcard bind with none listed."""
    listed = {name.rstrip(".").lower() for name in settings.allowed_hosts}
    if "*" in listed or (settings.host in WILDCARD_HOSTS and not listed):
        return None
    bound = settings.host.strip("[]").lower()
    return frozenset(listed | LOOPBACK_NAMES | ({bound} - WILDCARD_HOSTS))
