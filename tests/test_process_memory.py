"""Process memory: long-lived bookkeeping must not pin native memory (issue 8's soak).

The soak grew RSS by ~20% because every parked prefix-cache group kept a small torch
tensor alive; each such tensor is native allocations on the engine thread's malloc arena
that pin the freed step buffers around them (docs/memory.md, "Process memory"). The
tests count live tensors, which is what caused the growth, rather than RSS, which is
too noisy to assert on in a unit test.
"""

from __future__ import annotations

import gc
import logging
import os

import pytest
import torch

from engine.sampling import SamplingParams
from scheduler.llm import LLM
from server.memwatch import MemoryWatch, malloc_stats, rss_bytes, tree_rss_bytes
from tests.pools import make_pool
from tests.tiny_models import make_tiny_model


def live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def test_parked_prefix_groups_hold_no_tensors():
    layers, n = 4, 200
    pool = make_pool(layers * n, 4, 1, 2)
    held = [pool.allocate(layers) for _ in range(n)]
    before = live_tensors()
    for h, ids in enumerate(held):
        pool.register(h, ids)
    for ids in held:
        pool.release(ids)  # last owner gone: the groups stay parked in the cache
    del ids
    assert pool.num_cached_free == layers * n
    assert live_tensors() - before <= 1  # was +n: one tensor per parked group
    pool.check_invariants([])
    got = pool.acquire(7)  # a hit still hands the caller a tensor of the ids
    assert got is not None and got.tolist() == held[7].tolist()
    assert pool.num_cached_free == layers * (n - 1)
    pool.check_invariants([got])
    pool.release(got)
    fresh = pool.allocate(layers * n)  # recycles every parked group
    assert not pool.groups and not pool.hash_of
    pool.check_invariants([fresh])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def test_engine_tensor_count_does_not_grow_with_the_prefix_cache(llama):
    """Waves of distinct prompts park more and more groups; live tensors stay flat."""
    llm = LLM(llama, num_blocks=4000, block_size=4)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, detokenize=False)
    g = torch.Generator().manual_seed(0)

    def wave() -> int:
        prompts = [torch.randint(5, 250, (41,), generator=g).tolist() for _ in range(12)]
        llm.generate(prompts, params)
        return live_tensors()

    wave()  # warm-up: lazily created tensors, caches
    first, cached_first = wave(), llm.engine.pool.num_cached_free
    second = wave()
    layers = llm.engine.model_config.num_layers
    groups_added = (llm.engine.pool.num_cached_free - cached_first) // layers
    assert groups_added >= 100  # 12 prompts x 10 full blocks each were parked
    assert second - first < 10, f"{second - first} tensors for {groups_added} groups"
    llm.engine.check_invariants()


def test_memwatch_env_and_sample(caplog):
    assert MemoryWatch.from_env("") is None
    w = MemoryWatch.from_env("2.5,tracemalloc")
    assert w is not None and w.every_s == 2.5 and w.trace and not w.trim
    w = MemoryWatch(60.0)
    with caplog.at_level(logging.WARNING, "kvserve.memory"):
        fields = w.log_once()
        fields = w.log_once()  # the second line reports growth since the first
    assert fields["gc_objects"] > 0 and isinstance(fields["gc_grew"], dict)
    assert any(r.getMessage() == "memwatch" for r in caplog.records)
    if rss_bytes() is not None:  # Linux
        assert fields["rss_mib"] > 0
    stats = malloc_stats()
    if stats:  # glibc
        assert stats["heap_in_use_mib"] > 0 and stats["arenas"]


@pytest.mark.skipif(rss_bytes() is None, reason="needs /proc")
def test_tree_rss_counts_the_child_processes() -> None:
    """The soak's RSS with `--engine-layout process`: the engine is a child."""
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(200 * 2**20); "
                              "b[::4096] = b'x' * len(b[::4096]); input()"],
                             stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while (rss_bytes(child.pid) or 0) < 200 * 2**20:
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.05)
        own, tree = rss_bytes(), tree_rss_bytes(os.getpid())
        assert own is not None and tree is not None
        assert tree - own >= 200 * 2**20 - 16 * 2**20  # the child, within a page-table slack
    finally:
        child.kill()
        child.wait()
