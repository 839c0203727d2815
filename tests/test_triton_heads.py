"""The Triton paged-attention kernels under the per-head view (`--kv-layout head`).

Over a per-head pool a page holds one (layer, kv head) and the tables have a lane per
(layer, kv head), lane l·H + h. The runner hands the kernels each kv head of a group as
a sequence of its own with one kv head (engine/attention_groups.py: `by_head` views the
lanes as [L, H·B, ...], `heads_q` regroups q per kv head, `heads_out` and `lanes_of`
undo it), so the GQA group of query heads shares its kv head's own pages and length.
Here that call path runs the decode kernel (Tq = 1) and the prefill-chunk kernel over
a cached prefix, on CPU through TRITON_INTERPRET (fp32 maths), against:

- the same kernels on the per-layer layout when every head keeps the same tokens;
- a plain torch attention over each head's own kept tokens when heads keep different
  tokens and lengths;

and the engine's runner with Triton attention on a per-head pool against a per-layer
pool (full cache) and against the torch path (per-head eviction reading the mass).
Shapes are tiny: the interpreter runs every program in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from attention.torch_attention import PAD_QUERY_POS, paged_attention
from engine.attention_groups import AttentionGroup, by_head, heads_out, heads_q, lanes_of
from engine.demo import DEMO_MODEL_DIR
from engine.sampling import SamplingParams
from scheduler.llm import LLM
from tests.attention_cases import DEV

pytest.importorskip("triton")
triton_attention = pytest.importorskip("attention.triton_attention")
paged_attention_triton = triton_attention.paged_attention_triton

L, H, G, D, BS = 2, 2, 4, 8, 4  # layers, kv heads, query heads a kv head, head dim, block
SCALE = D**-0.5
TOL = 1e-5  # fp32 under the interpreter


@dataclass
class Lanes:
    """One step's attention inputs over a per-head pool, as the runner holds them."""

    q: torch.Tensor  # [L, B, Tq, H·G, D], strided (sliced out of a fused projection)
    k_cache: torch.Tensor  # [pages, BS, 1, D]
    v_cache: torch.Tensor
    tables: torch.Tensor  # [L·H, B, NB]: lane l·H + h, one page list a (layer, head, seq)
    slot_pos: torch.Tensor  # [L·H, B, NB·BS]
    q_pos: torch.Tensor  # [B, Tq], PAD_QUERY_POS past a chunk's end


def _queries(g: torch.Generator, b: int, tq: int) -> torch.Tensor:
    fused = torch.randn(L, b, tq, H * G + 2, D, generator=g)
    return fused[..., : H * G, :]


def _q_pos(prefixes: list[int], chunks: list[int]) -> torch.Tensor:
    q_pos = torch.full((len(chunks), max(chunks)), PAD_QUERY_POS, dtype=torch.int64)
    for b, (p, c) in enumerate(zip(prefixes, chunks)):
        q_pos[b, :c] = torch.arange(p, p + c)
    return q_pos


def _to_dev(x: Lanes) -> Lanes:
    return Lanes(*(t.to(DEV) for t in (x.q, x.k_cache, x.v_cache, x.tables, x.slot_pos,
                                       x.q_pos)))


