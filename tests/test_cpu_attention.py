"""The CPU decode kernel (kvpool/csrc/paged_decode_cpu.cpp) against the torch path.

The kernel is built once per test session (about 20 s; cached on disk afterwards). Cases
cross what the kernel must get right: ragged lengths in one batch, GQA groups, evicted
slots and -1 table columns, sliding windows, 16-bit caches, strided queries, attention
mass for policies, and the fallback for prefill rows and for a missing compiler.

With AVX-512 the kernel has a vector path for head dims 16/32/64/128 (query heads taken
1, 2 or 4 at a time by GQA group) and a portable one for the rest, so the semantic cases
run at d=8 (portable) and at vector-path shapes, including the 3m benchmark's (8 query
heads, 2 kv heads, d=32, blocks of 16).
"""

from __future__ import annotations

import pytest
import torch

from kvpool import cpu_attention
from kvpool.attention import paged_attention
from kvpool.cpu_attention import paged_attention_cpu
from tests.attention_cases import make_case

pytestmark = pytest.mark.skipif(not cpu_attention.kernel_available(),
                                reason="no C++ compiler for the CPU kernel")


def check(case: dict, window: int | None = None, probs: bool = False,
          atol: float = 1e-5) -> None:
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
@pytest.mark.parametrize(("hq", "hkv", "bs", "d"), [(4, 2, 4, 8), (8, 1, 8, 16), (3, 3, 16, 64),
                                                    (6, 2, 16, 20), (4, 2, 16, 32), (2, 1, 8, 128)])
@pytest.mark.parametrize("probs", [False, True])
def test_decode_ragged_batch(hq: int, hkv: int, bs: int, d: int, probs: bool) -> None:
    case = make_case([0, 3, 17, 40, 129], [1] * 5, hq=hq, hkv=hkv, bs=bs, d=d)
    check(case, probs=probs)


# (hq, hkv, d, bs): portable path; 3m shape (4 heads per kv head); MHA; GQA 2 with blocks
# of 8, so that a 16-slot tile spans two blocks in different places.
SHAPES = [(4, 2, 8, 4), (8, 2, 32, 16), (4, 4, 64, 16), (4, 2, 32, 8)]


@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), SHAPES)
@pytest.mark.parametrize("window", [None, 1, 6, 40])
def test_evicted_slots_padded_table_and_window(hq: int, hkv: int, d: int, bs: int,
                                               window: int | None) -> None:
    # Long enough for whole 16-slot tiles, contiguous ones and ones broken by evictions.
    evict = {0: [0, 4, 5], 1: [1, 2, 3, 4, 29], 3: [*range(10, 30), 50, 51, 90]}
    case = make_case([9, 30, 2, 99], [1, 1, 1, 1], evict=evict, extra_blocks=2,
                     hq=hq, hkv=hkv, d=d, bs=bs)
    check(case, window=window, probs=True)


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 8), (8, 2, 32), (2, 2, 64)])
def test_half_caches_accumulate_in_fp32(dtype: torch.dtype, hq: int, hkv: int, d: int) -> None:
    case = make_case([31, 7, 60], [1, 1, 1], dtype=dtype, hq=hq, hkv=hkv, d=d, bs=16)
    check(case, probs=True, atol=2e-2)


@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), SHAPES)
def test_row_with_no_visible_slot_is_zero(hq: int, hkv: int, d: int, bs: int) -> None:
    case = make_case([5, 5], [1, 1], evict={1: list(range(6))}, hq=hq, hkv=hkv, d=d, bs=bs)
    out, mass = paged_attention_cpu(**case, return_probs=True)
    assert torch.all(out[1] == 0) and torch.all(mass[1] == 0)
    assert torch.all(out[0] != 0)


def test_prefill_rows_take_the_torch_path() -> None:
    case = make_case([4, 0], [3, 5])
    out, mass = paged_attention_cpu(**case, return_probs=True)
    ref, ref_mass = paged_attention(**case, return_probs=True)
    assert torch.equal(out, ref) and torch.equal(mass, ref_mass)


def test_bad_inputs_raise_clear_errors() -> None:
    case = make_case([4], [1])
    with pytest.raises(RuntimeError, match="share a dtype"):
        paged_attention_cpu(**{**case, "k_cache": case["k_cache"].double()})
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        paged_attention_cpu(**{**case, "q": case["q"][:, :, :3]})


def test_disabled_by_env_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_CPU_KERNEL", "0")
    assert cpu_attention._load() is False
