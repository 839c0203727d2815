"""Linear layers with their weights prepacked by oneDNN or laid out in panels, for models
served on a CPU, and the vendor rules that chose between them before measurement did.

Which layout a layer takes is now measured on the CPU at start (engine/linear_choice.py,
cached per machine); the rules below (`faster_linear`, `panels_for`) are its fallback,
and the measurements they record are why they are what they are.

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
stays). On a CPU with AVX2 but no AVX-512 (AMD Zen 1-3, Intel client cores) oneDNN is not
used at all: every weight is laid out in 16-column panels once and multiplied by kvserve's
own kernel (`PanelLinear`, engine/csrc/linear_panels.h), in its own dtype. There a decode
step is bound by the weight bytes it streams: the panels run the 160M model's layers
1.3-2x faster than oneDNN in fp32 at 1-12 rows and level with it for prefill-sized steps
(0.94-1.08x), and a bf16 weight stays bf16 (oneDNN needed it widened to fp32: twice the
bytes to stream, 2-3x slower at 1-8 rows, and the widened copy kept beside the bf16 one for
few-row steps had tripled its memory; docs/benchmarks.md at commit 505ae8c). On an AMD
CPU with AVX-512 (Zen 4) fp32 layers take the panels too, with a 12-row AVX-512 tile
(1.3-1.4x oneDNN at 1-4 rows, level at 16-256, 0.93x at 2,048; commit 54a62b7), and so do
bf16 layers where the CPU has bf16 dot products (AVX512-BF16), in pairs multiplied by
`vdpbf16ps` (commit 8114403; `panels_for`). Where neither
panels nor native bf16 exist (no AVX2 and no AVX-512) a bf16 weight is packed widened to
fp32 and its layer computes in fp32, rounding its output to bf16 (`bf16_path`): torch's
dense bf16 GEMM is far slower there, and bf16 GEMMs accumulate in fp32 anyway, so the
results differ from `F.linear`'s only by the summation order, as fp32's do. The dense weight is dropped once laid out (a
weight tied to the input embedding lives on as the embedding), so neither layout doubles
memory. Results match `F.linear` to fp32 rounding: tests/test_cpu_linear.py (oneDNN) and
tests/test_cpu_linear_panels.py (the panels).

oneDNN's row counts are rounded up to a bucket (`padded_rows`: exact up to 32, then eight
buckets an octave, at most 12.5% padding; on an AMD CPU fewer than 6 rows pad to 6,
which oneDNN runs ~20% faster than one row). oneDNN builds and keeps state for every
input shape it sees, and a server's steps have any row count up to
max_num_batched_tokens: without buckets one weight fed 1-2,048 rows twice grew the
process by 7 GB (glibc kept what oneDNN's per-shape allocations fragmented), and the
10-minute soak's RSS by 16-27%; with them it stays within ~100 MB of the start
(docs/memory.md, "Process memory").
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import torch
from torch import nn

from native.build import load_ops
from native.cpu import cpuinfo, pair_fma, prefetch_from, whole_k_to
from native.huge_pages import huge_page_empty

PANEL = 16  # output columns a panel holds (`PanelLinear`; linear_panels.h's kNR)
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
# the output head, median ms, rows 1 / 2 / 4 / 6 (benchmarks/bench_linear_rows.py;
# commit 3c514cd):
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


def warm_buckets(model: nn.Module, rows: Sequence[tuple[int, bool]], vocab: int,
                 deadline: float) -> tuple[int, int]:
    """Run each distinct packed weight shape once at each (rows, head) bucket, in order,
    until `time.perf_counter()` passes `deadline`; returns (buckets done, buckets to do):
    (0, 0) for a model with no oneDNN-packed layer (panels, dense), which has no
    per-shape state to create.

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
    if not distinct:
        return 0, 0
    done = 0
    with torch.inference_mode():
        for n, head in rows:
            if time.perf_counter() > deadline:
                break
            for m in distinct.values():
                if head or m.out_features != vocab:
                    m(torch.zeros(n, m.in_features, dtype=m.dtype))
            done += 1
    return done, len(rows)


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
    faster than oneDNN's packed emulation at 32 rows) or "widened" (no AVX-512: packed
    fp32, `packed_dtype`, where the panels are not available, `faster_linear`; torch's
    dense bf16 on AMD Zen 3 made a 160M decode step 2x and a whole offline run 4x slower,
    docs/benchmarks.md at commit a4f35db)."""
    if native_bf16():
        return "native"
    return "dense" if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else "widened"


@functools.cache
def _kernel_choices() -> tuple[bool, int, int]:
    """This CPU's choices for the panel kernel, made in native/build.py and read once,
    by the first panel layer (the last needs the built op's ISA): whether a pair layer's
    steps run on FMAs (`pair_fma`), from which rows a whole-K step prefetches the next
    panel (`prefetch_from`), and up to which rows a step runs whole K (`whole_k_to`)."""
    return pair_fma(), prefetch_from(), whole_k_to(avx512=panels_isa().startswith("avx512"))


def panels_isa() -> str:
    """The panel kernel's vector loop in this build: "avx2", "avx512", "avx512_bf16"
    (AVX-512 with bf16 dot products: bf16 layers in pairs, `PanelLinear`), or "scalar" (or
    "none" without the C++ layer ops)."""
    if not load_ops("kvserve_layer_ops_cpu"):
        return "none"
    return str(torch.ops.kvserve_layer.linear_panels_isa())


def panels_available() -> bool:
    """The panel kernel (`PanelLinear`) is built here with a vector loop (AVX2 and FMA,
    or AVX-512): elsewhere it is a scalar loop."""
    return panels_isa() in ("avx2", "avx512", "avx512_bf16")


def panels_for(dtype: torch.dtype, vendor: str | None = None, amx: bool | None = None) -> bool:
    """Whether a linear layer of `dtype` runs on panels here rather than oneDNN: where
    they were measured faster (docs/benchmarks.md, "The decode step: host work and CPU kernels").

    - AVX2 without AVX-512 (AMD Zen 1-3): fp32 and bf16 (measured on Zen 3, commit 505ae8c).
    - AVX-512 on AMD (Zen 4: the 12-row tile): fp32, 1.3-1.4x oneDNN at 1-4 rows,
      level at 16-256, 0.93x at 2,048 (commit 54a62b7); bf16 where the build has the pair
      tile's bf16 dot products ("avx512_bf16"): a decode step of the 160M model 1.45x as
      fast as on oneDNN's bf16 with serve's waits at one row, 1.1x at 8-32, prefill level
      (commit 8114403; the layers on kvserve's thread team, not on OpenMP's sleeping one).
      Without the pair tile bf16 stays on oneDNN (widened panels: half its speed at 16+).
    - Intel CPUs with AVX-512 but no AMX (a Xeon, model 207, two threads; commit c8b6f91), the
      same rule: a pass over the 160M model's fp32 layers 1.4x oneDNN's speed at 1-8
      rows, 1.7x at 16, 1.4x at 24-32, 1.2x at 64, 0.97x at 256-2,048 (the wide tile);
      bf16 in pairs 1.4x at one row, 1.9x at 8, and from 6 rows on multiplied by FMAs
      (`pair_fma`) 1.5-1.6x at 16-2,048.
    - Intel CPUs with AMX: not measured (oneDNN's AMX bf16 kernels), oneDNN's."""
    if dtype not in (torch.float32, torch.bfloat16) or not panels_available():
        return False
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return True
    vendor = cpuinfo("vendor_id") if vendor is None else vendor
    amx = torch.cpu._is_amx_tile_supported() if amx is None else amx
    if not panels_isa().startswith("avx512") or not (
            vendor == "AuthenticAMD" or (vendor == "GenuineIntel" and not amx)):
        return False
    return dtype == torch.float32 or panels_isa() == "avx512_bf16"


def packed_dtype(dtype: torch.dtype, native: bool) -> torch.dtype:
    """The dtype a weight of `dtype` is packed and computed in: bf16 only where the CPU
    has bf16 dot products, else fp32."""
    return dtype if dtype != torch.bfloat16 or native else torch.float32


def panel_settings(dtype: torch.dtype, in_features: int, pairs: bool | None = None,
                   fma: bool | None = None) -> tuple[bool, bool, int, int]:
    """A panel weight's (pairs, fma, prefetch_from, whole_k_to) here: bf16 in pairs where
    the kernel has bf16 dot products (`panels_isa` "avx512_bf16"; or as `pairs` asks, for
    an even `in_features`), a pair layout's longer steps by FMAs (`pair_fma`; from which
    rows: linear_panels.h), and this CPU's kernel choices (`_kernel_choices`)."""
    if pairs is None:
        pairs = dtype == torch.bfloat16 and panels_isa() == "avx512_bf16"
    pairs = pairs and dtype == torch.bfloat16 and in_features % 2 == 0
    by_fma, prefetch, whole = _kernel_choices()
    return pairs, pairs and (by_fma if fma is None else fma), prefetch, whole


def panel_shape(out_features: int, in_features: int, pairs: bool) -> tuple[int, ...]:
    """A weight's panels: [ceil(out / 16), in, 16], in pairs [ceil(out / 16), in / 2, 16, 2]."""
    panels = -(-out_features // PANEL)
    return (panels, in_features // 2, PANEL, 2) if pairs else (panels, in_features, PANEL)


def lay_out_panels(w: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
    """`w` [out, in] (any strides: an [in, out] weight's transpose too) copied into `into`
    (`panel_shape`'s; pairs where it is 4-D) and returned: panel p holds outputs
    16p..16p+15, one row of 16 per input (in pairs: one row of 16 pairs per two inputs),
    zero columns past the last output. Copied straight from the weight's views, no
    intermediate left for the heap to hold (but the padding of a partial last panel)."""
    panels = into.shape[0]
    if panels * PANEL != w.shape[0]:  # zero columns past the last output
        w = nn.functional.pad(w, (0, 0, 0, panels * PANEL - w.shape[0]))
    w = w.unflatten(0, (panels, PANEL))  # [panels, 16, in]
    if into.dim() == 4:
        w = w.unflatten(2, (w.shape[2] // 2, 2))
    return into.copy_(w.transpose(1, 2))


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
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
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"oneDNN prepacked{widened}")


class PanelLinear(nn.Module):
    """`nn.Linear`'s forward over its weight in 16-column panels (`panels_available`;
    inference only): any row count, in the weight's own dtype (fp32 or bf16).

    A bf16 weight is laid out in pairs ([panels, in / 2, 16, 2]: two consecutive inputs'
    weights side by side) where the kernel multiplies them with bf16 dot products
    (`panels_isa` "avx512_bf16"), else as fp32's layout, widened as it is read."""

    def __init__(self, linear: nn.Linear, pairs: bool | None = None,
                 fma: bool | None = None) -> None:
        super().__init__()
        # its op, also where the vendor rule would not pick panels (a benchmark of both
        # layouts on a CPU with AVX-512 found it unloaded)
        if not load_ops("kvserve_layer_ops_cpu"):
            raise RuntimeError("panels need the C++ layer ops (native.build: no compiler?)")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.dtype = w.dtype
        self.pairs, self.fma, self.prefetch_from, self.whole_k_to = panel_settings(
            w.dtype, self.in_features, pairs, fma)
        # onto 2 MiB pages: a decode step streams every panel, and small pages cost a
        # one-thread stream ~20% of its rate here (native/huge_pages.py)
        laid = lay_out_panels(w, huge_page_empty(
            panel_shape(self.out_features, self.in_features, self.pairs), w.dtype))
        self.register_buffer("panels", laid, persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(
            linear.bias.detach().contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.kvserve_layer.linear_panels(
            x.reshape(-1, self.in_features).contiguous(), self.panels, self.bias,
            self.out_features, self.fma, self.prefetch_from, self.whole_k_to)
        return y.view(*x.shape[:-1], self.out_features)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """The first index of each row's largest output ([..., in] -> [...] int64), as
        `forward(x).float().max(dim=-1).indices` gives it, without writing the output: a
        greedy step's LM head (`greedy_ids`), whose logits nobody else reads."""
        ids = torch.ops.kvserve_layer.linear_panels_argmax(
            x.reshape(-1, self.in_features).contiguous(), self.panels, self.bias,
            self.out_features, self.fma, self.prefetch_from, self.whole_k_to)
        return ids.view(x.shape[:-1])

    def extra_repr(self) -> str:
        # which steps take the FMAs is the kernel's rule (linear_panels.h kFmaWholeFrom)
        pairs = " pairs" + (", longer steps by FMAs" if self.fma else "") if self.pairs else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{PANEL}-column panels, {str(self.dtype).removeprefix('torch.')}{pairs}")


def greedy_ids(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
    """Each row's argmax token through the LM head `head`, taken as the logits are made,
    where the head is a `PanelLinear` (None elsewhere: the caller computes the logits
    and takes the argmax of those). The op keeps a running maximum per row as each pair
    of panels finishes, in L1, and writes no logits: a bf16 head wrote bf16 logits that a
    copy to fp32 and the sampler then read back (the 160M head at 64 rows: ~0.9x the time),
    and an fp32 head's logits were read back from out of cache (the 3M model's argmax at
    64 rows was ~50 us of the host's ~300; paired steps in one engine: the step the same
    (3M) or 0.66 ms shorter of 159 (160M fp32), docs/benchmarks.md at commit 633b8ec)."""
    return head.argmax(hidden) if isinstance(head, PanelLinear) else None


def vendor_layout(weight: torch.Tensor) -> str:
    """The layout the vendor rules give a CPU layer's `weight`: "panels" where panels win
    for its dtype (`panels_for`), else "onednn" where packing helps (its dtype, at least
    PACK_MIN_ELEMENTS weights), else "dense" (torch's `F.linear`; also off the CPU)."""
    if weight.device.type != "cpu":
        return "dense"
    if panels_for(weight.dtype):
        return "panels"
    if weight.numel() >= PACK_MIN_ELEMENTS and packing_available(weight.dtype):
        return "onednn"
    return "dense"


def faster_linear(linear: nn.Linear) -> nn.Module | None:
    """What a CPU `nn.Linear` runs faster as here by the vendor rules (`vendor_layout`),
    if anything: a `PanelLinear` or a `PackedLinear`. The fallback of
    engine/linear_choice.py, which times the layouts on this CPU: used with `--cpu-kernels
    vendor`, and for a shape it could not time."""
    layout = vendor_layout(linear.weight)
    if layout == "panels":
        return PanelLinear(linear)
    return PackedLinear(linear) if layout == "onednn" else None
