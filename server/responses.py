"""OpenAI response bodies (non-streaming) and the logprob formats both modes share."""

from __future__ import annotations

import math
from typing import Any

from scheduler.outputs import TokenLogprob
from server.generation import ChoiceState, Generation


def _finite(x: float) -> float:
    """JSON has no -inf: clamp like vLLM does, so a masked token never breaks a client."""
    return x if math.isfinite(x) else -9999.0


class TokenText:
    """Token id -> its text, cached (logprob responses repeat the same tokens a lot)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id])
            if len(self._cache) < 65536:
                self._cache[token_id] = s
        return s


def completion_logprobs(tt: TokenText, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """Legacy completions format; `offset` is where these tokens' text starts."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        s = tt(lp.token_id)
        tokens.append(s)
        token_lps.append(_finite(lp.logprob))
        tops.append({tt(t): _finite(v) for t, v in lp.top} if lp.top else None)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def _chat_token(tt: TokenText, token_id: int, logprob: float) -> dict[str, Any]:
    s = tt(token_id)
    return {"token": s, "logprob": _finite(logprob), "bytes": list(s.encode("utf-8"))}


def chat_logprobs(tt: TokenText, lps: list[TokenLogprob]) -> dict[str, Any]:
    content = []
    for lp in lps:
        entry = _chat_token(tt, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [_chat_token(tt, t, v) for t, v in lp.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_body(gen: Generation, choices: list[ChoiceState], tt: TokenText
                    ) -> dict[str, Any]:
    p = gen.plan
    out = []
    for c in choices:
        lp = None
        if p.num_logprobs is not None:
            lp = completion_logprobs(tt, c.logprobs or [], 0)
        out.append({"index": c.index, "text": c.text, "logprobs": lp,
                    "finish_reason": c.finish_reason})
    return {"id": p.id, "object": "text_completion", "created": p.created, "model": p.model,
            "choices": out, "usage": gen.usage(), "system_fingerprint": None}


def chat_body(gen: Generation, choices: list[ChoiceState], tt: TokenText) -> dict[str, Any]:
    p = gen.plan
    out = []
    for c in choices:
        lp = chat_logprobs(tt, c.logprobs or []) if p.num_logprobs is not None else None
        out.append({"index": c.index,
                    "message": {"role": "assistant", "content": c.text, "refusal": None},
                    "logprobs": lp, "finish_reason": c.finish_reason})
    return {"id": p.id, "object": "chat.completion", "created": p.created, "model": p.model,
            "choices": out, "usage": gen.usage(), "system_fingerprint": None}
