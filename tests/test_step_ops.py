"""A decode step's host work does not grow with the batch (issue "one step, any batch").

The torch ops of one engine step are counted with a dispatch-mode counter (every op
that reaches the dispatcher, views included) at 8 and at 64 running requests in the
same phase (same prompt length, started together, so block boundaries fall on the same
step): the counts must be equal, on a per-layer and on a per-head pool. And the step's
transfers live in one place: the sampled ids (and logprobs) come back in one copy, the
inputs go in one.
"""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.runner import upload
from engine.sampler import SamplingBatch, sample, to_host, top_logprobs
from engine.sampling import SamplingParams
from kvpool import compaction
from scheduler.engine_core import EngineConfig, EngineCore
from tests.tiny_models import make_tiny_model, resolved


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        # A slice that spans the whole dimension is dispatched as an alias: one op.
        self.ops["aten.slice.Tensor" if name == "aten.alias.default" else name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"), max_position_embeddings=1024)


_COMPACTED = [0]


@pytest.fixture(autouse=True)
def _count_compactions(monkeypatch):
    real = compaction.compact

    def counting(tables, pool, caches, layers=None):
        freed = real(tables, pool, caches, layers)
        _COMPACTED[0] += sum(f > 0 for f in freed)
        return freed

    monkeypatch.setattr(compaction, "compact", counting)


def _ops_per_step(model: str, n: int, policies: list, steps: int = 6,
                  compactions: list[int] | None = None,
                  used: list[int] | None = None, kv_layout: str = "layer") -> list[Counter[str]]:
    """Ops of `steps` consecutive steps in steady decode; `compactions` gets, per step,
    how many layers were compacted (still one request at a time), `used` the pool's
    used blocks after it. `kv_layout` "head": a per-head pool (a page a (layer, kv head),
    each head its own tokens), as many pages per token as kv heads, so twice the pages."""
    # One prompt for all, no prefix sharing: members of a policy evict the same slots
    # on the same steps whatever their number, so data-dependent branches (a block
    # emptied, a compaction) fall on the same steps at 8 and at 64.
    eng = EngineCore(EngineConfig(model=model, num_blocks=6000 if kv_layout == "layer" else 12000,
                                  block_size=4, device="cpu", max_num_seqs=128,
                                  enable_prefix_caching=False, kv_layout=kv_layout))
    for i in range(n):
        prompt = [5 + (j * 7) % 200 for j in range(16)]
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
                        kv_policy=resolved(eng, policies[i % len(policies)]))
    for _ in range(30):  # prefill, then well into decode (policies past their budget)
        eng.step()
    _COMPACTED[0] = 0
    counts = []
    for _ in range(steps):  # more than a block: every block-boundary step is included
        counter = OpCounter()
        with counter:
            eng.step()
        counts.append(counter.ops)
        if used is not None:
            used.append(eng.pool.num_used)
        if compactions is not None:
            compactions.append(_COMPACTED[0])
            _COMPACTED[0] = 0
    assert eng.num_running == n
    return counts


@pytest.mark.parametrize("kv_layout", ["layer", "head"])
def test_full_decode_step_ops_do_not_grow_with_the_batch(model, kv_layout):
    used: list[int] = []
    small = _ops_per_step(model, 8, ["full"], used=used, kv_layout=kv_layout)
    large = _ops_per_step(model, 64, ["full"], kv_layout=kv_layout)
    for a, b in zip(small, large):
        assert a == b, {k: (a[k], b[k]) for k in a.keys() | b.keys() if a[k] != b[k]}
    assert len(set(used)) == 2  # a block boundary was measured


MIXES = [
    [{"name": "streaming", "sink": 4, "window": 16}, {"name": "tova", "budget": 20},
     {"name": "keydiff", "budget": 20}],
    [{"name": "h2o", "budget": 20, "window": 4}, {"name": "knorm", "budget": 20},
     {"name": "lazy_eviction", "budget": 20, "window": 4}],
]


