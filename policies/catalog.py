"""The one list of every `kv_policy`: name -> (config class, policy class).

Importing this module registers every config with `policies.config`, so
`parse_kv_policy` accepts them all (config.py imports this lazily to avoid a cycle).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies.attention_scores import H2OConfig, H2OPolicy, TOVAConfig, TOVAPolicy
from policies.base import Policy
from policies.config import (
    FullPolicyConfig,
    KVPolicyConfig,
    KVPolicyError,
    parse_kv_policy,
    register_policy_config,
)
from policies.full import FullPolicy
from policies.lazy_eviction import LazyEvictionConfig, LazyEvictionPolicy
from policies.norms import KeyDiffConfig, KeyDiffPolicy, KnormConfig, KnormPolicy
from policies.paged_eviction import PagedEvictionConfig, PagedEvictionPolicy
from policies.pyramid import PyramidConfig, PyramidPolicy
from policies.snapkv import SnapKVConfig, SnapKVPolicy
from policies.streaming import (
    LazyStreamingConfig,
    LazyStreamingPolicy,
    StreamingConfig,
    StreamingPolicy,
)

CATALOG: dict[str, tuple[type[KVPolicyConfig], type]] = {
    "full": (FullPolicyConfig, FullPolicy),
    "streaming": (StreamingConfig, StreamingPolicy),
    "lazy_streaming": (LazyStreamingConfig, LazyStreamingPolicy),
    "paged_eviction": (PagedEvictionConfig, PagedEvictionPolicy),
    "knorm": (KnormConfig, KnormPolicy),
    "keydiff": (KeyDiffConfig, KeyDiffPolicy),
    "h2o": (H2OConfig, H2OPolicy),
    "tova": (TOVAConfig, TOVAPolicy),
    "snapkv": (SnapKVConfig, SnapKVPolicy),
    "pyramid": (PyramidConfig, PyramidPolicy),
    "lazy_eviction": (LazyEvictionConfig, LazyEvictionPolicy),
}

for _name, (_config_cls, _) in CATALOG.items():
    register_policy_config(_name, _config_cls)


def build_policy(config: KVPolicyConfig | str | Mapping[str, Any] | None) -> Policy:
    """A fresh policy object (own state) for one request. Accepts a validated config or
    anything `parse_kv_policy` accepts."""
    cfg = parse_kv_policy(config)
    entry = CATALOG.get(cfg.name)
    if entry is None or not isinstance(cfg, entry[0]):
        raise KVPolicyError(f"no policy implements config {type(cfg).__name__}")
    return entry[1](cfg)
