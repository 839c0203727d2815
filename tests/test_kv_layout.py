"""Per-head KV pages (`--kv-layout head`, `EngineConfig.kv_layout`) and kv_policy's `heads`.

A head-layout pool's page holds one (layer, kv head)'s K/V, so a request's tables have
one lane a (layer, kv head) (lane l·H + h). Same bytes as a layer pool of N blocks means
H×N pages. What must hold:

- full cache: the same greedy tokens and logprobs as the layer pool, on every attention
  path (C++ kernel, torch, chunks after a cached prefix, prefix-cache hits, bf16 and
  quantized pools) and under preemption (swap and recompute);
- `heads: uniform` keeps tokens per kv head (a layer's lanes hold different positions,
  and the pages each head frees go back to the pool); `shared` keeps one set a layer,
  exactly what the layer pool keeps; `adaptive` (AdaKV) spreads a layer's budget over
  its heads by score;
- bad input: tests/test_kv_layout_input.py.

The demo model: 4 layers, 2 kv heads (8 query heads), head dim 32.
"""

from __future__ import annotations

import pytest
import torch

from attention.cpu_attention import prefix_prefill_runs
from attention.torch_attention import paged_attention
from engine import runner
from engine.demo import DEMO_MODEL_DIR
from engine.model_config import load_model_config
from engine.sampling import SamplingParams
from policies.heads import ALPHA
from scheduler.llm import LLM, Completion
from scheduler.resolve import resolve_request

MODEL = str(DEMO_MODEL_DIR)
BS = 4
_MC = load_model_config(MODEL)
H = _MC.num_kv_heads  # lanes a layer has over a per-head pool
LAYERS = _MC.num_layers
LOGPROB_TOL = 1e-5  # fp32: the same sums in the same order up to the kernels' splits


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, _MC.vocab_size - 1, (n,), generator=g).tolist()


def _greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False,
                          **kw)  # type: ignore[arg-type]


def _pair(blocks: int = 300, **kw: object) -> tuple[LLM, LLM]:
    """A layer pool of `blocks` blocks and a head pool of the same bytes (H× the pages)."""
    layer = LLM(MODEL, num_blocks=blocks, block_size=BS, device="cpu", kv_layout="layer", **kw)
    head = LLM(MODEL, num_blocks=H * blocks, block_size=BS, device="cpu", kv_layout="head", **kw)
    return layer, head


def _max_logprob_diff(a: Completion, b: Completion) -> float:
    worst = 0.0
    assert (a.logprobs is None) == (b.logprobs is None)
    for x, y in zip(a.logprobs or [], b.logprobs or []):
        assert x.token_id == y.token_id
        worst = max(worst, abs(x.logprob - y.logprob))
        tops = dict(y.top)
        for tok, lp in x.top:
            if tok in tops:
                worst = max(worst, abs(lp - tops[tok]))
    assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
    for x, y in zip(a.prompt_logprobs or [], b.prompt_logprobs or []):
        assert (x is None) == (y is None)
        if x is not None and y is not None:
            assert x.token_id == y.token_id
            worst = max(worst, abs(x.logprob - y.logprob))
    return worst


def _done(llm: LLM) -> None:
    llm.engine.check_invariants()
    assert llm.engine.pool.num_used == 0 and not llm.engine.has_unfinished()


def _prefix_prefill_reference(q, k_cache, v_cache, k, v, table, slot_pos, start, scale,
                              out=None):
    """`prefix_prefill_cpu`'s contract on the torch path: the chunk's queries over every
    visible slot of its sequence (the chunk's own K/V are in the pool already, written
    before attention), causal by position. Where the C++ op does not run (no AVX-512),
    this lets the runner's per-head prefix-prefill branch run all the same."""
    t = q.shape[0]
    o, _ = paged_attention(q[None], k_cache, v_cache, table[None], slot_pos[None],
                           torch.arange(start, start + t)[None], scale)
    if out is None:
        return o[0], None
    out.copy_(o[0])
    return out, None


# ---- 1. full-cache parity, layer vs head ----------------------------------------------

