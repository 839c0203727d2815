"""The CPU decode kernel (attention/csrc/paged_decode_cpu.cpp) against the torch path.

The kernel is built once per test session (about 20 s; cached on disk afterwards). Cases
cross what the kernel must get right: ragged lengths in one batch, GQA groups, evicted
slots and -1 table columns, sliding windows, 16-bit caches (under 16-bit queries, and
under fp32 ones: a pool narrower than the model), strided queries, attention mass for
policies, and the fallback for prefill rows and for a missing compiler. Last, the torch
path itself over a narrow pool: it is the fallback, so those tests run without a compiler.
What the kernel does with the mass for the policies (summed over heads, added into a
state, written into a window ring): tests/test_cpu_attention_mass.py.

With AVX-512 the kernel has a vector path for head dims 16/32/64/128 (query heads taken
1, 2 or 4 at a time by GQA group) and a portable one for the rest, so the semantic cases
run at d=8 (portable) and at vector-path shapes, including the 3m benchmark's (8 query
heads, 2 kv heads, d=32, blocks of 16). 16-bit K rows are read in chunks of 16 / GC
values when GC heads share them, so the GQA shapes cover every chunk width (4, 8, 16).
CPUs with AVX2 and no AVX-512 take an 8-lane vector path instead (paged_decode_avx2.h,
V loads shared by 4, 2 or 1 heads at d = 16, 32, 64+); on an AVX-512 CPU the whole file
also runs once more on a build without AVX-512 (tests/test_isa.py), so both vector paths
are checked wherever the suite runs.
"""

from __future__ import annotations

import pytest
import torch

from attention import cpu_attention
from attention.cpu_attention import paged_attention_cpu
from attention.torch_attention import causal_self_attention, paged_attention
from native import build as native
from tests import attention_cases, isa


def make_case(*args, **kw) -> dict:
    """The shared cases on the CPU whatever else the machine has: this is the CPU
    kernel (on a CUDA machine the shared default is the GPU, for the Triton tests)."""
    return attention_cases.make_case(*args, device="cpu", **kw)

needs_kernel = pytest.mark.skipif(not cpu_attention.kernel_available(),
                                  reason="no C++ compiler for the CPU kernel")


def check(case: dict, window: int | None = None, probs: bool = False,
          atol: float = 1e-5) -> None:
    """The kernel against the torch path run in fp32 on the same (widened) cache values."""
    out, mass = paged_attention_cpu(**case, window=window, return_probs=probs)
    ref_case = {k: (v.float() if k in ("q", "k_cache", "v_cache") else v)
                for k, v in case.items()}
    ref, ref_mass = paged_attention(**ref_case, window=window, return_probs=probs)
    assert out.dtype == case["q"].dtype and out.shape == case["q"].shape
    torch.testing.assert_close(out.float(), ref.float().nan_to_num(0.0), atol=atol, rtol=atol)
    if probs:
        assert mass.shape == ref_mass.shape and mass.dtype == torch.float32
        torch.testing.assert_close(mass, ref_mass.nan_to_num(0.0), atol=atol, rtol=atol)
    else:
        assert mass is None


# 32, 64 and 128 take the kernel's compile-time head-dim paths; the others its generic one.
@needs_kernel
@pytest.mark.parametrize(("hq", "hkv", "bs", "d"), [(4, 2, 4, 8), (8, 1, 8, 16), (3, 3, 16, 64),
                                                    (6, 2, 16, 20), (4, 2, 16, 32), (2, 1, 8, 128)])
@pytest.mark.parametrize("probs", [False, True])
def test_decode_ragged_batch(hq: int, hkv: int, bs: int, d: int, probs: bool) -> None:
    case = make_case([0, 3, 17, 40, 129], [1] * 5, hq=hq, hkv=hkv, bs=bs, d=d)
    check(case, probs=probs)


# (hq, hkv, d, bs): portable path; 3m shape (4 heads per kv head); MHA; GQA 2 with blocks
# of 8, so that a 16-slot tile spans two blocks in different places.
SHAPES = [(4, 2, 8, 4), (8, 2, 32, 16), (4, 4, 64, 16), (4, 2, 32, 8)]


