"""A decode step's host work does not grow with the batch (issue "one step, any batch").

The torch ops of one engine step are counted with a dispatch-mode counter (every op
that reaches the dispatcher, views included) at 8 and at 64 running requests in the
same phase (same prompt length, started together, so block boundaries fall on the same
step): the counts must be equal. And the step's transfers live in one place: the
sampled ids (and logprobs) come back in one copy, the inputs go in one.
"""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.runner import upload
from engine.sampler import SamplingBatch, sample, to_host, top_logprobs
from engine.sampling import SamplingParams
from scheduler.engine_core import EngineConfig, EngineCore
from tests.tiny_models import make_tiny_model


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"), max_position_embeddings=1024)


def _ops_per_step(model: str, n: int, policies: list, steps: int = 6) -> list[Counter[str]]:
    eng = EngineCore(EngineConfig(model=model, num_blocks=6000, block_size=4,
                                  max_num_seqs=128))
    for i in range(n):
        prompt = [5 + (i * 7 + j) % 200 for j in range(16)]  # distinct, same length
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=400, ignore_eos=True),
                        kv_policy=policies[i % len(policies)])
    for _ in range(30):  # prefill, then well into decode (policies past their budget)
        eng.step()
    counts = []
    for _ in range(steps):  # more than a block: every block-boundary step is included
        counter = OpCounter()
        with counter:
            eng.step()
        counts.append(counter.ops)
    assert eng.num_running == n
    return counts


def test_full_decode_step_ops_do_not_grow_with_the_batch(model):
    small, large = _ops_per_step(model, 8, ["full"]), _ops_per_step(model, 64, ["full"])
    for a, b in zip(small, large):
        assert a == b, {k: (a[k], b[k]) for k in a.keys() | b.keys() if a[k] != b[k]}
    assert len({sum(c.values()) for c in small}) == 2  # a block boundary was measured


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
def test_cuda_decode_steps_synchronise_only_to_return_the_ids(model, monkeypatch):
    """Decode steps run with CUDA's sync debug mode set to error; only the one copy of
    the sampled ids (engine.sampler.to_host) may synchronise."""
    import engine.sampler as sampler_mod
    import scheduler.engine_core as core_mod

    real = sampler_mod.to_host

    def allowed(*args):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return real(*args)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(core_mod, "to_host", allowed)
    eng = EngineCore(EngineConfig(model=model, device="cuda", num_blocks=512, block_size=4))
    for i in range(4):
        eng.add_request(f"r{i}", [5 + i, 6, 7, 8], SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        eng.step()  # prefill (may synchronise: not the contract)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
