"""The offline API, like vLLM's `LLM.generate`: batch in, completions out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from engine.sampling import SamplingParams
from policies.catalog import parse_kv_policy
from scheduler.engine_core import EngineConfig, EngineCore
from scheduler.limits import DEFAULT_MAX_TOKENS, fit_max_tokens, shifts_rope
from scheduler.outputs import KVUsage, TokenLogprob


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] | None
    kv: KVUsage | None
    num_preemptions: int
    # SamplingParams.prompt_logprobs: one per prompt token, None for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    def __init__(self, model: str, **config: object) -> None:
        self.engine = EngineCore(EngineConfig(model=model, **config))  # type: ignore[arg-type]
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(self, prompts: Sequence[str] | Sequence[list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool = False) -> list[Completion]:
        """Run every prompt to completion under continuous batching; results in input order.

        With no `params`, each prompt gets the completions default: 16 new tokens, fewer
        if the context has less room (`scheduler/limits.py`, as over HTTP). A prompt the
        engine refuses (RequestRejected: prompt + max_tokens past the context, ...)
        raises before anything runs, and none of the batch stays queued.
        """
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        if params is None:
            rope_shift = shifts_rope(parse_kv_policy(self.engine.config.default_kv_policy))
            params = [SamplingParams(max_tokens=fit_max_tokens(
                len(p), None, self.engine.max_model_len, rope_shift=rope_shift,
                default=DEFAULT_MAX_TOKENS)) for p in ids]
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        order: dict[str, int] = {}
        try:
            for i, (p, sp) in enumerate(zip(ids, plist)):
                rid = f"offline-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(rid, p, sp)  # checks the context (fit_max_tokens)
                order[rid] = i
        except Exception:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        tokens: list[list[int]] = [[] for _ in ids]
        texts = [""] * len(ids)
        lps: list[list[TokenLogprob] | None] = [None] * len(ids)
        prompt_lps: list[list[TokenLogprob | None] | None] = [None] * len(ids)
        results: list[Completion | None] = [None] * len(ids)
        bar = tqdm(total=len(ids), disable=not progress, desc="generate", unit="req")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                i = order[out.request_id]
                tokens[i] += out.new_token_ids
                texts[i] += out.new_text
                if out.logprobs is not None:
                    lps[i] = (lps[i] or []) + out.logprobs
                if out.prompt_logprobs is not None:
                    prompt_lps[i] = out.prompt_logprobs
                if out.finished:
                    results[i] = Completion(ids[i], tokens[i], texts[i], out.finish_reason or "",
                                            lps[i], out.kv, out.num_preemptions,
                                            prompt_lps[i])
                    bar.update(1)
        bar.close()
        return [r for r in results if r is not None]
