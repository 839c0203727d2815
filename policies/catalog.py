"""Every kv_policy by name (placeholder until the policy modules land: `full` only)."""

from __future__ import annotations

from policies.config import KVPolicyConfig


def build_policy(config: KVPolicyConfig) -> object:
    raise ValueError(f"kv_policy {config.name!r} has no implementation yet")
