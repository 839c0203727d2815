"""A fresh prompt's causal attention on the CPU op (attention/csrc/causal_prefill.h) against
torch's SDPA in fp32 (`causal_self_attention`), and the fallback where the op does not run.

Shapes cross what the kernel must get right: prompts shorter than, equal to and just past
its 16-query blocks (the diagonal chunk's mask, zero rows past T), long ones (many key
chunks, the online softmax's rescaling), GQA groups, every head dim it has a path for,
the strided q/k/v views of a fused qkv output, and bf16 (widened, rounded once at the
end; where the CPU has bf16 dot products, by them or, as on Intel, widened into fp32's
loop: both are checked on any AVX-512 CPU). tests/test_isa.py runs the file again on a build without AVX-512, where the op
refuses and `causal_prefill_cpu` takes SDPA."""

from __future__ import annotations

import pytest
import torch

from attention import cpu_attention
from attention.cpu_attention import causal_prefill_cpu
from attention.torch_attention import causal_self_attention, paged_attention
from engine.model_config import load_model_config

needs_kernel = pytest.mark.skipif(not cpu_attention.kernel_available(),
                                  reason="no C++ compiler for the CPU kernel")


def qkv_views(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    """q, k, v as the models make them: views of one [T, (Hq + 2 Hkv) * D] output."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2).to(dtype)
    return qkv.view(t, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "hq", "hkv", "d"), [
    (1, 2, 1, 16), (15, 4, 2, 64), (16, 3, 3, 64), (17, 12, 12, 64), (40, 8, 2, 32),
    (100, 4, 1, 128), (257, 6, 2, 64), (600, 2, 2, 64)])
def test_the_op_matches_sdpa(dtype: torch.dtype, t: int, hq: int, hkv: int, d: int) -> None:
    q, k, v = qkv_views(t, hq, hkv, d, dtype, seed=t)
    scale = d ** -0.5
    out = causal_prefill_cpu(q, k, v, scale)
    want = causal_self_attention(q.float(), k.float(), v.float(), scale)
    assert out.dtype == dtype and out.shape == (t, hq, d)
    outs = [out]
    if cpu_attention.vector_path() == "avx512":  # the op ran, with this CPU's bf16 path
        op = torch.ops.kvserve.causal_prefill
        assert torch.equal(out, op(q, k, v, scale, fma=cpu_attention.PAIR_FMA))
        # and the other CPU kind's: bf16 dot products, or bf16 widened into fp32's loop
        outs.append(op(q, k, v, scale, fma=not cpu_attention.PAIR_FMA))
        if dtype == torch.float32:  # one loop whatever `fma` says
            assert torch.equal(outs[1], out)
    for o in outs:
        if dtype == torch.float32:
            torch.testing.assert_close(o, want, atol=2e-5, rtol=2e-5)
        else:  # the fp32 result rounded once: within a bf16 ulp of its magnitude
            assert (o.float() - want).abs().max() <= want.abs().max() * 2 ** -7


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_query_sees_exactly_the_keys_up_to_it(dtype: torch.dtype) -> None:
    """A value placed at key j reaches queries j.. only, and with a query whose scores are
    all equal the output is the mean of the values it sees (the mask and the softmax,
    exactly where the blocks and chunks meet: keys 15, 16, 31, 32). In bf16 the
    probabilities (1 or 0) and the means are exact in bf16, so the weighted values' pairs
    of keys must each be the right two keys' values: the answer is exact."""
    t, d = 48, 16
    q = torch.zeros(t, 1, d, dtype=dtype)  # equal scores: each query averages its visible values
    k = torch.randn(t, 1, d).to(dtype)
    v = torch.zeros(t, 1, d, dtype=dtype)
    v[:, 0, 0] = torch.arange(t, dtype=torch.float32)
    means = torch.arange(t, dtype=torch.float32) / 2  # mean of 0..i
    outs = [causal_prefill_cpu(q, k, v, 1.0)]
    if cpu_attention.vector_path() == "avx512":  # both bf16 paths, whichever this CPU takes
        outs += [torch.ops.kvserve.causal_prefill(q, k, v, 1.0, fma=f) for f in (False, True)]
    for out in outs:
        if dtype == torch.bfloat16:
            assert torch.equal(out[:, 0, 0].float(), means)
        else:
            torch.testing.assert_close(out[:, 0, 0], means, atol=1e-5, rtol=1e-6)
        assert not out[:, 0, 1:].any()


@needs_kernel
def test_the_op_refuses_what_it_cannot_run() -> None:
    if cpu_attention.vector_path() != "avx512":
        q, k, v = qkv_views(4, 2, 1, 16, torch.float32)
        with pytest.raises(RuntimeError, match="needs an AVX-512 build"):
            torch.ops.kvserve.causal_prefill(q, k, v, 0.25)
        return
    op = torch.ops.kvserve.causal_prefill
    q, k, v = qkv_views(4, 4, 2, 16, torch.float32)
    for args, match in (((q, k.bfloat16(), v.bfloat16()), "one dtype"),
                        ((q.half(), k.half(), v.half()), "fp32 or bf16"),
                        ((q[:, :3], k, v), "multiple of Hkv"),
                        ((q, k[:3], v[:3]), "causal_prefill takes"),  # T differs
                        ((torch.zeros(4, 16, 4).transpose(1, 2), k, v), "contiguous"),
                        (qkv_views(4, 2, 1, 48, torch.float32), "head dim")):
        with pytest.raises(RuntimeError, match=match):
            op(*args, 0.25)
    assert op(q[:0], k[:0], v[:0], 0.25).shape == (0, 4, 16)


def test_the_fallback_takes_sdpa_where_the_op_does_not_run() -> None:
    """Head dims without a path, fp16, and rows whose heads are not contiguous go to SDPA
    (the same bits as `causal_self_attention`), as does everything without the kernel."""
    for q, k, v in (qkv_views(20, 4, 2, 48, torch.float32),
                    qkv_views(20, 4, 2, 16, torch.float16),
                    tuple(x.transpose(0, 1).contiguous().transpose(0, 1)
                          for x in qkv_views(20, 4, 2, 16, torch.float32))):
        assert torch.equal(causal_prefill_cpu(q, k, v, 0.3), causal_self_attention(q, k, v, 0.3))


needs_op = pytest.mark.skipif(not cpu_attention.causal_prefill_runs(torch.float32, 64),
                              reason="the causal_prefill op runs on AVX-512 builds only")


@pytest.mark.parametrize("d", [64, 48])  # the op where it runs; SDPA (48)
def test_out_takes_the_result_in_place(d: int) -> None:
    """With `out` (a prompt's rows of the step's output, as the runner passes them) the
    result is written there and returned, the same bits as without; the rows around it
    stay. The op refuses an `out` of another shape or dtype, a strided one, or q itself
    (it reads q while it writes)."""
    q, k, v = qkv_views(40, 4, 2, d, torch.bfloat16, seed=3)
    want = causal_prefill_cpu(q, k, v, 0.2)
    step = torch.full((50, 4, d), 7.0, dtype=torch.bfloat16)
    got = causal_prefill_cpu(q, k, v, 0.2, out=step[5:45])
    assert got.data_ptr() == step[5:45].data_ptr() and torch.equal(step[5:45], want)
    assert (step[:5] == 7).all() and (step[45:] == 7).all()
    strided = torch.zeros(4, 40, d, dtype=torch.bfloat16).transpose(0, 1)
    assert torch.equal(causal_prefill_cpu(q, k, v, 0.2, out=strided), want)  # copied into
    if not cpu_attention.causal_prefill_runs(torch.bfloat16, d):
        return
    op = torch.ops.kvserve.causal_prefill
    qc = q.contiguous()
    for out, match in ((torch.empty(39, 4, d, dtype=torch.bfloat16), "out must be"),
                       (torch.empty(40, 4, d), "out must be"),
                       (strided, "out must be"),
                       (qc, "apart from q")):
        with pytest.raises(RuntimeError, match=match):
            op(qc, k, v, 0.2, out=out)


def prefixed_case(p: int, t: int, hq: int, hkv: int, d: int, dtype: torch.dtype,
                  holes: int = 0, bs: int = 16, seed: int = 0) -> dict:
    """A sequence whose first p positions are cached in a pool's blocks (scattered, `holes`
    of them evicted: position -1) and whose chunk of t tokens (positions p..p+t-1) was
    just written after them, as the runner writes a layer's K/V before attending."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = qkv_views(t, hq, hkv, d, dtype, seed=seed)
    nb = -(-(p + t) // bs) + 1  # one table entry past the tokens: a pad (-1)
    blocks = torch.randperm(3 * nb, generator=g)[:nb]
    k_cache = (torch.randn(3 * nb, bs, hkv, d, generator=g) * 2).to(dtype)
    v_cache = (torch.randn(3 * nb, bs, hkv, d, generator=g) * 2).to(dtype)
    table = blocks.clone()
    table[-1] = -1
    slot_pos = torch.full((nb * bs,), -1, dtype=torch.int64)
    slot_pos[: p + t] = torch.arange(p + t)
    if holes:  # evicted prefix slots
        slot_pos[torch.randperm(p, generator=g)[:holes]] = -1
    rows = blocks[torch.arange(p, p + t) // bs] * bs + torch.arange(p, p + t) % bs
    k_cache.view(-1, hkv, d)[rows] = k
    v_cache.view(-1, hkv, d)[rows] = v
    return {"q": q, "k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache, "table": table,
            "slot_pos": slot_pos, "start": p}


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("p", "t", "holes", "hq", "hkv", "d"), [
    (1, 1, 0, 2, 1, 16), (15, 17, 0, 4, 2, 64), (16, 16, 3, 3, 3, 64), (17, 40, 5, 12, 12, 64),
    (100, 5, 0, 8, 2, 32), (300, 257, 40, 4, 2, 64), (33, 100, 0, 4, 1, 128), (5, 3, 5, 2, 2, 16)])
def test_a_chunk_after_a_cached_prefix_matches_the_torch_path(
        dtype: torch.dtype, p: int, t: int, holes: int, hq: int, hkv: int, d: int) -> None:
    """The op over a prefix in the pool (front padding to whole chunks of 16 masked, the
    chunk's diagonal aligned after it, evicted slots and the table's pad skipped) gives the
    torch path's answer (gather, mask, attention in fp32) for the same sequence: prefixes
    shorter than, equal to and past a chunk of 16, many chunks, GQA, every head dim, bf16,
    and a prefix whose every slot was evicted (the fresh prompt's answer)."""
    c = prefixed_case(p, t, hq, hkv, d, dtype, holes, seed=p + t)
    scale = d ** -0.5
    out, none = cpu_attention.prefix_prefill_cpu(
        c["q"], c["k_cache"], c["v_cache"], c["k"], c["v"], c["table"], c["slot_pos"],
        c["start"], scale)
    assert none is None and out.dtype == dtype and out.shape == (t, hq, d)
    want, _ = paged_attention(c["q"].float()[None], c["k_cache"].float(), c["v_cache"].float(),
                              c["table"][None], c["slot_pos"][None],
                              torch.arange(p, p + t)[None], scale, return_probs=True)
    want = want[0]
    op, fma = torch.ops.kvserve.causal_prefill, cpu_attention.PAIR_FMA
    # the other CPU kind's bf16 path too (bf16 dot products, or widened into fp32's loop)
    other = op(c["q"], c["k"], c["v"], scale, c["k_cache"], c["v_cache"], c["table"],
               c["slot_pos"], c["start"], fma=not fma)
    for o in (out, other):
        if dtype == torch.float32:
            torch.testing.assert_close(o, want, atol=2e-5, rtol=2e-5)
        else:  # the fp32 result rounded once: within a bf16 ulp of its magnitude
            assert (o.float() - want).abs().max() <= want.abs().max() * 2 ** -7
    if holes == p:  # nothing visible before the chunk: a fresh prompt
        assert torch.equal(out, op(c["q"], c["k"], c["v"], scale, fma=fma))
    # heads not side by side in a row (a transposed copy): taken contiguous, the same answer
    apart = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in (c["q"], c["k"], c["v"])]
    again, _ = cpu_attention.prefix_prefill_cpu(apart[0], c["k_cache"], c["v_cache"], *apart[1:],
                                                c["table"], c["slot_pos"], c["start"], scale)
    assert torch.equal(again, out)


@needs_op
def test_every_query_sees_the_whole_prefix_and_its_own_keys() -> None:
    """Equal scores: each query's output is the mean of the values it sees, the p prefix
    values (not the pad in front of them, nor the pool's other rows) and the chunk's up
    to itself, exactly where the chunks of 16 meet (p 21: a pad of 11)."""
    p, t, d = 21, 40, 16
    c = prefixed_case(p, t, 1, 1, d, torch.float32)
    c["q"] = torch.zeros(t, 1, d)
    c["k_cache"].view(-1, d)[:] = 1.0  # every value 0 except channel 0 = its position
    vflat = c["v_cache"].view(-1, d)
    vflat[:] = 0.0
    slots = torch.arange(p + t)
    rows = c["table"][slots // 16] * 16 + slots % 16
    vflat[rows, 0] = slots.float()
    v = torch.zeros(t, 1, d)
    v[:, 0, 0] = torch.arange(p, p + t, dtype=torch.float32)
    out, _ = cpu_attention.prefix_prefill_cpu(c["q"], c["k_cache"], c["v_cache"], c["k"], v,
                                              c["table"], c["slot_pos"], p, 1.0)
    means = torch.arange(p, p + t, dtype=torch.float32) / 2  # mean of 0..p+i
    torch.testing.assert_close(out[:, 0, 0], means, atol=1e-4, rtol=1e-6)
    assert not out[:, 0, 1:].any()


@needs_op
def test_the_prefix_arguments_are_checked() -> None:
    c = prefixed_case(20, 4, 4, 2, 16, torch.float32)
    op = torch.ops.kvserve.causal_prefill
    base = (c["q"], c["k"], c["v"], 0.25)
    for kw, match in (({"k_cache": c["k_cache"]}, "together"),
                      ({**c, "k_cache": c["k_cache"].bfloat16()}, "q's dtype"),
                      ({**c, "table": c["table"].int()}, "int64"),
                      ({**c, "table": torch.full_like(c["table"], 999)}, "past the pool")):
        kw = {key: kw[key] for key in ("k_cache", "v_cache", "table", "slot_pos", "start") if key in kw}
        with pytest.raises(RuntimeError, match=match):
            op(*base, **kw)


@needs_op
def test_the_engine_attends_chunks_after_a_prefix_through_the_op(tmp_path, monkeypatch) -> None:
    """A prompt split into chunks and a prefix-cache hit attend through the op (the real
    function, counted), and greedy tokens equal transformers' `generate`."""
    from transformers import AutoModelForCausalLM

    from engine import runner
    from engine.sampling import SamplingParams
    from scheduler.llm import LLM
    from tests.tiny_models import make_tiny_model

    path = make_tiny_model("llama", tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, hf.config.vocab_size, (37,), generator=g).tolist()
    prompts = [shared + torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist()
               for n in (5, 30)]
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                            pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
                for p in prompts]
    calls: list[int] = []

    def counted(q, *args, **kw):
        calls.append(q.shape[0])
        return cpu_attention.prefix_prefill_cpu(q, *args, **kw)

    monkeypatch.setattr(runner, "prefix_prefill_cpu", counted)
    llm = LLM(path, num_blocks=256, block_size=4, max_num_batched_tokens=16,
              enable_prefix_caching=True)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, detokenize=False)
    first = llm.generate(prompts[:1], params)  # 42 tokens: chunks of 16, 16 and 10
    chunked = len(calls)
    second = llm.generate(prompts[1:], params)  # a 36-token hit, then 31 tokens
    assert [first[0].token_ids, second[0].token_ids] == want
    layers = load_model_config(path).num_layers
    assert chunked == 2 * layers  # the second and third chunks, every layer
    assert len(calls) > chunked and llm.engine.scheduler.prefix_hits > 0


