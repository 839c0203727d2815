"""The CPU decode kernel's attention mass for the policies (attention/csrc/paged_decode_cpu.cpp):
summed over heads, added into a per-slot state, written into a window ring, each bit for
bit what the policy computes from the mass the kernel returns (the kernel's answers
themselves: tests/test_cpu_attention.py)."""

from __future__ import annotations

import pytest
import torch

from attention.cpu_attention import paged_attention_cpu
from tests.test_cpu_attention import SHAPES, make_case, needs_kernel


@needs_kernel
@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), [*SHAPES, (6, 3, 16, 16), (8, 4, 32, 16),
                                                    (4, 1, 32, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_mass_summed_over_kv_heads_is_head_sums_bits(hq: int, hkv: int, d: int, bs: int,
                                                     dtype: torch.dtype, threads: int) -> None:
    """`sum_heads`: the kernel's one mass row per sequence is the per-head mass added in
    head order exactly as the policy bridge's head_sum adds it (bit for bit: the
    policies' kept sets depend on it), the output unchanged; also for a lone sequence,
    which is then not cut into kv-head slices."""
    from kvpool.head_stats import head_sum

    evict = {0: [0, 4, 5], 1: [1, 2, 3, 4, 29], 3: [*range(10, 30), 50, 51, 90]}
    for prefixes in ([9, 30, 2, 99, 500], [301]):
        case = make_case(prefixes, [1] * len(prefixes), evict=evict, extra_blocks=2, hq=hq,
                         hkv=hkv, d=d, bs=bs, dtype=dtype)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out, mass = paged_attention_cpu(**case, return_probs=True)
            out_sum, summed = paged_attention_cpu(**case, return_probs=True, sum_heads=True)
        finally:
            torch.set_num_threads(before)
        assert summed.shape == (len(prefixes), 1, 1, mass.shape[-1])
        assert torch.equal(out_sum, out)
        assert torch.equal(summed[None], head_sum(mass[None]))


def _state_cases(hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype):
    """Decode batches for a kernel that writes into a per-slot state: (case, the same
    rows as every row of wider tables, their indices, B, S, a generator)."""
    evict = {0: [0, 4, 5], 1: [1, 2, 3, 4, 29], 3: [*range(10, 30), 50, 51, 90]}
    for prefixes in ([9, 30, 2, 99, 500], [301]):
        case = make_case(prefixes, [1] * len(prefixes), evict=evict, extra_blocks=2, hq=hq,
                         hkv=hkv, d=d, bs=bs, dtype=dtype)
        b, s = case["table"].shape[0], case["slot_pos"].shape[1]
        whole = {**case, "table": torch.cat([case["table"][:1], case["table"],
                                             case["table"][:1]]),
                 "slot_pos": torch.cat([case["slot_pos"][:1] * 0 - 1, case["slot_pos"],
                                        case["slot_pos"][:1] * 0 - 1])}
        yield case, whole, torch.arange(1, b + 1), b, s, torch.Generator().manual_seed(b)


@needs_kernel
@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), [(4, 2, 8, 4), (8, 2, 32, 16), (4, 1, 32, 16),
                                                    (8, 4, 32, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_mass_added_into_a_state_is_the_policys_add(hq: int, hkv: int, d: int, bs: int,
                                                    dtype: torch.dtype, threads: int) -> None:
    """`accumulate`: each sequence's mass row (summed over every head) added into a
    per-slot state by the kernel is, bit for bit, the state plus the row the kernel
    returns (H2O's `acc += mass` after the step), rows read in place or as a slice,
    slots past a row's blocks and invisible slots untouched; the output unchanged and no
    mass returned. One row per sequence, whatever the threads (no kv-head slices)."""
    for case, whole, rows, b, s, g in _state_cases(hq, hkv, d, bs, dtype):
        start = torch.rand(b + 2, s + 5, generator=g) * 3  # wider, more rows: a slice
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out, mass = paged_attention_cpu(**case, return_probs=True, sum_heads=hkv > 1)
            acc = start.clone()
            got, none = paged_attention_cpu(**case, sum_heads=hkv > 1,
                                            accumulate=acc[1 : b + 1, :s])
            acc_rows = start.clone()  # the same rows of "every row", by index
            paged_attention_cpu(**whole, sum_heads=hkv > 1, table_rows=rows,
                                accumulate=acc_rows[:, :s])
        finally:
            torch.set_num_threads(before)
        assert none is None and torch.equal(got, out)
        want = start.clone()
        want[1 : b + 1, :s] += mass[:, 0, 0]
        assert torch.equal(acc, want) and torch.equal(acc_rows, want)
        assert torch.equal(acc[:, s:], start[:, s:]) and torch.equal(acc[0], start[0])
        dead = case["slot_pos"] < 0  # invisible slots: untouched, not + 0.0
        assert torch.equal(acc[1 : b + 1, :s][dead], start[1 : b + 1, :s][dead])


@needs_kernel
@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), [(4, 2, 8, 4), (4, 1, 32, 16), (8, 4, 32, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_mass_written_into_a_window_ring_is_the_policys_update(
        hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype, threads: int) -> None:
    """`ring`: each sequence's mass row (summed over every head), written by the kernel
    as its column of a window ring stored by columns, with the ring's fixed-point total,
    is bit for bit pyramid's own update of the same state with the returned row
    (`_window_ring`, the torch form of its op; `window_ring.h` both) on every slot of
    the call's rows (an invisible one gets 0, as the policy writes its rows whole), rows
    read in place or as a slice; other columns, rows and slots untouched; the output
    unchanged and no mass returned."""
    from policies.pyramid import _fixed, _shift, _split, _window_ring

    alpha = 8
    shift = _shift(alpha)
    for case, whole, rows, b, s, g in _state_cases(hq, hkv, d, bs, dtype):
        # a ring of earlier queries' mass, stored by columns as the tables keep it, and
        # its exact total; two rows and five slots more than the call reads (a slice)
        start = (torch.rand(b + 2, alpha, s + 5, generator=g) / 4).transpose(1, 2)  # [R, S, α]
        start_total = _split(_fixed(start, shift).sum(dim=2))  # [R, S, 3]
        cols = torch.randint(0, alpha, (b,), generator=g)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out, mass = paged_attention_cpu(**case, return_probs=True, sum_heads=hkv > 1)

            def by_columns(x: torch.Tensor) -> torch.Tensor:  # [R, S, k] as stored: [R, k, S]
                return x.transpose(1, 2).clone(memory_format=torch.contiguous_format).transpose(1, 2)

            ring, total = by_columns(start), by_columns(start_total)
            got, none = paged_attention_cpu(
                **case, sum_heads=hkv > 1, ring=ring.transpose(1, 2)[1 : b + 1, :, :s],
                ring_total=total.transpose(1, 2)[1 : b + 1, :, :s], ring_cols=cols,
                ring_shift=shift)
            ring_rows, total_rows = by_columns(start), by_columns(start_total)
            paged_attention_cpu(**whole, sum_heads=hkv > 1, table_rows=rows,
                                ring=ring_rows.transpose(1, 2)[:, :, :s],
                                ring_total=total_rows.transpose(1, 2)[:, :, :s],
                                ring_cols=cols, ring_shift=shift)
        finally:
            torch.set_num_threads(before)
        assert none is None and torch.equal(got, out)
        want, want_total = start.clone(), start_total.clone()
        _window_ring(want[None, 1 : b + 1, :s], want_total[None, 1 : b + 1, :s],
                     mass[:, 0, 0][:, None], cols[:, None], shift)  # [1, R, W, α]
        for r, t in ((ring, total), (ring_rows, total_rows)):
            assert torch.equal(r, want) and torch.equal(t, want_total)
        assert (mass[:, 0, 0] > 0).any()  # the ring did change
        assert not torch.equal(ring, start)
