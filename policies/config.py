"""Pydantic configs for a request's `kv_policy`: the base classes every policy family's
config derives from, the budget type, context-share defaults and the error a bad value
raises.

Kept free of HTTP and tensors so both the server (validation, 400s naming the field) and
the engine (building the policy object) depend on it. It imports no other policy module:
the families import it, and the parser that knows them all, `parse_kv_policy`, lives with
the one list of them in `policies/catalog.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    WithJsonSchema,
    field_validator,
)

# The context the class defaults are written for (003's comparison: budget 1024 of 4096).
REFERENCE_CONTEXT = 4096


@dataclass(frozen=True)
class ContextDefault:
    """A parameter's default as a share of the model's context: `fraction` ×
    max_model_len, less the value of parameter `minus` if given, at least 1."""

    fraction: float
    minus: str | None = None

    def value(self, max_model_len: int, config: BaseModel) -> int:
        less = int(getattr(config, self.minus)) if self.minus else 0
        return max(1, round(self.fraction * max_model_len) - less)

    def rule(self) -> str:
        return f"{self.fraction:g} × max_model_len" + (f" − {self.minus}" if self.minus else "")


class KVPolicyError(ValueError):
    """A `kv_policy` value that names no known policy or has bad parameters."""

    def __init__(self, message: str, param: str = "kv_policy") -> None:
        super().__init__(message)
        self.param = param


class KVPolicyConfig(BaseModel):
    """Base of every policy config: unknown keys are an error, not silently ignored,
    so a typo in a budget never runs a request with the wrong cache."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str

    # Parameters whose default follows the model's context, so that a policy named
    # without parameters acts on every model: an absolute default (1024 tokens) is a
    # no-op on a model of 1024 positions. The class defaults are these rules at
    # REFERENCE_CONTEXT (tests/test_policies_config.py checks they agree); the engine
    # applies them to the served model (`for_context`).
    CONTEXT_DEFAULTS: ClassVar[dict[str, ContextDefault]] = {}

    def for_context(self, max_model_len: int) -> KVPolicyConfig:
        """This config with every context-relative parameter the client did not give
        set for a model of `max_model_len` positions. Idempotent: a parameter set here
        counts as given."""
        update = {name: rule.value(max_model_len, self)
                  for name, rule in self.CONTEXT_DEFAULTS.items()
                  if name not in self.model_fields_set}
        return self.model_copy(update=update) if update else self

    @property
    def context_resolved(self) -> bool:
        """Whether every context-relative parameter has a value (`for_context` ran, or
        the client gave them all): what the engine requires of a request's config."""
        return self.CONTEXT_DEFAULTS.keys() <= self.model_fields_set


class FullPolicyConfig(KVPolicyConfig):
    """Keep every token (the default)."""

    name: Literal["full"] = "full"


def _budget(value: object) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("a budget is a token count (integer >= 1) or a ratio of the "
                         "sequence (number in (0, 1])")
    if isinstance(value, int):
        if value < 1:
            raise ValueError("a token budget must be >= 1")
        return value
    if not 0.0 < value <= 1.0:  # also rejects nan and inf
        raise ValueError("a ratio budget must be in (0, 1]; give a token count as an integer")
    return float(value)


# A cache budget: tokens (int >= 1) or a ratio of the sequence (float in (0, 1]), resolved
# by `policies.base.resolve_budget`. One validator (not a Union) so that an error names
# the field itself (`kv_policy.budget`), not a union member.
Budget = Annotated[int | float, PlainValidator(_budget), WithJsonSchema(
    {"anyOf": [{"type": "integer", "minimum": 1},
               {"type": "number", "exclusiveMinimum": 0, "maximum": 1}]})]


def budget_field(default: int | float, what: str = "Tokens kept per layer") -> Any:
    """The `budget` parameter of a policy, described once for every policy listing."""
    return Field(default, description=f"{what}: a token count (integer), or a ratio of "
                 "the sequence (number in (0, 1]).")


HeadsMode = Literal["uniform", "adaptive", "shared"]  # policies/heads.py says what each is


class EvictingPolicyConfig(KVPolicyConfig):
    """Base of every config that evicts: `compact` asks the engine to pack a layer's
    live tokens into as few blocks as they need after each plan (read by the engine);
    `heads` how the kv heads of a layer keep tokens (policies/heads.py)."""

    # Whether the family ranks tokens by a score that `"heads": "adaptive"` can share
    # out among a layer's heads (AdaKV).
    ADAPTIVE: ClassVar[bool] = False

    compact: bool = Field(False, description=(
        "Pack each layer's live tokens into as few blocks as they need after every "
        "plan, so scattered evictions return whole blocks to the pool."))
    heads: HeadsMode | None = Field(None, description=(
        "How a layer's kv heads keep tokens: uniform (each head its own top tokens, "
        "the policy's budget each), adaptive (AdaKV: the layer's budget to the best "
        "scores of all its heads; scoring policies only), shared (one set a layer). "
        "uniform and adaptive need a per-head pool (--kv-layout head); default: "
        "uniform there, shared on a per-layer pool."))

    @field_validator("heads")
    @classmethod
    def _scored(cls, value: HeadsMode | None) -> HeadsMode | None:
        if value == "adaptive" and not cls.ADAPTIVE:
            raise ValueError("adaptive budgets share a layer's budget by score, and this "
                             "policy ranks no tokens by score: use uniform or shared")
        return value

    def heads_mode(self, per_head: bool) -> HeadsMode:
        """`heads`, or the pool's default (uniform over a per-head pool)."""
        return self.heads or ("uniform" if per_head else "shared")
