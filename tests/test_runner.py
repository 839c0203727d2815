"""Model runner: attention statistics for the requests that ask, sliding-window freeing."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.sampling import SamplingParams
from engine.step import SeqInput
from kvpool.seq_cache import SeqCache
from scheduler.llm import LLM
from tests.tiny_models import make_tiny_model, resolved


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def test_attention_mass_matches_transformers_eager(llama):
    """Per-slot attention mass (summed over each kv group's query heads) equals the
    attention weights transformers reports, for a chunk that attends to a cached prefix;
    a request that does not ask gets nothing and the same hidden states."""
    llm = LLM(llama, num_blocks=64, block_size=4, device="cpu")  # CPU tensors below
    eng = llm.engine
    cfg = eng.model_config
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, cfg.vocab_size, (19,), generator=g).tolist()
    cache = SeqCache(eng.pool, cfg.num_layers)
    other = SeqCache(eng.pool, cfg.num_layers)
    first = SeqInput(prompt[:7], 0, cache.append(torch.arange(7)), cache, False)
    eng.runner.execute([first])  # the prefix, without statistics
    rest = SeqInput(prompt[7:], 7, cache.append(torch.arange(7, 19)), cache, True, True)
    bystander = SeqInput(prompt[:5], 0, other.append(torch.arange(5)), other, True)
    out = eng.runner.execute([rest, bystander])
    assert set(out.attention) == {0}
    mass = out.attention[0].layers()
    assert len(mass) == cfg.num_layers

    hf = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt]), output_attentions=True)
    g_size = cfg.num_heads // cfg.num_kv_heads
    for layer in range(cfg.num_layers):
        a = ref.attentions[layer][0]  # [Hq, T, T]
        want = a.view(cfg.num_kv_heads, g_size, 19, 19).sum(1).permute(1, 0, 2)[7:]
        got = mass[layer][:, :, :19]
        assert torch.allclose(got, want, atol=1e-5), layer
        assert torch.allclose(got.sum(-1), torch.full((12, cfg.num_kv_heads), float(g_size)), atol=1e-4)
    assert torch.allclose(out.logits[0], ref.logits[0, -1], atol=1e-4)


def test_sliding_window_frees_blocks_outside_every_window(tmp_path):
    path = make_tiny_model("mistral", tmp_path)  # window 24 on every layer
    llm = LLM(path, num_blocks=256, block_size=4)
    out = llm.generate([[7] * 10], SamplingParams(max_tokens=150, temperature=0, ignore_eos=True,
                                                  detokenize=False))[0]
    layers = llm.engine.model_config.num_layers
    # 24 visible tokens need at most 7 blocks of 4 per layer (+1 being filled), not 40.
    assert out.kv.peak_blocks <= layers * 8
    assert llm.engine.pool.num_used == 0


def test_fresh_prompt_fast_path_equals_paged_attention(llama):
    """A prompt's first chunk with nothing cached takes plain causal SDPA; it must give
    what the paged path gives for the same chunk (which the bystander-free first test
    pins against transformers), and only such chunks may take it."""
    from attention.torch_attention import causal_self_attention, paged_attention
    from engine.attention_groups import fresh_prompts

    llm = LLM(llama, num_blocks=64, block_size=4, device="cpu")  # CPU tensors below
    eng = llm.engine
    cfg = eng.model_config
    g = torch.Generator().manual_seed(1)
    q = torch.randn(11, cfg.num_heads, cfg.head_dim, generator=g)
    k = torch.randn(11, cfg.num_kv_heads, cfg.head_dim, generator=g)
    v = torch.randn(11, cfg.num_kv_heads, cfg.head_dim, generator=g)
    cache = SeqCache(eng.pool, cfg.num_layers)
    slots = cache.append(torch.arange(11))[0]
    eng.pool.storage.k_cache.view(-1, cfg.num_kv_heads, cfg.head_dim)[slots] = k
    eng.pool.storage.v_cache.view(-1, cfg.num_kv_heads, cfg.head_dim)[slots] = v
    nb = cache.max_blocks
    ref, _ = paged_attention(q[None], eng.pool.storage.k_cache, eng.pool.storage.v_cache,
                             cache.table[0:1, :nb], cache.slot_pos[0:1, : nb * 4],
                             torch.arange(11)[None], cfg.head_dim**-0.5)
    got = causal_self_attention(q, k, v, cfg.head_dim**-0.5)
    torch.testing.assert_close(got, ref[0], atol=1e-5, rtol=1e-5)
    # A sliding window shorter than the chunk: the banded blocks (SDPA, and the explicit
    # softmax of soft-capping and sinks) give what the paged path's window mask gives.
    sinks = torch.randn(cfg.num_heads, generator=g)
    for window in (1, 3, 8, 10, 11, 40):
        for feat in ({}, {"softcap": 2.0}, {"sinks": sinks}):
            ref, _ = paged_attention(q[None], eng.pool.storage.k_cache, eng.pool.storage.v_cache,
                                     cache.table[0:1, :nb], cache.slot_pos[0:1, : nb * 4],
                                     torch.arange(11)[None], cfg.head_dim**-0.5, window, **feat)
            got = causal_self_attention(q, k, v, cfg.head_dim**-0.5, window=window, **feat)
            torch.testing.assert_close(got, ref[0], atol=1e-5, rtol=1e-5)

    fresh = SeqInput([5] * 11, 0, slots, cache, True)
    other = SeqCache(eng.pool, cfg.num_layers)
    stats = SeqInput([5] * 6, 0, other.append(torch.arange(6)), other, True, True)
    assert fresh_prompts([fresh, stats]) == {0}
    later = SeqInput([5] * 3, 11, cache.append(torch.arange(11, 14)), cache, True)
    assert fresh_prompts([later]) == set()  # cached prefix


@pytest.mark.parametrize("kv_policy", ["full", {"name": "h2o", "budget": 24, "window": 4}])
def test_decode_only_steps_agree_across_attention_paths(llama, kv_policy):
    """A decode-only step hands the whole token axis to attention (no gather or scatter);
    the C++ kernel and the torch path must then give the same tokens, and for h2o (every
    request wants attention mass) the same evictions."""
    from attention.cpu_attention import kernel_available, paged_attention_cpu
    from attention.torch_attention import paged_attention

    if not kernel_available():
        pytest.skip("no C++ compiler for the CPU kernel")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 250, (n,), generator=g).tolist() for n in (7, 19, 30, 41)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, detokenize=False)
    results = []
    for fn in (paged_attention_cpu, paged_attention):
        llm = LLM(llama, num_blocks=400, block_size=4, device="cpu", default_kv_policy=kv_policy
                  if isinstance(kv_policy, str) else "full")
        llm.engine.runner.attention_fn = fn
        for i, p in enumerate(prompts):
            llm.engine.add_request(f"r{i}", p, params, kv_policy=resolved(llm.engine, kv_policy))
        tokens: dict[str, list[int]] = {}
        evicted: dict[str, int] = {}
        while llm.engine.has_unfinished():
            for o in llm.engine.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    evicted[o.request_id] = o.kv.evicted_tokens
        results.append((tokens, evicted))
        assert llm.engine.pool.num_used == 0
    assert results[0] == results[1]
    if kv_policy != "full":
        assert all(n > 0 for n in results[0][1].values())


def test_steady_decode_steps_take_their_group_from_the_batch_append(llama, monkeypatch):
    """A step whose every input is one decode token wanting its logits alone builds its
    attention group from the scheduler's batch append (`decode_batch_group`: rows and
    the widest table, no pass over the requests), and that group is `build_group`'s for
    the same step, with the rows consecutive and then not (a request in the middle
    finished); a policy that asks for the mass keeps the general path."""
    import engine.runner as runner_mod
    from engine.attention_groups import build_group

    real = runner_mod.decode_batch_group
    seen: list[list[SeqInput]] = []
    fast: list[tuple[int, bool]] = []

    def checked(decode, q_pos, in_place):
        got = real(decode, q_pos, in_place)
        inputs = seen[-1]
        every = list(range(len(inputs)))
        want = build_group(every, inputs, every, False, None, False, in_place)
        assert got.members == want.members and not got.want_probs and got.want_kd is None
        for name in ("q_index", "valid", "q_pos", "tables", "slot_pos"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert (got.table_rows is None) == (want.table_rows is None)
        if got.table_rows is not None:
            assert torch.equal(got.table_rows, want.table_rows)
        fast.append((len(inputs), got.table_rows is not None))
        return got

    monkeypatch.setattr(runner_mod, "decode_batch_group", checked)

    def run(**config):
        llm = LLM(llama, num_blocks=256, block_size=4, device="cpu", **config)
        execute = llm.engine.runner.execute

        def spy(inputs, decode=None, ids_from=None, greedy=False):
            seen.append(inputs)
            return execute(inputs, decode, ids_from, greedy)

        llm.engine.runner.execute = spy
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (9, 14, 5, 11)]
        lengths = (12, 3, 12, 12)  # the second finishes first: rows 0, 2, 3 remain
        llm.generate(prompts, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
                               for m in lengths])

    run()
    assert (4, False) in fast and (3, True) in fast  # consecutive rows, then not
    fast.clear()
    run(default_kv_policy="h2o")
    assert not fast  # h2o asks for the mass every step: the general path


def _run_and_snap(llama, kv: dict, prompts: list[tuple[int, int]], seed: int,
                  states: tuple[str, ...], attention_fn=None, **engine_kw) -> tuple[list, dict]:
    """Greedy requests of (prompt length, max_tokens) under `kv` (the runner's attention
    `attention_fn` if given); the tables' positions and `states` after every step, and
    each request's tokens."""
    llm = LLM(llama, num_blocks=256, block_size=4, device="cpu", **engine_kw)
    eng = llm.engine
    if attention_fn is not None:
        eng.runner.attention_fn = attention_fn
    g = torch.Generator().manual_seed(seed)
    for i, (n, m) in enumerate(prompts):
        eng.add_request(f"r{i}", torch.randint(5, 200, (n,), generator=g).tolist(),
                        SamplingParams(max_tokens=m, temperature=0, ignore_eos=True),
                        kv_policy=resolved(eng, kv))
    snaps, tokens = [], {}
    while eng.has_unfinished():
        for o in eng.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        t = eng.kv.tables
        snaps.append([t.slot_pos.clone(), *(t.state[name].clone() for name in states)])
    assert eng.stats().evicted_tokens_by_policy_total[kv["name"]] > 0  # it did evict
    return snaps, tokens


