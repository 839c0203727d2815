"""Batched sampling: greedy, truncations, seeded reproducibility, the right distribution."""

import pytest
import torch

from engine.sampler import SamplingBatch, sample, top_logprobs, uniform_noise
from engine.sampling import SamplingParams


def _batch(params, seeds=None, steps=None):
    n = len(params)
    return SamplingBatch.build(params, seeds or list(range(n)), steps or [0] * n)


def test_greedy_and_degenerate_truncations_equal_argmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=0.7, top_p=1e-6), SamplingParams(temperature=2.0, min_p=1.0),
              SamplingParams(temperature=0)]
    assert torch.equal(sample(logits, _batch(params)), logits.argmax(-1))


def test_all_greedy_batch_builds_no_parameter_tensors():
    """Every row greedy: no per-row parameter tensor is built, the tokens are the argmax,
    and the largest logprobs request still reaches the engine."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0, logprobs=k) for k in (None, 2, 5, None)]
    b = _batch(params)
    assert b.all_greedy and b.max_logprobs == 5 and b.seed.numel() == 0
    assert torch.equal(sample(logits, b), logits.argmax(-1))
    mixed = _batch([SamplingParams(temperature=0), SamplingParams(temperature=0.5)])
    assert not mixed.all_greedy and mixed.seed.numel() == 2


def test_seeded_rows_do_not_depend_on_batch_neighbours():
    torch.manual_seed(1)
    logits = torch.randn(4, 100)
    p = SamplingParams(temperature=1.0)
    full = sample(logits, _batch([p] * 4, seeds=[7, 8, 9, 10], steps=[3, 3, 3, 3]))
    alone = sample(logits[2:3], _batch([p], seeds=[9], steps=[3]))
    assert full[2] == alone[0]
    mixed = sample(logits, _batch([SamplingParams(temperature=0), p, p, p],
                                  seeds=[0, 8, 9, 10], steps=[3, 3, 3, 3]))
    assert torch.equal(mixed[1:], full[1:])


def test_noise_is_uniform_and_varies_with_step():
    u = uniform_noise(torch.tensor([5, 5]), torch.tensor([0, 1]), 20000)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1])


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    n = 8000
    p = SamplingParams(temperature=1.0)
    b = SamplingBatch.build([p] * n, list(range(n)), [0] * n)
    toks = sample(logits.expand(n, 4).contiguous(), b)
    freq = torch.bincount(toks, minlength=4).float() / n
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.02)


def test_top_k_top_p_min_p_exclude_the_tail():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    n = 2000
    for p, allowed in [(SamplingParams(temperature=1, top_k=2), {0, 1}),
                       (SamplingParams(temperature=1, top_p=0.6), {0, 1}),
                       (SamplingParams(temperature=1, min_p=0.6), {0, 1})]:
        b = SamplingBatch.build([p] * n, list(range(n)), [0] * n)
        got = set(sample(logits.expand(n, 4).contiguous(), b).tolist())
        assert got == allowed, (p, got)


def test_top_logprobs():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    chosen, ids, vals = top_logprobs(logits, torch.tensor([1, 2]), 2)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(chosen, torch.stack([ref[0, 1], ref[1, 2]]))
    assert ids.tolist() == [[0, 1], [2, 0]] or ids.tolist() == [[0, 1], [2, 1]]
    assert torch.allclose(vals[:, 0], ref.max(-1).values)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_greedy_op_equals_torch_max_on_ties_nans_and_odd_vocabularies(threads):
    """The C++ greedy op must give torch.max's index: first of tied maxima, first NaN,
    index 0 for a row of -inf, any vocabulary size (vector body plus scalar tail), rows
    on one to three threads, and a non-contiguous input."""
    from engine.sampler import greedy_tokens, load_sampling_ops

    if not load_sampling_ops():
        pytest.skip("no C++ compiler")
    torch.set_num_threads(threads)  # restored by conftest's fixture
    g = torch.Generator().manual_seed(0)
    for vocab in (1, 7, 16, 17, 4096, 32000, 32003):
        x = torch.randn(9, vocab, generator=g)
        if vocab > 20:
            x[1, 3] = x[1, 19] = x[1].max() + 1  # tie: the first wins
            x[2, 18] = float("nan")
            x[2, 5] = float("nan")  # two NaNs: the first wins
            x[3] = float("-inf")
            x[4, vocab - 1] = 1e9  # the maximum in the scalar tail
            x[5, 0] = float("inf")
            x[6, 2] = x[6, vocab - 2] = x[6].max() + 1  # a tie far apart: the first wins
            x[7, 1] = x[7].max() + 1
            x[7, vocab - 3] = float("nan")  # a NaN after the maximum: it wins
            x[8, vocab - 20] = x[8].max() + 1  # the maximum near the end
        want = x.max(dim=-1).indices
        got = torch.ops.kvserve_sampling.greedy(x)
        assert torch.equal(got, want), vocab
        assert torch.equal(greedy_tokens(x), want)
    wide = torch.randn(6, 64, generator=g)
    assert torch.equal(greedy_tokens(wide[:, ::2]), wide[:, ::2].max(dim=-1).indices)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.kvserve_sampling.greedy(torch.randn(2, 8, dtype=torch.float64))


def test_greedy_tokens_without_the_op_use_torch(monkeypatch):
    from engine import sampler
    from native import build as native

    monkeypatch.setattr(native, "_loaded", {"kvserve_sampling_cpu": False})
    x = torch.randn(4, 100)
    assert torch.equal(sampler.greedy_tokens(x), x.max(dim=-1).indices)
    assert torch.equal(sampler.greedy_tokens(x.double()), x.double().max(dim=-1).indices)


def _race_torch(probs: torch.Tensor, seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The exponential race's tensor form (what runs off CPU): the reference."""
    expo = -torch.log(uniform_noise(seed, step, probs.shape[1]))
    return (probs / expo).argmax(dim=-1)


