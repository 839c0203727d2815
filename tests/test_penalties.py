"""Logit bias and repetition / frequency / presence penalties (engine/penalties.py).

transformers is the reference where it has the processor (`repetition_penalty`,
`sequence_bias` for single tokens); OpenAI's frequency and presence penalties, which it
lacks, are checked against a plain per-row loop of their documented formula, inside HF's
`generate` as a logits processor, so that every step's history is HF's own."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from engine.penalties import Penalties, TokenHistory, apply_penalties
from engine.sampling import SamplingParams
from scheduler.llm import LLM
from scheduler.outputs import RequestRejected
from tests.tiny_models import make_tiny_model

MAX_NEW = 16


class OpenAIPenalties(LogitsProcessor):
    """The OpenAI formula, row by row: logit -= count·frequency + (count > 0)·presence,
    counting the generated tokens only."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for row in range(scores.shape[0]):
            for tok in set(input_ids[row, self.prompt_len:].tolist()):
                count = int((input_ids[row, self.prompt_len:] == tok).sum())
                scores[row, tok] -= count * self.frequency
                scores[row, tok] -= self.presence
        return scores


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("pen"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    llm = LLM(path, num_blocks=256, block_size=4)
    g = torch.Generator().manual_seed(1)
    vocab = hf.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 11, 24)]
    return hf, llm, prompts


def _hf(hf, prompt: list[int], **kw) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                          pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def _ours(llm: LLM, prompts: list[list[int]], **kw) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True,
                            detokenize=False, **kw)
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_greedy_repetition_penalty_matches_transformers(tiny):
    hf, llm, prompts = tiny
    for rp in (1.3, 0.7):
        ours = _ours(llm, prompts, repetition_penalty=rp)
        assert ours == [_hf(hf, p, repetition_penalty=rp) for p in prompts]
    assert ours != _ours(llm, prompts)  # it changed something: the test can fail


def test_greedy_logit_bias_matches_transformers_sequence_bias(tiny):
    hf, llm, prompts = tiny
    plain = _ours(llm, prompts)
    # push down each prompt's first greedy token everywhere, pull up one other token a bit
    bias = {plain[0][0]: -5.0, plain[1][0]: -5.0, 7: 2.5}
    ours = _ours(llm, prompts, logit_bias=bias)
    assert ours == [_hf(hf, p, sequence_bias={(t,): b for t, b in bias.items()}) for p in prompts]
    assert ours != plain
    forced = _ours(llm, prompts, logit_bias={5: 100.0})
    assert all(t == 5 for row in forced for t in row)


@pytest.mark.parametrize("frequency,presence", [(0.8, 0.0), (0.0, 1.5), (0.5, -0.4), (-1.0, 0.0)])
def test_greedy_frequency_and_presence_penalties_match_the_formula(tiny, frequency, presence):
    hf, llm, prompts = tiny
    ours = _ours(llm, prompts, frequency_penalty=frequency, presence_penalty=presence)
    refs = [_hf(hf, p, logits_processor=LogitsProcessorList(
        [OpenAIPenalties(len(p), frequency, presence)])) for p in prompts]
    assert ours == refs


def _history(prompt: list[int], output: list[int]) -> TokenHistory:
    h = TokenHistory.of(prompt)
    h.take(output[:1])  # taken in over two steps, as the engine does
    h.take(output)
    return h


def test_penalties_combined_match_a_per_row_reference():
    """Bias, then repetition over prompt + output, then frequency and presence over the
    output, for a batch whose rows each ask for something else (and one for nothing)."""
    g = torch.Generator().manual_seed(3)
    vocab = 50
    logits = torch.randn(4, vocab, generator=g) * 3
    prompts = [[1, 2, 3], [4, 4, 9], [7], [10, 11]]
    outputs = [[3, 3, 5], [], [7, 8, 8, 8], [12]]
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, logit_bias={0: 1.0}),
              SamplingParams(),
              SamplingParams(presence_penalty=-0.7, logit_bias={8: -2.0, 49: 3.0}),
              SamplingParams(repetition_penalty=0.5, allowed_token_ids=[10, 3, 11, 3])]
    pen = Penalties.build(params, [_history(p, o) for p, o in zip(prompts, outputs)])
    assert pen is not None
    got = logits.clone()
    apply_penalties(got, pen)
    want = logits.clone()
    for i, p in enumerate(params):
        row = want[i : i + 1]
        if p.allowed_token_ids:
            others = torch.ones(vocab, dtype=torch.bool)
            others[p.allowed_token_ids] = False
            row[0, others] = float("-inf")
        for t, b in (p.logit_bias or {}).items():
            row[0, t] += b
        if p.repetition_penalty != 1.0:
            seen = torch.tensor([prompts[i] + outputs[i]])
            row = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(seen, row)
        for t in set(outputs[i]):
            row[0, t] -= outputs[i].count(t) * p.frequency_penalty
            row[0, t] -= p.presence_penalty
        want[i] = row[0]
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)
    assert Penalties.build([SamplingParams()] * 2, [None, None]) is None


