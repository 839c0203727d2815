"""A request's `kv_policy` and max_tokens are resolved once, by `scheduler/resolve.py`, on
both ways in (the server's preprocessing, the offline `LLM`), and the engine runs what it
made without parsing or fitting again: it takes a resolved config object, and refuses a
name, a mapping or a config without the model's context defaults. So an engine that
parsed again, or a way in that skipped the resolving, fails here."""

from __future__ import annotations

import asyncio

import pytest

from engine.sampling import SamplingParams
from policies.catalog import parse_kv_policy
from policies.config import KVPolicyError
from scheduler.async_engine import AsyncEngine
from scheduler.engine_core import EngineConfig, EngineCore
from scheduler.limits import DEFAULT_MAX_TOKENS
from scheduler.llm import LLM
from scheduler.outputs import RequestRejected
from scheduler.resolve import ModelLimits, resolve_request
from tests.tiny_models import make_tiny_model

CONTEXT = 64  # the tiny model's positions: h2o's context defaults are budget 16, window 2
PROMPT = [5 + (7 * i) % 200 for i in range(40)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama",
                           max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def core(model_dir: str) -> EngineCore:
    return EngineCore(EngineConfig(model=model_dir, num_blocks=128, block_size=4,
                                   default_kv_policy="streaming"))


def test_resolve_request() -> None:
    """The policy parsed with the model's context defaults, the server's default when the
    request names none, each prompt's max_tokens fitted, and a bad policy reported before
    a prompt that is too long."""
    limits = ModelLimits.of(CONTEXT, 48, "streaming")
    assert limits.default_kv_policy == parse_kv_policy("streaming").for_context(CONTEXT)
    r = resolve_request(limits, "h2o", [(20, 30), (20, None), (40, None)],
                        default_max_tokens=DEFAULT_MAX_TOKENS)
    assert (r.kv_policy.budget, r.kv_policy.window) == (16, 2) and r.kv_policy.context_resolved
    assert r.max_tokens == (30, 16, 8)  # the default, then what the pool's 48 tokens leave
    assert resolve_request(limits).kv_policy is limits.default_kv_policy
    assert resolve_request(limits, {"name": "h2o", "budget": 9}).kv_policy.budget == 9
    with pytest.raises(KVPolicyError) as e:
        resolve_request(limits, {"name": "h2o", "window": -1}, [(CONTEXT, None)])
    assert e.value.param == "kv_policy.window"
    with pytest.raises(RequestRejected) as e:
        resolve_request(limits, "h2o", [(20, 10), (20, CONTEXT)])
    assert e.value.param == "max_tokens"


def test_the_engine_takes_only_resolved_configs(core: EngineCore) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    unresolved = parse_kv_policy("h2o")  # class defaults: budget 1024 on 64 positions
    for raw in ("h2o", {"name": "h2o"}, unresolved):
        with pytest.raises(TypeError, match="resolve_request"):
            core.add_request("raw", PROMPT, params, kv_policy=raw)
    assert not core.requests
    config = resolve_request(core.limits, "h2o").kv_policy
    core.add_request("resolved", PROMPT, params, kv_policy=config)
    core.add_request("default", PROMPT, params)
    assert core.requests["resolved"].kv_policy is config  # taken as it is
    assert core.requests["default"].kv_policy is core.limits.default_kv_policy
    while core.has_unfinished():
        core.step()
    assert core.pool.num_used == 0


def test_the_engine_does_not_fit_max_tokens_again(core: EngineCore) -> None:
    """The context rule is the resolver's: a max_tokens it would refuse is not looked at
    again by the engine (which still refuses what only it can tell, the KV pool)."""
    full = resolve_request(core.limits, "full").kv_policy
    with pytest.raises(RequestRejected):
        resolve_request(core.limits, full, [(len(PROMPT), CONTEXT)])
    core.add_request("unfitted", PROMPT, SamplingParams(max_tokens=CONTEXT), kv_policy=full)
    core.abort_request("unfitted")
    with pytest.raises(RequestRejected) as e:  # more blocks than the pool holds
        core.add_request("huge", PROMPT, SamplingParams(max_tokens=100 * CONTEXT),
                         kv_policy=full)
    assert e.value.param == "max_tokens"
    assert not core.requests and core.pool.num_used == 0


def test_async_engine_refuses_a_policy_it_would_have_to_parse(model_dir: str) -> None:
    async def main() -> None:
        engine = AsyncEngine.from_config(EngineConfig(model=model_dir, num_blocks=128),
                                         warmup=False)
        await engine.start()
        gen = engine.generate(PROMPT, SamplingParams(max_tokens=2), kv_policy="h2o")
        with pytest.raises(TypeError, match="resolve_request"):
            await gen.__anext__()
        assert engine.num_active == 0 and engine.num_queued == 0
        assert engine.limits is not None
        config = resolve_request(engine.limits, "h2o").kv_policy
        outs = [o async for o in engine.generate(PROMPT, SamplingParams(
            max_tokens=3, ignore_eos=True), kv_policy=config)]
        assert outs[-1].finished and outs[-1].kv is not None and outs[-1].kv.evicted_tokens > 0
        await engine.shutdown()

    asyncio.run(main())


def test_the_offline_api_resolves(model_dir: str) -> None:
    """`LLM.generate` goes through the resolver: a bad policy raises the error the server
    answers 400 with, a policy named alone gets this model's defaults (h2o keeps 16 of
    the 40-token prompt, not its class default of 1,024), and max_tokens is fitted."""
    llm = LLM(model_dir, num_blocks=128, block_size=4)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    with pytest.raises(KVPolicyError) as e:
        llm.generate([PROMPT], params, kv_policy="no-such-policy")
    assert e.value.param == "kv_policy"
    with pytest.raises(RequestRejected) as e:
        llm.generate([PROMPT], SamplingParams(max_tokens=CONTEXT), kv_policy="h2o")
    assert e.value.param == "max_tokens"
    assert not llm.engine.requests
    (out,) = llm.generate([PROMPT], params, kv_policy="h2o")
    assert out.kv is not None and out.kv.evicted_tokens > 0
    (out,) = llm.generate([PROMPT], params)  # the engine's default: full
    assert out.kv is not None and out.kv.evicted_tokens == 0
    shift = {"name": "streaming", "sink": 4, "window": 16, "rope": "shift"}
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=CONTEXT, ignore_eos=True),
                          kv_policy=shift)
    assert len(out.token_ids) == CONTEXT  # past the context: rope shift, resolved as such
