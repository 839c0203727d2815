"""Warm-up before the server reports ready: pay every first-use cost before a client does.

Why: `/ready` tells a load balancer to route traffic here, so whatever is still lazy at
that moment lands on the first client's TTFT. On CPU the lazy part is large: the
sampling ops (`engine/csrc/sampling_cpu.cpp`: greedy argmax, exponential race), the
policies' selection and state updates (`policies/csrc/select_cpu.cpp`, `state_cpu.cpp`),
the tables' marking (`kvpool/csrc/tables_cpu.cpp`) and the pool's key statistics
(`attention/csrc/storage_cpu.cpp`) are built on their first call (~10-25 s on a machine
that has not cached them; a dlopen otherwise), oneDNN creates its state for each row
count a packed weight meets, and the first forward pays for allocator growth and the
tokenizer's first decode. On CUDA the Triton kernels compile on their first launch for
each shape family.

So the engine first loads every native op explicitly, then runs each distinct
oneDNN-packed weight once at every row bucket a step can have (`step_buckets`, within
PRIMITIVE_BUDGET_S: a demo-model prefill step of 2,048 tokens took 215 ms on first use
against 187 afterwards), then runs two tiny requests through the ordinary
`add_request`/`step` path (one prefill and one decode step: the paged decode kernel;
one greedy and one top-k/top-p row with logprobs, penalties and a bias: every sampling
branch; with xgrammar installed, a third under a grammar, so the compiler's tokenizer
tables are built before the first structured request). They have
fixed seeds, so the core's seed generator draws nothing and a client's unseeded request
gets the same seed with or without a warm-up. The counters those requests move are
taken off by the caller (`EngineStats.since`), and the step listener is detached
meanwhile, so metrics start at zero.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from attention.cpu_attention import kernel_available, vector_path
from attention.key_stats import load_storage_ops
from engine import structured
from engine.cpu_linear import row_buckets, warm_buckets
from engine.sampler import load_sampling_ops
from engine.sampling import SamplingParams, StructuredOutput
from kvpool.manager import load_memory_ops
from policies.config import FullPolicyConfig
from scheduler.outputs import EngineStats

logger = logging.getLogger("kvserve.engine")

WARMUP_PREFIX = "kvserve-warmup-"
MAX_STEPS = 64  # two requests of 2 tokens need 2 steps; more means something is stuck
# Seconds the oneDNN row buckets may take (`engine.cpu_linear.warm_buckets`): every
# bucket of the demo model (0.7 s) and of the 160M one (one thread: 3.6 s in bf16, 6.9 s
# in fp32), the decode buckets first, so a large model warms what it can and leaves the
# rest to its first steps.
PRIMITIVE_BUDGET_S = 8.0


@dataclass
class Warmup:
    seconds: float = 0.0
    native_ops: dict[str, bool] = field(default_factory=dict)  # op -> loaded
    steps: int = 0
    row_buckets: tuple[int, int] = (0, 0)  # oneDNN row buckets warmed, of all (0 without oneDNN)
    baseline: EngineStats = field(default_factory=EngineStats)  # stats after the warm-up


def load_native_ops(device: torch.device) -> dict[str, bool]:
    """Build (or load from the on-disk cache) every C++ op this device uses. The
    tables and the policies' selection run on the host whatever the device (on a GPU
    too: a first eviction once built its ops inside a client's request, ~15 s)."""
    host = load_memory_ops()
    if device.type != "cpu":
        return host
    return {**host, "paged_decode_cpu": kernel_available(), "storage_cpu": load_storage_ops(),
            "sampling_cpu": load_sampling_ops()}


def step_buckets(max_seqs: int, max_tokens: int) -> list[tuple[int, bool]]:
    """The (rows, output head) buckets a step's linear layers run at: decode batches
    first (every bucket up to max_seqs rows, the head included), then prefill steps'
    (the larger buckets up to max_tokens, without the head)."""
    decode = row_buckets(max_seqs)
    return ([(n, True) for n in decode]
            + [(n, False) for n in row_buckets(max_tokens) if n > decode[-1]])


def warm_up(core: Any) -> Warmup:
    """Load the native ops and run two tiny requests to completion on `core`.

    Raises what the core raises: a forward that fails here would fail every request,
    and the server should then fail to start rather than report ready."""
    t0 = time.perf_counter()
    ops = load_native_ops(getattr(core, "device", torch.device("cpu")))
    vocab = int(core.model_config.vocab_size)
    buckets = step_buckets(core.config.max_num_seqs, core.config.max_num_batched_tokens)
    warmed, to_warm = warm_buckets(core.model, buckets, vocab, t0 + PRIMITIVE_BUDGET_S)
    prompt = [t % vocab for t in (1, 2, 3)]
    params = [SamplingParams(max_tokens=2, temperature=0.0, seed=0, ignore_eos=True),
              SamplingParams(max_tokens=2, temperature=1.0, top_p=0.9, top_k=8, min_p=0.01,
                             seed=0, ignore_eos=True, logprobs=1, repetition_penalty=1.1,
                             logit_bias={prompt[0]: 1.0})]
    if structured.available():  # the grammar compiler's tokenizer tables (~0.2 s for a
        # 4k vocabulary, seconds for 128k) are built here, not in a client's request
        params.append(SamplingParams(max_tokens=2, temperature=0.0, seed=0, ignore_eos=True,
                                     structured=StructuredOutput("json_object")))
    ids = [f"{WARMUP_PREFIX}{i}" for i in range(len(params))]
    on_step = getattr(core, "on_step", None)
    core.on_step = None  # step histograms are for clients' steps
    steps = 0
    try:
        for rid, p in zip(ids, params):
            core.add_request(rid, prompt, p, kv_policy=FullPolicyConfig())
        while core.has_unfinished() and steps < MAX_STEPS:
            core.step()
            steps += 1
    finally:
        for rid in ids:  # no-op for finished requests; frees the blocks of stuck ones
            core.abort_request(rid)
        core.on_step = on_step
    graphs = getattr(getattr(core, "runner", None), "graphs", None)
    if graphs is not None:  # CUDA: every decode bucket's graph, before any client's step
        graphs.capture_all()
    w = Warmup(time.perf_counter() - t0, ops, steps, baseline=core.stats(),
               row_buckets=(warmed, to_warm))
    # which vector path -march=native gave the decode kernel (avx512, avx2, portable)
    isa = vector_path() if ops.get("paged_decode_cpu") else None
    logger.info("warmed up", extra={"fields": {"warmup_s": round(w.seconds, 3),
                                               "native_ops": ops, "decode_vector_path": isa,
                                               "steps": steps,
                                               "row_buckets": f"{warmed}/{to_warm}"}})
    return w