def _same_tables(a: tuple[list, dict], b: tuple[list, dict]) -> None:
    """Two runs' tokens, and their tables after every step on every slot in use (a
    request's last step may write into its row as it lets the row go: what a released
    row holds is never read again)."""
    assert a[1] == b[1] and len(a[0]) == len(b[0])
    for (pos_a, *state_a), (pos_b, *state_b) in zip(a[0], b[0]):
        live = pos_a >= 0
        assert torch.equal(pos_a, pos_b)
        assert all(torch.equal(x[live], y[live]) for x, y in zip(state_a, state_b))


def _kernel_or_policy(llama, monkeypatch, arg: str, *run: object, **engine_kw) -> None:
    """The same run with the decode kernel taking the step's mass into a state (`arg` of
    `paged_attention_cpu`: `accumulate`, `ring`) and with the mass returned to the
    policy: the kernel did take it in the first, never in the second, and the tables
    and tokens are the same."""
    import engine.runner as runner_mod
    from attention import cpu_attention

    if not cpu_attention.kernel_available():
        pytest.skip("no C++ compiler for the CPU kernel")
    calls = []
    real = cpu_attention.paged_attention_cpu

    def counting(*args, **kw):
        calls.append(kw.get(arg) is not None)
        return real(*args, **kw)

    monkeypatch.setattr(runner_mod, "paged_attention_cpu", counting)
    got = {}
    for fused in (True, False):
        monkeypatch.setattr(runner_mod, "accumulates",
                            lambda pool, fused=fused: fused and cpu_attention.accumulates(pool))
        calls.clear()
        got[fused] = _run_and_snap(llama, *run, attention_fn=counting, **engine_kw)
        assert any(calls) == fused, "the kernel took the mass" if not fused else "it never did"
    _same_tables(got[True], got[False])


