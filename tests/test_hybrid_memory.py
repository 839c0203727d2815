"""Hybrid memory (kvpool/windows.py): a sliding-window layer keeps its window's pages, and
admission, reservation, preemption, prefix caching and the pool's size count it so.

On a tiny Gemma-3-shaped model (5 local layers of window 16 : 1 global layer, 4-token
pages): the windowed lanes hold at most their window's pages and the tokens are those of
the same engine keeping every layer whole (`hybrid_kv_cache=False`); a request whose
whole context would not fit the pool runs; swap and recompute preemption give the same
tokens; a prefix hit, its windows' pages present or the older ones recycled, gives
exactly the tokens of a run without prefix caching; a per-head pool trims a windowed
layer's lanes alike. A kv_policy acts on the global layer alone: a streaming request's
tokens are a dense forward's whose global layer sees the sinks and the recent window and
whose local layers see their windows."""

from __future__ import annotations

import httpx
import pytest
import torch

from engine.sampling import SamplingParams
from kvpool.manager import KVCacheManager
from kvpool.pool import BlockPool
from kvpool.windows import longest_hit, request_blocks, vllm_block_lanes, window_blocks
from policies import expected_attention as ea
from scheduler.llm import LLM
from scheduler.outputs import RequestRejected
from tests.live_server import tiny_server
from tests.tiny_models import make_tiny_model, resolved

W, BS, CHUNK = 16, 4, 32  # the local layers' window, the page, the prefill chunk
GEMMA3 = {"num_hidden_layers": 6, "sliding_window_pattern": 6, "sliding_window": W}
PROMPT, NEW = 150, 60


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> str:
    return make_tiny_model("gemma3", tmp_path_factory.mktemp("gemma3_5to1"), **GEMMA3)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(5, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)


def _llm(path: str, **config: object) -> LLM:
    return LLM(path, **{"block_size": BS, "num_blocks": 2000, "device": "cpu",
                        "max_num_batched_tokens": CHUNK, **config})


def _run(llm: LLM, prompts: list[list[int]], new: int = NEW, kv_policy: object = None,
         watch: bool = True) -> tuple[list[list[int]], list]:
    """Every prompt to the end, checking the pool's invariants and (`watch`) that no
    windowed lane ever holds more than its window's pages; tokens and usage in order."""
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, _greedy(new),
                        kv_policy=None if kv_policy is None else resolved(eng, kv_policy))
    tokens: dict[str, list[int]] = {}
    usage = {}
    windows = eng.kv.windows
    while eng.has_unfinished():
        for o in eng.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                usage[o.request_id] = o.kv
        eng.check_invariants()
        if watch:
            for r in eng.scheduler.running:
                held = r.cache.nblocks
                for lane, w in enumerate(windows):
                    if w is not None:  # after its trim: its window, and the next token
                        assert held[lane] <= window_blocks(w, 1, BS), (lane, held)
    assert eng.pool.num_used == 0
    names = [f"r{i}" for i in range(len(prompts))]
    return [tokens[n] for n in names], [usage[n] for n in names]


