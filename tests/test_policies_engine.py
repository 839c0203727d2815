"""Eviction policies inside the engine: the real paged pool, continuous batching, a real
model forward. The policies' own formulas are pinned by the test_policies_* unit tests;
these tests pin what the engine does with their plans."""

import pytest
import torch

from engine.sampling import SamplingParams
from kvpool.manager import MIN_PREFILL_CHUNK
from policies.catalog import build_policy
from scheduler.llm import LLM
from tests.tiny_models import make_tiny_model, resolved

BS = 4
# Generated tokens a request: 4x the prompt and 6x the largest fixed budget, so every
# policy evicts (and lazy ones compress) many times over (1,000 took 4x the time).
LONG = 400

# Every policy at a budget small enough to evict within this test's lengths.
POLICIES = [
    {"name": "streaming", "sink": 4, "window": 60},
    {"name": "streaming", "sink": 4, "window": 60, "rope": "shift"},
    {"name": "lazy_streaming", "sink": 4, "window": 60, "compress_every": 16, "slack": 8, "max_drop": 16},
    {"name": "paged_eviction", "budget": 64},
    {"name": "knorm", "budget": 64, "window": 8},
    {"name": "keydiff", "budget": 64, "window": 8},
    {"name": "h2o", "budget": 64, "window": 16},
    {"name": "tova", "budget": 64},
    {"name": "snapkv", "budget": 32, "obs_window": 8},
    {"name": "pyramid", "budget": 64, "obs_window": 8},
    {"name": "lazy_eviction", "budget": 64, "window": 16},
    {"name": "h2o", "budget": 0.25, "window": 16, "compact": True},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"), max_position_embeddings=4096)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(5, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_full_policy_equals_no_policy(model):
    llm = LLM(model, num_blocks=400, block_size=BS)
    prompts = [_prompt(i, 20 + 7 * i) for i in range(4)]
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"none{i}", p, _greedy(30))
        llm.engine.add_request(f"full{i}", p, _greedy(30),
                               kv_policy=resolved(llm.engine, {"name": "full"}))
    out: dict[str, list[int]] = {}
    while llm.engine.has_unfinished():
        for o in llm.engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    for i in range(4):
        assert out[f"none{i}"] == out[f"full{i}"]


def test_mixed_batch_of_every_policy_stays_within_budget(model):
    """All policies in one continuous batch for LONG generated tokens each: every
    request's peak live tokens per layer respect its policy's bound (plus one step's
    chunk), peak blocks follow, and the pool is empty and consistent at the end."""
    llm = LLM(model, num_blocks=4000, block_size=BS, max_num_batched_tokens=64)
    eng = llm.engine
    peaks: dict[str, int] = {}
    blocks: dict[str, int] = {}
    prompt_len = 100
    for i, cfg in enumerate(POLICIES):
        eng.add_request(f"p{i}", _prompt(i, prompt_len), _greedy(LONG),
                        kv_policy=resolved(eng, cfg))
    finished = {}
    steps = 0
    while eng.has_unfinished():
        outs = eng.step()
        steps += 1
        for r in eng.scheduler.running:
            per_layer = max(r.cache.nblocks)
            live = int((r.cache.slot_pos >= 0).sum(dim=1).max())  # the fullest layer
            peaks[r.request_id] = max(peaks.get(r.request_id, 0), live)
            blocks[r.request_id] = max(blocks.get(r.request_id, 0), per_layer)
        if steps % 50 == 0:
            eng.check_invariants()
            for r in eng.scheduler.running:  # `alike` caches really hold one layout
                sp = r.cache.slot_pos
                assert not r.cache.alike or bool((sp == sp[:1]).all()), r.request_id
        for o in outs:
            if o.finished:
                finished[o.request_id] = o
    eng.check_invariants()
    assert eng.pool.num_used == 0
    total = prompt_len + LONG
    for i, cfg in enumerate(POLICIES):
        rid = f"p{i}"
        bound = build_policy(cfg).max_live(total, prompt_len, BS)
        assert bound < total, cfg  # the policy really evicts at this length
        assert peaks[rid] <= bound + 64, (cfg, peaks[rid], bound)  # + one prefill chunk
        # Dead slots pin at most a partly-used block at each end of the live range,
        # unless the policy drops tokens from the middle (then compaction bounds it).
        assert finished[rid].num_output_tokens == LONG
        assert finished[rid].kv.evicted_tokens > 0, cfg
    stats = eng.stats()
    assert sum(stats.evicted_tokens_by_policy_total.values()) > 0
    assert set(stats.policy_seconds_total) == {c["name"] for c in POLICIES}
    assert stats.freed_blocks_by_policy_total["streaming"] > 0


