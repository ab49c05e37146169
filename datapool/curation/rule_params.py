"""Curation rule params: one typed model per rule kind, checked on create and on every load.

Owns: what each rule kind's ``params`` may hold (names, types, bounds) and the one error a bad
value becomes (``InvalidPoolRequestError`` naming ``params.<field>``, expected vs. got). Strict
types: a string is never read as a number (``"abc"`` for ``min``), a boolean never as a number
(``true`` for ``min``), a number never as a name (``5`` for ``reward_name``); an unknown param
name is refused, never ignored. Never: evaluates a rule (``datapool.curation.rules``) or imports a
predicate (only its ``pkg.mod:fn`` shape is checked here).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)

from datapool.errors import InvalidPoolRequestError

Target = Literal["step", "trajectory"]
# A step flag's name (``steps.flags``): open-ended (outcomes, abort reasons, "constrained").
StepFlag = Annotated[str, StringConstraints(min_length=1, max_length=100, pattern=r"^[\w.:-]+$")]


class RuleParams(BaseModel):
    """Base of every kind's params: unknown names and loose types are refused."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class IntegrityParams(RuleParams):
    flags: list[StepFlag] | None = Field(
        default=None, min_length=1, description="Default: datapool.curation.rules.INTEGRITY_FLAGS."
    )
    target: Target = "step"


class PrefixBreakParams(RuleParams):
    pass


class TruncatedParams(RuleParams):
    target: Target = "step"


class EmptyParams(RuleParams):
    pass


class DegenerateGroupParams(RuleParams):
    reward_name: str = Field(default="final", min_length=1)
    eps: float = Field(default=1e-6, ge=0, allow_inf_nan=False)
    success_reward: float = Field(default=1.0, allow_inf_nan=False)
    fail_reward: float = Field(default=0.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _fail_below_success(self) -> DegenerateGroupParams:
        if self.fail_reward >= self.success_reward:
            raise ValueError(
                f"fail_reward must be below success_reward, got fail_reward "
                f"{self.fail_reward} and success_reward {self.success_reward}"
            )
        return self


class StaleParams(RuleParams):
    max_versions_behind: int = Field(ge=0, description="K: steps more than K versions behind.")
    current_version: int | None = Field(default=None, ge=0)
    target: Target = "step"


class LengthParams(RuleParams):
    max_prompt_tokens: int | None = Field(default=None, ge=1)
    max_response_tokens: int | None = Field(default=None, ge=1)
    max_total_tokens: int | None = Field(default=None, ge=1)
    max_steps: int | None = Field(default=None, ge=1)
    target: Target = "step"

    @model_validator(mode="after")
    def _one_limit(self) -> LengthParams:
        limits = (
            self.max_prompt_tokens,
            self.max_response_tokens,
            self.max_total_tokens,
            self.max_steps,
        )
        if all(v is None for v in limits):
            raise ValueError(
                "a 'length' rule needs at least one of max_prompt_tokens, "
                "max_response_tokens, max_total_tokens, max_steps"
            )
        return self


class DuplicatePromptParams(RuleParams):
    pass


class RewardThresholdParams(RuleParams):
    name: str = Field(default="final", min_length=1)
    min: float | None = Field(default=None, allow_inf_nan=False)
    max: float | None = Field(default=None, allow_inf_nan=False)

    @model_validator(mode="after")
    def _bounds(self) -> RewardThresholdParams:
        if self.min is None and self.max is None:
            raise ValueError("a 'reward_threshold' rule needs params.min or params.max")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min must not exceed max, got min {self.min} and max {self.max}")
        return self


class PredicateParams(RuleParams):
    function: str = Field(
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$",
        description="'pkg.mod:fn', called as fn(RewardContext).",
    )


PARAMS_MODELS: dict[str, type[RuleParams]] = {
    "integrity": IntegrityParams,
    "prefix_break": PrefixBreakParams,
    "truncated": TruncatedParams,
    "empty": EmptyParams,
    "degenerate_group": DegenerateGroupParams,
    "stale": StaleParams,
    "length": LengthParams,
    "duplicate_prompt": DuplicatePromptParams,
    "reward_threshold": RewardThresholdParams,
    "predicate": PredicateParams,
}


def parse_params(kind: str, params: Any) -> RuleParams:
    """``params`` of a rule of ``kind`` as its typed model.

    Raises ``InvalidPoolRequestError`` (``param`` = ``params.<field>``, or ``params`` for a
    problem of the whole object, ``kind`` for an unknown kind) stating expected vs. got.
    """
    model = PARAMS_MODELS.get(kind)
    if model is None:
        raise InvalidPoolRequestError(
            f"kind must be one of {tuple(PARAMS_MODELS)}, got {kind!r}", param="kind"
        )
    if not isinstance(params, dict):
        raise InvalidPoolRequestError(
            f"params must be an object, got {type(params).__name__}", param="params"
        )
    try:
        return model.model_validate(params)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in error["loc"])
        param = f"params.{where}" if where else "params"
        if error["type"] == "extra_forbidden":
            message = (
                f"rule kind {kind!r} takes params {sorted(model.model_fields)}, "
                f"got unknown {where!r}"
            )
        else:
            got = "" if error["type"] == "missing" else f" (got {error['input']!r})"
            message = f"{param}: {error['msg']}{got}"
        raise InvalidPoolRequestError(message, param=param) from exc
