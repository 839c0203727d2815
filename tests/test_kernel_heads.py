"""The C++ decode kernel's per-head calls (`paged_attention_cpu(heads=)`, issue 65).

Over a per-head pool each (kv head, sequence) is a row of its own. The kernel makes those
rows itself from q as the model gives it ([B, 1, Hq, D]), the sequences' positions and
the tables' per-head blocks, where the runner used to regroup q into [H·B, 1, G, D] and
the output back around every call and repeat the positions a head
(engine/attention_groups.by_head, heads_q, heads_out). Both forms must be the same
computation: the outputs and masses are compared bit for bit on every variant the kernel
has (dtypes, table rows in place or not, softcap, sinks, quantized pools, KeyDiff's
scores, the H2O accumulator, pyramid's ring); the engine's per-head decode steps then
take the kernel's form, with no regrouping copy.
"""

from __future__ import annotations

import pytest
import torch

from attention import cpu_attention
from attention.cpu_attention import paged_attention_cpu, paged_decode_key_diversity
from attention.key_stats import native_key_diversity
from attention.quant import FORMATS, QuantCache, quantize
from engine import runner
from engine.attention_groups import heads_out, heads_q
from engine.sampling import SamplingParams
from scheduler.llm import LLM
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not cpu_attention.kernel_available(),
                                reason="no C++ compiler for the CPU kernel")

H, G, D, BS, B, R, NB, N = 2, 3, 64, 16, 5, 7, 4, 64
SCALE = D ** -0.5


def _case(dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    """B sequences over a per-head pool (one kv head a page): R table rows a kv head,
    holes in the tables (-1 pages) and in the slots (evicted: position -1), sequences of
    different lengths, read through `rows` [B] in place."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, N, (H * R, NB), generator=g)
    table[3, 2] = table[R + 5, 0] = -1
    slot_pos = torch.arange(NB * BS).repeat(H * R, 1)
    slot_pos[:, 5] = -1
    slot_pos[R + 1, 20:30] = -1  # kv head 1 of table row 1 evicted what head 0 kept
    return dict(
        q=torch.randn(B, 1, H * G, D, generator=g).to(dtype),
        k=torch.randn(N, BS, 1, D, generator=g).to(dtype),
        v=torch.randn(N, BS, 1, D, generator=g).to(dtype),
        table=table, slot_pos=slot_pos,
        q_pos=torch.randint(20, NB * BS, (B,), generator=g),
        rows=torch.tensor([0, 3, 6, 1, 2]),
    )


def _head_rows(rows: torch.Tensor) -> torch.Tensor:
    """The regrouped form's table rows: kv head h of sequence b at h·R + rows[b]."""
    return (torch.arange(H)[:, None] * R + rows[None]).reshape(-1)


def _regrouped_sinks(sinks: torch.Tensor) -> torch.Tensor:
    return sinks.view(H, 1, G).expand(H, B, G).reshape(H * B, G)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["plain", "softcap", "sinks", "window", "gathered"])
def test_a_per_head_call_equals_the_regrouped_call(dtype: torch.dtype, variant: str) -> None:
    c = _case(dtype)
    sinks = torch.randn(H * G)
    kw: dict = {"softcap": 20.0} if variant == "softcap" else {}
    window = 24 if variant == "window" else None
    table, slot_pos, rows = c["table"], c["slot_pos"], c["rows"]
    head_rows = _head_rows(rows)
    if variant == "gathered":  # the tables gathered a (kv head, sequence) row, no `rows`
        table, slot_pos, rows, head_rows = table[head_rows], slot_pos[head_rows], None, None
    got, mass = paged_attention_cpu(
        c["q"], c["k"], c["v"], table, slot_pos, c["q_pos"], SCALE, window, True,
        table_rows=rows, heads=H, **kw, **({"sinks": sinks} if variant == "sinks" else {}))
    want, want_mass = paged_attention_cpu(
        heads_q(c["q"], H), c["k"], c["v"], table, slot_pos, c["q_pos"].repeat(H), SCALE,
        window, True, table_rows=head_rows, **kw,
        **({"sinks": _regrouped_sinks(sinks)} if variant == "sinks" else {}))
    assert got.shape == c["q"].shape
    assert torch.equal(got, heads_out(want, H))
    assert mass is not None and torch.equal(mass, want_mass)
    assert mass.shape[0] == H * B  # a row a (kv head, sequence), head-major


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "int4"])
def test_a_per_head_call_on_a_quantized_pool(name: str) -> None:
    c = _case()
    fmt = FORMATS[name]
    kc, ks = quantize(c["k"], fmt)
    vc, vs = quantize(c["v"], fmt)
    quant = QuantCache(fmt, ks, vs)
    got, mass = paged_attention_cpu(c["q"], kc, vc, c["table"], c["slot_pos"], c["q_pos"],
                                    SCALE, None, True, quant, table_rows=c["rows"], heads=H)
    want, want_mass = paged_attention_cpu(
        heads_q(c["q"], H), kc, vc, c["table"], c["slot_pos"], c["q_pos"].repeat(H), SCALE,
        None, True, quant, table_rows=_head_rows(c["rows"]))
    assert torch.equal(got, heads_out(want, H))
    assert mass is not None and torch.equal(mass, want_mass)