@pytest.mark.parametrize("name", ["streaming", "lazy_streaming"])
def test_rope_shift_generates_far_past_the_position_limit(tmp_path, name):
    """A 128-position model (so 3x its limit is 400 steps, not 1,600 at 512: the
    step count was this file's run time), the window well inside it."""
    limit, window, gen = 128, 40, 400
    path = make_tiny_model("llama", tmp_path, max_position_embeddings=limit)
    llm = LLM(path, num_blocks=200, block_size=BS)
    cfg = {"name": name, "sink": 4, "window": window, "rope": "shift"}
    out = None
    eng = llm.engine
    layers = eng.model_config.num_layers
    eng.add_request("long", _prompt(0, 50), _greedy(gen),  # 3x the limit
                    kv_policy=resolved(eng, cfg))
    peak_blocks = 0
    n = 0
    while eng.has_unfinished():
        for o in eng.step():
            n += len(o.new_token_ids)
            out = o
        r = eng.requests.get("long")
        if r is not None and r.cache is not None:
            peak_blocks = max(peak_blocks, r.cache.num_blocks)
            assert int(r.cache.slot_pos.max()) < limit  # positions stay inside the model's range
    assert n == gen and out.finish_reason == "length"
    assert peak_blocks <= layers * ((4 + window + 64) // BS + 3)
    assert eng.pool.num_used == 0


def test_original_rope_refuses_past_the_position_limit(tmp_path):
    from scheduler.outputs import RequestRejected

    path = make_tiny_model("llama", tmp_path, max_position_embeddings=512)
    llm = LLM(path, num_blocks=200, block_size=BS)
    with pytest.raises(RequestRejected):
        llm.generate([_prompt(0, 50)], _greedy(1000), kv_policy={"name": "streaming",
                                                                 "window": 100})


def test_paged_eviction_scores_kept_from_their_step_equal_scores_read_again(model, monkeypatch):
    """paged_eviction keeps each token's S_i from the step that computed it (new tokens'
    norms only, `Needs.new_value_norm`): every layer of every request keeps exactly what
    it keeps when every step reads every live token's norms again, through prefill
    chunks, block drops and compaction."""
    from policies import paged_eviction

    def run(reread: bool) -> list[dict[str, list[list[int]]]]:
        if reread:
            monkeypatch.setattr(paged_eviction, "_NEW_NORMS",
                                paged_eviction.Needs(key_norm=True, value_norm=True))
        llm = LLM(model, num_blocks=800, block_size=BS, max_num_batched_tokens=64)
        eng, kept = llm.engine, []
        for i in range(3):
            eng.add_request(f"p{i}", _prompt(60 + i, (90, 70, 120)[i]), _greedy(50),
                            kv_policy=resolved(eng, {"name": "paged_eviction", "budget": 40}))
        while eng.has_unfinished():
            eng.step()
            kept.append({r.request_id: [sp[sp >= 0].tolist() for sp in r.cache.slot_pos]
                         for r in eng.scheduler.running})
        eng.check_invariants()
        return kept

    cached = run(False)
    assert any(len(p) < 90 for k in cached for layers in k.values() for p in layers)
    assert cached == run(True)


@pytest.mark.parametrize("budget", [24, 48], ids=["first-plan-at-prefill", "first-plan-in-decode"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "per-request"])
def test_knorm_keeps_the_lowest_norms_of_the_pools_keys(model, batched, budget):
    """knorm in the engine keeps, in every layer, the tokens whose keys *in the pool*
    have the lowest head-mean norm. After its first plan it reads only the new tokens'
    norms (`Needs.new_key_norm`) and keeps the others' from earlier steps, alone and in
    a batch of requests, so a wrong slot or a stale score shows up here as a kept token
    with a larger norm than a dropped one."""
    from policies.base import Needs

    # CPU: the runner's norms and the pool's are the same bits there (engine.runner's
    # `new_norms`); a GPU reduces them in other orders, a few ulps apart.
    llm = LLM(model, num_blocks=600, block_size=BS, batch_policies=batched, device="cpu")
    eng, window = llm.engine, 4
    knorm = resolved(eng, {"name": "knorm", "budget": budget, "window": window})
    for i in range(3):
        eng.add_request(f"k{i}", _prompt(40 + i, (30, 30, 36)[i]), _greedy(60), kv_policy=knorm)
    norm: dict[tuple[str, int, int], float] = {}  # (request, layer, position) -> mean ‖K‖
    seen: dict[tuple[str, int], set[int]] = {}
    checked = 0
    while eng.has_unfinished():
        eng.step()
        for r in eng.scheduler.running:
            sp = r.cache.slot_pos
            for layer in range(sp.shape[0]):
                idx = (sp[layer] >= 0).nonzero().squeeze(1)
                pos = sp[layer, idx].tolist()
                phys = r.cache.table[layer, idx // BS] * BS + idx % BS
                k = eng.pool.storage.gather_stats(phys, key_norm=True)["key_norm"].mean(dim=-1).tolist()
                norm.update({(r.request_id, layer, p): x for p, x in zip(pos, k)})
                before = seen.get((r.request_id, layer), set())
                seen[(r.request_id, layer)] = set(pos)
                dropped = [norm[(r.request_id, layer, p)] for p in before - set(pos)]
                if not r.prefill_done or not dropped:
                    continue
                assert len(pos) == budget
                assert r.policy.needs == Needs(new_key_norm=True)  # it reads new norms only
                kept = [norm[(r.request_id, layer, p)] for p in sorted(pos)[:-window]]
                assert max(kept) <= min(dropped) + 1e-6, (r.request_id, layer)
                checked += 1
    assert checked > 100
    assert build_policy({"name": "knorm"}).needs.key_norm  # the first plan reads every norm
    eng.check_invariants()


@pytest.mark.parametrize("kv_policy", [
    {"name": "streaming", "sink": 4, "window": 60},
    {"name": "streaming", "sink": 4, "window": 60, "rope": "shift"},
    {"name": "lazy_streaming", "sink": 4, "window": 60, "compress_every": 8, "slack": 4,
     "max_drop": 8},
    {"name": "knorm", "budget": 64, "window": 4},
    {"name": "paged_eviction", "budget": 64},
    {"name": "keydiff", "budget": 64},
    {"name": "h2o", "budget": 64, "window": 8},
    {"name": "tova", "budget": 0.05},
    {"name": "lazy_eviction", "budget": 64, "window": 8, "alpha": 0.01},
])
def test_prefill_is_bounded_from_the_first_prompt_token(model, kv_policy):
    """A prompt 20x the bound never holds more than the bound + one chunk (+ one block)
    live tokens, at any step, prefill included (issue 20): its chunks are the larger of
    the bound and MIN_PREFILL_CHUNK, and the policy evicts after each. Before, the whole
    prompt was one chunk of the step budget and sat in the cache until it ended."""
    llm = LLM(model, num_blocks=2000, block_size=BS, max_num_batched_tokens=2048)
    core = llm.engine
    prompt = _prompt(7, 20 * 64)
    core.add_request("r", prompt, _greedy(24), kv_policy=resolved(core, kv_policy))
    req = core.requests["r"]
    bound = build_policy(kv_policy).max_live(len(prompt) - 1, len(prompt), BS)
    assert bound < len(prompt) and req.max_chunk == max(bound, MIN_PREFILL_CHUNK) < 2048
    steps, kv = 0, None
    while core.has_unfinished():
        for o in core.step():
            kv = o.kv or kv
        steps += 1
        core.check_invariants()
    assert kv is not None and kv.evicted_tokens > 0
    assert steps == -(-len(prompt) // req.max_chunk) + 23  # prompt chunks, then a token a step
    assert kv.peak_live_tokens <= bound + req.max_chunk + BS < len(prompt) / 3
    # The reservation admission made matches: bound + chunk, not the whole prompt.
    assert req.peak_blocks < core.kv.blocks_for(len(prompt)) / 3


def test_policies_that_keep_the_prompt_whole_keep_the_step_budget(model):
    """snapkv and pyramid compress the prompt at its end (they score it with a window
    of its last queries): short chunks would only cost throughput, so their chunk stays
    the step budget and admission reserves the prompt."""
    llm = LLM(model, num_blocks=400, block_size=BS, max_num_batched_tokens=512)
    for i, kv_policy in enumerate([{"name": "pyramid", "budget": 16},
                                   {"name": "snapkv", "budget": 16}, None]):
        llm.engine.add_request(f"r{i}", _prompt(i, 300), _greedy(4),
                               kv_policy=resolved(llm.engine, kv_policy))
        assert llm.engine.requests[f"r{i}"].max_chunk == 512


def test_min_prefill_chunk_trades_memory_for_whole_prompt_scoring(model):
    """`min_prefill_chunk` is the floor of a bounded prompt's chunks: at 1024 an h2o
    request of budget 64 prefills a 900-token prompt in one chunk (scored whole at its
    end, as before bounded prefill) and admission reserves that chunk; a floor below 1
    is refused."""
    prompt = _prompt(3, 900)
    peaks = {}
    for floor in (MIN_PREFILL_CHUNK, 1024):
        llm = LLM(model, num_blocks=2000, block_size=BS, max_num_batched_tokens=2048,
                  min_prefill_chunk=floor)
        llm.engine.add_request("r", prompt, _greedy(2),
                               kv_policy=resolved(llm.engine, {"name": "h2o", "budget": 64}))
        req = llm.engine.requests["r"]
        assert req.max_chunk == floor
        peaks[floor] = req.peak_blocks
    assert peaks[MIN_PREFILL_CHUNK] < peaks[1024]
    with pytest.raises(ValueError, match="min_prefill_chunk"):
        LLM(model, num_blocks=100, block_size=BS, min_prefill_chunk=0)