def test_h2o_decode_mass_is_added_in_the_kernel_with_the_same_bits(llama, monkeypatch):
    """H2O's cumulative attention (`Needs.accumulate`): in decode the C++ kernel adds each
    row's mass into the tables' `acc` as it writes it, and the policy adds nothing; the
    tables (positions and `acc`) after every step and the tokens are those of the same
    run with the mass returned and added by the policy (on every slot in use)."""
    _kernel_or_policy(llama, monkeypatch, "accumulate", {"name": "h2o", "budget": 12, "window": 3},
                      [(21, 24), (34, 9), (9, 30)], 2, ("acc",))  # the second ends first


def test_pyramid_decode_window_is_written_in_the_kernel_with_the_same_bits(llama, monkeypatch):
    """Pyramid's observation window (`Needs.ring`): in decode the C++ kernel writes each
    row's mass as its query's ring column and keeps the ring's exact total as it writes
    the mass, and the policy only plans; the tables (positions, ring and total) after
    every step and the tokens are those of the same run with the mass returned and
    written by the policy (on every slot in use). A 1-token prompt chunk (the step's
    token budget cuts the prompt there) is not a decode token: its mass comes back.
    40-token steps: 30 + 10, then 1 + 38 + 1: the last prompt's first chunk is a token at
    position 0, before its window, in a step with decode tokens."""
    _kernel_or_policy(llama, monkeypatch, "ring", {"name": "pyramid", "budget": 16, "obs_window": 4},
                      [(30, 20), (48, 9), (12, 26)], 3, ("pyramid_window4", "pyramid_total4"),
                      max_num_batched_tokens=40)