def test_key_diversity_scores_a_call_row() -> None:
    """KeyDiff's scores come a (kv head, sequence) row; `rows` flags stay a sequence."""
    if not native_key_diversity(torch.zeros(1)):
        pytest.skip("no fused KeyDiff op here")
    c = _case()
    flags = torch.tensor([True, False, True, True, False])
    got, _, kd = paged_decode_key_diversity(
        c["q"], c["k"], c["v"], c["table"], c["slot_pos"], c["q_pos"], SCALE, rows=flags,
        table_rows=c["rows"], heads=H)
    want, _, want_kd = paged_decode_key_diversity(
        heads_q(c["q"], H), c["k"], c["v"], c["table"], c["slot_pos"], c["q_pos"].repeat(H),
        SCALE, rows=flags.repeat(H), table_rows=_head_rows(c["rows"]))
    assert torch.equal(got, heads_out(want, H)) and torch.equal(kd, want_kd)
    assert kd[~flags.repeat(H)].abs().sum() == 0 and kd[flags.repeat(H)].abs().sum() > 0


@pytest.mark.parametrize("state", ["accumulate", "ring"])
def test_the_mass_goes_into_each_heads_own_state_row(state: str) -> None:
    """H2O's accumulator and pyramid's ring take the mass of (kv head h, sequence b) into
    table row h·R + rows[b], the ring's column being the sequence's."""
    c = _case()
    S = NB * BS
    cols = torch.tensor([0, 2, 1, 3, 0])

    def start() -> tuple[torch.Tensor, torch.Tensor]:  # the accumulator and the ring
        return torch.rand(H * R, S, generator=torch.Generator().manual_seed(1)), torch.zeros(H * R, 4, S)

    def run(heads: int) -> tuple[torch.Tensor, ...]:
        acc, ring = start()
        total = torch.zeros(H * R, 3, S)
        kw = ({"accumulate": acc} if state == "accumulate"
              else {"ring": ring, "ring_total": total, "ring_shift": 20})
        if heads == 1:
            q, q_pos, rows = heads_q(c["q"], H), c["q_pos"].repeat(H), _head_rows(c["rows"])
            if state == "ring":
                kw["ring_cols"] = cols.repeat(H)
        else:
            q, q_pos, rows = c["q"], c["q_pos"], c["rows"]
            kw["heads"] = H
            if state == "ring":
                kw["ring_cols"] = cols
        out, _ = paged_attention_cpu(q, c["k"], c["v"], c["table"], c["slot_pos"], q_pos,
                                     SCALE, None, True, sum_heads=True, table_rows=rows, **kw)
        return (out if heads > 1 else heads_out(out, H)), acc, ring, total

    got, want = run(H), run(1)
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    # the state the call wrote: exactly the rows' own table rows moved, no other
    which = 0 if state == "accumulate" else 1
    moved = (got[1 + which] != start()[which]).flatten(1).any(dim=1)
    assert torch.equal(moved.nonzero().flatten(), _head_rows(c["rows"]).sort().values)


def test_bad_heads_are_refused() -> None:
    c = _case()
    args = (c["k"], c["v"], c["table"], c["slot_pos"], c["q_pos"], SCALE, None, False)
    with pytest.raises(RuntimeError, match="heads must divide"):
        paged_attention_cpu(c["q"], *args, table_rows=c["rows"], heads=4)  # 6 query heads
    with pytest.raises(RuntimeError, match="row out of range"):
        paged_attention_cpu(c["q"], *args, table_rows=c["rows"] + R, heads=H)
    with pytest.raises(RuntimeError, match="a row per sequence"):
        paged_attention_cpu(c["q"], *args, heads=H)  # H·R table rows, not H·B
    with pytest.raises(RuntimeError, match="sinks as \\[Hq\\]"):
        paged_attention_cpu(c["q"], *args, table_rows=c["rows"], heads=H,
                            sinks=torch.zeros(B, H * G))


def test_per_head_decode_steps_regroup_nothing(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A per-head engine's decode rows reach the kernel in its per-head form (q as the
    model gives it, `heads` = the kv heads); the regrouping of q and output (`heads_q`,
    `heads_out`) is left to prompt chunks; the tokens are the per-layer pool's."""
    path = make_tiny_model("llama", tmp_path / "m", num_key_value_heads=2,
                           num_attention_heads=4)
    regrouped: list[int] = []
    real = runner.heads_q
    monkeypatch.setattr(runner, "heads_q",
                        lambda q, h: regrouped.append(q.shape[1]) or real(q, h))
    # where the prefix-prefill op runs (an AVX-512 build), it takes the later prompt
    # chunks, per head as they are: then nothing is regrouped at all
    prefix_op: list[bool] = []
    runs = runner.prefix_prefill_runs
    monkeypatch.setattr(runner, "prefix_prefill_runs",
                        lambda *a: prefix_op.append(runs(*a)) or prefix_op[-1])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5 + i for i in range(20)], [7 + i for i in range(33)]]
    tokens, decode_calls = [], []
    for layout in ("layer", "head"):
        # 16-token chunks: a prompt's later chunks attend to its cached part in groups
        llm = LLM(path, kv_layout=layout, max_num_seqs=4, max_num_batched_tokens=16)
        fn = llm.engine.runner.attention_fn

        def spy(q: torch.Tensor, *args, fn=fn, layout=layout, **kw):
            if q.shape[1] == 1:
                decode_calls.append((layout, q.shape[2], kw.get("heads", 1)))
            return fn(q, *args, **kw)

        # the runner knows the kernel by identity: the spy stands in for it there too
        monkeypatch.setattr(runner, "paged_attention_cpu", spy)
        llm.engine.runner.attention_fn = spy
        tokens.append([o.token_ids for o in llm.generate(prompts, params)])
    assert tokens[0] == tokens[1] and all(len(t) == 12 for t in tokens[1])
    assert {c for c in decode_calls if c[0] == "head"} == {("head", 4, 2)}
    assert {c for c in decode_calls if c[0] == "layer"} == {("layer", 4, 1)}
    assert all(t > 1 for t in regrouped)  # prompt chunks only
    assert regrouped or (prefix_op and all(prefix_op))  # the later chunks went one way