def test_windowed_lanes_hold_their_window_and_the_tokens_stay(gemma3) -> None:
    """The request's accounted peak is 1 global lane's context and 5 windows' pages (with
    a prefill chunk); what it held stays within it, a third of keeping every layer whole,
    and the tokens are those of the whole-context engine."""
    hybrid, whole = _llm(gemma3), _llm(gemma3, hybrid_kv_cache=False)
    prompt = _prompt(PROMPT, 0)
    assert hybrid.engine.kv.windows == [W] * 5 + [None]
    assert whole.engine.kv.windows == [None] * 6
    got, use = _run(hybrid, [prompt])
    want, use_whole = _run(whole, [prompt], watch=False)
    assert got == want
    context = -(-(PROMPT + NEW - 1) // BS)  # 53 pages
    peak = context + 5 * window_blocks(W, CHUNK, BS)
    assert peak == 53 + 5 * 13
    assert use[0].peak_blocks <= peak
    assert use_whole[0].peak_blocks == 6 * context
    assert 3 * use[0].peak_blocks < use_whole[0].peak_blocks


def test_a_request_fits_by_its_windows(gemma3) -> None:
    """A pool of 130 pages holds the request (118 at most) only because its local layers
    are counted as their windows: the whole-context engine refuses it (its prompt alone
    would need 228), and the longest request either would default to follows the same
    count."""
    prompt = _prompt(PROMPT, 0)
    whole = _llm(gemma3, num_blocks=130, hybrid_kv_cache=False)
    with pytest.raises(RequestRejected) as e:
        whole.engine.add_request("r", prompt, _greedy(NEW))
    assert e.value.param == "prompt"
    assert whole.engine.limits.max_request_tokens == 130 // 6 * BS
    assert whole.engine.kv_sizing.describe().endswith(
        "= 130 blocks = 86 tokens (hybrid KV cache off: its 5 sliding-window layers are "
        "kept whole)")
    hybrid = _llm(gemma3, num_blocks=130)
    assert hybrid.engine.limits.max_request_tokens == 256  # 64 + 5 · 13 pages: the context
    # the start-up line says so, where every layer whole would say 86 tokens
    assert hybrid.engine.kv_sizing.describe().endswith(
        "= 130 blocks = 1 request of 256 tokens at once (its 1 global layer holding each "
        "one's context, its 5 sliding-window layers only their window (16 tokens)); 86 "
        "tokens with every layer whole")
    short = _llm(gemma3, num_blocks=100).engine.kv_sizing
    assert (short.requests, short.longest) == (0, 140)  # 35 + 5 · 13 pages
    assert "= 100 blocks = one request of up to 140 tokens (" in short.describe()
    got, _ = _run(hybrid, [prompt])
    assert got == _run(_llm(gemma3), [prompt])[0]


def test_the_pool_is_sized_by_windows(gemma3) -> None:
    """An automatic pool is capped at max_num_seqs requests of the context, each local
    lane its window's pages."""
    one = request_blocks(256, [W] * 5 + [None], CHUNK, BS)
    assert one == 64 + 5 * 13
    auto = _llm(gemma3, num_blocks=None, max_num_seqs=4).engine
    assert auto.pool.num_blocks == 4 * one
    assert auto.kv_sizing.requests == 4 and "= 4 requests of 256 tokens at once (" in \
        auto.kv_sizing.describe()
    assert _llm(gemma3, num_blocks=None, max_num_seqs=4, hybrid_kv_cache=False
                ).engine.pool.num_blocks == 4 * 6 * 64


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_the_tokens(gemma3, mode: str) -> None:
    """Four requests in a pool for fewer: preempted by `mode`, the same tokens as a roomy
    pool's, every step's invariants intact."""
    prompts = [_prompt(PROMPT - 20 * i, i) for i in range(4)]
    want, _ = _run(_llm(gemma3), prompts)
    tight = _llm(gemma3, num_blocks=200, preemption_mode=mode)
    got, _ = _run(tight, prompts)
    assert got == want
    assert tight.engine.scheduler.preemptions[mode] > 0


@pytest.mark.parametrize("other", [0, 60, 120])
def test_a_prefix_hit_gives_the_tokens_of_no_prefix_caching(gemma3, other: int) -> None:
    """B shares 100 tokens (25 pages) with A, which ran before: B takes them all, its
    local lanes only their window's last pages (21-24), and generates what it generates
    with prefix caching off. A request of `other` tokens between them recycles parked
    pages, the oldest first: at 60 A's oldest local pages leave its groups (-1), which
    still serve B's whole hit (a group that lost a global lane's page would be gone); at
    120 the local pages B's windows need are gone too, and every shorter hit's (the
    oldest go first): B computes its prompt (shorter hits: test_longest_hit_...)."""
    a = _prompt(120, 1)
    b = a[:100] + _prompt(30, 2)
    want, _ = _run(_llm(gemma3, enable_prefix_caching=False), [b], 20)
    llm = _llm(gemma3, num_blocks=260)
    eng = llm.engine
    _run(llm, [a], 10)
    if other:  # it fills the never-used pages, then recycles parked ones
        _run(llm, [_prompt(other, 3)], 30)
        first = eng.pool.groups[_block_hash(eng, a, 0)]
        assert first[5] >= 0 and all(x == -1 for x in first[:5]), first
    got, use = _run(llm, [b], 20)
    assert got == want
    hit = use[0].prefix_hit_tokens
    assert hit == (100 if other < 120 else 0)


def _block_hash(eng, prompt: list[int], i: int) -> int:
    from scheduler.prefix import block_hashes

    return block_hashes(prompt, eng.kv.block_size, None)[i]


def test_vllm_blocks_span_vllms_groups() -> None:
    """vLLM's hybrid manager groups layers by the fewest of one kind (Gemma 3's 1 global
    : 5 local), or the most where that is under 1.5 times the fewest (gpt-oss with a
    drafter: 12 local, 13 global); one kind is one group of every layer."""
    assert vllm_block_lanes([W] * 5 + [None]) == 1
    assert vllm_block_lanes(([W] * 5 + [None]) * 2) == 2
    assert vllm_block_lanes([W] * 12 + [None] * 13) == 13
    assert vllm_block_lanes([None] * 6) == vllm_block_lanes([W] * 6) == 6


def test_longest_hit_needs_each_window_whole() -> None:
    """Synthetic groups (lane 0 windowed, w = 6 over 4-token pages: a hit of k pages needs
    pages (4k - 5) // 4 .. k - 1 of it): a page missing inside that span shortens the hit
    to where the span is whole again, and a lookup takes references only on the pages a
    hit needs."""
    ok, gone = (1, 2), (-1, 2)
    assert longest_hit([ok] * 5, [6, None], 4) == 5
    assert longest_hit([gone, gone, gone, ok, ok], [6, None], 4) == 5  # needs 3, 4
    assert longest_hit([ok, ok, ok, gone, ok], [6, None], 4) == 3  # 4 needs 3; 3 needs 1, 2
    assert longest_hit([ok, ok, ok, ok, gone], [6, None], 4) == 4
    assert longest_hit([gone] * 3, [6, None], 4) == 0  # even one page needs page 0
    pool = BlockPool(32, 4)
    kv = KVCacheManager(pool, 2, windows=[6, None])
    ids = pool.allocate(10).view(5, 2)
    for j in range(5):
        pool.register(100 + j, ids[j])
    pool.release(ids.flatten())  # parked: still cached
    hits = kv.lookup([100 + j for j in range(5)])
    assert len(hits) == 5
    assert [int(h[0]) for h in hits[:3]] == [-1, -1, -1]  # before the window: not taken
    assert pool.ref[ids[:3, 0]].tolist() == [0, 0, 0] and pool.ref[ids[3:, 0]].tolist() == [1, 1]
    assert pool.ref[ids[:, 1]].tolist() == [1] * 5
    kv.drop(hits)
    assert pool.num_used == 0


def test_a_head_pool_trims_a_windowed_layers_lanes_alike(gemma3) -> None:
    """Over a per-head pool (lanes = layer × kv head) each local layer's two lanes are
    windowed and trimmed; the tokens are the per-layer pool's."""
    prompt = _prompt(PROMPT, 0)
    head = _llm(gemma3, kv_layout="head", max_num_batched_tokens=256)
    assert head.engine.kv.windows == [W] * 10 + [None] * 2
    got, use = _run(head, [prompt])
    assert got == _run(_llm(gemma3, max_num_batched_tokens=256), [prompt])[0]
    context = -(-(PROMPT + NEW - 1) // BS)
    assert use[0].peak_blocks <= 2 * (context + 5 * window_blocks(W, 256, BS))


def test_a_policy_acts_on_the_global_layer_alone(gemma3) -> None:
    """streaming (4 sinks, window 20) on the 5:1 model: the global lane keeps sinks and
    window, each local lane its window, and the tokens are those of a dense forward
    whose global layer lets a generated token see the sinks and the last 20 positions
    (the whole prompt for the prompt's own) and whose local layers see their windows."""
    sink, window, new = 4, 20, 40
    llm = _llm(gemma3, max_num_batched_tokens=256, min_prefill_chunk=256)
    prompt = _prompt(60, 5)
    policy = {"name": "streaming", "sink": sink, "window": window}
    (got,), (use,) = _run(llm, [prompt], new, kv_policy=policy)
    eng = llm.engine
    assert use.evicted_tokens > 0
    # the global lane at sink + window + the step's token; the local ones at their window
    assert use.peak_blocks <= 5 * window_blocks(W, 60, BS) + -(-60 // BS)
    assert eng.kv.policy_lanes == [5]

    model, cfg = eng.model, eng.model_config
    ids = torch.tensor(prompt + got[:-1])
    pos = torch.arange(len(ids))
    delta = pos[:, None] - pos[None, :]

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mask = delta >= 0
        if cfg.sliding_windows[layer] is not None:
            mask &= delta < cfg.sliding_windows[layer]
        else:
            kept = (pos[None, :] < sink) | (delta <= window)
            mask &= kept | (pos[:, None] < len(prompt))
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * cfg.attn_scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)

    with torch.inference_mode():
        logits = model.compute_logits(model(ids, pos, attn))
    assert logits[len(prompt) - 1:].argmax(dim=-1).tolist() == got


@pytest.mark.parametrize("layout", ["layer", "head"])
@pytest.mark.parametrize("name", ["knorm", "paged_eviction", "keydiff", "h2o", "tova",
                                  "lazy_eviction", "snapkv", "pyramid", "expected_attention"])
def test_a_prompt_chunk_longer_than_the_window(gemma3, name: str, layout: str) -> None:
    """A prompt chunk longer than the local layers' window (64 tokens, window 16): their
    lanes are trimmed to the window before the policy runs, so some of the step's new
    tokens are gone from them; every scoring policy still acts on the global lane, per
    layer and per head, and keeps it near its budget (it once failed: the new tokens'
    norms were written at negative slots of the trimmed lanes)."""
    budget = 24
    pages = 2000 * (2 if layout == "head" else 1)
    llm = _llm(gemma3, max_num_batched_tokens=64, min_prefill_chunk=64, kv_layout=layout,
               num_blocks=pages)
    policy = {"name": name, "budget": budget}
    (got,), (use,) = _run(llm, [_prompt(100, 7)], 8, kv_policy=policy)
    # the global lane ends near its budget: of 107 tokens it evicted most
    assert len(got) == 8 and use.evicted_tokens >= 100 + 8 - 1 - 2 * budget


def test_a_policy_on_a_model_of_windows_alone_has_nothing_to_bound(tmp_path) -> None:
    """Mistral-style, every layer windowed (24): a streaming request's policy has no
    global layer to act on, so it runs as full, its windows bounding it."""
    llm = _llm(make_tiny_model("mistral", tmp_path), max_num_batched_tokens=256)
    prompt = _prompt(100, 7)
    (full,), _ = _run(llm, [prompt], 30)
    (got,), (use,) = _run(llm, [prompt], 30, kv_policy={"name": "streaming", "window": 8})
    assert got == full and use.evicted_tokens == 0
    assert llm.engine.stats().requests_by_policy_total["streaming"] == 1


def test_expected_attention_scores_by_the_models_scale(tmp_path, monkeypatch) -> None:
    """Gemma's softmax scale is query_pre_attn_scalar ** -0.5, not head_dim's: the policy
    scores with it."""
    path = make_tiny_model("gemma2", tmp_path)
    llm = _llm(path, max_num_batched_tokens=256)
    scales = []
    real = ea.expected_scores

    def recording(*args):
        scales.append(args[-1])
        return real(*args)

    monkeypatch.setattr(ea, "expected_scores", recording)
    _run(llm, [_prompt(80, 6)], 4, kv_policy={"name": "expected_attention", "budget": 32},
         watch=False)
    assert scales and all(x == pytest.approx(24 ** -0.5) for x in scales)
    assert llm.engine.model_config.attn_scale == pytest.approx(24 ** -0.5) != 32 ** -0.5


@pytest.mark.parametrize(("hybrid", "policy", "param"), [
    (True, {"name": "streaming", "window": 32, "rope": "shift"}, "kv_policy.rope"),
    (False, {"name": "expected_attention", "budget": 32}, "kv_policy.name"),
    (True, {"name": "expected_attention", "budget": 32}, None),
])
def test_policies_that_assume_one_rope_are_refused_where_it_is_not(
        gemma3, hybrid: bool, policy: dict, param: str | None) -> None:
    """Through the server, on Gemma 3 (its local layers rotate by their own base): rope
    shift is a 400 (windows are positions), expected_attention a 400 where it would act
    on the local layers (the hybrid KV cache off) and served where it acts on the global
    one."""
    with tiny_server(gemma3, hybrid_kv_cache=hybrid, block_size=BS) as s, \
            httpx.Client(base_url=s.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "abc " * 30,
                                            "max_tokens": 4, "kv_policy": policy})
    if param is None:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["kv_cache"]["policy"] == "expected_attention"
        return
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
