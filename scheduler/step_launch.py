"""Launching an engine step, the methods `EngineCore` takes from `StepLaunch`: the plan's
inputs built in one pass over its chunks, the forward, the logits shaped (penalties, bias,
grammars) and sampled, all on the device. What completing the step needs is its `Launch`
(scheduler/inflight.py), which scheduler/step_complete.py finishes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from engine.penalties import Penalties, TokenHistory, apply_penalties
from engine.sampler import SamplingBatch, TokenScores, sample, top_logprobs
from engine.sampling import SamplingParams
from engine.step import PromptScoring, SeqInput
from policies.base import Needs
from scheduler.inflight import Launch
from scheduler.outputs import TokenLogprob
from scheduler.request import Request
from scheduler.scheduler import Chunk, Plan

if TYPE_CHECKING:
    from engine.runner import ModelRunner
    from engine.structured import Grammars
    from scheduler.engine_config import EngineConfig
    from scheduler.inflight import HostIds
    from scheduler.policy_runner import PolicyRunner

NO_NEEDS = Needs()  # a request without a policy asks the runner for nothing
_ALL_GREEDY = SamplingBatch.greedy()  # read only
_PLACEHOLDER = [0]  # a decode input whose id is on the device (read only)


class StepLaunch:
    """`EngineCore`'s step launch (its state is the core's)."""

    config: EngineConfig
    runner: ModelRunner
    policies: PolicyRunner
    _host_ids: HostIds
    _grammars: Grammars | None
    _sampling: int  # requests whose rows need sampling parameters
    _shaped: int  # of them, requests with a logit bias, a penalty or a grammar

    def _launch(self, plan: Plan, t0: float, after: Launch | None = None) -> Launch | None:
        """Build the plan's inputs, run the forward and sample, on the device. `after`:
        the step in flight whose sampled ids are this step's input ids (every chunk is
        then one of its requests' decode token)."""
        if not plan.chunks:
            return None
        now = time.monotonic()
        inputs: list[SeqInput] = []
        done: list[Chunk] = []  # chunks that reach the end of their known tokens: sampled
        scored: list[Request] = []  # ... of scoring requests (max_tokens 0): finish now
        params: list[SamplingParams] = []
        seeds: list[int] = []
        steps: list[int] = []
        n_dec = n_pre = 0
        # every request may leave its tokens in flight (none shapes its logits from its
        # output so far, which must then be known)
        plain = self.config.async_scheduling and not self._shaped
        sampling = self._sampling
        # One pass, its fields read once: at 64 decoding every per-request pass shows
        for c in plan.chunks:
            r, n, start = c.request, c.num_tokens, c.start
            if n == 1:
                n_dec += 1
            else:
                n_pre += n
            if r.first_scheduled_time is None:
                r.first_scheduled_time = now
            cache = r.cache  # its peak sizes are kept as its slots are taken (SeqCache.peak)
            assert cache is not None
            p, completes = r.params, c.completes
            sampled = completes and p.max_tokens > 0
            if sampled:
                done.append(c)
                if sampling:
                    params.append(p)
                    seeds.append(r.seed)
                    steps.append(len(r.output_ids) + r.pending_tokens)
            elif completes:
                scored.append(r)
            # a token still in flight stands as a placeholder: the graph reads its id
            # from the device (`after`)
            tokens = _PLACEHOLDER if after is not None else r.token_slice(start, start + n)
            if r.policy is None and r.prompt_logprobs is None:  # asks for nothing more
                inputs.append(SeqInput(tokens, start - r.pos_offset, c.slots, cache, sampled))
                plain = plain and p.logprobs is None
            else:
                needs = r.policy.needs if r.policy is not None else NO_NEEDS
                # a policy that decides from sizes and positions alone may act before
                # the next plan without waiting for this step's tokens
                plain = (plain and needs == NO_NEEDS and r.prompt_logprobs is None
                         and p.logprobs is None)
                inputs.append(SeqInput(
                    tokens, start - r.pos_offset, c.slots, cache, sampled, needs.attention,
                    _prompt_scoring(r, c) if r.prompt_logprobs is not None else None,
                    needs.key_diversity and self.policies.acts(r, c), needs.attention_heads,
                    needs.new_key_norm or needs.new_value_norm, needs.accumulate,
                    # a decode token (the window holds every query after the prompt)
                    None if needs.ring is None or not r.prefill_done else (*needs.ring, start),
                    None if needs.query_stats is None
                    else (needs.query_stats[0], len(r.prompt_ids), needs.query_stats[1])))
            # Counted as computed now (nothing before the advance reads it): a step that
            # fails fails every request in it, so no later step sees the count early.
            r.num_computed += n
        t1 = time.perf_counter()
        ids_from = None
        if after is not None:  # each row's token: its request's row in the step in flight
            ids_from = (after.ids, [c.request.pending_row for c in plan.chunks])
        # every request greedy, none asking for logprobs: the LM head may take the argmax
        out = self.runner.execute(inputs, plan.decode, ids_from, greedy=not sampling)
        t2 = time.perf_counter()
        for i, scores in out.scores.items():
            _add_prompt_logprobs(plan.chunks[i].request, scores)
        lp = None
        if out.ids is not None:  # the argmax from the LM head, no logits written
            ids = out.ids
        else:
            assert out.logits is not None
            batch = SamplingBatch.build(params, seeds, steps, out.logits.device) \
                if sampling else _ALL_GREEDY
            logits = out.logits
            if self._shaped:  # the raw logits stay for the logprobs (vLLM's default)
                logits = self._shape(logits, params, done, copy=batch.max_logprobs is not None)
            ids = sample(logits, batch)  # on the model's device
            if batch.max_logprobs is not None:
                lp = top_logprobs(out.logits, ids, batch.max_logprobs)
        launch = Launch(plan, done, scored, ids, lp, out, n_pre, n_dec, t1 - t0, t2 - t1)
        if plain and out.graph and not scored and len(done) == len(plan.chunks):
            # left in flight: the ids start for the host now, read by the next call
            launch.host, launch.event = self._host_ids.start(ids)
            for row, c in enumerate(done):
                c.request.pending_tokens += 1
                c.request.pending_row = row
        launch.sample_s = time.perf_counter() - t2
        return launch

    def _shape(self, logits: torch.Tensor, params: list[SamplingParams], done: list[Chunk],
               copy: bool) -> torch.Tensor:
        """The sampled rows' logits after their penalties and bias (engine/penalties.py)
        and their grammars' masks (engine/structured.py); a copy if `copy`."""
        histories: list[TokenHistory | None] = []
        banned: list[frozenset[int] | None] = []  # EOS and stop ids before min_tokens
        rows = []  # those under a grammar
        for i, c in enumerate(done):  # one pass over the sampled rows' requests
            r = c.request
            if r.history is not None:
                r.history.take(r.output_ids)  # its new tokens only
            histories.append(r.history)
            least = r.params.min_tokens
            banned.append(r.stop_ids if least and len(r.output_ids) < least else None)
            if r.matcher is not None:
                rows.append(i)
        pen = Penalties.build(params, histories, banned, logits.device)
        if pen is None and not rows:
            return logits
        if copy:
            logits = logits.clone()
        if pen is not None:
            apply_penalties(logits, pen)
        if rows:
            assert self._grammars is not None
            self._grammars.mask(logits, rows, [done[i].request.matcher for i in rows])
        return logits


def _prompt_scoring(r: Request, c: Chunk) -> PromptScoring | None:
    """The rows of this chunk whose prompt logprobs are still owed: row j (token index
    j) predicts prompt token j + 1. Rows scored before a recompute are not scored again,
    and the last prompt token's row predicts the first output (sampling's, not ours)."""
    if not r.scoring_prompt:
        return None
    assert r.prompt_logprobs is not None and r.params.prompt_logprobs is not None
    lo = max(c.start, len(r.prompt_logprobs) - 1)
    hi = min(c.start + c.num_tokens, len(r.prompt_ids) - 1)
    if lo >= hi:
        return None
    return PromptScoring(lo - c.start, r.prompt_ids[lo + 1 : hi + 1], r.params.prompt_logprobs)


def _add_prompt_logprobs(r: Request, s: TokenScores) -> None:
    """Append one chunk's scored rows, in prompt order, to the request's list."""
    assert r.prompt_logprobs is not None
    first = len(r.prompt_logprobs)
    for k in range(len(s)):
        r.prompt_logprobs.append(TokenLogprob(
            r.prompt_ids[first + k], s.logprob[k], list(zip(s.top_ids[k], s.top_logprobs[k])),
            s.rank[k]))
