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


def _top_dict(tt: TokenText, top: list[tuple[int, float]]) -> dict[str, float] | None:
    """Legacy `top_logprobs` entry, keyed by token text: where two tokens decode to the
    same text (byte tokens of one character, both U+FFFD) the likelier one is kept, so
    the entry's max is still the position's most likely token."""
    if not top:
        return None
    out: dict[str, float] = {}
    for t, v in top:
        out.setdefault(tt(t), _finite(v))
    return out


def completion_logprobs(tt: TokenText, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """Legacy completions format; `offset` is where these tokens' text starts."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        s = tt(lp.token_id)
        tokens.append(s)
        token_lps.append(_finite(lp.logprob))
        tops.append(_top_dict(tt, lp.top))
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def echo_logprobs(tt: TokenText, prompt_ids: list[int], lps: list[TokenLogprob | None],
                  n: int) -> dict[str, Any]:
    """The prompt's share of the legacy format, for echo: what `completion_logprobs`
    gives a generated token, with the top-N that `logprobs` asked for. The first prompt
    token has no logprob (nothing predicts it): `null` and a `null` top entry, as OpenAI
    and vLLM return it. Offsets add up the tokens' decoded lengths from 0, as vLLM's do
    (a special token such as BOS counts its decoded text even where the echoed prompt
    string has none)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = 0
    for tid, lp in zip(prompt_ids, lps):
        s = tt(tid)
        tokens.append(s)
        token_lps.append(None if lp is None else _finite(lp.logprob))
        tops.append(None if lp is None else _top_dict(tt, lp.top[:n]))
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two legacy logprobs objects as one (the prompt's, then the generated tokens')."""
    return {k: first[k] + then[k] for k in first}


def vllm_prompt_logprobs(tt: TokenText, lps: list[TokenLogprob | None], n: int
                         ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of a choice: None for the first prompt token, then per
    token a dict token id -> {logprob, rank, decoded_token}: the prompt token itself
    first (its rank in the distribution), then the top-N (ranks 1..N) not already in it."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        d = {str(lp.token_id): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                "decoded_token": tt(lp.token_id)}}
        for rank, (t, v) in enumerate(lp.top[:n], 1):
            d.setdefault(str(t), {"logprob": _finite(v), "rank": rank,
                                  "decoded_token": tt(t)})
        out.append(d)
    return out


def end_offset(lp: dict[str, Any]) -> int:
    """Where the text after a legacy logprobs object's last token starts."""
    return lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else 0


def choice_logprobs(gen: Generation, c: ChoiceState, tt: TokenText,
                    lps: list[TokenLogprob] | None, with_prompt: bool) -> dict[str, Any]:
    """A completion choice's legacy logprobs for `lps`; `with_prompt` (echo) puts the
    prompt's first, and the generated tokens' offsets go on from the prompt's."""
    if not with_prompt:
        return completion_logprobs(tt, lps or [], 0)
    prompt = echo_logprobs(tt, c.prompt_ids, c.prompt_logprobs or [],
                           gen.plan.num_logprobs or 0)
    return joined(prompt, completion_logprobs(tt, lps or [], end_offset(prompt)))


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
            lp = choice_logprobs(gen, c, tt, c.logprobs, p.echo)
        choice = {"index": c.index, "text": c.text, "logprobs": lp,
                  "finish_reason": c.finish_reason}
        if p.num_prompt_logprobs is not None:  # vLLM's extension, only when asked
            choice["prompt_logprobs"] = vllm_prompt_logprobs(tt, c.prompt_logprobs or [],
                                                             p.num_prompt_logprobs)
        out.append(choice)
    return {"id": p.id, "object": "text_completion", "created": p.created, "model": p.model,
            "choices": out, "usage": gen.usage(), "system_fingerprint": None}


def chat_message(gen: Generation, c: ChoiceState) -> tuple[dict[str, Any], str | None]:
    """A chat choice's message and finish_reason: the reasoning apart where the server
    has a reasoning parser (server/reasoning/), the answer read for tool calls where
    the request has tools (server/tools.py); calls are looked for in the answer only."""
    p = gen.plan
    answer = c.text if c.reasoner is None else c.reasoner.content
    message: dict[str, Any] = {"role": "assistant", "content": answer, "refusal": None}
    finish = c.finish_reason
    if p.tools is not None:
        message, finish = p.tools.message(answer, finish)
    if c.reasoner is not None:
        message["content"] = message["content"] or None
        message["reasoning_content"] = c.reasoner.reasoning or None
    return message, finish


def chat_body(gen: Generation, choices: list[ChoiceState], tt: TokenText) -> dict[str, Any]:
    p = gen.plan
    out = []
    for c in choices:
        lp = chat_logprobs(tt, c.logprobs or []) if p.num_logprobs is not None else None
        message, finish = chat_message(gen, c)
        out.append({"index": c.index, "message": message, "logprobs": lp,
                    "finish_reason": finish})
    return {"id": p.id, "object": "chat.completion", "created": p.created, "model": p.model,
            "choices": out, "usage": gen.usage(), "system_fingerprint": None}
