"""Per-request sampling parameters (the OpenAI fields, already validated upstream)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StructuredOutput:
    """Output constrained to a grammar (engine/structured.py). `kind`: "json" (`spec`, a
    JSON schema as text), "json_object" (any JSON object or array), "regex", "choice"
    (`spec`: a JSON list of the strings) or "grammar" (EBNF, xgrammar's / GBNF).
    `param`: the request field it came from, which a refusal names. `any_whitespace`
    False: JSON with no free whitespace, ", " and ": " between its tokens (vLLM's
    `disable_any_whitespace`; the server's tool calls use it)."""

    kind: str
    spec: str = ""
    param: str = "structured_outputs"
    any_whitespace: bool = True


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
    # Penalties and bias (engine/penalties.py): OpenAI's presence and frequency penalties
    # (on the output's tokens), vLLM's repetition penalty (on the prompt's and the
    # output's; 1 = off), and a bias added to given token ids' logits.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # vLLM's: no EOS or stop token id before this many output tokens (their logits are
    # -inf until then), and stop strings are looked for only from then on.
    min_tokens: int = 0
    # vLLM's: only these token ids may be drawn (None: any)
    allowed_token_ids: list[int] | None = None
    # vLLM's: the stop string (or a stop token id's text) stays at the end of the text
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # False: special tokens' text is in the output text
    structured: StructuredOutput | None = None  # a grammar the output must follow
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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            raise ValueError("repetition_penalty must be > 0")
        if not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            raise ValueError("min_tokens must be >= 0 and <= max_tokens")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or min(self.allowed_token_ids) < 0):
            raise ValueError("allowed_token_ids must be a non-empty list of ids >= 0")
        if self.logit_bias and any(t < 0 for t in self.logit_bias):
            raise ValueError("logit_bias token ids must be >= 0")

    @property
    def shapes_logits(self) -> bool:
        """Whether its logits are changed before sampling (penalties or a grammar): its
        rows then never take the LM head's argmax, nor leave a step in flight."""
        return self.penalized or self.structured is not None

    @property
    def penalized(self) -> bool:
        """Whether `engine.penalties` changes its logits (penalties, a bias, min_tokens,
        allowed ids)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias or self.min_tokens
                    or self.allowed_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