def test_race_op_draws_the_tensor_forms_tokens():
    """The C++ race hashes the same noise and compares the same keys as the tensor form:
    the same token for every row, over peaked, flat and truncated distributions, odd
    vocabularies (vector body and scalar tail), seeds past 32 bits and negative ones,
    NaN rows (the first NaN wins, as argmax) and a non-contiguous input."""
    from engine.sampler import exponential_race, load_sampling_ops

    if not load_sampling_ops():
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(3)
    for vocab in (1, 5, 16, 17, 1000, 32000, 32003):
        rows = 24
        logits = torch.randn(rows, vocab, generator=g) * torch.linspace(0.1, 8, rows)[:, None]
        probs = torch.softmax(logits, dim=-1)
        if vocab > 20:
            probs[1, 10:] = 0.0  # truncated (top-k / top-p)
            probs[2] = 0.0
            probs[2, vocab - 1] = 1.0  # all mass in the scalar tail
            probs[3, 7] = float("nan")
            probs[3, 19] = float("nan")
        seed = torch.randint(-(2**40), 2**40, (rows,), generator=g)
        step = torch.randint(0, 5000, (rows,), generator=g)
        want = _race_torch(probs, seed, step)
        got = torch.ops.kvserve_sampling.race(probs, seed, step)
        assert torch.equal(got, want), vocab
        assert torch.equal(exponential_race(probs, seed, step), want)
        if vocab > 20:
            assert got[2] == vocab - 1 and got[3] == 7
    # Seed 166's noise at step 0 rounds to 1.0 in float32 at token 24417; kept just below
    # (E = -log 1 = 0 gave a token of p = 0 there the key 0 / 0 = NaN, which argmax took:
    # a token a grammar had masked, drawn), so p = 0 never wins, and p > 0 there does
    seed, step = torch.tensor([166, 166]), torch.zeros(2, dtype=torch.int64)
    assert uniform_noise(seed, step, 32000)[0, 24417] == 1.0 - 2.0**-24
    probs = torch.softmax(torch.randn(2, 32000, generator=g), dim=-1)
    probs[0, 24417] = 0.0
    want = _race_torch(probs, seed, step)
    assert want[0] != 24417 and probs[0, want[0]] > 0 and want[1] == 24417
    assert torch.equal(torch.ops.kvserve_sampling.race(probs, seed, step), want)
    wide = torch.softmax(torch.randn(6, 128, generator=g), dim=-1)[:, ::2]
    s, t = torch.arange(6), torch.zeros(6, dtype=torch.int64)
    assert torch.equal(exponential_race(wide, s, t), _race_torch(wide, s, t))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.kvserve_sampling.race(wide.double(), s, t)
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.kvserve_sampling.race(wide.contiguous(), s.int(), t)


def test_race_op_matches_over_many_draws():
    """Many seeded draws over a realistic vocabulary: each the tensor form's token (a
    libm logf and torch's may differ in the last place, which could only matter at a
    near-tie; none in these draws), and the frequencies follow the probabilities."""
    from engine.sampler import load_sampling_ops

    if not load_sampling_ops():
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(4)
    probs = torch.softmax(torch.randn(1, 32000, generator=g) * 3, dim=-1).expand(512, -1)
    seed = torch.arange(512) * 7919
    for step in (0, 1, 99):
        st = torch.full((512,), step)
        assert torch.equal(torch.ops.kvserve_sampling.race(probs.contiguous(), seed, st),
                           _race_torch(probs, seed, st))
    small = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).expand(20000, 4).contiguous()
    toks = torch.ops.kvserve_sampling.race(small, torch.arange(20000), torch.zeros(20000, dtype=torch.int64))
    freq = torch.bincount(toks, minlength=4).float() / 20000
    assert torch.allclose(freq, small[0], atol=0.015)


