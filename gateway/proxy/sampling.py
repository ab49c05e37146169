"""The distribution a call samples from: its effective sampling parameters and the channel's policy.

Owns: what vLLM samples with once the client's fields and the channel's defaults are in the
upstream body (``effective``: vLLM's own default for every field left out), which of them
narrow the distribution beyond its temperature (``narrowing``), the per-channel sampling
policy that lets an operator pass, override, enforce or refuse them (``apply_policy``), and
the record a step keeps of all that (``steps.sampling``, read by batches and the trainer).

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

Never: reads the client's dialect (the upstream body is a chat or completions body in every
dialect) or talks to vLLM.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gateway.dialects import Dialect, Prepared
from gateway.errors import InvalidRequestError
from gateway.settings import LOGPROBS_MODES, SAMPLING_POLICIES

NARROWED = "narrowed"  # quality flag: the distribution was narrowed beyond its temperature
RAW_LOGPROBS = "raw_logprobs"  # integrity flag: logprobs at temperature 1, sampled at another

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


def _top_k_off(name: str, fields: dict[str, Any]) -> bool:
    return name == "top_k" and fields["top_k"] <= 0


def apply_policy(
    dialect: Dialect,
    prepared: Prepared,
    policy: str,
    defaults: dict[str, Any],
) -> tuple[Prepared, dict[str, Any]]:
    """``prepared`` under the channel's sampling ``policy``, and the fields it replaced (upstream
    field → the value the body held, None where the body left it out).

    ``flag``: as it is (narrowed steps are flagged). ``override``: every narrowing field but a
    greedy temperature set to its neutral value (masks and biases removed). ``enforce``: the
    channel's ``defaults`` replace the body's values, not only fill the fields it left out.
    ``refuse``: ``InvalidRequestError`` (400, ``sampling_refused``) naming the first narrowing
    field in the client's own name; nothing reaches vLLM.
    """
    upstream = prepared.upstream_body
    if policy == "flag":
        return prepared, {}
    if policy == "refuse":
        narrowed = narrowing(upstream)
        if not narrowed:
            return prepared, {}
        name = dialect.client_field(narrowed[0])
        raise InvalidRequestError(
            f"'{name}' {upstream.get(narrowed[0])!r} narrows the sampling distribution, which "
            "this channel's sampling policy refuses (TRAJGATE_SAMPLING_POLICY 'refuse'): the "
            "trainer could not reproduce it. Leave it out, or use a channel whose policy is "
            "'flag', 'override' or 'enforce'.",
            param=name,
            code="sampling_refused",
        )
    if policy == "override":
        replaced = {name: upstream.get(name) for name in narrowing(upstream) if name in NEUTRAL}
        replaced.pop("temperature", None)  # greedy is a choice of temperature, kept (flagged)
        masks = {name: upstream[name] for name in _MASKS if upstream.get(name)}
        body = {**upstream, **{name: NEUTRAL[name] for name in replaced}}
        for name in masks:
            del body[name]
        changed = {**replaced, **masks}
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


def sampling_record(
    upstream_body: dict[str, Any], logprobs_mode: str, policy: str, replaced: dict[str, Any]
) -> dict[str, Any]:
    """What a step keeps (``steps.sampling``): the effective fields, ``narrowed_by`` (see
    ``narrowing``), the server's ``logprobs_mode``, ``logprobs_temperature`` (the temperature
    its stored logprobs are at, which the trainer divides its logits by), the ``policy`` and
    the fields it ``replaced`` (their values in the body before)."""
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
        "logprobs_mode": logprobs_mode,
        "logprobs_temperature": at,
        "policy": policy,
        "replaced": replaced,
    }


def sampling_flags(record: dict[str, Any]) -> list[str]:
    """``narrowed`` and ``raw_logprobs`` as they apply to a step's ``sampling_record``."""
    flags = [NARROWED] if record["narrowed_by"] else []
    sampled_at = float(record["temperature"])
    if sampled_at >= GREEDY_BELOW and record["logprobs_temperature"] != sampled_at:
        flags.append(RAW_LOGPROBS)
    return flags