PROMPTS = [_prompt(1, 37), _prompt(2, 9), _prompt(3, 61)]
PARITY_CASES = {
    "cpp": {},  # the default CPU path: the C++ decode kernel (where it builds)
    "torch": {"torch": True},
    "chunked": {"max_num_batched_tokens": 8},
    "chunked-prefix-op-reference": {"max_num_batched_tokens": 8, "reference_op": True},
    "bf16": {"kv_cache_dtype": "bfloat16"},
    "int8": {"kv_cache_dtype": "int8"},
    "int4": {"kv_cache_dtype": "int4"},
    "fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"},
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_full_cache_head_pool_equals_layer_pool(case: str, monkeypatch: pytest.MonkeyPatch
                                                ) -> None:
    """A head pool of the same bytes gives the layer pool's greedy tokens and logprobs
    (prompt logprobs too) on each attention path and pool dtype, and holds H× its pages."""
    kw = dict(PARITY_CASES[case])
    use_torch = kw.pop("torch", False)
    reference_op = kw.pop("reference_op", False)
    calls: list[int] = []
    real = runner.prefix_prefill_cpu

    def counted(q, *args, **kwargs):
        calls.append(q.shape[0])
        return (_prefix_prefill_reference if reference_op else real)(q, *args, **kwargs)

    monkeypatch.setattr(runner, "prefix_prefill_cpu", counted)
    if reference_op:  # the runner's branch taken wherever the pool allows it
        monkeypatch.setattr(runner, "prefix_prefill_runs",
                            lambda dtype, d, cache_dtype, quantized:
                            not quantized and cache_dtype == dtype)
    layer, head = _pair(**{"max_num_batched_tokens": 256, **kw})
    params = _greedy(8, logprobs=2, prompt_logprobs=1)
    outs, counts = [], []
    for llm in (layer, head):
        if use_torch:
            llm.engine.runner.attention_fn = paged_attention
        calls.clear()
        outs.append(llm.generate(PROMPTS, params))
        counts.append(len(calls))
        _done(llm)
    a, b = outs
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 8 for o in a)
    if not kw.get("kv_cache_dtype", "").startswith(("int", "fp8")):
        worst = max(_max_logprob_diff(x, y) for x, y in zip(a, b))
        assert worst <= LOGPROB_TOL, worst
    # the same bytes: H× the pages of 1/H the size, per request and in the pool
    for x, y in zip(a, b):
        assert x.kv is not None and y.kv is not None
        assert y.kv.peak_blocks == H * x.kv.peak_blocks
        assert y.kv.peak_bytes == x.kv.peak_bytes
        assert y.kv.peak_live_tokens == x.kv.peak_live_tokens
    assert (head.engine.storage.block_bytes * head.engine.pool.num_blocks
            == layer.engine.storage.block_bytes * layer.engine.pool.num_blocks)
    if "max_num_batched_tokens" in kw:  # the later chunks go through the prefix-prefill op
        op_runs = prefix_prefill_runs(torch.float32, _MC.head_dim, torch.float32, False)
        if reference_op or op_runs:
            assert counts[0] > 0, "no chunk went through the prefix-prefill path"
            assert counts[1] == H * counts[0]  # one call a kv head
        else:
            assert counts == [0, 0]


def test_prefix_cache_hit_head_pool_equals_layer_pool() -> None:
    """A second request sharing a 40-token prefix is served from the prefix cache in both
    layouts (the head pool's per-head pages shared) with the same tokens and logprobs."""
    shared = _prompt(7, 40)
    layer, head = _pair(max_num_batched_tokens=32)
    params = _greedy(8, logprobs=2)
    got = []
    for llm in (layer, head):
        first = llm.generate([shared + _prompt(8, 13)], params)[0]
        second = llm.generate([shared + _prompt(9, 6)], params)[0]
        assert first.kv is not None and second.kv is not None
        assert first.kv.prefix_hit_tokens == 0
        assert second.kv.prefix_hit_tokens >= 36, second.kv  # every whole block of the prefix
        got.append((first, second))
        _done(llm)
    (a1, a2), (b1, b2) = got
    assert a2.kv.prefix_hit_tokens == b2.kv.prefix_hit_tokens  # type: ignore[union-attr]
    assert [a1.token_ids, a2.token_ids] == [b1.token_ids, b2.token_ids]
    assert max(_max_logprob_diff(a1, b1), _max_logprob_diff(a2, b2)) <= LOGPROB_TOL


# ---- 2. preemption ---------------------------------------------------------------------

