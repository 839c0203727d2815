"""Policy defaults follow the model's context (issue 20, part 4): a policy named without
parameters evicts on every model, and `GET /v1/kv_policies` says what it will keep."""

from __future__ import annotations

import pytest

from engine.demo import DEMO_MODEL_DIR
from engine.sampling import SamplingParams
from policies.catalog import CATALOG, describe_policies, parse_kv_policy
from policies.config import REFERENCE_CONTEXT
from scheduler.engine_core import EngineConfig, EngineCore
from scheduler.resolve import resolve_request


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_class_defaults_are_the_rules_at_the_reference_context(name: str) -> None:
    """The documented rule and the class default agree (docs and listing show both)."""
    config_cls = CATALOG[name][0]
    assert config_cls().for_context(REFERENCE_CONTEXT) == config_cls()
    for field in config_cls.CONTEXT_DEFAULTS:
        assert field in config_cls.model_fields


def test_for_context_keeps_what_the_client_gave() -> None:
    given = parse_kv_policy({"name": "h2o", "budget": 50})
    fitted = given.for_context(1024)
    assert fitted.budget == 50 and fitted.window == 32  # window: 1/32 of the context
    assert fitted.for_context(8192) == fitted  # resolved once, then it counts as given
    lazy = parse_kv_policy({"name": "lazy_streaming", "sink": 8}).for_context(1024)
    assert lazy.window == 512 - 8  # half the context less the sinks
    assert parse_kv_policy("lazy_eviction").for_context(100).budget == 0.5  # a ratio


def test_listing_resolves_defaults_for_the_model() -> None:
    by_name = {p["name"]: p for p in describe_policies(1024)}
    assert set(by_name) == set(CATALOG)
    h2o = by_name["h2o"]["parameters"]
    assert h2o["budget"]["default"] == 256 and h2o["budget"]["default_rule"] == "0.25 × max_model_len"
    assert h2o["window"]["minimum"] == 0 and h2o["window"]["description"]
    assert by_name["snapkv"]["parameters"]["budget"]["default"] == 512
    assert by_name["tova"]["parameters"]["compact"]["default_rule"] is None
    assert all(p["description"] for p in by_name.values())
    assert describe_policies()[1]["parameters"]["window"]["default"] == 1024  # no model


@pytest.mark.parametrize("layout", ["layer", "head"])
def test_every_default_policy_evicts_on_the_demo_model(layout: str) -> None:
    """A 900-token prompt on the demo model (1,024 positions): with the old absolute
    defaults (1,024-2,048 tokens) h2o, tova, knorm, keydiff, snapkv, pyramid, streaming
    and lazy_streaming kept everything and looked like `full`. Over a per-head pool too,
    with duo (per head only) streaming by the demo model's shipped head roles."""
    pages = 4096 if layout == "layer" else 8192  # the same bytes: 2 kv heads
    core = EngineCore(EngineConfig(model=str(DEMO_MODEL_DIR), num_blocks=pages,
                                   kv_layout=layout))
    assert core.max_model_len == 1024
    names = [n for n in sorted(CATALOG) if n != "full" and (layout == "head" or n != "duo")]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompt = [5 + (7 * i) % 200 for i in range(900)]
    for name in names:  # all at once: one batched run of every policy
        core.add_request(name, prompt, params,
                         kv_policy=resolve_request(core.limits, name).kv_policy)
    evicted: dict[str, int] = {}
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                assert out.kv is not None
                evicted[out.request_id] = out.kv.evicted_tokens
    assert set(evicted) == set(names)
    assert all(n > 0 for n in evicted.values()), evicted
    core.check_invariants()
