"""Expected Attention (`expected_attention`, policies/expected_attention.py; arXiv
2510.00636) against NVIDIA kvpress's `ExpectedAttentionPress`, in the engine.

tests/data/kvpress_demo.pt holds the scores the press (kvpress 0.5.5, its defaults:
512 future positions, 4 sinks, covariance and ‖V‖ on) computed per kv head on the demo
model for one 192-token prompt (benchmarks/kvpress_reference.py). The same prompt runs
through our engine at the same budget (96 kept): per head (`uniform`) every lane keeps
exactly the press's top set for its head, AdaKV (`adaptive`) what `AdaKVPress` keeps
from those scores, and a per-layer pool the top of their head mean; a chunked prefill
keeps the one-shot sets (the query sums add up across chunks). Then real generation on
both layouts, prefix caching, and bad parameters through the server.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.nn.functional as F

from engine.demo import DEMO_MODEL_DIR
from engine.rope import apply_rotary
from engine.sampling import SamplingParams
from policies import expected_attention as ea
from policies.catalog import parse_kv_policy
from policies.config import KVPolicyError
from policies.heads import ALPHA
from policies.rows import RowsView
from scheduler.engine_core import EngineConfig, EngineCore
from scheduler.llm import LLM
from scheduler.resolve import resolve_request
from tests.live_server import tiny_server
from tests.policy_recording import step_recording
from tests.test_kvpress_heads import _adakv

REFERENCE = Path(__file__).parent / "data" / "kvpress_demo.pt"
MODEL = str(DEMO_MODEL_DIR)
HEADS, LAYERS, SINK = 2, 4, 4  # the demo model's kv heads and layers; the press's n_sink


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    return torch.load(REFERENCE)


def _budget(ref: dict[str, Any]) -> int:
    return int(len(ref["prompt"]) * (1 - ref["compression_ratio"]))  # kvpress's n_kept


def _run(ref: dict[str, Any], layout: str, heads: str, monkeypatch: pytest.MonkeyPatch,
         chunk: int = 2048) -> tuple[list[set[int]], list[torch.Tensor], int]:
    """The prompt under the policy at the press's budget: every lane's kept positions
    after the prompt, the scores it ranked each lane by (`expected_scores`' answers, in
    lane order), and the steps that only summed the queries (prompt chunks before the
    last)."""
    core = EngineCore(EngineConfig(model=MODEL, num_blocks=2048, device="cpu",
                                   kv_layout=layout, enable_prefix_caching=False,
                                   max_num_batched_tokens=chunk))
    cfg = {"name": "expected_attention", "budget": _budget(ref), "heads": heads}
    core.add_request("r", ref["prompt"], SamplingParams(max_tokens=2),
                     kv_policy=resolve_request(core.limits, cfg).kv_policy)
    scores: list[torch.Tensor] = []
    real = ea.expected_scores

    def recording(*args: Any) -> torch.Tensor:
        out = real(*args)
        scores.append(out)
        return out

    monkeypatch.setattr(ea, "expected_scores", recording)
    kept: list[set[int]] = []
    summing = 0

    def record(cls: type, view: RowsView, drop: torch.Tensor | None) -> None:
        nonlocal summing
        if not view.prefill_done[0]:
            summing += drop is None and view.query_sum is not None
            return
        for lane in range(view.num_layers):
            pos = view.positions[lane]
            gone = torch.zeros_like(pos, dtype=torch.bool) if drop is None else drop[lane]
            kept.append(set(pos[(pos >= 0) & ~gone].tolist()))

    step_recording(core, record)
    assert len(kept) == len(scores) == core.kv.num_layers
    return kept, scores, summing


def _top(scores: torch.Tensor, k: int) -> set[int]:
    return set(scores.topk(k).indices.tolist())


def test_mean_rotation_is_ropes_rotation_averaged() -> None:
    """At one position R̄ is RoPE itself (the model's `apply_rotary`, scaling and a
    pass-through tail of a partial rotary included); over n positions their mean."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))  # rotary 8
    x = torch.randn(3, 1, 12, dtype=torch.float64)  # head dim 12: 4 dims pass through
    for p in (0, 5, 300):
        freqs = torch.tensor([float(p)])[:, None] * inv_freq
        want = apply_rotary(x, freqs.cos() * 1.5, freqs.sin() * 1.5)
        got = x @ ea.mean_rotation(inv_freq, 1.5, p, 1, 12).T
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    mean = sum(ea.mean_rotation(inv_freq, 1.0, p, 1, 12) for p in range(7, 17)) / 10
    torch.testing.assert_close(ea.mean_rotation(inv_freq, 1.0, 7, 10, 12), mean)