PRE_PROMPTS = [_prompt(10 + i, n) for i, n in enumerate((30, 41, 52, 19, 63, 25))]
PRE_NEW = 12


@pytest.fixture(scope="module")
def unconstrained() -> list[list[int]]:
    llm = LLM(MODEL, num_blocks=2000, block_size=BS, device="cpu", kv_layout="head")
    return [o.token_ids for o in llm.generate(PRE_PROMPTS, _greedy(PRE_NEW))]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_head_pool_gives_the_unconstrained_tokens(mode: str,
                                                            unconstrained: list[list[int]]
                                                            ) -> None:
    """A head pool that holds the largest request and little more preempts (swapping the
    per-head pages out and in, or recomputing them) and still gives an unconstrained
    pool's tokens, every page returned."""
    need = [LAYERS * H * -(-(len(p) + PRE_NEW) // BS) for p in PRE_PROMPTS]  # pages
    assert max(need) + 16 <= sum(need) // 3
    llm = LLM(MODEL, num_blocks=max(need) + 16, block_size=BS, device="cpu", kv_layout="head",
              preemption_mode=mode, swap_space=1 << 20, max_num_batched_tokens=24)
    outs = llm.generate(PRE_PROMPTS, _greedy(PRE_NEW))
    assert llm.engine.scheduler.preemptions[mode] > 0
    assert any(o.num_preemptions for o in outs)
    assert [o.token_ids for o in outs] == unconstrained
    _done(llm)
    if mode == "swap":
        assert llm.engine.swap is not None and llm.engine.swap.num_used == 0


def test_preempted_shared_policy_head_pool_equals_layer_pool() -> None:
    """Under swap preemption an evicting policy (knorm, shared) on a head pool keeps, swaps
    and gives what the layer pool of the same bytes does (lanes of unequal lengths go out
    and come back). Bounded requests are admitted with their growth reserved, so the
    pressure comes from two `full` requests growing past what they were admitted on; the
    knorm requests, of lower priority, are their victims."""
    outs = []
    for layout, blocks in (("layer", 120), ("head", 120 * H)):
        eng = LLM(MODEL, num_blocks=blocks, block_size=BS, device="cpu", kv_layout=layout,
                  preemption_mode="swap", swap_space=1 << 20, max_num_batched_tokens=24).engine
        knorm = resolve_request(eng.limits, {"name": "knorm", "budget": 20,
                                             "heads": "shared"}).kv_policy
        for j in range(2):
            eng.add_request(f"full{j}", _prompt(9 + j, 16), _greedy(60))
        for i, p in enumerate(PRE_PROMPTS):
            eng.add_request(f"k{i}", p, _greedy(30), priority=1, kv_policy=knorm)
        got: dict[str, list[int]] = {}
        swapped_knorm = evicted = 0
        while eng.has_unfinished():
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished and o.request_id.startswith("k"):
                    swapped_knorm += o.num_preemptions
                    evicted += o.kv.evicted_tokens if o.kv else 0
        assert eng.scheduler.preemptions["swap"] > 0 and swapped_knorm > 0 and evicted > 0
        outs.append(got)
        eng.check_invariants()
        assert eng.pool.num_used == 0
    assert outs[0] == outs[1]


# ---- 3. per-head eviction --------------------------------------------------------------

BUDGET = 16
EVICT_PROMPT = _prompt(21, 64)
EVICT_CHUNK = 32


@pytest.fixture(scope="module")
def head_llm() -> LLM:
    """A head pool with no prefix cache: a request's pages are its own, so the pool's
    used pages are exactly what its lanes hold."""
    return LLM(MODEL, num_blocks=800, block_size=BS, device="cpu", kv_layout="head",
               max_num_batched_tokens=EVICT_CHUNK, enable_prefix_caching=False)


def _lane_sets(llm: LLM, rid: str) -> list[frozenset[int]] | None:
    req = llm.engine.requests.get(rid)
    if req is None or req.cache is None or req.cache.swapped:
        return None
    sp = req.cache.slot_pos  # [lanes, slots] of the shared tables' row
    return [frozenset(x for x in sp[lane].tolist() if x >= 0) for lane in range(sp.shape[0])]


def _run_tracking(llm: LLM, policy: object, prompt: list[int], max_tokens: int = 6
                  ) -> list[dict]:
    """One request stepped to completion; after each step that leaves it running: its
    lanes' live positions and sizes, and the pool's free pages."""
    eng = llm.engine
    eng.add_request("r", prompt, _greedy(max_tokens),
                    kv_policy=resolve_request(eng.limits, policy).kv_policy)
    snaps = []
    while eng.has_unfinished():
        outs = eng.step()
        sets = _lane_sets(llm, "r")
        if sets is None:
            continue
        c = eng.requests["r"].cache
        assert c is not None
        snaps.append({"sets": sets, "live": list(c.layer_live), "pages": list(c.nblocks),
                      "free": eng.pool.num_free, "sampled": any(o.new_token_ids for o in outs),
                      "used": eng.pool.num_used})
    _done(llm)
    return snaps


def test_uniform_heads_keep_and_free_their_own_tokens(head_llm: LLM) -> None:
    """`heads: uniform` on a head pool: each lane keeps its own budget (the lanes of a
    layer hold different positions) and the pages the policy frees go back to the pool,
    against a full request of the same prompt."""
    full = _run_tracking(head_llm, "full", EVICT_PROMPT)
    uni = _run_tracking(head_llm, {"name": "knorm", "budget": BUDGET, "heads": "uniform"},
                        EVICT_PROMPT)
    assert len(full) == len(uni) and uni
    for s in uni:
        for lane, positions in enumerate(s["sets"]):
            assert len(positions) == s["live"][lane]  # the tables' sizes say what they hold
            assert len(positions) <= BUDGET + EVICT_CHUNK
        assert s["used"] == sum(s["pages"])  # every used page is one of its lanes'
    after = [s for s in uni if s["sampled"]]  # the prompt done: evicted to the budget
    assert after
    for s in after:
        assert s["live"] == [BUDGET] * (LAYERS * H)
        assert any(s["sets"][layer * H] != s["sets"][layer * H + h]
                   for layer in range(LAYERS) for h in range(1, H))
    for f, u in zip(full, uni):
        if u["sampled"]:
            assert u["free"] > f["free"]
            assert sum(u["pages"]) * 2 <= sum(f["pages"])  # most of the prompt's pages freed


def test_shared_heads_keep_one_set_a_layer(head_llm: LLM) -> None:
    """`heads: shared` on a head pool: at every step the lanes of a layer hold the same
    positions, at the budget once the prompt is done."""
    snaps = _run_tracking(head_llm, {"name": "knorm", "budget": BUDGET, "heads": "shared"},
                          EVICT_PROMPT)
    assert snaps
    for s in snaps:
        for layer in range(LAYERS):
            lanes = s["sets"][layer * H : (layer + 1) * H]
            assert all(x == lanes[0] for x in lanes)
    assert all(s["live"] == [BUDGET] * (LAYERS * H) for s in snaps if s["sampled"])


def test_default_heads_is_uniform_on_a_head_pool(head_llm: LLM) -> None:
    """A kv_policy naming no `heads` keeps tokens per head on a head pool."""
    snaps = _run_tracking(head_llm, {"name": "knorm", "budget": BUDGET}, EVICT_PROMPT,
                          max_tokens=2)
    s = next(s for s in snaps if s["sampled"])
    assert any(s["sets"][layer * H] != s["sets"][layer * H + 1] for layer in range(LAYERS))


# ---- 4. shared parity --------------------------------------------------------------------

SHARED_POLICIES = {
    "knorm": {"name": "knorm", "budget": 24},
    "keydiff": {"name": "keydiff", "budget": 24},
    "tova": {"name": "tova", "budget": 24},
    "h2o": {"name": "h2o", "budget": 24, "window": 4},
    "snapkv": {"name": "snapkv", "budget": 24, "obs_window": 4, "kernel_size": 3},
    "pyramid": {"name": "pyramid", "budget": 24, "obs_window": 4},
    "streaming": {"name": "streaming", "sink": 4, "window": 16},
}


@pytest.mark.parametrize("name", list(SHARED_POLICIES))
def test_shared_heads_on_a_head_pool_equal_the_layer_pool(name: str) -> None:
    """`heads: shared` on a head pool scores every lane by its layer's statistics, so it
    keeps, evicts and generates exactly what the layer pool does."""
    policy = {**SHARED_POLICIES[name], "heads": "shared"}
    layer, head = _pair(max_num_batched_tokens=32)
    prompts = [_prompt(31, 48), _prompt(32, 70)]
    a = layer.generate(prompts, _greedy(10, logprobs=1), kv_policy=policy)
    b = head.generate(prompts, _greedy(10, logprobs=1), kv_policy=policy)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert max(_max_logprob_diff(x, y) for x, y in zip(a, b)) <= LOGPROB_TOL
    for x, y in zip(a, b):
        assert x.kv is not None and y.kv is not None
        assert x.kv.evicted_tokens > 0  # the policy did evict: the parity is not trivial
        assert (x.kv.evicted_tokens, x.kv.peak_bytes) == (y.kv.evicted_tokens, y.kv.peak_bytes)
    _done(layer)
    _done(head)


# ---- 5. adaptive (AdaKV) -----------------------------------------------------------------


def test_adaptive_spreads_a_layers_budget_over_its_heads(head_llm: LLM) -> None:
    """After the prompt, `heads: adaptive` keeps per layer the total uniform keeps
    (H × budget), its heads' counts differ, and each head keeps at least ALPHA × budget."""
    snaps = _run_tracking(head_llm, {"name": "knorm", "budget": BUDGET, "heads": "adaptive"},
                          EVICT_PROMPT, max_tokens=2)
    s = next(s for s in snaps if s["sampled"])  # the first step after the prompt
    live = s["live"]
    per_layer = [live[layer * H : (layer + 1) * H] for layer in range(LAYERS)]
    assert all(sum(heads) == H * BUDGET for heads in per_layer), per_layer
    assert any(len(set(heads)) > 1 for heads in per_layer), per_layer
    assert min(live) >= int(ALPHA * BUDGET), per_layer
    assert [len(x) for x in s["sets"]] == live


def test_adaptive_keeps_a_layers_total_through_decode(head_llm: LLM) -> None:
    """Through decode, each step's eviction leaves a layer of an adaptive request at
    H × budget tokens, as uniform's lanes stay at the budget each."""
    snaps = _run_tracking(head_llm, {"name": "knorm", "budget": BUDGET, "heads": "adaptive"},
                          EVICT_PROMPT, max_tokens=8)
    totals = [[sum(s["live"][layer * H : (layer + 1) * H]) for layer in range(LAYERS)]
              for s in snaps if s["sampled"]]
    assert len(totals) > 3
    assert all(t == [H * BUDGET] * LAYERS for t in totals), totals


def test_adaptive_keeps_every_heads_floor_through_decode(head_llm: LLM) -> None:
    """Through decode no head of an adaptive (keydiff) request falls below ALPHA × budget
    live tokens (AdaKV's safeguard)."""
    snaps = _run_tracking(head_llm, {"name": "keydiff", "budget": BUDGET, "heads": "adaptive"},
                          EVICT_PROMPT, max_tokens=12)
    lows = [min(s["live"]) for s in snaps if s["sampled"]]
    assert len(lows) > 3
    assert min(lows) >= int(ALPHA * BUDGET), lows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"])
def test_a_per_head_pool_takes_a_layers_kv_as_the_projection_gives_it(
        dtype: torch.dtype | str) -> None:
    """`KVStorage.write` into a pool of one kv head a slot: a layer's K/V [T, H, D] (here
    strided views of one fused projection output, as the models make them) at slots
    [H·T], head-major, land where the regrouped [H·T, 1, D] rows would: through the C++
    op (float pools) and the torch path (a quantized pool)."""
    from attention.storage import KVStorage

    t, h, d = 5, 3, 8
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(t, (4 + 2 * h) * d, generator=g).view(t, 4 + 2 * h, d)
    k, v = qkv[:, 4 : 4 + h], qkv[:, 4 + h :]
    slots = torch.randperm(8 * 4, generator=g)[: h * t]
    got, want = KVStorage(8, 4, 1, d, dtype=dtype), KVStorage(8, 4, 1, d, dtype=dtype)
    got.write(slots, k, v)
    want.write(slots, *(x.transpose(0, 1).reshape(-1, 1, d).contiguous() for x in (k, v)))
    assert torch.equal(got.kv, want.kv)
    if want.quant is not None:
        assert torch.equal(got.scales, want.scales)
    with pytest.raises(RuntimeError, match="slots must be"):
        KVStorage(8, 4, 1, d).write(slots[:t], k, v)  # one slot a token: too few