def test_a_penalized_row_changes_nothing_for_its_neighbours(tiny):
    """Rows are batched: a penalized request gives the same tokens alone and in a batch,
    and the requests beside it the same as without it."""
    _, llm, prompts = tiny
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, detokenize=False)
    pen = SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=11, ignore_eos=True,
                         detokenize=False, repetition_penalty=1.2, frequency_penalty=0.5,
                         logit_bias={9: 1.0})
    alone = [o.token_ids for o in llm.generate(prompts, params)]
    pen_alone = llm.generate([prompts[1]], pen)[0].token_ids
    mixed = llm.generate([*prompts, prompts[1]], [params] * 3 + [pen])
    assert [o.token_ids for o in mixed[:3]] == alone
    assert mixed[3].token_ids == pen_alone


def test_logprobs_stay_those_of_the_raw_distribution(tiny):
    """vLLM's default (`raw_logprobs`): a bias that forces a token does not make its
    reported logprob 0."""
    _, llm, prompts = tiny
    raw = llm.generate([prompts[0]], SamplingParams(max_tokens=1, temperature=0, logprobs=3,
                                                    ignore_eos=True))[0]
    forced_tok = raw.logprobs[0].top[-1][0]  # the third most likely first token
    out = llm.generate([prompts[0]], SamplingParams(
        max_tokens=1, temperature=0, logprobs=3, ignore_eos=True,
        logit_bias={forced_tok: 100.0}))[0]
    assert out.token_ids == [forced_tok]
    assert out.logprobs[0].logprob == pytest.approx(dict(raw.logprobs[0].top)[forced_tok], abs=1e-5)
    assert out.logprobs[0].logprob < -1e-3


@pytest.mark.parametrize("kw,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
])
def test_bad_values_are_refused(kw, param):
    with pytest.raises(ValueError, match=param):
        SamplingParams(**kw)


def test_a_bias_outside_the_vocabulary_is_refused(tiny):
    _, llm, prompts = tiny
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(RequestRejected) as e:
        llm.engine.add_request("x", prompts[0], SamplingParams(logit_bias={vocab: 1.0}))
    assert e.value.param == "logit_bias"
    assert not llm.engine.has_unfinished()


def test_min_tokens_holds_back_eos_and_stop_ids(tiny):
    """A bias of 50 makes EOS (and a stop token id) the greedy choice from the first
    token; `min_tokens` keeps them out until then, and the request stops right after."""
    _, llm, prompts = tiny
    eos = llm.engine.tokenizer.eos_token_id
    for stop_ids, banned in (([], eos), ([11], 11)):
        kw = dict(max_tokens=MAX_NEW, temperature=0, detokenize=False, stop_token_ids=stop_ids,
                  logit_bias={banned: 50.0})
        eager = llm.generate([prompts[1]], SamplingParams(**kw))[0]
        assert eager.token_ids == [banned] and eager.finish_reason == "stop"
        held = llm.generate([prompts[1]], SamplingParams(**kw, min_tokens=5))[0]
        assert len(held.token_ids) == 6 and held.token_ids[-1] == banned
        assert banned not in held.token_ids[:5] and held.finish_reason == "stop"
    # min_tokens = max_tokens: never stopped early
    full = llm.generate([prompts[1]], SamplingParams(max_tokens=4, min_tokens=4, temperature=0,
                                                     logit_bias={eos: 50.0}))[0]
    assert len(full.token_ids) == 4 and eos not in full.token_ids
    assert full.finish_reason == "length"
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_allowed_token_ids_confine_the_draws(tiny):
    _, llm, prompts = tiny
    plain = _ours(llm, prompts)
    allowed = sorted({t for row in plain for t in row})  # the argmax is always allowed
    assert _ours(llm, prompts, allowed_token_ids=allowed) == plain
    few = [5, 6, 7]
    sampled = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=1.5, seed=3,
                                                   ignore_eos=True, allowed_token_ids=few))
    assert all(t in few for o in sampled for t in o.token_ids)
    with pytest.raises(RequestRejected):
        llm.engine.add_request("y", prompts[0], SamplingParams(allowed_token_ids=[10**6]))


def test_include_stop_str_keeps_a_stop_tokens_text(tiny):
    """A stop token id that has text ("a", a byte token) ends the request; its text is
    in the output only with include_stop_str_in_output (vLLM's)."""
    _, llm, prompts = tiny
    a = llm.tokenizer.encode("a", add_special_tokens=False)[0]
    kw = dict(max_tokens=8, temperature=0, stop_token_ids=[a], min_tokens=2,
              logit_bias={a: 50.0})
    cut = llm.generate([prompts[0]], SamplingParams(**kw))[0]
    kept = llm.generate([prompts[0]], SamplingParams(**kw, include_stop_str_in_output=True))[0]
    assert cut.token_ids == kept.token_ids and cut.token_ids[-1] == a
    assert kept.text == cut.text + "a"