@pytest.mark.parametrize(("t", "window"), [(600, 1), (600, 100), (600, 300), (513, 512)])
@pytest.mark.parametrize("feat", ["none", "softcap", "sinks"])
def test_a_sliding_window_shorter_than_the_chunk(t: int, window: int, feat: str) -> None:
    """A windowed layer's fresh chunk: blocks of queries over the keys their windows reach
    (SDPA, or the explicit softmax for soft-capping and sinks) equal one masked softmax
    over every key with `visible_mask`'s window rule; `causal_prefill_cpu` takes that path
    too (its op has no window), the window honoured wherever the op would run."""
    from attention.torch_attention import explicit_attention, visible_mask

    q, k, v = qkv_views(t, 6, 2, 64, torch.float32, seed=window)
    kw = {"none": {}, "softcap": {"softcap": 3.0},
          "sinks": {"sinks": torch.linspace(-1, 1, 6)}}[feat]
    pos = torch.arange(t)[None]
    want, _ = explicit_attention(q[None], k[None], v[None], visible_mask(pos, pos, window),
                                 0.125, **kw)
    got = causal_self_attention(q, k, v, 0.125, window=window, **kw)
    torch.testing.assert_close(got, want[0], atol=2e-5, rtol=1e-5)
    assert torch.equal(causal_prefill_cpu(q, k, v, 0.125, window=window, **kw), got)