@pytest.mark.parametrize(("cov", "vnorm", "eps", "scale"), [
    (True, True, 0.0, None), (False, True, 0.0, None), (True, False, 0.0, None),
    (True, True, 0.01, None), (True, True, 0.0, 0.4), (False, True, 0.0, 0.4)])
def test_scores_are_the_press_formula(cov: bool, vnorm: bool, eps: float,
                                      scale: float | None) -> None:
    """`expected_scores` against kvpress's `score` transcribed (repeat_kv, softmax per
    query head over the keys past the sinks, group mean, (· + eps) × ‖v‖) on random
    keys and statistics, two kv heads of a group of 3; ours is the mean over kv heads.
    With a model's own softmax scale s (Gemma's) in place of 1/√d: s·μk + s²·kᵀΣk / 2."""
    g = torch.Generator().manual_seed(0)
    hkv, grp, d, n = 2, 3, 16, 40
    keys, values = torch.randn(hkv, n, d, generator=g), torch.randn(hkv, n, d, generator=g)
    mu = torch.randn(hkv * grp, d, generator=g, dtype=torch.float64)
    a = torch.randn(hkv * grp, d, d, generator=g, dtype=torch.float64) / 4
    sigma = a @ a.transpose(1, 2)
    k = keys[:, SINK:].repeat_interleave(grp, dim=0).transpose(1, 2)  # [H, d, n - sink]
    s = 1 / math.sqrt(d) if scale is None else scale
    z = (mu.float()[:, None] @ k)[:, 0] * s
    if cov:
        z += torch.einsum("hin,hij,hjn->hn", k, sigma.float(), k) * s * s / 2
    theirs = F.softmax(z, dim=-1).view(hkv, grp, -1).mean(dim=1)
    if vnorm:
        theirs = (theirs + eps) * values[:, SINK:].norm(dim=-1)
    cand = torch.arange(n) >= SINK
    mine = ea.expected_scores(keys.transpose(0, 1), values.norm(dim=-1).T if vnorm else None,
                              cand, mu.view(hkv, grp, d), sigma.view(hkv, grp, d, d) if cov
                              else None, eps, scale)
    torch.testing.assert_close(mine[SINK:], theirs.mean(dim=0), atol=1e-6, rtol=1e-5)
    assert bool((mine[:SINK] == 0).all())


def test_each_head_keeps_exactly_the_press_top_set(ref, monkeypatch) -> None:
    """uniform on a per-head pool: lane (layer, h) scores as the press's head h (to fp32
    rounding) and keeps its sinks and the top k - 4 of the rest: all 8 sets exact (the
    press's k-th and k+1-th scores lie ≥ 3e-4 apart, our scores within 3e-6)."""
    k = _budget(ref)
    kept, scores, _ = _run(ref, "head", "uniform", monkeypatch)
    theirs = ref["scores"]["expected_attention"]  # [L, H, n]; sinks at max + 1
    differ = False
    for layer in range(LAYERS):
        lanes = kept[layer * HEADS : (layer + 1) * HEADS]
        differ |= lanes[0] != lanes[1]
        for h in range(HEADS):
            mine, t = scores[layer * HEADS + h], theirs[layer, h]
            torch.testing.assert_close(mine[SINK:], t[SINK:], atol=1e-7, rtol=1e-4)
            assert lanes[h] == _top(t, k), (layer, h)
    assert differ


