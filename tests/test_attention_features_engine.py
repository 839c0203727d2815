"""The attention variants through the engine, against transformers: a tiny Gemma 2
(attention logit soft-capping at 10, which moves these log-probabilities by up to 10;
query_pre_attn_scalar's scale; sliding (window 8) and full layers alternating) served
with prompts several windows long, in chunks shorter than the window so that a chunk's
queries straddle its edge, and repeated so that later requests start from the prefix
cache, through the CPU paths (the C++ decode kernel, the torch path's
explicit softmax for chunks, the causal op where it runs) and through the Triton
kernels (`runner.attention_fn`, interpreted on CPU); then learned sinks with the cap on
a tiny Llama body, per-layer and per-head pools. Kernel by kernel:
tests/test_attention_features.py, tests/test_triton_features.py; the Gemma families'
own parity: tests/test_parity.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.sampling import SamplingParams
from scheduler.llm import LLM
from tests.tiny_models import make_tiny_model

MAX_NEW = 6
WINDOW = 8


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """(path, prompts, references): greedy tokens and the first token's log-probabilities
    from transformers' eager attention (the one that soft-caps)."""
    path = make_tiny_model("gemma2", tmp_path_factory.mktemp("gemma2"), num_hidden_layers=4,
                           sliding_window=WINDOW)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None
    assert hf.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(5, 250, (21,), generator=g).tolist()
    prompts = [shared + torch.randint(5, 250, (n,), generator=g).tolist() for n in (3, 14)]
    prompts += [torch.randint(5, 250, (n,), generator=g).tolist() for n in (1, 6, 30)]
    prompts += prompts[:2]  # again: their prefix comes from the cache
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
            refs.append((out[0, len(p):].tolist(), torch.log_softmax(hf(ids).logits[0, -1], -1)))
    return path, prompts, refs


def _check(llm: LLM, prompts: list, refs: list) -> None:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=5,
                            detokenize=False)
    outs = llm.generate(prompts, params)
    for i, (o, (tokens, logp)) in enumerate(zip(outs, refs)):
        assert o.token_ids == tokens, f"prompt {i} (len {len(prompts[i])})"
        for tok, lp in o.logprobs[0].top:
            assert abs(lp - logp[tok].item()) < 1e-4, (i, tok)
    llm.engine.check_invariants()
    assert llm.engine.pool.num_used == 0


@pytest.mark.parametrize("layout", ["layer", "head"])
def test_soft_capped_windowed_gemma2_equals_transformers(gemma2, layout: str) -> None:
    """On a per-layer pool and a per-head one (`--kv-layout head`: each kv head a
    sequence of its own, its windowed lanes trimmed alike)."""
    path, prompts, refs = gemma2
    llm = LLM(path, num_blocks=800, block_size=4, device="cpu", kv_layout=layout,
              max_num_batched_tokens=5, enable_prefix_caching=True)
    assert llm.engine.runner.features[0] == {"softcap": 10.0}
    _check(llm, prompts, refs)
    assert llm.engine.scheduler.prefix_hits > 0


def test_soft_capped_windowed_gemma2_on_the_triton_kernels(gemma2) -> None:
    """The runner's Triton path (what a CUDA device selects): decode rows through the
    decode kernel, chunks after a cached prefix through the general one, each layer's
    window and the cap as compile-time flags."""
    triton_attention = pytest.importorskip("attention.triton_attention")
    path, prompts, refs = gemma2
    llm = LLM(path, num_blocks=400, block_size=4, device="cpu", max_num_batched_tokens=5,
              enable_prefix_caching=True)
    calls: list[tuple[int, object]] = []

    def counted(q: torch.Tensor, *args: object, **kw: object):
        calls.append((q.shape[1], args[6]))  # (queries a row, the layer's window)
        return triton_attention.paged_attention_triton(q, *args, **kw)

    llm.engine.runner.attention_fn = counted
    _check(llm, prompts[:4], refs[:4])
    assert {tq > 1 for tq, _ in calls} == {True, False}
    assert {w for _, w in calls} == {WINDOW, None}


@pytest.mark.parametrize("layout", ["layer", "head"])
@pytest.mark.parametrize("path_name", ["cpu", "triton"])
def test_learned_sinks_through_the_engine(tmp_path, layout: str, path_name: str) -> None:
    """Learned sinks (gpt-oss's) and soft-capping together on a tiny Llama body, through
    every step kind: a fresh prompt's causal attention, chunks of 5 after a cached prefix,
    decode rows; on a per-layer pool and a per-head one (each kv head's rows take its
    query heads' sinks, `heads_features`). The sinks and the cap together belong to no
    family (gpt-oss's sinks alone: tests/test_parity.py), so the runner's per-layer
    arguments are set as `layer_features` makes them for a model whose
    `attention_sinks(layer)` gives these; the reference is the same model's forward over
    each whole sequence with a dense attention that has the sinks and the cap
    (tests/test_models.py's `dense_attention`)."""
    from tests.test_models import dense_attention

    path = make_tiny_model("llama", tmp_path)
    llm = LLM(path, num_blocks=600, block_size=4, device="cpu", kv_layout=layout,
              max_num_batched_tokens=5, enable_prefix_caching=True)
    runner, cfg = llm.engine.runner, llm.engine.model_config
    if path_name == "triton":
        runner.attention_fn = pytest.importorskip("attention.triton_attention").paged_attention_triton
    g = torch.Generator().manual_seed(3)
    sinks = [torch.randn(cfg.num_heads, generator=g) * 3 for _ in range(cfg.num_layers)]
    runner.features = [{"softcap": 4.0, "sinks": s} for s in sinks]
    shared = torch.randint(5, 250, (13,), generator=g).tolist()
    prompts = [shared + torch.randint(5, 250, (n,), generator=g).tolist() for n in (2, 9)]
    prompts += [prompts[0], torch.randint(5, 250, (1,), generator=g).tolist()]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=5,
                            detokenize=False)
    outs = llm.generate(prompts, params)
    model = llm.engine.model
    for p, o in zip(prompts, outs):
        ids = torch.tensor(p + o.token_ids[:-1])
        pos = torch.arange(len(ids))
        attn = dense_attention(torch.zeros(len(ids)), pos, cfg.sliding_windows, cfg.attn_scale,
                               4.0, lambda layer: sinks[layer])
        with torch.inference_mode():
            logp = torch.log_softmax(model.compute_logits(model(ids, pos, attn)), -1)
        assert o.token_ids == logp[len(p) - 1 :].argmax(-1).tolist()
        for step, lps in enumerate(o.logprobs):
            for tok, lp in lps.top:
                assert abs(lp - logp[len(p) - 1 + step, tok].item()) < 1e-4
    assert llm.engine.scheduler.prefix_hits > 0
    llm.engine.check_invariants()