def attend_by_head(x: Lanes, window: int | None = None, probs: bool = False,
                   num_splits: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What `ModelRunner.execute` does with a group over a per-head pool, every layer:
    `by_head`, `heads_q` into the kernel, `heads_out` back, the layers' mass stacked and
    read through `lanes_of`. Returns ([L, B, Tq, H·G, D], [L·H, B, Tq, 1, S] or None)."""
    b, tq = x.q_pos.shape
    group = AttentionGroup(list(range(b)), torch.arange(b * tq).view(b, tq),
                           x.q_pos != PAD_QUERY_POS, x.q_pos, x.tables, x.slot_pos, probs,
                           None)
    g = by_head(group, H, L)
    outs, mass = [], []
    for layer in range(L):
        o, m = paged_attention_triton(heads_q(x.q[layer], H), x.k_cache, x.v_cache,
                                      g.tables[layer], g.slot_pos[layer], g.q_pos, SCALE,
                                      window, probs, num_splits=num_splits)
        outs.append(heads_out(o, H))
        mass.append(m)
    return torch.stack(outs), lanes_of(torch.stack(mass), H) if probs else None


# ---- every head keeps the same tokens: the per-layer layout's answer --------------------


def same_tokens(prefixes: list[int], chunks: list[int], evict: dict[tuple[int, int], list[int]],
                seed: int = 0) -> tuple[dict, Lanes]:
    """A per-layer pool (page = one layer's BS tokens × H heads, tables [L, B, NB]) and
    the per-head pool holding the same K/V: page (block n, head h) is a shuffled page
    of its own, and lane l·H + h reads the pages of layer l's table for head h.
    `evict`: (layer, seq) -> logical slots marked dead (in every head of that layer)."""
    g = torch.Generator().manual_seed(seed)
    lens = [p + c for p, c in zip(prefixes, chunks)]
    nblocks = [-(-n // BS) for n in lens]
    nb, b = max(nblocks) + 1, len(lens)  # one -1 column past the longest
    n_pages = L * sum(nblocks) + 2
    ids = torch.randperm(n_pages, generator=g)
    table = torch.full((L, b, nb), -1, dtype=torch.int64)
    slot_pos = torch.full((L, b, nb * BS), -1, dtype=torch.int64)
    used = 0
    for layer in range(L):
        for i, n in enumerate(lens):
            table[layer, i, : nblocks[i]] = ids[used : used + nblocks[i]]
            used += nblocks[i]
            slot_pos[layer, i, :n] = torch.arange(n)
            slot_pos[layer, i, evict.get((layer, i), [])] = -1
    kv = torch.randn(2, n_pages, BS, H, D, generator=g)
    # the per-head pool: page of (block n, head h) = perm[n·H + h]
    perm = torch.randperm(n_pages * H, generator=g)
    kv_head = torch.empty(2, n_pages * H, BS, 1, D)
    kv_head[:, perm] = kv.permute(0, 1, 3, 2, 4).reshape(2, n_pages * H, BS, 1, D)
    lanes = torch.stack([torch.where(table[layer] >= 0, perm[table[layer].clamp(min=0) * H + h],
                                     -1)
                         for layer in range(L) for h in range(H)])
    q_pos = _q_pos(prefixes, chunks)
    q = _queries(g, b, max(chunks))
    layer_case = {"q": q, "kv": kv, "table": table, "slot_pos": slot_pos, "q_pos": q_pos}
    head_case = Lanes(q, kv_head[0], kv_head[1], lanes,
                      slot_pos.repeat_interleave(H, dim=0), q_pos)
    return layer_case, head_case


SAME_CASES = {
    # name: (prefixes, chunks, evicted (layer, seq) -> slots, window, num_splits)
    "decode": ([0, 6, 17], [1, 1, 1], {(1, 2): [1, 2, 6, 9]}, None, None),
    "decode-window-split": ([40, 9], [1, 1], {(0, 0): [0, 3, 4, 30]}, 12, 3),
    "chunk": ([0, 5, 9], [3, 6, 1], {(1, 1): [0, 2]}, None, None),
    "chunk-window-split": ([23, 4], [5, 2], {(0, 0): [3, 4, 5, 6, 7]}, 6, 2),
}


@pytest.mark.parametrize("name", list(SAME_CASES))
def test_per_head_view_equals_the_layer_layout(name: str) -> None:
    """Every head keeping the same tokens: the kernels over the per-head pool, through
    the runner's views, give the per-layer layout's output and mass (per kv head, lane
    l·H + h), to 1e-5, decode and chunk, under a window and split slot ranges."""
    prefixes, chunks, evict, window, splits = SAME_CASES[name]
    layer_case, head_case = same_tokens(prefixes, chunks, evict)
    out, mass = attend_by_head(_to_dev(head_case), window, True, splits)
    assert mass is not None
    kv = layer_case["kv"].to(DEV)
    for layer in range(L):
        ref, ref_mass = paged_attention_triton(
            layer_case["q"][layer].to(DEV), kv[0], kv[1], layer_case["table"][layer].to(DEV),
            layer_case["slot_pos"][layer].to(DEV), layer_case["q_pos"].to(DEV), SCALE, window,
            True, num_splits=splits)
        torch.testing.assert_close(out[layer], ref, atol=TOL, rtol=TOL)
        for h in range(H):  # the layer layout's [B, Tq, H, S] against lane l·H + h
            torch.testing.assert_close(mass[layer * H + h, :, :, 0], ref_mass[:, :, h],
                                       atol=TOL, rtol=TOL)


# ---- heads keep different tokens: a plain attention over each head's own ----------------


def own_tokens(prefixes: list[int], chunks: list[int], seed: int = 0, holes: int = 2) -> Lanes:
    """A per-head pool where every (layer, head, seq) keeps its own random subset of the
    prefix (each with its own length) plus its chunk's tokens (written before attention),
    in slots of its own pages, with up to `holes` dead slots among them."""
    g = torch.Generator().manual_seed(seed)
    b = len(chunks)
    rows: list[list[list[int]]] = []  # [lane][seq] -> slot positions (-1 dead)
    for _ in range(L * H):
        lane = []
        for p, c in zip(prefixes, chunks):
            kept = [x for x in range(p) if torch.rand(1, generator=g).item() < 0.6]
            row = kept + list(range(p, p + c))
            for _ in range(int(torch.randint(0, holes + 1, (1,), generator=g))):
                row.insert(int(torch.randint(0, len(row) + 1, (1,), generator=g)), -1)
            lane.append(row)
        rows.append(lane)
    nb = max(-(-len(r) // BS) for lane in rows for r in lane) + 1
    n_pages = sum(-(-len(r) // BS) for lane in rows for r in lane) + 3
    ids = torch.randperm(n_pages, generator=g).tolist()
    tables = torch.full((L * H, b, nb), -1, dtype=torch.int64)
    slot_pos = torch.full((L * H, b, nb * BS), -1, dtype=torch.int64)
    for lane, seqs in enumerate(rows):
        for i, row in enumerate(seqs):
            pages = -(-len(row) // BS)
            tables[lane, i, :pages] = torch.tensor(ids[:pages], dtype=torch.int64)
            ids = ids[pages:]
            slot_pos[lane, i, : len(row)] = torch.tensor(row, dtype=torch.int64)
    kv = torch.randn(2, n_pages, BS, 1, D, generator=g)
    return Lanes(_queries(g, b, max(chunks)), kv[0], kv[1], tables, slot_pos,
                 _q_pos(prefixes, chunks))


def reference(x: Lanes, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each query over the K/V its kv head keeps, visible by
    position (causal, window), slot by slot: ([L, B, Tq, H·G, D], its mass per lane
    and slot [L·H, B, Tq, S]; padded query rows left zero)."""
    b, tq = x.q_pos.shape
    out = torch.zeros(L, b, tq, H * G, D)
    mass = torch.zeros(L * H, b, tq, x.slot_pos.shape[2])
    for lane in range(L * H):
        layer, h = divmod(lane, H)
        for i in range(b):
            sp = x.slot_pos[lane, i]
            slots = [s for s in range(sp.shape[0]) if sp[s] >= 0]
            pages = x.tables[lane, i, torch.tensor(slots) // BS]
            k = x.k_cache[pages, torch.tensor(slots) % BS, 0]  # [n, D]
            v = x.v_cache[pages, torch.tensor(slots) % BS, 0]
            for t in range(tq):
                qp = int(x.q_pos[i, t])
                if qp == PAD_QUERY_POS:
                    continue
                seen = [j for j, s in enumerate(slots)
                        if sp[s] <= qp and (window is None or sp[s] > qp - window)]
                q = x.q[layer, i, t, h * G : (h + 1) * G]  # the kv head's query group
                p = torch.softmax(q @ k[seen].T * SCALE, dim=-1)  # [G, n]
                out[layer, i, t, h * G : (h + 1) * G] = p @ v[seen]
                mass[lane, i, t, torch.tensor(slots)[seen]] = p.sum(dim=0)
    return out, mass


OWN_CASES = {
    # name: (prefixes, chunks, window, num_splits)
    "decode": ([3, 14, 30], [1, 1, 1], None, None),
    "decode-window-split": ([45, 8], [1, 1], 10, 3),
    "chunk": ([0, 7, 12], [4, 2, 5], None, None),
    "chunk-window": ([19, 6], [3, 4], 5, None),
}


@pytest.mark.parametrize("name", list(OWN_CASES))
def test_per_head_view_attends_each_heads_own_tokens(name: str) -> None:
    """Heads keeping different tokens and lengths (each lane its own pages, dead slots
    among them): every query head attends exactly its kv head's kept tokens, output and
    mass as a plain softmax over them, to 1e-5, decode and chunk."""
    prefixes, chunks, window, splits = OWN_CASES[name]
    x = own_tokens(prefixes, chunks)
    lengths = (x.slot_pos >= 0).sum(dim=2)  # [L·H, B]: the heads do differ
    assert any(len(set(lengths[layer * H : (layer + 1) * H, i].tolist())) > 1
               for layer in range(L) for i in range(len(chunks)))
    out, mass = attend_by_head(_to_dev(x), window, True, splits)
    assert mass is not None
    ref, ref_mass = reference(x, window)
    valid = x.q_pos != PAD_QUERY_POS  # padded rows' results are never read
    torch.testing.assert_close(out.cpu()[:, valid], ref[:, valid], atol=TOL, rtol=TOL)
    torch.testing.assert_close(mass.cpu()[:, valid, 0], ref_mass[:, valid], atol=TOL, rtol=TOL)


# ---- the engine's runner with Triton attention on a per-head pool ------------------------

MODEL = str(DEMO_MODEL_DIR)


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 1000, (n,), generator=g).tolist()


PROMPTS = [_prompt(1, 19), _prompt(2, 9)]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False,
                        logprobs=2)


def _generate(layout: str, attention: object, calls: list[tuple[int, int]] | None = None,
              **kw: object) -> list:
    """Greedy completions of PROMPTS on the demo model (4 layers, 2 kv heads), prompts
    in chunks of 8 so later chunks attend over a cached prefix, `attention` the runner's
    paged attention; `calls` gets each call's (query tokens a row, kv heads a page)."""
    heads = 2 if layout == "head" else 1
    llm = LLM(MODEL, num_blocks=120 * heads, block_size=BS, device="cpu", kv_layout=layout,
              max_num_batched_tokens=8, enable_prefix_caching=False)

    def counted(q: torch.Tensor, k_cache: torch.Tensor, *args: object, **kwargs: object):
        if calls is not None:
            calls.append((q.shape[1], k_cache.shape[2]))
        return attention(q, k_cache, *args, **kwargs)  # type: ignore[operator]

    llm.engine.runner.attention_fn = counted
    outs = llm.generate(PROMPTS, PARAMS, **kw)  # type: ignore[arg-type]
    llm.engine.check_invariants()
    assert llm.engine.pool.num_used == 0
    return outs


def _worst(a: list, b: list) -> float:
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    return max(abs(x.logprob - y.logprob) for p, r in zip(a, b)
               for x, y in zip(p.logprobs, r.logprobs))


def test_runner_triton_on_a_head_pool_equals_the_layer_pool() -> None:
    """Full cache: the runner's Triton path (the one a CUDA device selects) over a
    per-head pool gives the per-layer pool's tokens and logprobs, decode rows and prompt
    chunks after a cached prefix both through the kernels, one kv head a page."""
    calls: list[tuple[int, int]] = []
    layer = _generate("layer", paged_attention_triton)
    head = _generate("head", paged_attention_triton, calls)
    assert {tq > 1 for tq, _ in calls} == {True, False} and {h for _, h in calls} == {1}
    assert _worst(layer, head) <= TOL


def test_runner_triton_per_head_eviction_equals_the_torch_path() -> None:
    """`heads: uniform` h2o on a per-head pool (each head keeps and drops its own tokens
    by its own query group's mass, which the Triton mass pass returns per lane): the
    Triton path evicts and generates what the torch path does."""
    policy = {"name": "h2o", "budget": 10, "window": 2, "heads": "uniform"}
    tri = _generate("head", paged_attention_triton, kv_policy=policy)
    ref = _generate("head", paged_attention, kv_policy=policy)
    assert [o.kv.evicted_tokens for o in tri] == [o.kv.evicted_tokens for o in ref]
    assert tri[0].kv.evicted_tokens > 0
    assert _worst(tri, ref) <= 1e-4  # two kernels' sums: the torch path is SDPA's
