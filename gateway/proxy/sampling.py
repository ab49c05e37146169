"""The distribution a call samples from: its effective sampling parameters and the channel's policy.

Owns: what vLLM samples with once the client's fields and the channel's defaults are in the
upstream body (``effective``: vLLM's own default for every field left out), which of them
narrow the distribution beyond its temperature (``narrowing``), which put the call under a
grammar (``constrained_by``), the per-channel sampling policy that
lets an operator pass, override, enforce or refuse them (``apply_policy``), the record a step
keeps of all that (``steps.sampling``, read by batches and the trainer) and the flags its
steps get from it (``sampling_flags``).

Why: a token's behaviour logprob must be the one of the distribution that drew it (DESIGN.md,
invariant 9). vLLM's ``--logprobs-mode`` decides which one it reports (vLLM 0.32,
``v1/sample/sampler.py``): ``raw_logprobs`` (its default) is log-softmax of the model's logits,
temperature 1, before everything below; ``processed_logprobs`` is log-softmax after, in this
order, allowed-token and bad-word masks, min-tokens and logit-bias, the three penalties, the
temperature (a greedy row keeps temperature 1), min-p and the top-k / top-p masks (masked
tokens at ``-inf``). A grammar's bitmask is applied before the sampler, so both modes see it
(``constrained``). With processed logprobs a row sampled at temperature ``t`` and nothing else
stores ``log_softmax(logits / t)``, which the trainer recomputes exactly by dividing its logits
by ``t`` (``logprobs_temperature``). What narrows the distribution further (top-p < 1, top-k,
min-p, penalties, greedy, biases, masks) is stored exactly too, but the trainer's full softmax
is not that distribution: such steps are flagged ``narrowed`` (a quality fact, like
``constrained``, for curation), unless the channel's policy overrides or refuses the fields.
Raw logprobs of a row sampled at ``t != 1`` are not of its distribution and cannot be made so:
flagged ``raw_logprobs``, an integrity flag (never trained on).

vLLM 0.32 samples a call under a grammar (read for this: ``parser/abstract_parser.py``
``Parser._apply_structural_tag``, ``tool_parsers/structural_tag_registry.py``
``resolve_tool_strictness``, ``tool_parsers/utils.py`` ``get_json_schema_from_tools``,
``entrypoints/openai/chat_completion/protocol.py``) for ``response_format`` JSON,
``structured_outputs`` / ``guided_*``, ``tool_choice`` ``required`` or a named function, and,
with ``tool_choice`` ``auto`` (vLLM's default when tools are offered; an explicit ``null`` gets
none), a structural tag when any tool is ``strict``, when ``parallel_tool_calls`` is false, or
when the server's ``--tool-strict-level`` is ``function`` or ``parameter``. ``tool_choice``
``none`` or no tools: no grammar. A structural tag under ``auto`` masks the text before any
call too: an answer without a call, offered one strict tool, stored logprobs 0.025 nats from
the same seeded sample without ``strict`` (tests/test_strict_tools.py), so every choice of such
a call is ``constrained``. The Responses and Messages dialects send the chat body these rules
read (``strict`` and ``disable_parallel_tool_use`` carried over).

Never: reads the client's dialect (the upstream body is a chat or completions body in every
dialect) or talks to vLLM.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gateway.dialects import Dialect, Prepared
from gateway.errors import InvalidRequestError
from gateway.settings import (
    LOGPROBS_MODES,
    SAMPLING_POLICIES,
    TOOL_STRICT_LEVELS,
    GatewaySettings,
)

NARROWED = "narrowed"  # quality flag: the distribution was narrowed beyond its temperature
RAW_LOGPROBS = "raw_logprobs"  # integrity flag: logprobs at temperature 1, sampled at another
# Quality flag: sampled under a grammar. vLLM reports logprobs of the masked distribution (a
# forced token has logprob 0), not of the policy the trainer computes, so the importance ratio
# against them is meaningless. Curation usually keeps such steps out.
CONSTRAINED = "constrained"
# Body fields that put the answer under a grammar whenever they are set.
_STRUCTURED_FIELDS = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
# How vLLM's request models (pydantic, lax) read a boolean sent as a number or a string.
_TRUE = frozenset({"1", "true", "t", "yes", "y", "on"})
_FALSE = frozenset({"0", "false", "f", "no", "n", "off"})

# vLLM's sampling below this temperature is greedy (``_SAMPLING_EPS``) and its logprobs then
# stay at temperature 1 in both modes.
GREEDY_BELOW = 1e-5
# What vLLM 0.32 uses for a field the body leaves out (``SamplingParams``' defaults; a model's
# generation_config.json can change them: docs/deployment.md), and the value that does nothing.
NEUTRAL: dict[str, float] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
}
# Fields that narrow the distribution when present and non-empty (masks and biases).
_MASKS = ("logit_bias", "allowed_token_ids", "bad_words")


def effective(upstream_body: dict[str, Any]) -> dict[str, Any]:
    """The numeric sampling fields vLLM samples ``upstream_body`` with: the body's value, else
    vLLM's default (``NEUTRAL``); a top-k of -1 is vLLM's 0 (off)."""
    fields: dict[str, Any] = {}
    for name, default in NEUTRAL.items():
        value = upstream_body.get(name)
        fields[name] = default if value is None or isinstance(value, bool) else value
    if fields["top_k"] == -1:
        fields["top_k"] = 0
    return fields


def narrowing(upstream_body: dict[str, Any]) -> list[str]:
    """The fields of ``upstream_body`` that narrow its distribution beyond the temperature
    (``temperature`` itself when it is greedy), in ``NEUTRAL``'s order then the masks."""
    fields = effective(upstream_body)
    narrowed = [
        name
        for name, neutral in NEUTRAL.items()
        if name != "temperature" and fields[name] != neutral and not _top_k_off(name, fields)
    ]
    if fields["temperature"] < GREEDY_BELOW:
        narrowed.insert(0, "temperature")
    return narrowed + [name for name in _MASKS if upstream_body.get(name)]