@needs_kernel
@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), SHAPES)
@pytest.mark.parametrize("window", [None, 1, 6, 40])
def test_evicted_slots_padded_table_and_window(hq: int, hkv: int, d: int, bs: int,
                                               window: int | None) -> None:
    # Long enough for whole 16-slot tiles, contiguous ones and ones broken by evictions.
    evict = {0: [0, 4, 5], 1: [1, 2, 3, 4, 29], 3: [*range(10, 30), 50, 51, 90]}
    case = make_case([9, 30, 2, 99], [1, 1, 1, 1], evict=evict, extra_blocks=2,
                     hq=hq, hkv=hkv, d=d, bs=bs)
    check(case, window=window, probs=True)


@needs_kernel
@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), SHAPES)
def test_invisible_slots_are_never_read(hq: int, hkv: int, d: int, bs: int) -> None:
    """Evicted slots, a last block's unwritten tail and unused blocks may hold anything
    (a freed block's old rows, never-written memory): NaN there must not leak out."""
    case = make_case([40, 20], [1, 1], evict={0: [3, 17, 18, 33], 1: [0, 5]},
                     extra_blocks=1, hq=hq, hkv=hkv, d=d, bs=bs)
    ref, ref_mass = paged_attention_cpu(**case, return_probs=True)
    dirty = {**case, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()}
    used = set()
    for b in range(2):
        for j, blk in enumerate(case["table"][b].tolist()):
            if blk < 0:
                continue
            used.add(blk)
            for o in range(bs):
                if case["slot_pos"][b, j * bs + o] < 0:
                    dirty["k_cache"][blk, o] = float("nan")
                    dirty["v_cache"][blk, o] = float("nan")
    for blk in set(range(case["k_cache"].shape[0])) - used:
        dirty["k_cache"][blk] = float("nan")
        dirty["v_cache"][blk] = float("nan")
    out, mass = paged_attention_cpu(**dirty, return_probs=True)
    assert torch.equal(out, ref) and torch.equal(mass, ref_mass)


@needs_kernel
@pytest.mark.parametrize(("hq", "hkv", "d"), [(3, 3, 64), (4, 2, 64), (8, 2, 32), (8, 2, 16),
                                              (2, 2, 128), (4, 1, 128)])
def test_bf16_scores_are_fp32_sums_of_exact_products(hq: int, hkv: int, d: int) -> None:
    """bf16 queries over a bf16 cache: on a CPU with bf16 dot products the scores come
    from `vdpbf16ps` over channel pairs of the unscaled q (scale applied after). Each
    product of two bf16 values is exact and the sums are fp32, so the probabilities
    match the fp32 computation on the same values to fp32 rounding, here with scores of
    several units (q times 4, exact in bf16) where a scale or pairing error shows; heads
    taken 1, 2 and 4 at a time (K chunks of 16, 8 and 4 pairs)."""
    case = make_case([31, 7, 60, 200], [1, 1, 1, 1], dtype=torch.bfloat16, hq=hq, hkv=hkv, d=d,
                     bs=16)
    case["q"].mul_(4)  # a power of two: still exact
    out, mass = paged_attention_cpu(**case, return_probs=True)
    ref_case = {k: (v.double() if k in ("q", "k_cache", "v_cache") else v)
                for k, v in case.items()}
    ref, ref_mass = paged_attention(**ref_case, return_probs=True)
    assert float(ref_mass.max()) > 0.2  # peaked: the scores are large
    torch.testing.assert_close(mass.double(), ref_mass.double().nan_to_num(0.0), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out.double(), ref.double().nan_to_num(0.0), atol=1e-2, rtol=1e-2)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 8), (8, 2, 32), (2, 2, 64)])
def test_half_caches_accumulate_in_fp32(dtype: torch.dtype, hq: int, hkv: int, d: int) -> None:
    case = make_case([31, 7, 60], [1, 1, 1], dtype=dtype, hq=hq, hkv=hkv, d=d, bs=16)
    check(case, probs=True, atol=2e-2)


