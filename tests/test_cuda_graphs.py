"""Decode steps through engine/cuda_graphs.py: static buffers, padded buckets, eviction
between replays.

Without capture (`capture=False`: on a CPU through Triton's interpreter) every other
part runs: the staging copy, padding a batch up to its bucket (padded rows write the
pool's scratch block and see nothing), tables wider than the step (`slot_count`), and a
policy evicting between steps, and the statistics graphs (attention mass for h2o and
pyramid, K/V norms for knorm). The generations must equal the eager engine's. On a CUDA
machine the engines also capture and replay real graphs, against `--enforce-eager` and
against transformers.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from attention.storage import KVStorage
from engine.sampling import SamplingParams
from scheduler import engine_core
from scheduler.llm import LLM
from tests.tiny_models import make_tiny_model, resolved

pytest.importorskip("triton")
cuda_graphs = pytest.importorskip("engine.cuda_graphs")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# h2o reads attention mass, knorm its tokens' key norms: statistics graphs, beside plain
# ones in a mixed batch (the mass computed for the rows that ask alone).
POLICIES = [None, {"name": "streaming", "sink": 4, "window": 12},
            {"name": "h2o", "budget": 24}]
# SnapKV scores the prompt once, then decodes with nothing to ask: graph steps over
# tables with scattered holes.
SNAPKV = [None, {"name": "snapkv", "budget": 12, "obs_window": 4}]
STATS = [{"name": "knorm", "budget": 16}, {"name": "pyramid", "budget": 16, "obs_window": 4},
         {"name": "tova", "budget": 20}]
PARAMS = pytest.mark.parametrize("policies", [POLICIES[:1], POLICIES[:2], SNAPKV, POLICIES,
                                              STATS],
                                 ids=["full", "streaming", "snapkv", "mixed", "statistics"])


STREAMING = {"name": "streaming", "sink": 2, "window": 6}


def test_batch_buckets() -> None:
    assert cuda_graphs.batch_buckets(1) == [1]
    assert cuda_graphs.batch_buckets(8) == [1, 2, 4, 8]
    assert cuda_graphs.batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("graphs"), num_hidden_layers=2)


class ScratchStorage(KVStorage):
    """The storage a CUDA engine with graphs gets (one scratch block), for an engine built
    without them (on a CPU, or eager) that a test gives uncaptured graphs."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **{**kw, "scratch": True})


@pytest.fixture
def scratch_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_core, "KVStorage", ScratchStorage)


# Each request's length: 4, 6 or 8 tokens (two requests finish, then two more, then the
# last runs alone: the batch goes 5 -> 3 -> 1, buckets 8 -> 4 -> 1). Short, because on a
# CPU every graph step runs Triton's interpreter; LONG reaches past 48 slots.
GEN = [4 + 2 * (i % 3) for i in range(5)]
LONG = [6 + 4 * (i % 3) for i in range(5)]


def _run(path: str, graphs: str, policies: list, device: str = DEVICE, attention=None,
         gen_lengths: list[int] = GEN) -> tuple[list[list[int]], LLM]:
    """Greedy generations of 5 requests (prompts of 9..41 tokens: batches of 5 pad to 8,
    then 3 to 4 as short ones finish) under `graphs`: "off" (eager), "uncaptured"
    (the graph path without capture) or "captured" (CUDA). `attention`: the eager
    steps' attention function instead of the device's."""
    llm = LLM(path, num_blocks=200, block_size=4, max_num_seqs=8,
              max_num_batched_tokens=64, enforce_eager=graphs != "captured", device=device)
    core = llm.engine
    if attention is not None:
        core.runner.attention_fn = attention
    if graphs == "uncaptured":
        core.runner.graphs = cuda_graphs.DecodeGraphs(core.runner, 8, core.max_model_len,
                                                      capture=False)
    gen = torch.Generator().manual_seed(1)
    for i in range(5):
        prompt = torch.randint(5, 250, (9 + 8 * i,), generator=gen).tolist()
        core.add_request(f"r{i}", prompt, SamplingParams(
            max_tokens=gen_lengths[i], temperature=0, ignore_eos=True, detokenize=False),
            kv_policy=resolved(core, policies[i % len(policies)]))
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            core.check_invariants()
    return [tokens[f"r{i}"] for i in range(5)], llm


@PARAMS
def test_uncaptured_graph_steps_equal_eager(tiny: str, policies: list, scratch_pool) -> None:
    ref, _ = _run(tiny, "off", policies)
    got, llm = _run(tiny, "uncaptured", policies)
    graphs = llm.engine.runner.graphs
    assert got == ref
    assert graphs.steps > 0 and graphs.eager_steps == 0  # every decode step a graph's
    # the statistics graphs served the steps that asked (mixed: the h2o request outlives
    # the others, so each of its steps has an h2o row), the plain ones the others
    assert {s for _, s in graphs.logits} == {policies in (POLICIES, STATS)}
    assert {b for b, _ in graphs.logits} <= {1, 2, 4, 8}
    assert llm.engine.pool.num_used == 0  # the scratch block is nobody's
    _check_overlap(llm, policies)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory) -> str:
    """Attention soft-capping at 10, a sliding (24) and a full layer: the graph's
    attention takes each layer's variants (`ModelRunner.features`) and window."""
    return make_tiny_model("gemma2", tmp_path_factory.mktemp("graphs_gemma2"), num_hidden_layers=2)


