"""StreamingLLM's ring (kvpool/tables.py, `SlotTables.start_ring`): once a streaming
request's cache holds sink + window tokens, each decode token is written over the oldest
past the sinks instead of being appended and evicted after the step.

What must hold, on a real model and pool: the kept set after every step is still the
first `sink` + the newest `window`; the step's attention sees exactly that set, so the
tokens equal those of the evict-after-write path with a window one shorter (which sees
the same set while its step runs); a request at its window holds exactly its window's
blocks, so a pool of k windows runs k requests at once; usage and metrics count the
overwrites as evictions; a block shared through the prefix cache is copied before the
ring writes into it."""

import math

import pytest
import torch

from engine.sampling import SamplingParams
from scheduler.llm import LLM
from scheduler.policy_runner import PolicyRunner
from tests.tiny_models import make_tiny_model, resolved

BS = 4
SINK, WINDOW = 4, 28
CAP = SINK + WINDOW
RING = {"name": "streaming", "sink": SINK, "window": WINDOW}
SHORTER = {"name": "streaming", "sink": SINK, "window": WINDOW - 1}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"), max_position_embeddings=1024)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(5, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _drive(llm: LLM, check=None) -> tuple[dict[str, list[int]], dict[str, object], int]:
    """Step to the end: (tokens, final usage, most requests running in one step)."""
    tokens: dict[str, list[int]] = {}
    usage: dict[str, object] = {}
    most = 0
    eng = llm.engine
    while eng.has_unfinished():
        for o in eng.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.kv is not None:
                usage[o.request_id] = o.kv
        most = max(most, len(eng.scheduler.running))
        eng.check_invariants()
        if check is not None:
            check(eng)
    return tokens, usage, most


def _kept_is_sinks_and_window(eng) -> None:
    for r in eng.scheduler.running:
        if r.policy is None:
            continue
        n = r.num_computed
        want = list(range(n)) if n <= CAP else [*range(SINK), *range(n - WINDOW, n)]
        sp = r.cache.slot_pos
        for layer in range(sp.shape[0]):
            assert sorted(p for p in sp[layer].tolist() if p >= 0) == want, (r.request_id, n)


@pytest.mark.parametrize("prompt_len", [10, 50])  # within the window; past it (evicted, compacted)
def test_the_ring_keeps_the_window_in_exactly_its_blocks(model, prompt_len, monkeypatch):
    """... and once its ring has written, a request is never handed to its policy again
    (nothing to drop, no block more: `Request.ringing`)."""
    steps: dict[tuple[int, str], int] = {}  # (runner, request) -> steps its policy ran
    real = PolicyRunner._note_reserve  # every request its policy looks at comes here

    def noting(self, r, num_new):
        assert not r.ringing
        steps[id(self), r.request_id] = steps.get((id(self), r.request_id), 0) + 1
        real(self, r, num_new)

    monkeypatch.setattr(PolicyRunner, "_note_reserve", noting)
    runs = []
    for ring, cfg in ((True, RING), (False, SHORTER)):
        llm = LLM(model, num_blocks=400, block_size=BS, streaming_ring=ring)
        for i in range(3):
            llm.engine.add_request(f"r{i}", _prompt(i, prompt_len + 5 * i), _greedy(80),
                                   kv_policy=resolved(llm.engine, cfg))
        held: list[int] = []

        def note(eng, held=held):
            held.extend(r.cache.num_blocks for r in eng.scheduler.running
                        if r.num_computed > CAP + 1)

        runs.append((*_drive(llm, _kept_is_sinks_and_window if ring else note), held, llm))
    (tok, usage, _, _, llm), (tok_short, usage_short, _, held_short, _) = runs
    # the same attention every step: the same tokens
    assert tok == tok_short
    nl = llm.engine.model_config.num_layers
    blocks = nl * math.ceil(CAP / BS)
    for i in range(3):
        computed = prompt_len + 5 * i + 80 - 1  # the last sampled token is never fed back
        assert usage[f"r{i}"].evicted_tokens == computed - CAP
        if prompt_len < CAP:  # a long prompt's chunk is held before its plan evicts it
            assert usage[f"r{i}"].peak_live_tokens == CAP
            assert usage[f"r{i}"].peak_blocks == blocks
            assert usage_short[f"r{i}"].peak_blocks > blocks
    assert max(held_short) > blocks  # a block more a layer during the step, a partly dead one
    ring_runner = id(llm.engine.policies)
    for (runner, _), n in steps.items():  # until its ring first wrote; without one, always
        assert n < 40 if runner == ring_runner else n >= 79, (runner == ring_runner, n)
    stats = llm.engine.stats()
    assert stats.evicted_tokens_by_policy_total == {
        "streaming": sum(u.evicted_tokens for u in usage.values())}
    assert llm.engine.pool.num_used == 0


def test_a_pool_of_k_windows_runs_k_requests_at_once(model):
    """Admission reserves a ring request exactly its window's blocks (no watermark when
    every request is reserved): k of them fit a pool of k windows, and none is preempted.
    Appending and evicting after the step needs a block more a layer and a partly dead
    one: one request fewer."""
    k = 4
    most = []
    for ring in (True, False):
        probe = LLM(model, num_blocks=16, block_size=BS)
        nl = probe.engine.model_config.num_layers
        llm = LLM(model, num_blocks=k * nl * math.ceil(CAP / BS), block_size=BS,
                  streaming_ring=ring, enable_prefix_caching=False)
        for i in range(2 * k):
            llm.engine.add_request(f"r{i}", _prompt(i, 12), _greedy(60),
                                   kv_policy=resolved(llm.engine, RING))
        _, _, m = _drive(llm)
        most.append(m)
        assert llm.engine.stats().preemptions_total == {"swap": 0, "recompute": 0}
    assert most == [k, k - 1]


