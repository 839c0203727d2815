"""kv_policy configs: every policy is known to `parse_kv_policy`, by name or object, with
paper defaults, validated ranges, and errors that name the offending field."""

import pytest

from policies.base import resolve_budget
from policies.catalog import CATALOG, build_policy, known_policies, parse_kv_policy
from policies.config import KVPolicyError
from policies.full import FullPolicy
from tests.policy_views import LayerView, arange, run_step, view

ALL = ["full", "streaming", "lazy_streaming", "paged_eviction", "knorm", "keydiff", "h2o",
       "tova", "snapkv", "pyramid", "lazy_eviction", "duo", "expected_attention"]


def test_catalog_lists_every_policy_and_parser_knows_them():
    assert sorted(CATALOG) == sorted(ALL)
    assert known_policies() == sorted(ALL)
    for name in ALL:
        cfg = parse_kv_policy(name)
        assert cfg.name == name and isinstance(cfg, CATALOG[name][0])
        assert parse_kv_policy({"name": name}) == cfg
        policy = build_policy(cfg)
        assert isinstance(policy, CATALOG[name][1]) and policy.name == name
        assert build_policy(name).config == cfg
        assert policy.max_live(10, 5, 4) <= 10


def test_paper_defaults():
    c = parse_kv_policy("lazy_streaming")
    assert (c.sink, c.window, c.extra, c.compress_every, c.slack, c.max_drop) == (
        4, 2044, 0, 32, 16, 32)
    s = parse_kv_policy("snapkv")
    assert (s.budget, s.obs_window, s.kernel_size, s.pooling, s.sink) == (2048, 32, 5, "avg", 0)
    e = parse_kv_policy("lazy_eviction")
    assert (e.budget, e.window, e.alpha) == (0.5, 25, 5e-4)
    h = parse_kv_policy("h2o")
    assert (h.budget, h.window) == (1024, 128)
    p = parse_kv_policy("pyramid")
    assert (p.budget, p.beta, p.omega, p.obs_window, p.kernel_size) == (1024, 20, 4.0, 32, 1)
    assert parse_kv_policy("paged_eviction").compact is True
    assert parse_kv_policy("streaming").rope == "original"


@pytest.mark.parametrize("value,param", [
    ({"name": "streaming", "windw": 3}, "kv_policy.windw"),
    ({"name": "streaming", "window": 0}, "kv_policy.window"),
    ({"name": "streaming", "sink": -1}, "kv_policy.sink"),
    ({"name": "streaming", "rope": "yarn"}, "kv_policy.rope"),
    ({"name": "lazy_streaming", "compress_every": -1}, "kv_policy.compress_every"),
    ({"name": "lazy_streaming", "slack": -2}, "kv_policy.slack"),
    ({"name": "lazy_streaming", "max_drop": 1.5}, "kv_policy.max_drop"),
    ({"name": "h2o", "budget": 0}, "kv_policy.budget"),
    ({"name": "h2o", "budget": 1.5}, "kv_policy.budget"),
    ({"name": "h2o", "budget": 0.0}, "kv_policy.budget"),
    ({"name": "h2o", "budget": True}, "kv_policy.budget"),
    ({"name": "h2o", "budget": "512"}, "kv_policy.budget"),
    ({"name": "h2o", "budget": float("nan")}, "kv_policy.budget"),
    ({"name": "tova", "budget": -3}, "kv_policy.budget"),
    ({"name": "snapkv", "kernel_size": 4}, "kv_policy.kernel_size"),
    ({"name": "snapkv", "pooling": "median"}, "kv_policy.pooling"),
    ({"name": "snapkv", "obs_window": 0}, "kv_policy.obs_window"),
    ({"name": "pyramid", "omega": 0.5}, "kv_policy.omega"),
    ({"name": "pyramid", "beta": 0}, "kv_policy.beta"),
    ({"name": "pyramid", "kernel_size": 2}, "kv_policy.kernel_size"),
    ({"name": "lazy_eviction", "alpha": 0}, "kv_policy.alpha"),
    ({"name": "lazy_eviction", "alpha": 2}, "kv_policy.alpha"),
    ({"name": "lazy_eviction", "window": 0}, "kv_policy.window"),
    ({"name": "knorm", "window": -1}, "kv_policy.window"),
    ({"name": "paged_eviction", "compact": "maybe"}, "kv_policy.compact"),
    ({"name": "full", "budget": 3}, "kv_policy.budget"),
    ({"name": "nope"}, "kv_policy.name"),
    ({"budget": 3}, "kv_policy.name"),
    ("nope", "kv_policy"),
])
def test_bad_values_name_the_field(value, param):
    with pytest.raises(KVPolicyError) as e:
        parse_kv_policy(value)
    assert e.value.param == param


def test_budget_is_tokens_or_ratio():
    assert parse_kv_policy({"name": "h2o", "budget": 512}).budget == 512
    r = parse_kv_policy({"name": "h2o", "budget": 0.25})
    assert r.budget == 0.25 and isinstance(r.budget, float)
    assert parse_kv_policy({"name": "h2o", "budget": 1.0}).budget == 1.0  # ratio: keep all
    assert resolve_budget(512, 100) == 512
    assert resolve_budget(0.25, 100) == 25
    assert resolve_budget(1.0, 7) == 7
    assert resolve_budget(0.01, 10) == 1  # never below one token


def test_configs_are_frozen_and_build_fresh_state():
    cfg = parse_kv_policy({"name": "h2o", "budget": 8})
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen error
        cfg.budget = 9  # type: ignore[misc]
    a, b = build_policy(cfg), build_policy(cfg)
    assert a is not b and a.needs is not b.needs


def test_full_policy_keeps_everything():
    p = build_policy(None)
    assert isinstance(p, FullPolicy) and not any(vars(p.needs).values())
    v = view([LayerView(positions=arange(50))], 50, 10, 1)
    assert run_step(p, v) == {} and p.max_live(50) == 50


def test_needs_declared_per_family():
    assert build_policy("streaming").needs.attention is False
    assert build_policy("paged_eviction").needs.key_norm and build_policy(
        "paged_eviction").needs.value_norm
    assert build_policy("knorm").needs.key_norm
    assert build_policy("keydiff").needs.key_diversity
    for name in ["h2o", "tova", "snapkv", "pyramid", "lazy_eviction"]:
        assert build_policy(name).needs.attention