@pytest.mark.parametrize("native", [True, False])
def test_pyramid_rows_apart_are_read_in_place_with_the_same_bits(llama, monkeypatch, native):
    """A pyramid group whose table rows are not consecutive (a request between them
    finished) hands its ring and total whole, request r at its row (`RowsView.whole`,
    `pyramid_window(rows=)`), instead of copying its rows out and back: the tables after
    every step and the tokens are those of the copying run. Without the C++ op the torch
    form copies the rows on first use (`RowsView.layered`) and the engine puts them back."""
    import engine.runner as runner_mod
    import kvpool.manager as manager_mod
    import kvpool.policy_rows as policy_rows_mod
    from policies import rows as rows_mod

    if not native:
        # No window op (the warm-up's load would bring it back) and no kernel write: the
        # torch form updates the rows' copy, which the engine must put back.
        for mod in (policy_rows_mod, manager_mod):
            monkeypatch.setattr(mod, "load_select", lambda: True)
        monkeypatch.setitem(rows_mod.NATIVE, "state", False)
        monkeypatch.setattr(runner_mod, "accumulates", lambda pool: False)

    seen = []
    real = policy_rows_mod.build_view

    def noting(members):
        view = real(members)
        seen.append(bool(view.handed_whole))
        return view

    monkeypatch.setattr(policy_rows_mod, "build_view", noting)
    runs = {}
    for whole in (True, False):
        monkeypatch.setattr(policy_rows_mod, "by_columns", lambda t, whole=whole: (
            whole and t.dim() == 4 and t.shape[3] > 1 and t.stride(2) == 1))
        seen.clear()
        runs[whole] = _run_and_snap(llama, {"name": "pyramid", "budget": 12, "obs_window": 4},
                                    [(20, 22), (25, 5), (18, 24), (22, 6), (30, 20)], 4,
                                    ("pyramid_window4", "pyramid_total4"))
        assert any(seen) == whole, "no group's rows were apart" if whole else "handed whole"
    _same_tables(runs[True], runs[False])
