"""Linear layers with their weights prepacked by oneDNN, for models served on a CPU.

Why: a decode step on the CPU is mostly GEMMs of a few rows against every weight
matrix, and `F.linear` re-reads each weight in its plain row-major layout, step after
step. oneDNN can lay a weight out once in the blocked format its kernels stream best
(`mkldnn._reorder_linear_weight`) and multiply against it directly
(`mkldnn._linear_pointwise`), as vLLM's CPU backend does. Measured (fp32, one
thread, the 160M model's shapes): on a Xeon 1.3-2x faster for 8 to 64 rows, the output
head (768 x 32,000) 1.8-2.2x, no faster for a single row; on an AMD EPYC, where torch's
MKL takes its slow paths, 2.3-2.7x at 32 rows and 1.0-2.4x at one (docs/benchmarks.md
has the engine-level numbers).

Only where it is known to help: fp32 weights, or bf16 on a CPU with native bf16 dot
products (on plain AVX-512 oneDNN's bf16 path is emulated and slower than torch's, which
stays). On a CPU without AVX-512 at all (AMD Zen 1-3, Intel client cores) a bf16 weight
is packed widened to fp32 and its layer computes in fp32, rounding its output to bf16
(`bf16_path`): torch's dense bf16 GEMM there was 4x slower than fp32 for a whole 160M run
(docs/benchmarks.md, session 29), and bf16 GEMMs accumulate in fp32 anyway, so the
results differ from `F.linear`'s only by the summation order, as fp32's do. A widened layer
also keeps its bf16 weight: steps of at most `FEW_ROWS` rows (decoding at low
concurrency) are bound by the weight bytes they stream, and a C++ pass over the bf16
weight (`linear_rows`, engine/csrc/layer_ops_cpu.cpp) made a 160M single-row step 3x
faster than oneDNN over the widened one (session 30). Such weights take three times
their bf16 memory (the load log says so). Otherwise the dense weight is dropped once
packed (a weight tied to the input embedding lives on as the embedding), so packing alone
does not double memory. Results match `F.linear` to fp32 rounding (the summation order
differs): tests/test_cpu_linear.py.

Row counts are rounded up to a bucket (`padded_rows`: exact up to 32, then eight
buckets an octave, at most 12.5% padding; on an AMD CPU fewer than 6 rows pad to 6,
which oneDNN runs ~20% faster than one row). oneDNN builds and keeps state for every
input shape it sees, and a server's steps have any row count up to
max_num_batched_tokens: without buckets one weight fed 1-2,048 rows twice grew the
process by 7 GB (glibc kept what oneDNN's per-shape allocations fragmented), and the
10-minute soak's RSS by 16-27%; with them it stays within ~100 MB of the start
(docs/memory.md, "Process memory").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch
from torch import nn

from kvpool.native import cpuinfo, load_ops

log = logging.getLogger("kvserve.engine")

# Rows the packed layout is tuned for: a decode batch. oneDNN runs any row count on it.
_BATCH_HINT = 64
_EXACT_ROWS = 32  # row counts kept as they are (decode batches): padding them costs most
# Where torch's dense fp32 GEMM is MKL on an Intel CPU, smaller weights stay dense:
# oneDNN's per-call cost outweighs its layout there. Measured (Xeon, one thread):
# 256 x 384 at one row 13 us dense vs 33 us packed, at 32 rows 56 vs 82; 256 x 1,376 60
# vs 80 and 225 vs 258; 688 x 256 18 vs 44 and 113 vs 121 (the demo model's shapes).
# From ~0.5M weights on packed wins at 8-32 rows (768 x 2,304: 955 vs 1,171 us at 32
# rows), and the 160M model (768 x 768 and up) keeps every weight packed. MKL takes its
# slow paths on other vendors' CPUs (AMD EPYC, AVX-512, one thread: 256 x 1,376 at 4 rows
# 108 us dense vs 49 packed, at 32 rows 226 vs 133; 256 x 256 at 32 rows 83 vs 48; on
# two threads a demo-model step of 4 rows took 5.6 ms dense against 1.4 packed), so
# there every weight is packed.
_INTEL_MKL_MIN_ELEMENTS = 1 << 19


def pack_min_elements(vendor: str, mkl: bool) -> int:
    """The smallest weight worth packing: everything unless the dense path is MKL on an
    Intel CPU (where it is fast for small weights)."""
    return _INTEL_MKL_MIN_ELEMENTS if mkl and vendor == "GenuineIntel" else 0


PACK_MIN_ELEMENTS = pack_min_elements(cpuinfo("vendor_id"), torch.backends.mkl.is_available())


# Fewer rows than this are padded to it: oneDNN's kernels for 1-3 rows are slower than
# its 6-row one on an AMD EPYC (AVX-512, avx512_bf16), which streams each weight once
# for 6 rows as fast as for one. The 160M model's linear layers over all 12 layers and
# the output head, median ms, rows 1 / 2 / 4 / 6 (loadtest/bench_linear_rows.py;
# docs/benchmarks.md, session 17):
# fp32 two threads 24.7 / 26.7 / 21.7 / 19.9, one thread 38.0 / 44.5 / 32.9 / 31.2;
# bf16 two threads 12.7 / 13.4 / 12.0 / 10.7, one thread 20.6 / 22.9 / 18.6 / 18.6.
# A batch of one (a chat at concurrency 1) is the row count that matters most. Not
# measured on other vendors' CPUs, which keep exact small buckets.
_MIN_ROWS_AMD = 6


def min_rows(vendor: str) -> int:
    """The smallest bucket for this CPU vendor (`_MIN_ROWS_AMD`)."""
    return _MIN_ROWS_AMD if vendor == "AuthenticAMD" else 1


MIN_ROWS = min_rows(cpuinfo("vendor_id"))


def padded_rows(rows: int, smallest: int = MIN_ROWS) -> int:
    """The bucket `rows` rounds up to: `smallest` below it, itself up to 32, then 8
    buckets an octave."""
    if rows <= _EXACT_ROWS:
        return max(rows, smallest)
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def row_buckets(limit: int) -> list[int]:
    """Every bucket a step of at most `limit` rows can pad to, ascending."""
    out, rows = [], 1
    while rows <= limit:  # the last bucket appended is padded_rows(limit)
        out.append(padded_rows(rows))
        rows = out[-1] + 1
    return out


def warm_buckets(model: nn.Module, rows: Iterable[tuple[int, bool]], vocab: int,
                 deadline: float) -> int:
    """Run each distinct packed weight shape once at each (rows, head) bucket, in order,
    until `time.perf_counter()` passes `deadline`; returns the buckets done.

    Why: oneDNN creates its kernel state for a shape on the first call with it, and a
    served step's rows can be any bucket; the first wave of traffic paid ~0.4 ms per
    new shape per weight (a demo-model prefill step of 2,048 tokens 215 against 187 ms
    afterwards, a fresh 32-row decode step 7.6 against 6.8). `head` False skips the
    output head (the weights with `vocab` outputs): only sampled rows reach it (at most
    max_num_seqs), and it is the largest weight."""
    distinct: dict[tuple, PackedLinear] = {}
    for m in model.modules():
        if isinstance(m, PackedLinear):
            bias = None if m.bias is None else m.bias.dtype
            distinct.setdefault((m.in_features, m.out_features, bias, m.dtype), m)
    done = 0
    with torch.inference_mode():
        for n, head in rows:
            if time.perf_counter() > deadline:
                break
            for m in distinct.values():
                if head or m.out_features != vocab:
                    m(torch.zeros(n, m.in_features, dtype=m.dtype))
            done += 1
    return done


def packing_available(dtype: torch.dtype) -> bool:
    """oneDNN prepacking exists in this torch build and helps for `dtype` on this CPU
    (bf16: where `bf16_path` is not "dense")."""
    if not torch.backends.mkldnn.is_available() or not hasattr(
            torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and bf16_path() != "dense")


def native_bf16() -> bool:
    """The CPU has bf16 dot products (AVX512-BF16 or AMX)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def bf16_path() -> str:
    """How a bf16 linear layer runs here: "native" (bf16 dot products: packed bf16),
    "dense" (plain AVX-512: torch's dense bf16, which its AVX-512 emulation runs 1.4x
    faster than oneDNN's packed emulation at 32 rows) or "widened" (no AVX-512, e.g. AMD
    Zen 1-3: packed fp32, `packed_dtype`; torch's dense bf16 there made a 160M decode
    step 2x and a whole offline run 4x slower, docs/benchmarks.md session 29)."""
    if native_bf16():
        return "native"
    return "dense" if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else "widened"


