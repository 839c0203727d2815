"""Completing an engine step, the methods `EngineCore` takes from `StepComplete`: the
step's sampled ids to the host, every request advanced by its token (stop conditions,
text, logprobs) into its output delta, scoring requests finished, sliding windows
trimmed, then the policies on the slot layout the forward saw and the step's statistics.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.sampler import to_host
from scheduler.inflight import Launch
from scheduler.outputs import KVUsage, RequestOutput, StepStats, TokenLogprob
from scheduler.request import Request, Status
from scheduler.scheduler import Chunk

if TYPE_CHECKING:
    from attention.storage import KVStorage
    from engine.model_config import ModelConfig
    from kvpool.manager import KVCacheManager
    from scheduler.policy_runner import PolicyRunner
    from scheduler.preemption import CostModel
    from scheduler.scheduler import Scheduler


class StepComplete:
    """`EngineCore`'s step completion (its state is the core's)."""

    scheduler: Scheduler
    policies: PolicyRunner
    kv: KVCacheManager
    storage: KVStorage
    model_config: ModelConfig
    cost_model: CostModel | None
    on_step: Callable[[StepStats], None] | None
    _forget: Callable[[Request], None]  # EngineCore's: a finished request leaves
    _windows: list[int]  # the distinct sliding windows of the pool's lanes (hybrid memory)
    _prompt_tokens: int
    _generation_tokens: int

    def _complete(self, launch: Launch, t: float) -> list[RequestOutput]:
        """Wait for a launched step's tokens and advance its requests: stop conditions,
        outputs, then their policies on the slot layout its forward saw."""
        if launch.host is not None:
            if launch.event is not None:
                launch.event.synchronize()
            tokens, lp = launch.host.tolist(), None
        else:
            tokens, lp = to_host(launch.ids, launch.lp)  # the step's one device-to-host copy
        t3 = time.perf_counter()
        plan = launch.plan
        self.scheduler.publish(plan.chunks)  # before anything is evicted or trimmed
        outputs = self._advance(launch.done, tokens, lp) + self._finish_scored(launch.scored)
        t4 = time.perf_counter()
        if not launch.policies_ran:
            self._trim_windows(plan.chunks)
            self.policies.run(plan.chunks, launch.out.attention)  # the layout the forward saw
        t5 = time.perf_counter()
        if (self.cost_model is not None and len(plan.chunks) == 1
                and plan.chunks[0].num_tokens > 1):
            self.cost_model.observe_prefill(plan.chunks[0].num_tokens, launch.forward_s)
        if self.on_step is not None:
            self.on_step(StepStats(
                len(plan.chunks), launch.n_pre, launch.n_dec, launch.schedule_s + t4 - t3,
                launch.forward_s, launch.sample_s + t3 - t, launch.policy_s + t5 - t4,
                launch.schedule_s + launch.forward_s + launch.sample_s + launch.policy_s
                + t5 - t))
        return outputs

    def _advance(self, done: list[Chunk], tokens: list[int],
                 lp: tuple[list[float], list[list[int]], list[list[float]]] | None
                 ) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        finished = Status.FINISHED
        for row, (c, tok) in enumerate(zip(done, tokens)):
            r = c.request
            if r.status is finished:  # stopped, or aborted, while this step ran
                continue
            if r.pending_tokens:
                r.pending_tokens -= 1
            if r.first_token_time is None:
                r.first_token_time = now
                self._prompt_tokens += len(r.prompt_ids)
            r.output_ids.append(tok)
            if r.matcher is not None:  # its grammar follows every token it drew
                r.matcher.accept_token(tok)  # type: ignore[attr-defined]
            logprobs = None
            if (k := r.params.logprobs) is not None:
                logprobs = []
                if lp is not None:
                    top = list(zip(lp[1][row][:k], lp[2][row][:k]))
                    logprobs.append(TokenLogprob(tok, lp[0][row], top))
            text, finish = self._check_stop(r, tok)
            if finish is not None:
                r.finish_reason = finish
                r.pending_tokens = 0  # a token of the step after this one is dropped
                if r.detok is not None:
                    text += r.detok.flush()
                self.scheduler.remove(r)
                self._forget(r)
            outputs.append(self._output(r, [tok], text, logprobs))
        self._generation_tokens += len(outputs)  # a token each
        return outputs

    def _finish_scored(self, reqs: list[Request]) -> list[RequestOutput]:
        """Scoring requests (max_tokens 0) whose prefill is done: finished with "length"
        and no token sampled; their output carries the prompt logprobs."""
        outputs = []
        for r in reqs:
            self._prompt_tokens += len(r.prompt_ids)
            r.finish_reason = "length"
            self.scheduler.remove(r)
            self._forget(r)
            outputs.append(self._output(r, [], "", [] if r.params.logprobs is not None else None))
        return outputs

    def _check_stop(self, r: Request, tok: int) -> tuple[str, str | None]:
        n, least = len(r.output_ids), r.params.min_tokens
        if tok in r.stop_ids and n > least:  # banned before (engine/penalties.py)
            # its text only if asked (an EOS, a special token, has none unless asked too)
            kept = r.detok is not None and r.params.include_stop_str_in_output
            return (r.detok.add([tok], stops=False)[0] if kept else ""), "stop"  # type: ignore[union-attr]
        text = ""
        if r.detok is not None:
            text, hit = r.detok.add([tok], stops=n >= least)  # vLLM's count for strings
            if hit:
                return text, "stop"
        if r.matcher is not None and r.matcher.is_terminated():  # type: ignore[attr-defined]
            return text, "stop"  # its grammar took its end (EOS, even with ignore_eos)
        # max_tokens is within the context unless the request shifts RoPE positions
        # (`scheduler/resolve.py` fitted it: the one context rule), so it is the one bound.
        if len(r.output_ids) >= r.params.max_tokens:
            return text, "length"
        return text, None

    def _trim_windows(self, chunks: list[Chunk]) -> None:
        """Free the pages of the step's requests' windowed lanes that no later query
        sees, as soon as a lane's oldest page is wholly out of its window (hybrid memory,
        kvpool/windows.py: admission counts a windowed lane as its window's pages, so
        it must never hold one more). Before the policies: they act on the global lanes
        alone, and the reservation they are checked against counts the windowed lanes
        trimmed. A windowed lane's slots after its trim no longer line up with the
        forward's attention mass, which no policy reads for them."""
        if not self._windows:
            return
        bs = self.kv.block_size
        for c in chunks:
            r = c.request
            n, last = r.num_computed, r.window_trimmed
            if r.cache is None or n == last:
                continue
            if any(max(0, n - w + 1) // bs > max(0, last - w + 1) // bs for w in self._windows):
                self.kv.trim(r.cache, n)
            r.window_trimmed = n

    def _output(self, r: Request, ids: list[int], text: str,
                logprobs: list[TokenLogprob] | None) -> RequestOutput:
        """The step's delta of one request: every running request reports every step, so
        the new ids (and logprobs) are the step's own, never a backlog."""
        prompt_lps = None
        if r.prompt_logprobs is not None and not r.prompt_logprobs_sent:
            assert not r.scoring_prompt, "a request's first output follows its prefill"
            prompt_lps, r.prompt_logprobs_sent = r.prompt_logprobs, True
        finished = r.finish_reason is not None
        # Positional, in RequestOutput's field order: a keyword call costs 2.5x as much,
        # and this runs for every request every step.
        return RequestOutput(
            r.request_id, ids, text, logprobs,
            finished, r.finish_reason, len(r.prompt_ids), len(r.output_ids),
            self._final_kv(r) if finished else None,  # kv
            r.arrival_time, r.first_scheduled_time, r.first_token_time, r.num_preemptions,
            prompt_lps)

    def _final_kv(self, r: Request) -> KVUsage:
        r.kv.peak_bytes = r.kv.peak_blocks * self.storage.block_bytes
        return r.kv
