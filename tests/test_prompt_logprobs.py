"""Prompt logprobs in the engine (`SamplingParams.prompt_logprobs`, `max_tokens=0`): the
values against transformers' log-softmax on the same tokens, across prefill chunks, next
to the prefix cache, and through a preemption and recompute."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.sampling import SamplingParams
from scheduler.llm import LLM
from scheduler.outputs import RequestRejected, TokenLogprob
from tests.tiny_models import VOCAB_SIZE, make_tiny_model

TOL = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("plp") / "llama")


@pytest.fixture(scope="module")
def hf(model_dir: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, VOCAB_SIZE) for _ in range(n)]


def _reference(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] log-softmax of transformers' logits, row j predicting token j + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check(plp: list[TokenLogprob | None] | None, ids: list[int], ref: torch.Tensor,
           n: int) -> float:
    """Every prompt token scored once, in order, against the reference; the worst
    difference."""
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    worst = 0.0
    for j in range(1, len(ids)):
        lp = plp[j]
        assert lp is not None and lp.token_id == ids[j]
        row = ref[j - 1]
        worst = max(worst, abs(lp.logprob - row[ids[j]].item()))
        assert lp.rank == int((row >= row[ids[j]]).sum())
        top = row.topk(n)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        worst = max([worst] + [abs(v - e) for (_, v), e in zip(lp.top, top.values.tolist())])
    assert worst < TOL, worst
    return worst


def test_scoring_request_matches_transformers(model_dir: str, hf: torch.nn.Module) -> None:
    """max_tokens=0: no token sampled, finish "length", every prompt token's logprob,
    rank and top-3 equal transformers' log-softmax."""
    ids = _prompt(1, 70)
    out = LLM(model_dir, num_blocks=256).generate(
        [ids], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert out.token_ids == [] and out.finish_reason == "length" and out.text == ""
    _check(out.prompt_logprobs, ids, _reference(hf, ids), 3)


@pytest.mark.parametrize("chunk", [5, 16, 64])
def test_chunked_prefill_gives_the_same_prompt_logprobs(model_dir: str, hf: torch.nn.Module,
                                                        chunk: int) -> None:
    """A prompt split into prefill chunks (`max_num_batched_tokens`) is scored over
    every chunk boundary exactly as in one chunk, next to other requests in the batch."""
    ids = _prompt(2, 90)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)
    whole = LLM(model_dir, num_blocks=256).generate([ids], params)[0]
    llm = LLM(model_dir, num_blocks=256, max_num_batched_tokens=chunk)
    other = _prompt(3, 20)
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = llm.generate([other, ids, other], [plain, params, plain])
    assert outs[1].token_ids == whole.token_ids
    assert outs[0].prompt_logprobs is None and outs[0].token_ids == outs[2].token_ids
    _check(outs[1].prompt_logprobs, ids, _reference(hf, ids), 2)
    for a, b in zip(outs[1].prompt_logprobs[1:], whole.prompt_logprobs[1:]):
        assert abs(a.logprob - b.logprob) < 1e-4 and a.rank == b.rank


def test_prefix_cache_is_skipped_while_scoring(model_dir: str, hf: torch.nn.Module) -> None:
    """A prompt already in the prefix cache is computed again for a request that wants its
    logprobs (the hit's positions have no logits), which still publishes its blocks."""
    ids = _prompt(4, 48)
    ref = _reference(hf, ids)
    llm = LLM(model_dir, num_blocks=256, block_size=4)
    plain = SamplingParams(max_tokens=1)
    scoring = SamplingParams(max_tokens=0, prompt_logprobs=1)
    first = llm.generate([ids], scoring)[0]
    assert first.kv.prefix_hit_tokens == 0
    hit = llm.generate([ids], plain)[0]
    assert hit.kv.prefix_hit_tokens == 44  # the scoring request published its blocks
    again = llm.generate([ids], scoring)[0]
    assert again.kv.prefix_hit_tokens == 0
    _check(again.prompt_logprobs, ids, ref, 1)
    assert [x.logprob for x in again.prompt_logprobs[1:]] == pytest.approx(
        [x.logprob for x in first.prompt_logprobs[1:]], abs=1e-5)


def test_recompute_after_preemption_scores_each_token_once(model_dir: str,
                                                           hf: torch.nn.Module) -> None:
    """A scoring request preempted in the middle of its chunked prefill (its next chunk
    does not fit beside a growing higher-priority request) is recomputed from the start
    later: its prompt logprobs still have one entry per prompt token, equal to
    transformers', and the ones scored before the preemption are not scored again."""
    layers = 3  # the tiny llama
    eng = LLM(model_dir, num_blocks=layers * 55, block_size=4, watermark=0.0,
              max_num_batched_tokens=9).engine
    eng.add_request("grow", _prompt(5, 8), SamplingParams(max_tokens=200, ignore_eos=True),
                    priority=-1)
    eng.step()
    ids = _prompt(6, 200)
    eng.add_request("score", ids, SamplingParams(max_tokens=3, prompt_logprobs=2,
                                                 ignore_eos=True))
    req = eng.requests["score"]
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == "score"]
        if req.num_preemptions == 0:
            assert req.prompt_logprobs is not None
            scored_before = len(req.prompt_logprobs)
    assert req.num_preemptions == 1 and 1 < scored_before < len(ids)
    firsts = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(firsts) == 1 and outs[0].prompt_logprobs is firsts[0]
    assert sum(len(o.new_token_ids) for o in outs) == 3 and outs[-1].finished
    _check(firsts[0], ids, _reference(hf, ids), 2)
    assert eng.pool.num_used == 0


def test_scoring_request_may_fill_the_context(model_dir: str) -> None:
    """max_tokens=0 generates nothing, so its prompt may be as long as the context;
    asking for one token more than that is still refused."""
    llm = LLM(model_dir, num_blocks=256)
    ids = _prompt(7, llm.engine.max_model_len)
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[1].top == []
    with pytest.raises(RequestRejected):
        llm.generate([ids], SamplingParams(max_tokens=1))
