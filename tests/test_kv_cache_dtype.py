"""A KV pool narrower than the model (`kv_cache_dtype`, vLLM's `--kv-cache-dtype`).

An fp32 model over a bf16 pool rounds each key and value once, when it is written; the
attention widens them back to fp32. So the engine's log-probabilities stay within bf16's
rounding of transformers' fp32 forward (tolerance 2e-2 per token, teacher-forced on the
engine's own tokens), while every pool mechanism (swap, eviction, RoPE shift, compaction)
runs on the narrow blocks. The every-policy test also runs on the quantized formats
(int8, fp8_e4m3, int4; the rest of their tests are in test_kv_quant.py).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.sampling import SamplingParams
from scheduler.llm import LLM
from tests.test_policies_engine import POLICIES
from tests.tiny_models import make_tiny_model, resolved

BS = 4
LOGPROB_TOL = 2e-2
QUANT = ["int8", "fp8_e4m3", "int4"]  # attention/quant.py; their own tests: test_kv_quant.py


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"), max_position_embeddings=4096)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(5, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False, **kw)


def test_pool_takes_the_narrow_dtype_and_twice_the_blocks(model):
    wide = LLM(model, kv_cache_memory="1MiB")
    narrow = LLM(model, kv_cache_memory="1MiB", kv_cache_dtype="bfloat16")
    assert wide.engine.pool.storage.kv.dtype == torch.float32
    assert narrow.engine.pool.storage.kv.dtype == torch.bfloat16
    assert next(narrow.engine.model.parameters()).dtype == torch.float32  # model untouched
    assert narrow.engine.pool.num_blocks == 2 * wide.engine.pool.num_blocks


def test_unknown_kv_cache_dtype_is_refused(model):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(model, num_blocks=64, kv_cache_dtype="fp4")


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_narrow_pool_stays_close_to_transformers_fp32(model, kv_dtype):
    """Prompts longer than the prefill chunk, so later chunks and every decode step read
    rounded keys back from the pool; each generated token's log-probability is compared
    with transformers' fp32 forward over the same sequence."""
    llm = LLM(model, num_blocks=512, block_size=BS, max_num_batched_tokens=32,
              kv_cache_dtype=kv_dtype)
    prompts = [_prompt(i, n) for i, n in enumerate((5, 40, 77, 130))]
    outs = llm.generate(prompts, _greedy(24, logprobs=1))
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    worst = 0.0
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p + o.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0].float(), -1)
        for j, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs)):
            ref = logp[len(p) - 1 + j, tok].item()
            worst = max(worst, abs(lp.logprob - ref))
    assert worst < LOGPROB_TOL, worst
    llm.engine.check_invariants()
    assert llm.engine.pool.num_used == 0


def test_swap_on_a_narrow_pool_changes_no_token(model):
    """Swapping copies the narrow blocks byte for byte: the same tokens as a pool large
    enough that nobody is preempted. (Quantized pools: test_kv_quant.py.)"""
    prompts = [_prompt(10 + i, 30 + 11 * i) for i in range(6)]
    big = LLM(model, num_blocks=2000, block_size=BS, kv_cache_dtype="bfloat16")
    ref = [o.token_ids for o in big.generate(prompts, _greedy(40))]
    small = LLM(model, num_blocks=120, block_size=BS, kv_cache_dtype="bfloat16",
                preemption_mode="swap", swap_space=1 << 20, max_num_batched_tokens=32)
    outs = small.generate(prompts, _greedy(40))
    assert small.engine.scheduler.preemptions["swap"] > 0
    assert [o.token_ids for o in outs] == ref
    assert small.engine.swap.kv.dtype == torch.bfloat16
    assert small.engine.pool.num_used == 0 and small.engine.swap.num_used == 0


@pytest.mark.parametrize("kv_dtype", ["bfloat16", *QUANT])
def test_every_policy_runs_on_a_narrow_pool(model, kv_dtype):
    """Key/value norms, attention mass, RoPE shift and compaction read and write narrow
    (bf16, or quantized with their scales) blocks; all policies in one batch evict,
    finish and leave the pool empty."""
    llm = LLM(model, num_blocks=3000, block_size=BS, max_num_batched_tokens=64,
              kv_cache_dtype=kv_dtype)
    eng = llm.engine
    # 120 tokens: every policy is past its budget for most of them, and the compacting
    # h2o compacts ~20 times (300 ran the same paths in twice the time)
    for i, cfg in enumerate(POLICIES):
        eng.add_request(f"p{i}", _prompt(i, 100), _greedy(120), kv_policy=resolved(eng, cfg))
    finished = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
    eng.check_invariants()
    assert eng.pool.num_used == 0
    for i, cfg in enumerate(POLICIES):
        o = finished[f"p{i}"]
        assert o.num_output_tokens == 120 and o.kv.evicted_tokens > 0, cfg
