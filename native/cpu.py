"""What this CPU is, for the kernels' choices: /proc/cpuinfo's fields and the vendor rules
the linear panels and the causal prefill read (the fallback where nothing was measured)."""

from __future__ import annotations


def cpuinfo(field: str) -> str:
    """The value of /proc/cpuinfo's first `field` line (`vendor_id`, `model name`,
    `flags`), '' where there is none (another OS, a restricted container)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _intel(vendor: str | None) -> bool:
    """Whether `vendor` (this CPU's when None) is Intel: the vendor choices below."""
    return (cpuinfo("vendor_id") if vendor is None else vendor) == "GenuineIntel"


def pair_fma(vendor: str | None = None) -> bool:
    """Whether bf16 products meant for `vdpbf16ps` (pairs of channels, two products a
    lane) run as fp32 FMAs over widened operands instead, on CPUs that have both: yes on
    Intel, whose cores run two 512-bit FMAs a cycle and `vdpbf16ps` at half that; no on
    AMD Zen 4, whose dot products run at its FMAs' rate, two products each (commit 8114403).
    Read by a bf16 linear layer in pairs (its steps of 6 rows and more, the same bits:
    engine/csrc/linear_panels.h, `gemm`'s ByFma; a Xeon without AMX, the 160M model's
    layers at 2,048 rows: 2.36 s against 3.51 by dot products, commit 16102ed; at 8-16
    rows 0.8-0.87x the time, commit a9d648a) and by a bf16 prompt's causal attention
    (attention/csrc/causal_prefill.h: K and V widened, fp32's loop; one layer of the 160M
    model 1.25-1.6x as fast at 128-2,048 tokens, commit 57bae56)."""
    return _intel(vendor)


def prefetch_from(vendor: str | None = None) -> int:
    """The fewest rows of a step whose panel GEMM prefetches the next panel's weights while
    it multiplies this one's (engine/csrc/linear_panels.h, steps of up to 12 rows: the
    weights stream from DRAM). 1 on Intel: a Xeon without AMX streamed the 160M model's
    weights 1.2-1.4x as fast at 1-4 rows with it (commit 24816c8). 6 elsewhere: on AMD
    Zen 4 each k step of 1-5 rows was too short to hide it, level or 5-10% slower (commit
    3ef4ea8)."""
    return 1 if _intel(vendor) else 6


def whole_k_to(vendor: str | None = None, avx512: bool = True) -> int:
    """The most rows of a step the panel GEMM runs whole K, its input read in place; longer
    steps are packed into blocks (engine/csrc/linear_panels.h; 0: the build's own limit,
    12 with AVX-512, 72 with AVX2). 5 on Intel with AVX-512: fp32 steps of 6-12 rows were
    1.05-1.2x as fast packed on a Xeon (commit 8f96091); Zen 4 measured packing from 13
    (commit 54a62b7)."""
    return 5 if _intel(vendor) and avx512 else 0