@pytest.mark.parametrize("policy", [None, {"name": "h2o", "budget": 24}], ids=["full", "h2o"])
def test_uncaptured_graph_steps_of_a_soft_capped_windowed_model(gemma2: str, policy,
                                                                 scratch_pool) -> None:
    """The graph path's attention (Triton, plain and with the mass for h2o) under the
    model's soft-capping gives the eager engine's log-probabilities (the C++ kernel on a
    CPU): greedy tokens alone barely move with the cap."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3,
                            detokenize=False)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, 250, (9 + 8 * i,), generator=gen).tolist() for i in range(4)]
    runs = []
    for graphs in (False, True):
        llm = LLM(gemma2, num_blocks=200, block_size=4, max_num_seqs=8, enforce_eager=True,
                  device=DEVICE)
        if graphs:
            llm.engine.runner.graphs = cuda_graphs.DecodeGraphs(
                llm.engine.runner, 8, llm.engine.max_model_len, capture=False)
        runs.append((llm.generate(prompts, params, kv_policy=policy), llm))
    (ref, _), (got, llm) = runs
    assert llm.engine.runner.features[0] == {"softcap": 10.0}
    assert llm.engine.runner.graphs.steps > 0
    for r, o in zip(ref, got):
        assert o.token_ids == r.token_ids
        for a, b in zip(r.logprobs, o.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-4


def _check_overlap(llm: LLM, policies: list) -> None:
    """Async scheduling plans a step while the last one runs only in a batch of plain
    requests (no kv_policy: it acts between steps on what the forward saw)."""
    if policies == POLICIES[:1]:
        assert llm.engine.overlapped_steps > 0
    if policies == STATS:  # a policy in every request
        assert llm.engine.overlapped_steps == 0


# 3 tokens a step: fewer than the running requests, so steps leave some out (the next
# one is not planned ahead while a running request has no token in flight), and overlap
# comes only as requests finish
@pytest.mark.parametrize("budget", [64, 3])
@pytest.mark.parametrize("ring", [True, False])
def test_async_scheduling_changes_no_token(tiny: str, scratch_pool, budget: int,
                                           ring: bool) -> None:
    """Async scheduling (EngineCore.step) plans and launches a graph step before the
    tokens of the one in flight are on the host, its ids taken from the device. Every
    request's tokens must equal the engine's that waits for each step: greedy and seeded
    sampled rows, requests finishing on length at different steps, one stopping on a
    token id while the next step is already computed for it (dropped), one aborted
    with a step in flight, two evicting every step (streaming: with its ring, the decode
    append writes over the oldest token as the step after is planned; without, its
    policy acts before the next plan, on sizes and positions alone); a request arriving mid-run ends the
    overlap until it joins; with a token budget under the batch, steps that leave a
    request out. Nothing leaks."""

    def run(overlap: bool, stop: int | None, graphs: bool = True
            ) -> tuple[dict[str, list[int]], LLM]:
        llm = LLM(tiny, num_blocks=200, block_size=4, max_num_seqs=8, device=DEVICE,
                  max_num_batched_tokens=budget, enforce_eager=True, async_scheduling=overlap,
                  streaming_ring=ring)
        core = llm.engine
        if graphs:
            core.runner.graphs = cuda_graphs.DecodeGraphs(core.runner, 8, core.max_model_len,
                                                          capture=False)
        gen = torch.Generator().manual_seed(2)
        prompts = [torch.randint(5, 250, (7 + 5 * i,), generator=gen).tolist() for i in range(6)]

        def params(i: int) -> SamplingParams:
            return SamplingParams(max_tokens=[9, 14, 12, 16, 10, 6][i],
                                  temperature=0.8 if i == 3 else 0, seed=7, ignore_eos=True,
                                  stop_token_ids=[stop] if i == 1 and stop is not None else [],
                                  detokenize=False)
        for i in range(5):  # r0 and r4 evict every step (a policy of sizes alone)
            core.add_request(f"r{i}", prompts[i], params(i),
                             kv_policy=resolved(core, STREAMING if i in (0, 4) else None))
        tokens: dict[str, list[int]] = {}
        calls = 0
        while core.has_unfinished():
            calls += 1
            if calls == 6:
                core.add_request("r5", prompts[5], params(5))  # joins: the overlap waits
            if len(tokens.get("r2", [])) >= 4 and "r2" in core.requests:
                core.abort_request("r2")
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                assert out.num_output_tokens == len(tokens[out.request_id])
            core.check_invariants()
        assert core.pool.num_used == 0 and not core.requests
        return tokens, llm

    # only to pick r1's sixth token as its stop, mid-run: the eager steps give the graph
    # steps' greedy tokens (test_uncaptured_graph_steps_equal_eager) without a third run
    # through Triton's interpreter
    free, _ = run(False, None, graphs=False)
    stop = free["r1"][5]
    ref, _ = run(False, stop)
    got, llm = run(True, stop)
    assert got == ref
    assert len(got["r1"]) == free["r1"].index(stop) + 1 < 14
    assert [len(got[f"r{i}"]) for i in (0, 3, 4, 5)] == [9, 16, 10, 6]
    assert 4 <= len(got["r2"]) < 12
    assert llm.engine.overlapped_steps > (5 if budget > 8 else 0)
    assert llm.engine.stats().evicted_tokens_by_policy_total["streaming"] > 20
    assert bool(llm.engine.scheduler.ring_evicted) == ring  # the ring's, counted as it writes


def test_capture_all_takes_both_graphs_of_every_bucket(tiny: str, scratch_pool) -> None:
    """Warm-up captures the statistics graphs too, so a policy's first request does not
    stall the batch; on padding alone their mass is zero (no row asks, none sees a slot)."""
    llm = LLM(tiny, num_blocks=64, block_size=4, max_num_seqs=4, device=DEVICE,
              enforce_eager=True)
    graphs = cuda_graphs.DecodeGraphs(llm.engine.runner, 4, 64, capture=False)
    graphs.capture_all()
    assert sorted(graphs.logits) == [(b, s) for b in (1, 2, 4) for s in (False, True)]
    mass, kn, _ = graphs.stats[4]
    assert mass.shape[:4] == (2, 4, 1, 1) and not mass.any()
    assert kn.shape == (2, 4, llm.engine.model_config.num_kv_heads)


def test_eager_triton_steps_hand_the_mass_summed_over_heads(tiny: str, monkeypatch) -> None:
    """On a GPU the eager steps (prefill chunks, steps past the graphs) use the Triton
    kernels too: their mass comes summed over the kv heads from the kernel, as the
    statistics graphs hand it (the same pass, so the same bits in either step), not
    per head to be summed on the host (1/Hkv of the bytes to copy out). The
    generations equal the C++ kernel's run on the CPU."""
    from attention.triton_attention import paged_attention_triton
    from engine.runner import ModelRunner

    ref, _ = _run(tiny, "off", STATS, device="cpu")
    shapes: list[tuple[int, ...]] = []
    execute = ModelRunner.execute

    def spy(self, inputs, decode=None, ids_from=None, greedy=False):
        out = execute(self, inputs, decode, ids_from, greedy)
        shapes.extend(tuple(a.group.shape) for a in out.attention.values() if a.group is not None)
        return out

    monkeypatch.setattr(ModelRunner, "execute", spy)
    # the Triton kernels on the GPU where there is one, else through the interpreter
    got, llm = _run(tiny, "off", STATS, device=DEVICE, attention=paged_attention_triton)
    assert got == ref
    assert llm.engine.model_config.num_kv_heads == 2
    assert {s[3] for s in shapes} == {1}  # [L, B, Tq, Hkv, S]: summed, Hkv = 1
    assert {s[2] for s in shapes} > {1}  # prefill chunks' too, not only decode rows