@pytest.mark.parametrize("kv_layout", ["layer", "head"])
@pytest.mark.parametrize("mix", MIXES, ids=["streaming+tova+keydiff", "h2o+knorm+lazy"])
def test_policy_mix_decode_step_ops_do_not_grow_with_the_batch(model, mix, kv_layout):
    """Three policies at their budget, batched per policy: the view, the selection, the
    drops, the freed blocks and the compactions that keep scattered survivors within
    their reservations are a fixed number of ops for any number of members. On a
    per-head pool too, where each policy ranks and drops per (layer, kv head) lane."""
    comp_small: list[int] = []
    comp_large: list[int] = []
    small = _ops_per_step(model, 8, mix, steps=12, compactions=comp_small, kv_layout=kv_layout)
    # 8 and 64 rows are GEMM row buckets (engine/cpu_linear.py): a count between buckets
    # adds the same 4 padding ops per linear at any batch size. 8 = 3 + 3 + 2 members and
    # 64 = 22 + 21 + 21: uneven groups count the same too.
    large = _ops_per_step(model, 64, mix, steps=12, compactions=comp_large, kv_layout=kv_layout)
    for a, b in zip(small, large):
        assert a == b, {k: (a[k], b[k]) for k in a.keys() | b.keys() if a[k] != b[k]}
    assert sum(comp_small) and sum(comp_large), "no compaction was measured"


def test_upload_round_trips_every_dtype():
    ts = [torch.tensor([[1, -2], [3, 4]]), torch.tensor([True, False, True]),
          torch.arange(5, dtype=torch.int32)]
    for t, u in zip(ts, upload(ts, "cpu")):
        assert u.dtype == t.dtype and torch.equal(t, u)


def test_to_host_unpacks_ids_and_logprobs():
    logits = torch.randn(3, 50)
    b = SamplingBatch.build([SamplingParams(temperature=0.8, logprobs=4)] * 3, [1, 2, 3],
                            [0, 0, 0])
    ids = sample(logits, b)
    lp = top_logprobs(logits, ids, 4)
    tokens, (chosen, top_ids, top_vals) = to_host(ids, lp)
    assert tokens == ids.tolist()
    assert chosen == pytest.approx(lp[0].tolist())
    assert top_ids == lp[1].tolist()
    assert torch.allclose(torch.tensor(top_vals, dtype=torch.float64), lp[2].double())
    assert to_host(ids, None) == (ids.tolist(), None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_cuda_decode_steps_synchronise_only_to_return_the_ids(model, monkeypatch, eager):
    """Decode steps run with CUDA's sync debug mode set to error; only the one copy of
    the sampled ids (engine.sampler.to_host) may synchronise. A graph step left in
    flight (async scheduling) instead copies them into pinned memory and waits on an
    event, which the debug mode does not count: any other synchronising op still
    raises. Statistics policies are not covered: their mass and norms still go to the
    host (engine/cuda_graphs.py), issue 23's fused statistics."""
    import engine.sampler as sampler_mod
    import scheduler.engine_core as core_mod

    real = sampler_mod.to_host

    def allowed(*args):
        mode = torch.cuda.get_sync_debug_mode()  # the caller's: warm-up steps run with 0
        torch.cuda.set_sync_debug_mode(0)
        try:
            return real(*args)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    monkeypatch.setattr(core_mod, "to_host", allowed)
    eng = EngineCore(EngineConfig(model=model, device="cuda", num_blocks=512, block_size=4,
                                  enforce_eager=eager))
    for i in range(4):
        eng.add_request(f"r{i}", [5 + i, 6, 7, 8], SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        eng.step()  # prefill, first decodes, graph capture (may synchronise: not the contract)
    produced = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            produced += sum(len(o.new_token_ids) for o in eng.step())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert produced >= 4 * 7  # the steps decoded (an async step's ids arrive one call late)