class SamplingSettingsError(ValueError):
    """A channel's sampling policy refuses what its own sampling defaults would ask for."""


def check_defaults_against_policy(settings: GatewaySettings) -> None:
    """Refuse at start a channel whose policy is ``refuse`` and whose ``sampling_defaults``
    narrow the distribution: the defaults fill the fields a call leaves out, so every call
    that left them out would be refused with a message blaming the client.

    Raises:
        SamplingSettingsError: naming the channel and the narrowing default fields.
    """
    channels = {"train", *settings.sampling_policy, *settings.sampling_defaults}
    for channel in sorted(channels):
        if settings.sampling_policy_for(channel) != "refuse":
            continue
        narrowed = narrowing(dict(settings.sampling_defaults_for(channel)))
        if narrowed:
            raise SamplingSettingsError(
                f"channel {channel!r}: its sampling policy is 'refuse' but its sampling "
                f"defaults narrow the distribution ({', '.join(narrowed)}), so every call "
                "leaving them out would be refused: drop those defaults "
                "(TRAJGATE_SAMPLING_DEFAULTS) or give the channel another policy "
                "(TRAJGATE_SAMPLING_POLICY)"
            )


def _top_k_off(name: str, fields: dict[str, Any]) -> bool:
    return name == "top_k" and fields["top_k"] <= 0