def test_steps_past_the_buffers_run_eagerly(tiny: str, scratch_pool) -> None:
    """A batch larger than the largest bucket, or a table wider than the buffers, is
    no graph's step: the engine runs it eagerly, with the same results."""
    ref, _ = _run(tiny, "off", POLICIES[:1], gen_lengths=LONG)
    llm = LLM(tiny, num_blocks=200, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
              device=DEVICE, enforce_eager=True)
    core = llm.engine
    graphs = cuda_graphs.DecodeGraphs(core.runner, 2, 48, capture=False)  # 2 rows, 48 slots
    core.runner.graphs = graphs
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 250, (9 + 8 * i,), generator=gen).tolist() for i in range(5)]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
              for n in LONG]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    assert graphs.steps > 0 and graphs.eager_steps > 0


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
@PARAMS
def test_captured_graphs_equal_eager(tiny: str, policies: list) -> None:
    eager, _ = _run(tiny, "off", policies)
    got, llm = _run(tiny, "captured", policies)
    graphs = llm.engine.runner.graphs
    assert got == eager
    assert graphs.graphs and graphs.steps > 0 and graphs.eager_steps == 0
    _check_overlap(llm, policies)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("family", ["llama", "llama3", "mistral", "qwen2", "qwen3", "gpt_neox"])
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_greedy_parity_with_transformers_on_cuda(tmp_path, family: str, eager: bool) -> None:
    """transformers on the same GPU is the reference; bf16 would round differently from
    it at every layer, so both run in fp32."""
    path = make_tiny_model(family, tmp_path / family)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().cuda()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (3, 17, 40)]
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=12,
                              do_sample=False, pad_token_id=0, eos_token_id=None)
            refs.append(out[0, len(p):].tolist())
    llm = LLM(path, num_blocks=256, block_size=4, enforce_eager=eager)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                detokenize=False))
    assert [o.token_ids for o in outs] == refs
    assert (llm.engine.runner.graphs is None) == eager
    if not eager:
        assert llm.engine.runner.graphs.steps > 0
