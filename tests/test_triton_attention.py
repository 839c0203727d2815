"""Triton paged attention against the torch reference (CPU: through TRITON_INTERPRET).

Shapes are tiny because the interpreter runs every program in Python; they are chosen
to cross tile edges anyway (odd lengths, several slot tiles, split-KV, padded rows).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from attention.torch_attention import PAD_QUERY_POS, paged_attention
from kvpool.seq_cache import SeqCache
from tests.attention_cases import DEV, make_case
from tests.pools import make_pool

triton_attention = pytest.importorskip("attention.triton_attention")
pytest.importorskip("triton")
paged_attention_triton = triton_attention.paged_attention_triton


def check(case: dict, window: int | None = None, probs: bool = False,
          num_splits: int | None = None, atol: float = 1e-4) -> None:
    """Assert the Triton result equals the reference (output and, if asked, probs)."""
    out, mass = paged_attention_triton(**case, window=window, return_probs=probs,
                                       num_splits=num_splits)
    ref_case = {k: (v.float() if k in ("q", "k_cache", "v_cache") else v)
                for k, v in case.items()}
    ref, ref_mass = paged_attention(**ref_case, window=window, return_probs=probs)
    assert out.dtype == case["q"].dtype and out.shape == case["q"].shape
    # Rows that see no slot (with a window, padded rows too): the reference's explicit
    # softmax branch gives NaN there, its SDPA branch and the kernels give zeros.
    ref = ref.float().nan_to_num(0.0)
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=atol)
    if probs:
        torch.testing.assert_close(mass, ref_mass.nan_to_num(0.0), atol=atol, rtol=atol)
    else:
        assert mass is None


@pytest.mark.parametrize(("hq", "hkv", "bs"), [(4, 2, 4), (8, 1, 8), (2, 2, 16)])
def test_decode_odd_lengths(hq: int, hkv: int, bs: int) -> None:
    """One query per sequence; lengths that are not multiples of the block size."""
    check(make_case([0, 6, 16], [1, 1, 1], bs=bs, hq=hq, hkv=hkv))


def test_decode_long_and_split_kv() -> None:
    """3 slot tiles: online softmax across tiles in one program, then split-KV (forced)
    where the short sequence leaves two splits empty."""
    case = make_case([149, 36], [1, 1], bs=8, hq=4, hkv=2)
    check(case, num_splits=1)
    check(case, num_splits=3)
    check(case, num_splits=3, window=70, probs=True)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_slot_count_reads_only_the_leading_slots(num_splits: int) -> None:
    """A CUDA graph's tables are wider than the step's (engine/cuda_graphs.py): past
    `slot_count` lie stale blocks and positions that would be visible. The kernel must
    answer as if the tables ended there, split or not."""
    case = make_case([149, 36], [1, 1], bs=8, hq=4, hkv=2, extra_blocks=3)
    count = 40  # slots 40.. of both rows are stale: positions that pass every check
    stale = {**case, "slot_pos": case["slot_pos"].clone()}
    stale["slot_pos"][:, count:] = torch.arange(count, stale["slot_pos"].shape[1])
    stale["table"] = case["table"].clamp(min=0)
    out, _ = paged_attention_triton(**stale, num_splits=num_splits,
                                    slot_count=torch.tensor([count], device=DEV))
    nb = count // 8
    cut = {**case, "table": case["table"][:, :nb], "slot_pos": case["slot_pos"][:, :count]}
    ref, _ = paged_attention(**{k: (v.float() if k in ("q", "k_cache", "v_cache") else v)
                                for k, v in cut.items()})
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-4, rtol=1e-4)


def test_graph_mass_summed_over_heads_for_flagged_rows() -> None:
    """A CUDA graph's statistics pass (engine/cuda_graphs.py): tables wider than the
    step (`slot_count`), the mass summed over every head (`sum_heads`, [B, 1, 1, S]),
    and only the rows flagged in `mass_rows` computed (zeros elsewhere). Each flagged row
    equals the reference's per-head mass summed over its kv heads; past the count the
    mass is zero although the stale positions there would be visible."""
    case = make_case([149, 36, 20], [1, 1, 1], bs=8, hq=4, hkv=2, extra_blocks=3)
    count = 64
    stale = {**case, "slot_pos": case["slot_pos"].clone(), "table": case["table"].clamp(min=0)}
    stale["slot_pos"][:, count:] = torch.arange(count, stale["slot_pos"].shape[1])
    rows = torch.tensor([1, 0, 1], dtype=torch.int32, device=DEV)
    _, mass = paged_attention_triton(**stale, return_probs=True, sum_heads=True, mass_rows=rows,
                                     slot_count=torch.tensor([count], device=DEV))
    assert mass.shape == (3, 1, 1, stale["slot_pos"].shape[1])
    nb = count // 8
    cut = {**case, "table": case["table"][:, :nb], "slot_pos": case["slot_pos"][:, :count]}
    _, ref = paged_attention(**{k: (v.float() if k in ("q", "k_cache", "v_cache") else v)
                                for k, v in cut.items()}, return_probs=True)
    ref = ref.sum(dim=2, keepdim=True)
    torch.testing.assert_close(mass[[0, 2], ..., :count], ref[[0, 2]], atol=1e-4, rtol=1e-4)
    assert not mass[1].any() and not mass[..., count:].any()
    # every flagged row's mass sums to its query heads (4), the skipped row's to 0
    torch.testing.assert_close(mass.sum(-1).flatten().cpu(), torch.tensor([4.0, 0.0, 4.0]))


@pytest.mark.parametrize(("hq", "hkv", "d", "tiles"), [
    (2, 2, 8, None), (6, 2, 12, (16, 2, 2)), (8, 2, 8, None), (8, 1, 8, (32, 4, 2))])
def test_decode_kernel_matches_the_general_kernel(hq: int, hkv: int, d: int,
                                                  tiles: tuple[int, ...] | None) -> None:
    """`_decode_kernel` (one query token a row; auto for Tq = 1) against `_attn_kernel`
    (`decode=False`) and the reference: MHA, a group of 3 (rows padded) with head_dim 12
    (padded to 16), G = 4, G = 8; over evicted slots, a window, forced splits, the mass
    pass (which reads the decode kernel's LSE) and several slot tiles."""
    evict = {0: [1, 2, 6, 8, 9, 10, 11], 1: [0, 3, 4]}
    case = make_case([70, 9, 0], [1, 1, 1], bs=8, hq=hq, hkv=hkv, d=d, extra_blocks=2,
                     evict=evict)
    for window, splits in ((None, None), (20, 3)):
        out, mass = paged_attention_triton(**case, window=window, num_splits=splits,
                                           return_probs=True, tiles=tiles)
        ref, ref_mass = paged_attention_triton(**case, window=window, num_splits=splits,
                                               return_probs=True, decode=False)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mass, ref_mass, atol=1e-5, rtol=1e-5)
    check(case, window=20, num_splits=3, probs=True)