@needs_kernel
@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), SHAPES)
def test_row_with_no_visible_slot_is_zero(hq: int, hkv: int, d: int, bs: int) -> None:
    case = make_case([5, 5], [1, 1], evict={1: list(range(6))}, hq=hq, hkv=hkv, d=d, bs=bs)
    out, mass = paged_attention_cpu(**case, return_probs=True)
    assert torch.all(out[1] == 0) and torch.all(mass[1] == 0)
    assert torch.all(out[0] != 0)


@needs_kernel
def test_prefill_rows_take_the_torch_path() -> None:
    case = make_case([4, 0], [3, 5])
    out, mass = paged_attention_cpu(**case, return_probs=True)
    ref, ref_mass = paged_attention(**case, return_probs=True)
    assert torch.equal(out, ref) and torch.equal(mass, ref_mass)


def narrow_pool(case: dict, dtype: torch.dtype) -> dict:
    """The case with its caches rounded to `dtype` and q left as it is."""
    return {**case, "k_cache": case["k_cache"].to(dtype), "v_cache": case["v_cache"].to(dtype)}


# (hq, hkv, d, bs) -> heads per K load (GC) and 16-bit chunk width (16 / GC) with AVX-512:
# portable (d=8, d=20); d=16 G=4 (GC 4, chunks of 4) with blocks of 8; d=32 G=4 (GC 4,
# the 3m shape); d=32 G=2 (GC 2, chunks of 8); d=32 G=3 (GC 1, whole rows); d=64 G=2
# (GC 2); d=128 MHA.
MIXED_SHAPES = [(4, 2, 8, 4), (6, 2, 20, 16), (8, 2, 16, 8), (8, 2, 32, 16), (4, 2, 32, 16),
                (6, 2, 32, 16), (4, 2, 64, 16), (2, 2, 128, 8)]


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), MIXED_SHAPES)
@pytest.mark.parametrize(("window", "probs"), [(None, False), (None, True), (7, True)])
def test_fp32_queries_over_a_narrow_pool(kv_dtype: torch.dtype, hq: int, hkv: int, d: int,
                                         bs: int, window: int | None, probs: bool) -> None:
    """fp32 q over a bf16/fp16 pool (`kv_cache_dtype`): the kernel widens each K/V value
    exactly and computes in fp32, so it matches the fp32 torch path on the widened
    caches as tightly as the all-fp32 kernel does; output stays fp32. Odd lengths,
    evicted slots, a -1 table tail and lengths across several 16-slot tiles."""
    evict = {0: [0, 4, 5], 1: [1, 2, 3, 29], 3: [*range(10, 30), 50, 90]}
    case = make_case([9, 30, 0, 99], [1] * 4, evict=evict, extra_blocks=2, hq=hq, hkv=hkv,
                     d=d, bs=bs)
    check(narrow_pool(case, kv_dtype), window=window, probs=probs)


@needs_kernel
@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [(torch.bfloat16, torch.float16),
                                                   (torch.float16, torch.bfloat16),
                                                   (torch.float64, torch.float32)])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 8), (8, 2, 32)])
def test_other_dtype_pairs(q_dtype: torch.dtype, kv_dtype: torch.dtype, hq: int, hkv: int,
                           d: int) -> None:
    """q's dtype is a run-time switch in the kernel, so every pair works; the output is
    rounded to q's dtype once, at the end."""
    case = make_case([31, 7, 60], [1, 1, 1], hq=hq, hkv=hkv, d=d, bs=16)
    case = narrow_pool({**case, "q": case["q"].to(q_dtype)}, kv_dtype)
    check(case, probs=True, atol=1e-2 if q_dtype.itemsize == 2 else 1e-5)


@needs_kernel
@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [(torch.float32, torch.float32),
                                                   (torch.float32, torch.bfloat16),
                                                   (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), [(4, 2, 8, 4), (8, 2, 32, 16)])