def constrained_by(upstream_body: dict[str, Any], tool_strict_level: str) -> list[str]:
    """What puts ``upstream_body`` under a grammar in vLLM (empty: nothing), as upstream field
    names in body order: ``tools.strict`` for strict tools, ``tool_strict_level`` for the
    server's floor (``tool_strict_level``: the replicas' ``--tool-strict-level``). Rules in the
    module docstring. Raises ``ValueError`` for an unknown level.

    Errs towards a grammar where vLLM has none: a tool parser without structural tags, or
    ``VLLM_ENFORCE_STRICT_TOOL_CALLING=0``, samples strict tools under ``auto`` free.
    """
    if tool_strict_level not in TOOL_STRICT_LEVELS:
        raise ValueError(
            f"tool strict level must be one of {TOOL_STRICT_LEVELS}, got {tool_strict_level!r}"
        )
    causes: list[str] = []
    tools = upstream_body.get("tools")
    # vLLM sets ``auto`` only where the key is absent; an explicit null stays none.
    tool_choice = upstream_body.get("tool_choice", "auto")
    if tools and isinstance(tools, list):
        if tool_choice == "required" or isinstance(tool_choice, dict):
            causes.append("tool_choice")
        elif tool_choice == "auto":
            if any(_lax_bool(_function_of(tool).get("strict")) is True for tool in tools):
                causes.append("tools.strict")
            if _lax_bool(upstream_body.get("parallel_tool_calls")) is False:
                causes.append("parallel_tool_calls")
            if tool_strict_level != "auto":
                causes.append("tool_strict_level")
    response_format = upstream_body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        causes.append("response_format")
    return causes + [name for name in _STRUCTURED_FIELDS if upstream_body.get(name) is not None]


def _function_of(tool: Any) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    return function if isinstance(function, dict) else {}


