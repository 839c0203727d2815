"""The offline API, like vLLM's `LLM.generate`: batch in, completions out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from engine.sampling import SamplingParams
from scheduler.engine_core import EngineConfig, EngineCore
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


class LLM:
    def __init__(self, model: str, **config: object) -> None:
        self.engine = EngineCore(EngineConfig(model=model, **config))  # type: ignore[arg-type]
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(self, prompts: Sequence[str] | Sequence[list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool = False) -> list[Completion]:
        """Run every prompt to completion under continuous batching; results in input order."""
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        order: dict[str, int] = {}
        for i, (p, sp) in enumerate(zip(ids, plist)):
            rid = f"offline-{self._next_id}"
            self._next_id += 1
            order[rid] = i
            self.engine.add_request(rid, p, sp)
        tokens: list[list[int]] = [[] for _ in ids]
        texts = [""] * len(ids)
        lps: list[list[TokenLogprob] | None] = [None] * len(ids)
        results: list[Completion | None] = [None] * len(ids)
        bar = tqdm(total=len(ids), disable=not progress, desc="generate", unit="req")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                i = order[out.request_id]
                tokens[i] += out.new_token_ids
                texts[i] += out.new_text
                if out.logprobs is not None:
                    lps[i] = (lps[i] or []) + out.logprobs
                if out.finished:
                    results[i] = Completion(ids[i], tokens[i], texts[i], out.finish_reason or "",
                                            lps[i], out.kv, out.num_preemptions)
                    bar.update(1)
        bar.close()
        return [r for r in results if r is not None]
