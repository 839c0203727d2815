"""Pydantic configs for a request's `kv_policy`, and the one parser the server calls.

Kept free of HTTP and tensors so both the server (validation, 400s naming the field) and
the engine (building the policy object) depend on it. A policy family registers its
config class here; `parse_kv_policy` then accepts it by name or as an object.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError


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


class FullPolicyConfig(KVPolicyConfig):
    """Keep every token (the default)."""

    name: Literal["full"] = "full"


POLICY_CONFIGS: dict[str, type[KVPolicyConfig]] = {"full": FullPolicyConfig}


def register_policy_config(name: str, cls: type[KVPolicyConfig]) -> None:
    POLICY_CONFIGS[name] = cls


def known_policies() -> list[str]:
    return sorted(POLICY_CONFIGS)


def _unknown(name: object, param: str) -> KVPolicyError:
    return KVPolicyError(
        f"unknown kv_policy {name!r}; known policies: {', '.join(known_policies())}", param)


def parse_kv_policy(value: str | Mapping[str, Any] | KVPolicyConfig | None) -> KVPolicyConfig:
    """`None`, a policy name, or `{"name": ..., params...}` -> a validated config.

    Raises KVPolicyError whose `param` names the offending field (e.g.
    `kv_policy.window`), so the server can answer 400 with OpenAI's `param`.
    """
    if value is None:
        return FullPolicyConfig()
    if isinstance(value, KVPolicyConfig):
        return value
    if isinstance(value, str):
        cls = POLICY_CONFIGS.get(value)
        if cls is None:
            raise _unknown(value, "kv_policy")
        return cls(name=value)
    if not isinstance(value, Mapping):
        raise KVPolicyError("kv_policy must be a policy name or an object with a 'name'")
    name = value.get("name")
    if not isinstance(name, str):
        raise KVPolicyError("kv_policy object needs a string 'name'", "kv_policy.name")
    cls = POLICY_CONFIGS.get(name)
    if cls is None:
        raise _unknown(name, "kv_policy.name")
    try:
        return cls.model_validate(dict(value))
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise KVPolicyError(f"kv_policy ({name}): {loc}: {err['msg']}",
                            f"kv_policy.{loc}" if loc else "kv_policy") from None