def _lax_bool(value: Any) -> bool | None:
    """``value`` as vLLM's pydantic models read a boolean (None: absent or not a boolean)."""
    if isinstance(value, bool):
        return value
    if type(value) in (int, float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        lowered = value.strip().lower()
        return True if lowered in _TRUE else False if lowered in _FALSE else None
    return None


def _strict_tools(upstream_body: dict[str, Any]) -> dict[str, Any]:
    """Tool name → its ``strict`` value, for the tools of ``upstream_body`` that carry one."""
    return {
        str(_function_of(tool).get("name")): _function_of(tool)["strict"]
        for tool in upstream_body.get("tools") or []
        if _function_of(tool).get("strict") is not None
    }


def _without_strict(upstream_body: dict[str, Any]) -> dict[str, Any]:
    tools = [
        {**tool, "function": {k: v for k, v in _function_of(tool).items() if k != "strict"}}
        if "strict" in _function_of(tool)
        else tool
        for tool in upstream_body["tools"]
    ]
    return {**upstream_body, "tools": tools}


def apply_policy(
    dialect: Dialect,
    prepared: Prepared,
    policy: str,
    defaults: dict[str, Any],
    tool_strict_level: str,
) -> tuple[Prepared, dict[str, Any]]:
    """``prepared`` under the channel's sampling ``policy``, and the fields it replaced (upstream
    field → the value the body held, None where the body left it out; ``tools.strict``: tool
    name → its ``strict``).

    ``flag``: as it is (narrowed and constrained steps are flagged). ``override``: every
    narrowing field but a greedy temperature set to its neutral value (masks and biases
    removed), and ``strict`` removed from every tool where it alone puts the call under a
    grammar (``tool_choice`` ``auto``; a forced call is under one anyway, and ``strict`` keeps
    its arguments valid). ``enforce``: the channel's ``defaults`` replace the body's values, not
    only fill the fields it left out. ``refuse``: ``InvalidRequestError`` (400,
    ``sampling_refused``) naming the first narrowing field in the client's own name, or
    ``tools`` where strict tools alone would put the call under a grammar; nothing reaches
    vLLM. ``tool_strict_level``: the replicas' ``--tool-strict-level`` (see ``constrained_by``).
    """
    upstream = prepared.upstream_body
    if policy == "flag":
        return prepared, {}
    if policy == "refuse":
        narrowed = narrowing(upstream)
        if narrowed:
            name = dialect.client_field(narrowed[0])
            raise InvalidRequestError(
                f"'{name}' {upstream.get(narrowed[0])!r} narrows the sampling distribution, "
                "which this channel's sampling policy refuses (TRAJGATE_SAMPLING_POLICY "
                "'refuse'): the trainer could not reproduce it. Leave it out, or use a channel "
                "whose policy is 'flag', 'override' or 'enforce'.",
                param=name,
                code="sampling_refused",
            )
        if _strict_alone(upstream, tool_strict_level):
            name = dialect.client_field("tools")
            strict = ", ".join(sorted(_strict_tools(upstream)))
            raise InvalidRequestError(
                f"'{name}' holds strict tools ({strict}): vLLM would sample the answer under "
                "a grammar, whose logprobs the trainer could not reproduce, which this "
                "channel's sampling policy refuses (TRAJGATE_SAMPLING_POLICY 'refuse'). Leave "
                "'strict' out, or use a channel whose policy is 'flag', 'override' or "
                "'enforce'.",
                param=name,
                code="sampling_refused",
            )
        return prepared, {}
    if policy == "override":
        replaced = {name: upstream.get(name) for name in narrowing(upstream) if name in NEUTRAL}
        replaced.pop("temperature", None)  # greedy is a choice of temperature, kept (flagged)
        masks = {name: upstream[name] for name in _MASKS if upstream.get(name)}
        body = {**upstream, **{name: NEUTRAL[name] for name in replaced}}
        for name in masks:
            del body[name]
        changed = {**replaced, **masks}
        if _strict_alone(upstream, tool_strict_level):
            changed["tools.strict"] = _strict_tools(upstream)
            body = _without_strict(body)
    elif policy == "enforce":
        changed = {
            name: upstream.get(name)
            for name, value in defaults.items()
            if upstream.get(name) is not None and upstream.get(name) != value
        }
        body = {**upstream, **defaults}
    else:
        raise ValueError(f"sampling policy must be one of {SAMPLING_POLICIES}, got {policy!r}")
    if not changed:
        return prepared, {}
    return replace(prepared, upstream_body=body), changed


def _strict_alone(upstream_body: dict[str, Any], tool_strict_level: str) -> bool:
    """Whether strict tools are all that puts ``upstream_body`` under a grammar: without
    ``strict`` it would be sampled free."""
    return constrained_by(upstream_body, tool_strict_level) == ["tools.strict"]


def sampling_record(
    upstream_body: dict[str, Any],
    logprobs_mode: str,
    policy: str,
    replaced: dict[str, Any],
    *,
    tool_strict_level: str,
) -> dict[str, Any]:
    """What a step keeps (``steps.sampling``): the effective fields, ``narrowed_by`` (see
    ``narrowing``), ``constrained_by`` (see ``constrained_by``; ``tool_strict_level`` is the
    replicas' ``--tool-strict-level``), the server's ``logprobs_mode``,
    ``logprobs_temperature`` (the temperature its stored logprobs are at, which the trainer
    divides its logits by), the ``policy`` and the fields it ``replaced`` (their values in the
    body before)."""
    fields = effective(upstream_body)
    temperature = float(fields["temperature"])
    if logprobs_mode == "raw_logprobs" or temperature < GREEDY_BELOW:
        at = 1.0
    elif logprobs_mode == "processed_logprobs":
        at = temperature
    else:
        raise ValueError(f"logprobs mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
    return {
        **fields,
        "narrowed_by": narrowing(upstream_body),
        "constrained_by": constrained_by(upstream_body, tool_strict_level),
        "logprobs_mode": logprobs_mode,
        "logprobs_temperature": at,
        "policy": policy,
        "replaced": replaced,
    }


def sampling_flags(record: dict[str, Any]) -> list[str]:
    """``constrained``, ``narrowed`` and ``raw_logprobs`` as they apply to a step's
    ``sampling_record``."""
    flags = [CONSTRAINED] if record["constrained_by"] else []
    if record["narrowed_by"]:
        flags.append(NARROWED)
    sampled_at = float(record["temperature"])
    if sampled_at >= GREEDY_BELOW and record["logprobs_temperature"] != sampled_at:
        flags.append(RAW_LOGPROBS)
    return flags
