"""Greedy outputs of the continuous-batching engine equal transformers' `generate`.

Tolerance for logits: the engine's log-probabilities of the first generated token
(top 5) agree with transformers' forward pass within 1e-4 (fp32).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.model_config import load_model_config
from engine.sampling import SamplingParams
from scheduler.llm import LLM
from tests.tiny_models import make_tiny_model

FAMILIES = ["llama", "llama3", "mistral", "qwen2", "qwen3", "gpt_neox", "phi3", "olmo2",
            "gemma2", "gemma3", "gemma3_mm", "qwen3_moe", "mixtral", "gpt_oss"]
MAX_NEW = 12


def _prompts(vocab: int, lengths: tuple[int, ...] = (1, 5, 16, 17, 33, 70, 9, 50)
             ) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, vocab, (40,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    prompts[6] = shared + prompts[6]  # two prompts share a 40-token (2.5-block) prefix
    prompts[7] = shared + prompts[7]
    return prompts


def _references(family: str, path: str, lengths: tuple[int, ...] | None = None):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    vocab = hf.config.get_text_config().vocab_size
    prompts = _prompts(vocab) if lengths is None else _prompts(vocab, lengths)
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
            logp = torch.log_softmax(hf(ids).logits[0, -1].float(), -1)
            refs.append((out[0, len(p):].tolist(), logp))
    return family, path, prompts, refs


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return _references(request.param, path)


def _check(llm: LLM, prompts, refs, family):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=5,
                            detokenize=False)
    outs = llm.generate(prompts, params)
    for i, (o, (ref_tokens, ref_logp)) in enumerate(zip(outs, refs)):
        assert o.token_ids == ref_tokens, f"{family} prompt {i} (len {len(prompts[i])})"
        first = o.logprobs[0]
        for tok, lp in first.top:
            assert abs(lp - ref_logp[tok].item()) < 1e-4, (family, i, tok)
    llm.engine.check_invariants()
    assert llm.engine.pool.num_used == 0
    assert not llm.engine.has_unfinished()
    return outs


def test_greedy_parity_with_transformers(family_model):
    family, path, prompts, refs = family_model
    llm = LLM(path, num_blocks=512, block_size=4, max_num_batched_tokens=64)
    _check(llm, prompts, refs, family)


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_parity_under_preemption_and_chunking(family_model, mode, prefix_caching):
    """The pool holds the largest request and little more (at most a third of the batch's
    peak need); the batch repeats two prompts (as n > 1 does) so the prefix cache has work."""
    family, path, prompts, refs = family_model
    prompts, refs = prompts + prompts[6:8], refs + refs[6:8]
    layers = load_model_config(path).num_layers
    need = [layers * -(-(len(p) + MAX_NEW) // 4) for p in prompts]
    assert max(need) + 2 <= sum(need) // 3
    llm = LLM(path, num_blocks=max(need) + 2, block_size=4,
              max_num_batched_tokens=24, preemption_mode=mode, swap_space=1 << 20,
              enable_prefix_caching=prefix_caching)
    outs = _check(llm, prompts, refs, family)
    sched = llm.engine.scheduler
    assert sum(sched.preemptions.values()) > 0
    assert any(o.num_preemptions for o in outs)
    if mode == "swap":
        assert sched.preemptions["swap"] > 0 and llm.engine.swap.num_used == 0
    if prefix_caching:
        assert sched.prefix_hits > 0  # exact counts are pinned in test_memory.py
    else:
        assert sched.prefix_hits == 0


def test_longrope_long_factors_parity(tmp_path):
    """Phi-3 served past original_max_position_embeddings (64 of 256) rotates by the long
    factors from the first token (engine/rope.py's rule, vLLM's); transformers does for
    sequences longer than 64, which every prompt here is."""
    path = make_tiny_model("phi3_long", tmp_path)
    family, path, prompts, refs = _references("phi3_long", path, (65, 70, 81, 90, 100, 120, 30, 40))
    assert min(len(p) for p in prompts) > 64
    llm = LLM(path, num_blocks=512, block_size=4, max_num_batched_tokens=64)
    _check(llm, prompts, refs, family)


def test_gpt_oss_per_head_pool_parity(tmp_path):
    """gpt-oss over a per-head pool (`kv_layout="head"`: each kv head a lane of its own,
    whose rows take its query heads' sinks), in chunks of 5 and with repeated prompts
    starting from the prefix cache, through its sliding and full layers."""
    path = make_tiny_model("gpt_oss", tmp_path)
    family, path, prompts, refs = _references("gpt_oss", path)
    prompts, refs = prompts + prompts[6:8], refs + refs[6:8]
    llm = LLM(path, num_blocks=4096, block_size=4, max_num_batched_tokens=5,
              kv_layout="head", enable_prefix_caching=True)
    _check(llm, prompts, refs, family)
    assert llm.engine.scheduler.prefix_hits > 0
