"""The one list of every `kv_policy`: name -> (config class, policy class), and the
parser that accepts them all.

`parse_kv_policy` is here, not in `policies/config.py`, because it must know every
family's config class: the families import config.py for their base classes, so a parser
there would import them back (an import cycle).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from policies.attention_scores import H2OConfig, H2OPolicy, TOVAConfig, TOVAPolicy
from policies.base import Policy
from policies.config import FullPolicyConfig, KVPolicyConfig, KVPolicyError
from policies.duo_attention import DuoConfig, DuoPolicy
from policies.expected_attention import ExpectedAttentionConfig, ExpectedAttentionPolicy
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
    "duo": (DuoConfig, DuoPolicy),
    "expected_attention": (ExpectedAttentionConfig, ExpectedAttentionPolicy),
}

# What each keeps, in a user's words (GET /v1/kv_policies; docs/policies.md has the rest).
SUMMARIES: dict[str, str] = {
    "full": "Keeps every token (no eviction).",
    "streaming": "StreamingLLM: the first `sink` tokens plus the most recent `window`.",
    "lazy_streaming": "StreamingLLM pruned lazily: only once the overflow reaches "
                      "`compress_every`, at most `max_drop` tokens at a time.",
    "paged_eviction": "PagedEviction: drops the tokens, then whole blocks, with the lowest "
                      "‖V‖/‖K‖, down to `budget`.",
    "knorm": "Keeps the `budget` tokens with the lowest key norm.",
    "keydiff": "Keeps the `budget` tokens whose keys differ most from the mean key.",
    "h2o": "Heavy hitters: the `budget` tokens with the most cumulative attention, the "
           "recent `window` included.",
    "tova": "Keeps the `budget` tokens the current query attends to most.",
    "snapkv": "Compresses the prompt once, to `budget` tokens, by the attention of its "
              "last `obs_window` queries.",
    "pyramid": "Per-layer budgets in a pyramid (more below, fewer above) averaging "
               "`budget`, by observation-window attention.",
    "lazy_eviction": "Every `window` decode steps, keeps the recent `window` and the "
                     "tokens whose attention recurs, down to `budget`.",
    "duo": "DuoAttention: retrieval heads keep every token, streaming heads (the "
           "`streaming_ratio` the model's head roles need least) `sink` + `window`. Needs "
           "--kv-layout head.",
    "expected_attention": "Compresses the prompt once, to `budget` tokens, by the attention "
                          "the next `n_future_positions` queries are expected to pay each "
                          "token (from the prompt's query statistics), times ‖V‖.",
}



def known_policies() -> list[str]:
    return sorted(CATALOG)


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
        entry = CATALOG.get(value)
        if entry is None:
            raise _unknown(value, "kv_policy")
        return entry[0](name=value)
    if not isinstance(value, Mapping):
        raise KVPolicyError("kv_policy must be a policy name or an object with a 'name'")
    name = value.get("name")
    if not isinstance(name, str):
        raise KVPolicyError("kv_policy object needs a string 'name'", "kv_policy.name")
    entry = CATALOG.get(name)
    if entry is None:
        raise _unknown(name, "kv_policy.name")
    try:
        return entry[0].model_validate(dict(value))
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise KVPolicyError(f"kv_policy ({name}): {loc}: {err['msg']}",
                            f"kv_policy.{loc}" if loc else "kv_policy") from None


def describe_policies(max_model_len: int | None = None) -> list[dict[str, Any]]:
    """Every policy with its parameters — JSON-schema type and bounds, meaning, and the
    default a request gets on a model of `max_model_len` positions (the class default
    when None) with the rule behind it — for `GET /v1/kv_policies` and docs/api.md, so a
    user can see what `"kv_policy": "h2o"` will keep before sending it."""
    out = []
    for name, (config_cls, policy_cls) in CATALOG.items():
        config = config_cls()
        if max_model_len is not None:
            config = config.for_context(max_model_len)
        props = config_cls.model_json_schema()["properties"]
        params = {}
        for field, schema in props.items():
            if field == "name":
                continue
            rule = config_cls.CONTEXT_DEFAULTS.get(field)
            params[field] = {**{k: v for k, v in schema.items() if k != "title"},
                             "default": getattr(config, field),
                             "default_rule": rule.rule() if rule else None}
        paper = (policy_cls.__doc__ or "").strip().split("\n\n")[0]
        out.append({"name": name, "description": SUMMARIES[name],
                    "reference": " ".join(paper.split()), "parameters": params})
    return out


def build_policy(config: KVPolicyConfig | str | Mapping[str, Any] | None) -> Policy:
    """A fresh policy object (own state) for one request. Accepts a validated config or
    anything `parse_kv_policy` accepts."""
    cfg = parse_kv_policy(config)
    entry = CATALOG.get(cfg.name)
    if entry is None or not isinstance(cfg, entry[0]):
        raise KVPolicyError(f"no policy implements config {type(cfg).__name__}")
    return entry[1](cfg)