def test_narrow_pool_invisible_slots_and_empty_rows(q_dtype: torch.dtype, kv_dtype: torch.dtype,
                                                    hq: int, hkv: int, d: int, bs: int) -> None:
    """NaN in slots nobody sees does not leak out, and a sequence that sees no slot gets
    zeros in q's dtype, whatever the pool's dtype."""
    case = make_case([40, 5], [1, 1], evict={0: [3, 17, 18, 33], 1: list(range(6))},
                     extra_blocks=1, hq=hq, hkv=hkv, d=d, bs=bs)
    case = narrow_pool({**case, "q": case["q"].to(q_dtype)}, kv_dtype)
    ref, ref_mass = paged_attention_cpu(**case, return_probs=True)
    dirty = {**case, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()}
    live = {int(blk) for blk in case["table"][0] if blk >= 0}
    for blk in set(range(case["k_cache"].shape[0])) - live:
        dirty["k_cache"][blk] = float("nan")
        dirty["v_cache"][blk] = float("nan")
    for s in (3, 17, 18, 33):
        blk = int(case["table"][0, s // bs])
        dirty["k_cache"][blk, s % bs] = float("nan")
        dirty["v_cache"][blk, s % bs] = float("nan")
    out, mass = paged_attention_cpu(**dirty, return_probs=True)
    assert out.dtype == q_dtype
    assert torch.equal(out, ref) and torch.equal(mass, ref_mass)
    assert torch.all(out[1] == 0) and torch.all(mass[1] == 0) and torch.all(out[0] != 0)


@needs_kernel
def test_bad_inputs_raise_clear_errors() -> None:
    case = make_case([4], [1])
    with pytest.raises(RuntimeError, match="k_cache and v_cache must share a dtype"):
        paged_attention_cpu(**{**case, "k_cache": case["k_cache"].bfloat16()})
    with pytest.raises(RuntimeError, match="must be float32, bfloat16, float16 or float64"):
        paged_attention_cpu(**narrow_pool(case, torch.int32))
    with pytest.raises(RuntimeError, match="must be float32, bfloat16, float16 or float64"):
        paged_attention_cpu(**{**case, "q": case["q"].to(torch.int32)})
    with pytest.raises(RuntimeError, match="share a head dim"):
        paged_attention_cpu(**{**case, "q": case["q"][..., :4]})
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        paged_attention_cpu(**{**case, "q": case["q"][:, :, :3]})


@needs_kernel
def test_an_empty_batch_gives_an_empty_answer() -> None:
    """No decoding rows: nothing to split over threads, nothing read."""
    case = make_case([4, 9], [1, 1])
    empty = {**case, **{k: case[k][:0] for k in ("q", "table", "slot_pos", "q_pos")}}
    out, mass = paged_attention_cpu(**empty, return_probs=True)
    assert out.shape == (0, *case["q"].shape[1:]) and mass.shape[0] == 0


def test_disabled_by_env_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_CPU_KERNEL", "0")
    assert native.build("kvserve_paged_decode_cpu",
                        native.LIBRARIES["kvserve_paged_decode_cpu"].source, [], []) is False


def widened(case: dict) -> dict:
    """The case with its caches widened to fp32: the values a narrow pool holds, exactly."""
    return {**case, "k_cache": case["k_cache"].float(), "v_cache": case["v_cache"].float()}


# (prefixes, chunks, hq, hkv, probs) -> the torch path's branches
TORCH_BRANCHES = [
    ([9, 30, 0], [1, 1, 1], 8, 2, False),  # decode under GQA: heads folded into query rows
    ([9, 30, 0], [1, 1, 1], 4, 4, False),  # decode without GQA: plain SDPA
    ([0, 5, 9], [3, 6, 1], 8, 2, False),   # prefill chunks over a cached prefix: enable_gqa
    ([9, 30, 0], [1, 1, 1], 8, 2, True),   # explicit softmax (attention mass)
    ([0, 5, 9], [3, 6, 1], 8, 2, True),
]


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("prefixes", "chunks", "hq", "hkv", "probs"), TORCH_BRANCHES)
@pytest.mark.parametrize("window", [None, 4])
def test_torch_path_over_a_narrow_pool(kv_dtype: torch.dtype, prefixes: list[int],
                                       chunks: list[int], hq: int, hkv: int, probs: bool,
                                       window: int | None) -> None:
    """SDPA refuses keys in another dtype than the queries; the torch path casts what it
    gathers to q's dtype, so it gives bit for bit what it gives on caches widened first."""
    case = narrow_pool(make_case(prefixes, chunks, hq=hq, hkv=hkv, evict={1: [2, 3, 7]},
                                 extra_blocks=1), kv_dtype)
    out, mass = paged_attention(**case, window=window, return_probs=probs)
    ref, ref_mass = paged_attention(**widened(case), window=window, return_probs=probs)
    assert out.dtype == torch.float32
    # Padded rows under a window see nothing: NaN in the explicit-softmax branch.
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)
    if probs:
        torch.testing.assert_close(mass, ref_mass, rtol=0, atol=0, equal_nan=True)
    else:
        assert mass is None


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_causal_self_attention_over_narrow_keys(kv_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(11, h, 16, generator=g) for h in (8, 2, 2))
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    out = causal_self_attention(q, k, v, 0.25)
    assert out.dtype == torch.float32
    assert torch.equal(out, causal_self_attention(q, k.float(), v.float(), 0.25))