@pytest.mark.parametrize("chunk", [1, 3])
def test_kernels_never_read_an_invisible_slot(chunk: int) -> None:
    """Slots no query sees (evicted, past the causal edge, a table's -1 tail) may hold
    anything, NaN included (a pool's memory is not cleared when a slot is freed): both
    kernels mask their loads (the decode kernel by each slot's visibility, the general
    one, here for decode rows and a prefill chunk, by whether any row of the tile sees
    it), so the result is the one on clean caches."""
    evict = {0: [1, 2, 6], 1: [0, 3, 4]}
    case = make_case([13, 9], [chunk, chunk], extra_blocks=2, evict=evict, hq=4, hkv=2)
    dirty = {**case, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()}
    for b, row in enumerate(case["table"].tolist()):
        for s in range(len(row) * 4):
            blk = row[s // 4]
            if blk >= 0 and int(case["slot_pos"][b, s]) < 0:  # a dead slot of a live block
                dirty["k_cache"][blk, s % 4] = float("nan")
                dirty["v_cache"][blk, s % 4] = float("nan")
    assert dirty["v_cache"].isnan().any()
    for decode in ((None, False) if chunk == 1 else (None,)):
        out, _ = paged_attention_triton(**dirty, decode=decode)
        ref, _ = paged_attention_triton(**case, decode=decode)
        torch.testing.assert_close(out, ref)


@pytest.mark.parametrize(("hq", "hkv"), [(4, 2), (8, 1), (2, 2)])
def test_prefill_chunk_over_cached_prefix(hq: int, hkv: int) -> None:
    """Chunks attend causally to an earlier cached prefix; padded rows included."""
    check(make_case([0, 5, 9], [3, 6, 1], hq=hq, hkv=hkv))


@pytest.mark.parametrize(("hq", "hkv", "chunks"), [(8, 1, [9, 4]), (3, 1, [40, 2])])
def test_prefill_many_query_tiles(hq: int, hkv: int, chunks: list[int]) -> None:
    """More rows than one tile: 72 rows (G = 8), and 120 rows with G = 3, whose groups
    straddle tile edges; 40 queries also give the probs pass two query tiles."""
    check(make_case([3, 17], chunks, hq=hq, hkv=hkv), probs=True)


def test_sliding_window() -> None:
    check(make_case([0, 11, 20], [1, 1, 1], hq=4, hkv=2), window=5)
    check(make_case([7, 2], [5, 3], hq=8, hkv=1, bs=8), window=4)


def test_evicted_slots_and_padded_table() -> None:
    """Dead slots mid-block, a fully dead block still in the table, -1 table tail."""
    evict = {0: [1, 2, 6, 8, 9, 10, 11], 1: [0, 3, 4]}
    check(make_case([13, 9], [1, 1], extra_blocks=2, evict=evict), probs=True)
    check(make_case([10, 6], [4, 2], extra_blocks=1, evict=evict), probs=True)


@pytest.mark.parametrize("window", [None, 6])
def test_return_probs(window: int | None) -> None:
    case = make_case([3, 12], [5, 2], hq=8, hkv=2, bs=4)
    check(case, window=window, probs=True)
    _, mass = paged_attention_triton(**case, window=window, return_probs=True)
    # Each query row's probabilities sum to 1 per query head: G per kv group (rows
    # that see nothing, i.e. padded rows under a window, sum to 0).
    real = case["q_pos"] != PAD_QUERY_POS
    sums = mass.sum(-1)[real]
    torch.testing.assert_close(sums, torch.full_like(sums, 4.0))


def test_odd_head_dim_and_group() -> None:
    """head_dim 12 (padded to 16 and masked) and a non-power-of-two group (G = 3)."""
    check(make_case([4, 9], [3, 1], hq=3, hkv=1, d=12), probs=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_cast_on_load(dtype: torch.dtype) -> None:
    """16-bit pool and queries: upcast on load, fp32 maths, output back in q's dtype."""
    atol = 2e-3 if dtype == torch.float16 else 1e-2
    check(make_case([5, 0], [1, 3], dtype=dtype), probs=True, atol=atol)


def narrow_pool(case: dict, dtype: torch.dtype) -> dict:
    """The case with its caches rounded to `dtype` and q left fp32 (`kv_cache_dtype`)."""
    return {**case, "k_cache": case["k_cache"].to(dtype), "v_cache": case["v_cache"].to(dtype)}


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_fp32_queries_over_a_narrow_pool(kv_dtype: torch.dtype) -> None:
    """fp32 q over a bf16/fp16 pool: K/V are widened exactly on load and the dots stay
    IEEE, so the result is the fp32 reference's on the widened caches to fp32 rounding,
    and out stays fp32. (On GPU this also holds the wrapper to IEEE dots for fp32 q:
    tf32 would round q's mantissa and miss 1e-5; the interpreter ignores precision.)"""
    evict = {0: [1, 2, 6, 8, 9, 10, 11], 1: [0, 3, 4]}
    decode = make_case([13, 9, 0], [1, 1, 1], extra_blocks=2, evict=evict, hq=8, hkv=2)
    check(narrow_pool(decode, kv_dtype), probs=True, atol=1e-5)
    check(narrow_pool(decode, kv_dtype), window=5, atol=1e-5)
    prefill = make_case([0, 5, 9], [3, 6, 1], hq=6, hkv=2, evict={2: [1, 4]})
    check(narrow_pool(prefill, kv_dtype), probs=True, atol=1e-5)
    check(narrow_pool(prefill, kv_dtype), window=4, probs=True, atol=1e-5)
    long = make_case([149, 36], [1, 1], bs=8, hq=4, hkv=2)
    check(narrow_pool(long, kv_dtype), num_splits=3, atol=1e-5)
    check(narrow_pool(long, kv_dtype), num_splits=3, window=70, probs=True, atol=1e-5)


def test_row_with_no_visible_slot_is_zero() -> None:
    """A query before every cached position sees nothing: zeros, as SDPA gives."""
    case = make_case([0], [1])
    case["slot_pos"] = case["slot_pos"].masked_fill(case["slot_pos"] >= 0, 5)
    out, mass = paged_attention_triton(**case, return_probs=True)
    ref, _ = paged_attention(**case)
    assert bool((out == 0).all()) and bool((mass == 0).all())
    torch.testing.assert_close(out, ref)


def test_with_pool_and_seq_cache() -> None:
    """End to end with the real pool layout: k_cache = kv[0] view, per-layer tables."""
    bs, hkv, d, hq = 4, 2, 8, 4
    pool = make_pool(num_blocks=12, block_size=bs, num_kv_heads=hkv, head_dim=d)
    torch.manual_seed(0)
    seqs = [SeqCache(pool, num_layers=2), SeqCache(pool, num_layers=2)]
    for sc, n in zip(seqs, (10, 7)):
        slots = sc.append(torch.arange(n))  # [L, n] physical slot ids
        pool.storage.kv.view(2, -1, hkv, d)[:, slots.reshape(-1)] = torch.randn(2, 2 * n, hkv, d)
    seqs[0].evict(1, torch.tensor([0, 1, 2, 3, 5]))  # frees a whole block in layer 1
    layer = 1
    nb = max(sc.max_blocks for sc in seqs)
    table = torch.stack([sc.table[layer, :nb] for sc in seqs])
    slot_pos = torch.stack([sc.slot_pos[layer, : nb * bs] for sc in seqs])
    case = {"q": torch.randn(2, 1, hq, d), "k_cache": pool.storage.k_cache, "v_cache": pool.storage.v_cache,
            "table": table, "slot_pos": slot_pos, "q_pos": torch.tensor([[9], [6]]),
            "scale": d**-0.5}
    check({k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in case.items()},
          probs=True)


def test_select_attention() -> None:
    cpu = triton_attention.select_attention(torch.device("cpu"))
    assert cpu in (paged_attention, triton_attention.paged_attention_cpu)
    assert triton_attention.select_attention(torch.device("cuda")) is paged_attention_triton


def test_module_imports_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU installs without triton still import the module and get the torch path."""
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("_ta_no_triton", triton_attention.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.triton is None
    assert mod.select_attention(torch.device("cuda")) is paged_attention


def test_tile_choices_give_the_same_attention() -> None:
    """The GPU benchmark's tile sweep (benchmarks/bench_gpu_kernels.py) must only move the
    speed: every (BLOCK_N, warps, stages) it tries answers as the default, over
    slot tiles that cross blocks and a split, MHA for its MHA tiles, G = 4 for the GQA
    ones."""
    from benchmarks.bench_gpu_kernels import GQA_TILES, TILES

    for tiles_tried, hq in ((TILES, 2), (GQA_TILES, 8)):
        case = make_case([149, 36], [1, 1], bs=8, hq=hq, hkv=2)
        ref, _ = paged_attention_triton(**case)
        for tiles in tiles_tried:
            out, _ = paged_attention_triton(**case, tiles=tiles)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