def test_the_ring_copies_a_block_shared_through_the_prefix_cache(model):
    """Two ring requests of one prompt (the second takes the first's published blocks),
    then a third after both: each gets the tokens it gets on a pool without prefix
    caching; while a ring is on, none of its blocks is published or shared."""
    prompt = _prompt(7, 24)
    ref = LLM(model, num_blocks=400, block_size=BS, enable_prefix_caching=False)
    for name, cfg in (("a", RING), ("b", RING), ("c", None)):
        ref.engine.add_request(name, prompt, _greedy(60), kv_policy=resolved(ref.engine, cfg))
    want, _, _ = _drive(ref)

    llm = LLM(model, num_blocks=400, block_size=BS)
    eng = llm.engine
    eng.add_request("a", prompt, _greedy(60), kv_policy=resolved(eng, RING))
    got: dict[str, list[int]] = {}
    usage: dict[str, object] = {}

    def step() -> None:
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.kv is not None:
                usage[o.request_id] = o.kv
        eng.check_invariants()
        for r in eng.scheduler.running:
            if r.cache.ring:
                held = r.cache.owned_blocks()
                assert bool((eng.pool.ref[held] == 1).all())
                assert not any(b in eng.pool.hash_of for b in held.tolist())

    step()  # a's prompt, published
    eng.add_request("b", prompt, _greedy(60), kv_policy=resolved(eng, RING))
    rings = 0
    while eng.has_unfinished():
        step()
        rings = max(rings, sum(r.cache.ring for r in eng.scheduler.running))
    assert rings == 2
    assert usage["b"].prefix_hit_tokens > 0
    eng.add_request("c", prompt, _greedy(60))
    while eng.has_unfinished():
        step()
    assert got == want
    assert eng.pool.num_used == 0


def test_a_swapped_ring_resumes_where_it_was(model):
    """A ring request preempted by swap comes back with its ring (cursor included): its
    tokens are those of a run without preemption."""
    prompts = [_prompt(20 + i, 10) for i in range(3)]
    ref = LLM(model, num_blocks=400, block_size=BS)
    for i, p in enumerate(prompts):
        ref.engine.add_request(f"s{i}", p, _greedy(70), kv_policy=resolved(ref.engine, RING))
    ref.engine.add_request("full", _prompt(30, 10), _greedy(90))
    want, _, _ = _drive(ref)

    llm = LLM(model, num_blocks=80, block_size=BS, preemption_mode="swap")
    for i, p in enumerate(prompts):  # lower priority than the full request: the victims
        llm.engine.add_request(f"s{i}", p, _greedy(70), kv_policy=resolved(llm.engine, RING),
                               priority=1)
    llm.engine.add_request("full", _prompt(30, 10), _greedy(90))
    got, _, _ = _drive(llm, _kept_is_sinks_and_window)
    assert llm.engine.stats().preemptions_total["swap"] > 0
    assert got == want


def test_no_ring_where_positions_are_renumbered_or_trimmed(model, tmp_path):
    llm = LLM(model, num_blocks=400, block_size=BS)
    llm.engine.add_request("shift", _prompt(1, 10), _greedy(60),
                           kv_policy=resolved(llm.engine, {**RING, "rope": "shift"}))
    llm.engine.add_request("ring", _prompt(2, 10), _greedy(60),
                           kv_policy=resolved(llm.engine, RING))
    assert llm.engine.requests["shift"].ring is None
    assert llm.engine.requests["ring"].ring == (SINK, CAP)
    windowed = make_tiny_model("mistral", tmp_path, sliding_window=48)
    llm = LLM(windowed, num_blocks=400, block_size=BS)
    assert not llm.engine.kv.rings
    llm.engine.add_request("ring", _prompt(2, 10), _greedy(60),
                           kv_policy=resolved(llm.engine, RING))
    assert llm.engine.requests["ring"].ring is None
    _drive(llm)  # the window trims the sinks too, as it does without a ring
    assert llm.engine.pool.num_used == 0


def test_a_ring_request_holds_its_window_together_once_its_prompt_is_in(model):
    """Its window's blocks are reserved anyway: taken at once when the prompt is in, each
    layer's consecutive, not one a step interleaved with the other requests' (which
    scatters a row's K/V over the pool). A request that ends within its window (nothing
    reserved) takes only what it fills."""
    llm = LLM(model, num_blocks=400, block_size=BS)
    eng = llm.engine
    eng.add_request("ring", _prompt(3, 10), _greedy(60), kv_policy=resolved(eng, RING))
    eng.add_request("other", _prompt(4, 10), _greedy(60), kv_policy=resolved(eng, RING))
    eng.add_request("short", _prompt(5, 10), _greedy(8), kv_policy=resolved(eng, RING))
    eng.step()  # the prompts
    blocks = math.ceil(CAP / BS)
    caches = {r.request_id: r.cache for r in eng.scheduler.running}
    for name in ("ring", "other"):
        c = caches[name]
        assert c.nblocks == [blocks] * c.num_layers
        for layer in range(c.num_layers):
            ids = c.table[layer, 3:blocks].tolist()  # past the prompt's 3 blocks
            assert ids == list(range(ids[0], ids[0] + len(ids)))
    assert caches["short"].nblocks == [3] * caches["short"].num_layers
    _, usage, _ = _drive(llm, _kept_is_sinks_and_window)
    assert usage["ring"].peak_blocks == usage["other"].peak_blocks == blocks * caches["ring"].num_layers