def test_adaptive_keeps_what_adakv_press_keeps(ref, monkeypatch) -> None:
    """adaptive: each head keeps exactly what AdaKVPress keeps from the press's scores,
    the layer H·k in all, at least ALPHA·k a head, and some layer's heads unequally."""
    k = _budget(ref)
    kept, _, _ = _run(ref, "head", "adaptive", monkeypatch)
    unequal = False
    for layer in range(LAYERS):
        lanes = kept[layer * HEADS : (layer + 1) * HEADS]
        assert sum(len(x) for x in lanes) == HEADS * k
        unequal |= len(lanes[0]) != len(lanes[1])
        theirs = _adakv(ref["scores"]["expected_attention"][layer].float(), k)
        assert lanes == theirs, layer
        assert min(len(x) for x in lanes) >= int(ALPHA * k)
    assert unequal


def test_a_layer_pool_keeps_the_top_of_the_press_head_mean(ref, monkeypatch) -> None:
    """Per layer: the score is the mean over kv heads of the press's, and the kept set
    is exactly the top k of that mean (the sinks are the press's top in every head)."""
    k = _budget(ref)
    kept, scores, _ = _run(ref, "layer", "shared", monkeypatch)
    for layer in range(LAYERS):
        t = ref["scores"]["expected_attention"][layer].mean(dim=0)
        torch.testing.assert_close(scores[layer][SINK:], t[SINK:], atol=1e-7, rtol=1e-4)
        assert kept[layer] == _top(t, k), layer


@pytest.mark.parametrize(("layout", "heads"), [("layer", "shared"), ("head", "uniform"),
                                               ("head", "adaptive")])
def test_chunked_prefill_keeps_the_one_shot_sets(ref, monkeypatch, layout: str,
                                                 heads: str) -> None:
    """A prompt of 192 in chunks of 24 (7 steps only summing queries) keeps the sets
    one 192-token step keeps: the sums of all chunks are the prompt's."""
    one, _, none = _run(ref, layout, heads, monkeypatch)
    chunked, _, summed = _run(ref, layout, heads, monkeypatch, chunk=24)
    assert (none, summed) == (0, 7)
    assert chunked == one


@pytest.mark.parametrize("layout", ["layer", "head"])
def test_a_group_keeps_what_each_request_alone_keeps(layout: str) -> None:
    """Three prompts compressed in one `select` (a group: rows l·R + r) keep, lane by
    lane, what each keeps as a group of one."""
    prompts = [[5 + (7 * i + 11 * s) % 300 for i in range(64)] for s in range(3)]

    def kept(batch: list[int]) -> dict[int, list[set[int]]]:
        core = EngineCore(EngineConfig(model=MODEL, num_blocks=2048, device="cpu",
                                       kv_layout=layout, enable_prefix_caching=False))
        cfg = resolve_request(core.limits, {"name": "expected_attention", "budget": 20})
        for i in batch:
            core.add_request(str(i), prompts[i], SamplingParams(max_tokens=2),
                             kv_policy=cfg.kv_policy)
        out: dict[int, list[set[int]]] = {}

        def record(cls: type, view: RowsView, drop: torch.Tensor | None) -> None:
            assert drop is not None and view.num_requests == len(batch)
            for r, i in enumerate(batch):
                rows = range(r, view.shape[0], view.num_requests)
                out[i] = [set(view.positions[x][(view.positions[x] >= 0) & ~drop[x]].tolist())
                          for x in rows]

        step_recording(core, record)
        return out

    together = kept([0, 1, 2])
    assert set(together) == {0, 1, 2}
    assert together == {**kept([0]), **kept([1]), **kept([2])}
    assert together[0] != together[1]


def _generate(layout: str, policy: dict[str, Any], prompts: list[list[int]],
              **engine: Any) -> tuple[list[Any], LLM]:
    llm = LLM(MODEL, num_blocks=600 * (HEADS if layout == "head" else 1), block_size=4,
              device="cpu", kv_layout=layout, max_num_batched_tokens=32, **engine)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, detokenize=False)
    return llm.generate(prompts, params, kv_policy=policy), llm


PROMPTS = [[5 + (7 * i + 3 * s) % 300 for i in range(n)] for s, n in ((1, 70), (2, 131))]