def test_the_paged_explicit_softmax_runs_in_blocks_of_query_rows() -> None:
    """A prompt chunk whose explicit softmax (here: the mass a policy reads, and sinks)
    would hold more than `_EXPLICIT_ELEMS` scores at once runs a block of query rows at a
    time, with each row's own results: the same output and mass as one pass."""
    from attention import torch_attention as ta

    b, tq, hq, hkv, d, bs = 1, 1100, 4, 2, 32, 16
    s = 4000  # 4 x 1,100 x 4,000 = 17.6M scores > 16 Mi: two blocks
    assert hq * tq * s > ta._EXPLICIT_ELEMS >= hq * s
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(s // bs, bs, hkv, d, generator=g)
    v_cache = torch.randn(s // bs, bs, hkv, d, generator=g)
    q = torch.randn(b, tq, hq, d, generator=g)
    table = torch.arange(s // bs)[None]
    slot_pos = torch.arange(s)[None]
    q_pos = torch.arange(s - tq, s)[None]
    sinks = torch.linspace(-1, 1, hq)
    out, mass = ta.paged_attention(q, k_cache, v_cache, table, slot_pos, q_pos, 0.2,
                                   return_probs=True, sinks=sinks)
    k, v = ta.gather_blocks(k_cache, table), ta.gather_blocks(v_cache, table)
    want, want_mass = ta.explicit_attention(q, k, v, ta.visible_mask(slot_pos, q_pos, None),
                                            0.2, sinks=sinks)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(mass, want_mass, atol=1e-7, rtol=1e-5)