# Rows up to which a widened layer streams its bf16 weight (`few_rows_available`).
FEW_ROWS = 16


def few_rows_available() -> bool:
    """The C++ pass of a few rows over a bf16 weight (`linear_rows`, in
    engine/csrc/layer_ops_cpu.cpp) is built with its vector loop (`linear_rows_isa`: AVX2
    and FMA; elsewhere the pass is a scalar loop, no match for oneDNN): widened layers
    then keep their bf16 weight."""
    return (load_ops("kvserve_layer_ops_cpu")
            and str(torch.ops.kvserve_layer.linear_rows_isa()) == "avx2")


def packed_dtype(dtype: torch.dtype, native: bool) -> torch.dtype:
    """The dtype a weight of `dtype` is packed and computed in: bf16 only where the CPU
    has bf16 dot products, else fp32."""
    return dtype if dtype != torch.bfloat16 or native else torch.float32


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over a oneDNN-prepacked weight (inference only)."""

    def __init__(self, linear: nn.Linear, native: bool | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype  # what the layer takes and returns
        compute = packed_dtype(self.dtype, native_bf16() if native is None else native)
        self.widened = compute != self.dtype  # converts in and out (off the fp32 hot path)
        weight = linear.weight.detach().to(compute)
        # An opaque oneDNN tensor: a buffer, not a parameter (nothing trains it, and
        # state_dict readers must not mistake it for a dense weight).
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(
            weight, _BATCH_HINT), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(
            linear.bias.detach().to(compute), requires_grad=False)
        # A widened layer keeps its bf16 weight too, for steps of a few rows
        # (`FEW_ROWS`): streaming half the bytes, a C++ pass beats oneDNN's fp32 there.
        # `few`: a plain attribute, read every call (a buffer's lookup through
        # nn.Module.__getattr__ is ~1.4 us, ~0.1 ms a 160M step)
        self.few = self.widened and few_rows_available()
        self.register_buffer("bf16_weight", linear.weight.detach().contiguous() if self.few
                             else None, persistent=False)
        self.register_buffer("bf16_bias", linear.bias.detach().contiguous()
                             if self.few and linear.bias is not None else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.few and rows <= FEW_ROWS and x.is_contiguous():
            y = torch.ops.kvserve_layer.linear_rows(
                x.view(rows, self.in_features), self.bf16_weight, self.bf16_bias)
            return y.view(*x.shape[:-1], self.out_features)
        padded = padded_rows(rows)
        if padded == rows:
            y = torch.ops.mkldnn._linear_pointwise(
                x.float() if self.widened else x, self.packed, self.bias, "none", [], "")
        else:
            xp = x.new_empty(padded, self.in_features, dtype=self.packed.dtype)
            xp[:rows] = x.reshape(rows, self.in_features)
            xp[rows:].zero_()  # rows are independent; zeros keep denormal garbage out
            y = torch.ops.mkldnn._linear_pointwise(xp, self.packed, self.bias, "none", [], "")
            y = y[:rows].view(*x.shape[:-1], self.out_features)
        return y.to(self.dtype) if self.widened else y

    def extra_repr(self) -> str:
        widened = ", computed in fp32" if self.widened else ""
        if self.few:
            widened += f" (bf16 weight kept for steps of at most {FEW_ROWS} rows)"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"oneDNN prepacked{widened}")


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of a CPU model whose weight packing helps (its dtype,
    at least PACK_MIN_ELEMENTS weights) with a `PackedLinear`, in place; returns how
    many were replaced (0 when unavailable)."""
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is nn.Linear and m.weight.device.type == "cpu"
               and m.weight.numel() >= PACK_MIN_ELEMENTS and packing_available(m.weight.dtype)]
    widened = kept = 0
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        packed = PackedLinear(linear)
        widened += packed.widened
        kept += packed.few
        setattr(parent, attr, packed)
    if targets:
        log.info("CPU: %d linear layers use oneDNN-prepacked weights%s", len(targets),
                 f" ({widened} bf16 ones widened to fp32: no AVX-512 on this CPU"
                 + (f"; {kept} keep their bf16 weight too, for steps of at most {FEW_ROWS}"
                    " rows: 3x the memory)" if kept else ")")
                 if widened else "")
    return len(targets)