@pytest.mark.parametrize("layout", ["layer", "head"])
@pytest.mark.parametrize("extra", [{}, {"use_covariance": False, "use_vnorm": False}])
def test_generates_on_both_layouts(layout: str, extra: dict[str, Any]) -> None:
    """Two prompts batched, chunked prefill: each prompt compressed once to the budget
    (evicted = P - 24 in every lane), then 12 generated tokens kept; the pool is
    consistent and empty afterwards."""
    outs, llm = _generate(layout, {"name": "expected_attention", "budget": 24, **extra},
                          PROMPTS)
    for out, prompt in zip(outs, PROMPTS):
        assert len(out.token_ids) == 12 and out.kv is not None
        assert out.kv.evicted_tokens == len(prompt) - 24, out.kv
        assert out.kv.peak_live_tokens <= len(prompt) + 1, out.kv
    llm.engine.check_invariants()
    assert llm.engine.pool.num_used == 0


def test_shared_heads_on_a_head_pool_generate_what_the_layer_pool_does() -> None:
    """`heads: shared` on a per-head pool ranks every lane by its layer's statistics:
    the same tokens and evictions as the per-layer pool."""
    policy = {"name": "expected_attention", "budget": 24, "heads": "shared"}
    a, _ = _generate("layer", policy, PROMPTS)
    b, _ = _generate("head", policy, PROMPTS)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.kv.evicted_tokens for o in a] == [o.kv.evicted_tokens for o in b]  # type: ignore[union-attr]


def test_prompt_is_computed_not_taken_from_the_prefix_cache() -> None:
    """The policy's statistics are the prompt's own queries: after a full request
    cached the prompt, an expected_attention request takes no hits (and still
    compresses), where a streaming request takes them."""
    llm = LLM(MODEL, num_blocks=600, block_size=4, device="cpu", max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False)
    prompt = PROMPTS[1]
    llm.generate([prompt], params, kv_policy="full")
    hit = llm.generate([prompt], params, kv_policy={"name": "streaming", "sink": 4,
                                                    "window": 100})[0].kv
    ours = llm.generate([prompt], params, kv_policy={"name": "expected_attention",
                                                     "budget": 24})[0].kv
    assert hit is not None and hit.prefix_hit_tokens > 0
    assert ours is not None and ours.prefix_hit_tokens == 0
    assert ours.evicted_tokens == len(prompt) - 24


def test_config_defaults_and_context_rule() -> None:
    c = parse_kv_policy("expected_attention")
    assert (c.budget, c.n_future_positions, c.n_sink, c.use_covariance, c.use_vnorm,
            c.epsilon) == (2048, 512, 4, True, True, 0.0)
    assert c.for_context(1024).budget == 512
    assert parse_kv_policy({"name": "expected_attention", "heads": "adaptive"}).heads == "adaptive"
    with pytest.raises(KVPolicyError) as e:
        parse_kv_policy({"name": "expected_attention", "window": 8})
    assert e.value.param == "kv_policy.window"


@pytest.mark.parametrize(("params", "param"), [
    ({"n_future_positions": 0}, "kv_policy.n_future_positions"),
    ({"n_sink": -1}, "kv_policy.n_sink"),
    ({"epsilon": -0.5}, "kv_policy.epsilon"),
    ({"use_covariance": "sometimes"}, "kv_policy.use_covariance"),
    ({"budget": 0}, "kv_policy.budget"),
    ({"heads": "uniform"}, "kv_policy.heads"),  # a per-layer server
])
def test_bad_values_are_a_400_naming_the_field(server: Any, params: dict[str, Any],
                                               param: str) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/completions", json={
            "model": "tiny", "prompt": "def read(path):", "max_tokens": 2,
            "kv_policy": {"name": "expected_attention", **params}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_a_request_through_the_server_evicts(server: Any) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/completions", json={
            "model": "tiny", "prompt": "The os module provides " * 20, "max_tokens": 8,
            "ignore_eos": True, "kv_policy": {"name": "expected_attention", "budget": 0.25}})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    kv = usage["kv_cache"]
    assert kv["policy"] == "expected_attention" and usage["completion_tokens"] == 8
    prompt = usage["prompt_tokens"]
    assert kv["evicted_tokens"] == prompt - round(0.25 * prompt), (prompt, kv)


@pytest.fixture(scope="module")
def server() -> Any:
    with tiny_server(MODEL, num_blocks=1024, device="cpu") as s:
        yield s