@needs_kernel
@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), [(8, 4, 32, 16), (6, 3, 64, 8), (4, 2, 8, 4)])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fewer_sequences_than_threads_split_by_kv_heads(hq: int, hkv: int, d: int, bs: int,
                                                        rows: int, dtype: torch.dtype) -> None:
    """With more threads than sequences each sequence is cut into slices of its kv heads
    (4 threads: 1 row -> up to 4 slices, 3 rows -> 2); the answers, attention mass
    included, are the one-slice answers. The first sequence reads 128K K/V elements
    inside its window: a smaller call runs on one thread (native/csrc/team.h)."""
    first = (128 << 10) // (2 * hkv * d) + 20
    case = make_case([first, 5, 33][:rows], [1] * rows, evict={0: [3, 4, 40]}, hq=hq,
                     hkv=hkv, d=d, bs=bs, dtype=dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        check(case, window=first - 10, probs=True,
              atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize(("hq", "hkv", "d", "kv_dtype"), [(8, 8, 64, torch.bfloat16),
                                                          (8, 2, 64, torch.float16),
                                                          (4, 4, 64, torch.float32)])
def test_a_call_from_dram_touches_rows_and_answers_the_same(hq: int, hkv: int, d: int,
                                                             kv_dtype: torch.dtype) -> None:
    """A call over more than 8 MB of K/V (`kStreamBytes`) reads its rows with demand
    loads in address order instead of prefetches: only the memory traffic differs, so
    the answers are the bits of the same sequences attended one per call (each under
    the limit), and match the torch path. Evictions and a window leave tiles whose rows
    are not consecutive, and short last tiles."""
    lens = [1500, 1203, 700, 1499, 1388, 911, 1450, 1321, 1024, 1499, 640, 1333]
    evict = {0: [*range(5, 40), 700], 2: [0, 1, 2, 17, 18, 650], 5: [*range(100, 400)]}
    case = narrow_pool(make_case(lens, [1] * len(lens), evict=evict, extra_blocks=1, hq=hq,
                                 hkv=hkv, d=d, bs=16), kv_dtype)
    row_bytes = hkv * d * case["k_cache"].element_size()
    assert 2 * case["slot_pos"].numel() * row_bytes > 8 << 20  # the whole call streams
    assert 2 * case["slot_pos"].shape[1] * row_bytes < 8 << 20  # one sequence does not
    out, mass = paged_attention_cpu(**case, window=1200, return_probs=True)
    for i in range(len(lens)):
        one = {k: (v[i : i + 1] if k in ("q", "table", "slot_pos", "q_pos") else v)
               for k, v in case.items()}
        o, m = paged_attention_cpu(**one, window=1200, return_probs=True)
        assert torch.equal(o, out[i : i + 1]) and torch.equal(m, mass[i : i + 1])
    check(case, window=1200, probs=True)


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_rows_of_wider_tables_are_read_in_place(kv_dtype: torch.dtype) -> None:
    """The runner hands the kernel rows of the engine's shared tables as views (row
    stride wider than the batch's blocks; `SlotTables.rows_of`): the kernel reads each
    row at its stride, never the columns past it, which here hold visible-looking
    positions and real block ids, and answers the bits of the contiguous call."""
    case = narrow_pool(make_case([37, 5, 64, 20], [1, 1, 1, 1], evict={2: [3, 4, 40]},
                                 hq=4, hkv=2, d=32, bs=8), kv_dtype)
    b, nb = case["table"].shape
    s = case["slot_pos"].shape[1]
    table = torch.zeros(b + 2, nb + 3, dtype=torch.int64)  # block 0 exists: never read
    slot_pos = torch.zeros(b + 2, s + 3 * 8, dtype=torch.int64)  # position 0: visible
    table[1 : b + 1, :nb] = case["table"]
    slot_pos[1 : b + 1, :s] = case["slot_pos"]
    view = {**case, "table": table[1 : b + 1, :nb], "slot_pos": slot_pos[1 : b + 1, :s]}
    assert not view["table"].is_contiguous() and not view["slot_pos"].is_contiguous()
    want, want_mass = paged_attention_cpu(**case, window=None, return_probs=True)
    got, mass = paged_attention_cpu(**view, window=None, return_probs=True)
    assert torch.equal(got, want) and torch.equal(mass, want_mass)


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_rows_by_index_are_read_in_place(kv_dtype: torch.dtype, monkeypatch) -> None:
    """Rows that are not consecutive (a request finished between two others) reach the
    kernel as the engine's whole tables and each sequence's row index (`table_rows`;
    `SlotTables.rows_of(whole=True)`), nothing gathered: the same bits as the gathered
    call, KeyDiff's fused scores included, and the torch path (no kernel) gathers them."""
    from attention.cpu_attention import paged_decode_key_diversity

    case = narrow_pool(make_case([37, 5, 64, 20], [1, 1, 1, 1], evict={2: [3, 4, 40]},
                                 hq=4, hkv=2, d=32, bs=8), kv_dtype)
    nb = case["table"].shape[1]
    s = case["slot_pos"].shape[1]
    rows = torch.tensor([5, 0, 3, 6])  # rows 1, 2 and 4 belong to nobody in this call
    table = torch.zeros(7, nb + 3, dtype=torch.int64)  # block 0 exists: never read
    slot_pos = torch.zeros(7, s + 3 * 8, dtype=torch.int64)  # position 0: visible
    table[rows, :nb] = case["table"]
    slot_pos[rows, :s] = case["slot_pos"]
    whole = {**case, "table": table[:, :nb], "slot_pos": slot_pos[:, :s]}
    want, want_mass = paged_attention_cpu(**case, window=None, return_probs=True)
    got, mass = paged_attention_cpu(**whole, window=None, return_probs=True, table_rows=rows)
    assert torch.equal(got, want) and torch.equal(mass, want_mass)
    if kv_dtype == torch.float32:  # KeyDiff's fused scores take float pools
        kd_want = paged_decode_key_diversity(**case, return_probs=True)
        kd_got = paged_decode_key_diversity(**whole, return_probs=True, table_rows=rows)
        assert all(torch.equal(x, y) for x, y in zip(kd_got, kd_want))
    monkeypatch.setattr(cpu_attention, "kernel_available", lambda: False)
    torch_want, _ = paged_attention_cpu(**case, window=None)
    torch_got, _ = paged_attention_cpu(**whole, window=None, table_rows=rows)
    assert torch.equal(torch_got, torch_want)
    with pytest.raises(RuntimeError, match="row"):
        monkeypatch.undo()
        paged_attention_cpu(**whole, window=None, table_rows=torch.tensor([5, 0, 3, 7]))


@needs_kernel
def test_the_build_takes_the_vector_path_of_this_cpu() -> None:
    """-march=native picks the path: a CPU with AVX2 but no AVX-512 must not be left on
    the portable loop (~3x slower at the 3m shape on a Zen 3 host)."""
    assert cpu_attention.vector_path() == isa.expected_path()
