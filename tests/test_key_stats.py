"""The pool's key statistics (attention/key_stats.py, attention/csrc/storage_cpu.cpp) against their
torch reference: KeyDiff's score read from the keys in place equals
`policies.norms.keydiff_scores` over the gathered keys, and the bridge falls back to
that reference where the op does not serve the pool (a quantized pool, no op)."""

from __future__ import annotations

import pytest
import torch

from attention import key_stats
from kvpool.policy_rows import Member, build_view
from kvpool.pool import BlockPool
from kvpool.seq_cache import SeqCache
from policies.base import Needs
from policies.norms import keydiff_scores
from tests.policy_views import evict_positions
from tests.pools import make_pool

pytestmark = pytest.mark.skipif(not key_stats.load_storage_ops(), reason="no C++ compiler")


def _rows(pool: BlockPool, lengths: list[int], gen: torch.Generator,
          dead: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows over blocks drawn from the pool without repeats: table [N, nb] (-1 past a
    row's blocks) and positions [N, nb·bs] with a fraction `dead` of the used slots
    dead (-1) and everything past a row's length dead."""
    bs = pool.block_size
    nb = max(-(-n // bs) for n in lengths) + 1  # a -1 column at the end of every row
    perm = torch.randperm(pool.num_blocks, generator=gen)
    table = torch.full((len(lengths), nb), -1, dtype=torch.int64)
    pos = torch.full((len(lengths), nb * bs), -1, dtype=torch.int64)
    used = 0
    for r, n in enumerate(lengths):
        k = -(-n // bs)
        table[r, :k] = perm[used:used + k]
        used += k
        keep = torch.rand(n, generator=gen) >= dead
        pos[r, :n] = torch.where(keep, torch.arange(n), -1)
    return table, pos


def _reference(pool: BlockPool, table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """What the bridge's torch form computes: the gathered keys' keydiff_scores."""
    bs = pool.block_size
    phys = (table.clamp(min=0)[:, :, None] * bs + torch.arange(bs)).view(-1)
    keys = pool.storage.gather_stats(phys, keys=True)["keys"]
    return keydiff_scores(keys.view(*pos.shape, *keys.shape[1:]), pos >= 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# vector tiles (AVX-512 and AVX2; 128: AVX2's anchor in two chunks); portable loop
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 8, 24])
def test_key_diversity_equals_keydiff_scores(dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    pool = make_pool(96, 16, 2, head_dim, dtype=dtype)  # GQA: 2 kv heads
    keys = torch.randn(pool.storage.k_cache.shape, generator=gen) * (
        1 + 3 * torch.rand(*pool.storage.k_cache.shape[:-1], 1, generator=gen))
    keys[..., 0] += 1.5  # a shared direction, so the anchor is not ~0
    pool.storage.k_cache.copy_(keys)
    table, pos = _rows(pool, [200, 37, 1, 16, 95, 0], gen)
    got = pool.storage.key_diversity(table, pos)
    assert got is not None and got.dtype == torch.float32 and got.shape == pos.shape
    live = pos >= 0
    torch.testing.assert_close(got[live], _reference(pool, table, pos)[live], atol=1e-5, rtol=0)
    assert bool((got[~live] == 0).all())


def test_key_diversity_of_zero_keys_and_rows_without_live_slots() -> None:
    """F.normalize's eps: a zero key is a zero unit key; a row of zero keys or of dead
    slots only has a zero anchor (its norm clamped), and every score is 0."""
    pool = make_pool(8, 4, 2, 16)
    pool.storage.k_cache[1].normal_()
    table = torch.tensor([[0, 1], [0, -1], [2, -1]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, -1, 3, -1, -1, -1, -1],
                        [-1] * 8])
    got = pool.storage.key_diversity(table, pos)
    torch.testing.assert_close(got[pos >= 0], _reference(pool, table, pos)[pos >= 0],
                               atol=1e-6, rtol=0)
    assert bool((got[1:] == 0).all()) and bool((got[0, :4] == 0).all())


def test_quantized_pool_is_not_served() -> None:
    pool = make_pool(8, 4, 2, 32, dtype="int8")
    assert pool.storage.key_diversity(torch.zeros(1, 1, dtype=torch.int64),
                              torch.zeros(1, 4, dtype=torch.int64)) is None


class _Diversity:
    needs = Needs(key_diversity=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, "int8"])
def test_build_view_falls_back_to_keydiff_scores(dtype, monkeypatch) -> None:
    """The view's scores are the op's where it serves the pool, else keydiff_scores of
    the keys the pool holds (dequantized): the same numbers either way, and no keys in
    the view (they were not asked for)."""
    pool = make_pool(64, 4, 2, 32, dtype=dtype)
    pool.storage.write(torch.arange(pool.num_blocks * 4),
               torch.randn(pool.num_blocks * 4, 2, 32, generator=torch.Generator().manual_seed(1)),
               torch.zeros(pool.num_blocks * 4, 2, 32))
    c = SeqCache(pool, 3)
    c.append(torch.arange(40))
    evict_positions(c, {0: torch.tensor([0, 5]), 1: torch.arange(4, 12), 2: torch.tensor([39])})
    member = Member(c, _Diversity(), 40, 30, 1, True, None)
    native = build_view([member])
    assert native.keys is None and native.key_diversity is not None
    monkeypatch.setattr(key_stats, "native_key_diversity", lambda k: False)
    fallback = build_view([member])
    assert fallback.keys is None
    live = native.live
    torch.testing.assert_close(native.key_diversity[live], fallback.key_diversity[live],
                               atol=1e-5, rtol=0)


def _decode_case(dtype: torch.dtype, head_dim: int, lengths: list[int], seed: int):
    """A pool with keys that share a direction, rows over it (`_rows`), GQA queries."""
    gen = torch.Generator().manual_seed(seed)
    pool = make_pool(96, 16, 2, head_dim, dtype=dtype)
    keys = torch.randn(pool.storage.k_cache.shape, generator=gen)
    keys[..., 0] += 1.5
    pool.storage.k_cache.copy_(keys)
    pool.storage.v_cache.copy_(torch.randn(pool.storage.v_cache.shape, generator=gen))
    table, pos = _rows(pool, lengths, gen)
    q = torch.randn(len(lengths), 1, 4, head_dim, generator=gen).to(dtype)
    q_pos = pos.max(dim=1).values.clamp(min=0)
    return pool, table, pos, q, q_pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 24])  # vector tiles; portable loop
@pytest.mark.parametrize("lengths", [[200, 37, 1, 16, 95, 0], [300]])  # [300]: head slices
def test_decode_kernel_returns_the_ops_key_diversity(dtype, head_dim, lengths) -> None:
    """The decode kernel's KeyDiff scores (computed per sequence right after its
    attention) are the pool op's bit for bit (one code path, key_diversity.h, built
    without -ffast-math in both), also when one sequence is cut into kv-head slices
    across threads; the attention output is the plain kernel's."""
    from attention.cpu_attention import (
        kernel_available,
        paged_attention_cpu,
        paged_decode_key_diversity,
    )

    if not kernel_available():
        pytest.skip("no C++ compiler")
    pool, table, pos, q, q_pos = _decode_case(dtype, head_dim, lengths, head_dim)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a lone sequence is then cut into one slice per kv head
    try:
        out, mass, kd = paged_decode_key_diversity(q, pool.storage.k_cache, pool.storage.v_cache, table,
                                                   pos, q_pos, 0.125, None, True)
        plain, plain_mass = paged_attention_cpu(q, pool.storage.k_cache, pool.storage.v_cache, table, pos,
                                                q_pos, 0.125, None, True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(kd, pool.storage.key_diversity(table, pos))
    assert torch.equal(out, plain) and torch.equal(mass, plain_mass)
    # only the flagged rows are scored (the rest of a decode group: zeros)
    rows = torch.arange(len(lengths)) % 2 == 0
    out_some, _, some = paged_decode_key_diversity(q, pool.storage.k_cache, pool.storage.v_cache, table, pos,
                                                   q_pos, 0.125, None, False, rows=rows)
    assert torch.equal(some[rows], kd[rows]) and not some[~rows].any()
    assert torch.equal(out_some, plain)


def test_keydiff_engine_takes_its_scores_from_decode(tmp_path) -> None:
    """On a real model forward, KeyDiff requests get their decode steps' scores from
    the decode kernel (the pool's op then only runs on prompt steps) and keep exactly
    what an engine asking the pool's op every step keeps."""
    from scheduler.llm import LLM
    from tests.tiny_models import make_tiny_model, submit_each

    model = make_tiny_model("llama", tmp_path, max_position_embeddings=512)
    llms = [LLM(model, num_blocks=800, block_size=4, max_num_batched_tokens=256, device="cpu")
            for _ in range(2)]
    llms[1].engine.runner._fuse_kd = False
    calls = [0, 0]
    for i, llm in enumerate(llms):
        op = llm.engine.pool.storage.key_diversity

        def counted(table, positions, op=op, i=i):
            calls[i] += 1
            return op(table, positions)

        llm.engine.pool.storage.key_diversity = counted  # type: ignore[method-assign]
    configs = [{"name": "keydiff", "budget": 24}] * 3 + [{"name": "keydiff", "budget": 0.5},
                                                         {"name": "keydiff", "budget": 20,
                                                          "compact": True}]
    submit_each(llms, configs, seed=3)
    steps = 0
    while llms[0].engine.has_unfinished():
        for llm in llms:
            llm.engine.step()
        steps += 1
        kept = [{r.request_id: r.cache.slot_pos.tolist() for r in llm.engine.scheduler.running}
                for llm in llms]
        assert kept[0] == kept[1], steps
    assert not llms[1].engine.has_unfinished()
    assert calls[1] > 40 and calls[0] <= len(configs), calls
    for llm in llms:
        llm.engine.check_invariants()


class _NewNorms:
    needs = Needs(new_key_norm=True, new_value_norm=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 3])
def test_runner_norms_are_the_pools_bits(dtype: torch.dtype, k: int) -> None:
    """The new tokens' norms the runner takes as it writes K/V (`engine.runner.new_norms`,
    read from the step's packed token axis) are the ones read back out of the pool's
    slots after the step, bit for bit, with the same new-slot index: knorm and
    paged_eviction keep the same scores either way."""
    from attention.stats import AttentionMass
    from engine.step import new_norms

    gen = torch.Generator().manual_seed(k)
    from kvpool.tables import SlotTables

    pool = make_pool(64, 4, 2, 32, dtype=dtype)
    tables = SlotTables(3, 4)  # one step's requests share the engine's tables
    caches, members, ks, vs = [], [], [], []
    for n in [13, 7 + k, 22]:
        c = SeqCache(pool, 3, tables=tables)
        slots = c.append(torch.arange(n))  # [L, n]: the last k are "this step's"
        kv = torch.randn(2, 3, n, 2, 32, generator=gen) * 3  # fp32, like an fp32 model's
        for layer in range(3):
            pool.storage.write(slots[layer], kv[0, layer], kv[1, layer])
        evict_positions(c, {1: torch.tensor([0, 2])})
        caches.append(c)
        ks.append(kv[0, :, n - k:])
        vs.append(kv[1, :, n - k:])
    # the step's packed token axis: the three inputs' k tokens each, in order
    step = [new_norms(torch.cat([x[layer] for x in ks]), torch.cat([x[layer] for x in vs]),
                      pool.storage.k_cache.dtype) for layer in range(3)]
    kn, vn = (torch.stack([s[j] for s in step]) for j in (0, 1))
    for i, c in enumerate(caches):
        a = AttentionMass(None, 0, k, key_norm=kn, value_norm=vn, token=i * k)
        members.append(Member(c, _NewNorms(), 30, 10, k, False, a))
    fused = build_view(members)
    pooled = build_view([Member(m.cache, m.policy, 30, 10, k, False, None) for m in members])
    assert torch.equal(fused.new_index, pooled.new_index)
    assert torch.equal(fused.new_key_norm, pooled.new_key_norm)
    assert torch.equal(fused.new_value_norm, pooled.new_value_norm)


def test_norm_policies_read_no_slot_back_in_decode(tmp_path) -> None:
    """knorm and paged_eviction take their decode steps' new-token norms from the
    runner: after the prompt steps (whose first plan scores every live token from the
    pool) the pool is never asked for a slot's norms again."""
    from engine.sampling import SamplingParams
    from scheduler.llm import LLM
    from tests.tiny_models import make_tiny_model, resolved

    llm = LLM(make_tiny_model("llama", tmp_path, max_position_embeddings=512),
              num_blocks=400, block_size=4, max_num_batched_tokens=256)
    eng = llm.engine
    for i, cfg in enumerate([{"name": "knorm", "budget": 16},
                             {"name": "paged_eviction", "budget": 16}]):
        eng.add_request(f"r{i}", list(range(5, 45)), SamplingParams(
            max_tokens=30, temperature=0, ignore_eos=True, detokenize=False),
            kv_policy=resolved(eng, cfg))
    out: dict[str, int] = {}
    while len(out) < 2 or min(out.values()) < 2:  # the prompts, in chunks of about the
        for o in eng.step():                       # budget (bounded prefill), then decode
            out[o.request_id] = out.get(o.request_id, 0) + len(o.new_token_ids)
    calls = []
    gather = eng.pool.storage.gather_stats
    eng.pool.storage.gather_stats = lambda *a, **kw: calls.append(1) or gather(*a, **kw)  # type: ignore[method-assign]
    while eng.has_unfinished():
        eng.step()
    assert not calls
    eng.check_invariants()


def test_keydiff_within_budget_costs_the_decode_kernel_nothing(tmp_path, monkeypatch) -> None:
    """A KeyDiff request whose layers are all within its budget is idle after the step,
    so the decode kernel does not score its keys for it (`PolicyRunner.acts`, asked
    before the forward); once past the budget it does."""
    from engine import runner as runner_mod
    from engine.sampling import SamplingParams
    from scheduler.llm import LLM
    from tests.tiny_models import make_tiny_model, resolved

    calls: list[int] = []
    real = runner_mod.paged_decode_key_diversity

    def counted(q, *a, **kw):
        calls.append(q.shape[0])
        return real(q, *a, **kw)

    monkeypatch.setattr(runner_mod, "paged_decode_key_diversity", counted)
    llm = LLM(make_tiny_model("llama", tmp_path, max_position_embeddings=512),
              num_blocks=400, block_size=4, max_num_batched_tokens=256, device="cpu")
    eng = llm.engine
    eng.add_request("r", list(range(5, 25)), SamplingParams(  # 20 prompt tokens
        max_tokens=20, temperature=0, ignore_eos=True, detokenize=False),
        kv_policy=resolved(eng, {"name": "keydiff", "budget": 30}))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    # one call per layer of a step that scores: the decode steps computing positions
    # 20..29 leave every layer within 30 tokens (idle); those computing 30..38 do not
    assert steps == 20 and len(calls) == 9 * eng.runner.config.num_layers, (len(calls), steps)
