"""The offline API, like vLLM's `LLM.generate`: batch in, completions out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from engine.sampling import SamplingParams
from scheduler.engine_core import EngineConfig, EngineCore
from scheduler.limits import DEFAULT_MAX_TOKENS
from scheduler.outputs import KVUsage, TokenLogprob
from scheduler.resolve import resolve_request


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
                 progress: bool = False, *, kv_policy: object = None) -> list[Completion]:
        """Run every prompt to completion under continuous batching; results in input order.

        `kv_policy`: every prompt's (a policy name, an object or a config, as the HTTP
        field takes; None: the engine's default). It and each prompt's max_tokens are
        resolved as over HTTP (`scheduler/resolve.py`): with no `params`, each prompt gets
        the completions default, 16 new tokens, fewer if the context (or the KV pool) or
        the model's generation-config max_new_tokens has less room, and the sampling
        defaults of that file (`generation_config`; vLLM's `get_default_sampling_params`).
        A bad policy (KVPolicyError) or a prompt the engine refuses
        (RequestRejected: prompt + max_tokens past the context, ...) raises before
        anything runs, and none of the batch stays queued.
        """
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        plist = None if params is None else (
            list(params) if isinstance(params, Sequence) else [params] * len(prompts))
        if plist is not None and len(plist) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        asked = [None] * len(ids) if plist is None else [sp.max_tokens for sp in plist]
        resolved = resolve_request(self.engine.limits, kv_policy,
                                   [(len(p), n) for p, n in zip(ids, asked)],
                                   default_max_tokens=DEFAULT_MAX_TOKENS)
        if plist is None:
            model = self.engine.limits.sampling_defaults.sampling()
            plist = [SamplingParams(max_tokens=n, **model) for n in resolved.max_tokens]
        order: dict[str, int] = {}
        try:
            for i, (p, sp) in enumerate(zip(ids, plist)):
                rid = f"offline-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(rid, p, sp, kv_policy=resolved.kv_policy)
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
