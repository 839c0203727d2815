"""Per-request sampling parameters (the OpenAI fields, already validated upstream)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    # 0: score the prompt only (with prompt_logprobs): the request finishes after its
    # prefill without sampling a token (the server allows it only with `echo`).
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None  # None: a random seed is drawn at submission
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; N >= 0 = sampled token's logprob + top-N
    # None = off; N >= 0 = every prompt token's logprob (the first has none), its rank,
    # and the top-N at its position. The prompt is then computed, never taken from the
    # prefix cache (a hit's positions have no logits).
    prompt_logprobs: int | None = None
    # False skips incremental detokenization (offline throughput runs that only want ids;
    # stop strings then cannot match).
    detokenize: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError("prompt_logprobs must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1, 0 (off) or positive")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