def test_engine_builds_sampling_parameters_only_while_a_request_needs_them(tmp_path):
    """EngineCore counts the requests whose rows need parameters (a temperature,
    logprobs); while none is left, greedy rows are sampled without building any. A
    seeded sampled request draws the same tokens beside greedy ones as alone, and the
    greedy ones the same tokens before, beside and after it (finished or aborted)."""
    from scheduler.llm import LLM
    from tests.tiny_models import make_tiny_model

    llm = LLM(make_tiny_model("llama", tmp_path), num_blocks=256, block_size=4)
    eng = llm.engine
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, detokenize=False)
    hot = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True,
                         detokenize=False)
    alone = [o.token_ids for o in llm.generate([[5, 6, 7], [9, 9]], [hot, greedy])]
    assert eng._sampling == 0
    eng.add_request("g", [9, 9], greedy)
    eng.add_request("s", [5, 6, 7], hot)
    eng.add_request("x", [4, 4], hot)
    assert eng._sampling == 2
    eng.abort_request("x")
    tokens: dict[str, list[int]] = {"g": [], "s": []}
    while eng.has_unfinished():
        for o in eng.step():
            tokens[o.request_id] += o.new_token_ids
    assert eng._sampling == 0
    assert [tokens["s"], tokens["g"]] == alone
    after = llm.generate([[9, 9]], greedy)[0].token_ids
    assert after == tokens["g"]


def _truncate_torch(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """engine/sampler.py's torch form of `truncate` (what it runs without the C++ op)."""
    from engine.sampler import truncate

    return truncate(probs, top_k, top_p, native=False)


def test_truncate_op_keeps_the_torch_forms_tokens():
    """The C++ top-k / top-p op orders only what the cut needs (the near-peak tokens, or
    a histogram's window, or halvings by rank; the ranks clearly before the cut summed in
    any order, exact in double): the same probabilities kept as the torch form's
    whole-row sort and cumsum, over flat, peaked, equal and tied rows, tails below 2^-29,
    top_p next to 1, top-k alone and together, and vocabularies from 7 to 32k."""
    from engine.sampler import load_sampling_ops

    if not load_sampling_ops():
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(5)
    for vocab in (7, 300, 4096, 32000):
        for scale in (0.0, 0.01, 3.0, 20.0):
            rows = 16
            probs = torch.softmax(torch.randn(rows, vocab, generator=g) * scale, dim=-1)
            probs[0, :5] = probs[0, 5]  # ties: the lower id first
            top_k = torch.randint(0, 3000, (rows,), generator=g)
            top_k[::3] = 0
            top_p = torch.rand(rows, generator=g).clamp(0.05, 1.0)
            top_p[::4] = 1.0
            top_p[1], top_p[2] = 0.999999, 0.9999999
            want = _truncate_torch(probs, top_k, top_p)
            got = torch.ops.kvserve_sampling.truncate(probs, top_k, top_p)
            assert torch.equal(got, want), (vocab, scale)
            kept = (got > 0).sum(dim=1)
            assert (kept >= 1).all() and (kept[top_k > 0] <= top_k[top_k > 0]).all()
            off = (top_p == 1.0) & (top_k == 0)  # nothing to cut: the row as it was
            assert torch.equal(got[off], probs[off])
    # a flat head over a tail below 2^-29 (the any-order sums stop before it), cut near 1
    tail = torch.softmax(torch.cat([torch.randn(8, 3000, generator=g) * 0.01,
                                    torch.full((8, 1096), -30.0)], dim=1), dim=-1)
    top_p = torch.tensor([0.5, 0.9, 0.99, 0.999, 0.9999, 0.99999, 0.999999, 0.9999999])
    zeros = torch.zeros(8, dtype=torch.int64)
    assert torch.equal(torch.ops.kvserve_sampling.truncate(tail, zeros, top_p),
                       _truncate_torch(tail, zeros, top_p))
    nan = torch.softmax(torch.randn(2, 50, generator=g), dim=-1)
    nan[0, 7] = float("nan")
    got = torch.ops.kvserve_sampling.truncate(nan, torch.tensor([3, 3]), torch.tensor([0.5, 0.5]))
    assert torch.equal(got[0].nan_to_num(-1), nan[0].nan_to_num(-1))  # a NaN row stays whole
    assert (got[1] > 0).sum() <= 3
