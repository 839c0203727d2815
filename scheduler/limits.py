"""Prompt + max_tokens against the context: the one rule, for every way in.

`scheduler/resolve.py` calls `fit_max_tokens`, once for each prompt, for both ways in (the
HTTP layer and the offline `LLM.generate`, before anything is queued); the engine runs
the max_tokens it fitted and does not check it again.

The rule:
- the prompt must leave room for one token in the context (`max_model_len`), unless
  max_tokens is 0 (a scoring request: prompt logprobs, nothing generated), whose prompt
  may fill the context;
- prompt + max_tokens must fit the context, except for a `kv_policy` with
  `rope: "shift"` (StreamingLLM with position shift): it renumbers the kept tokens after
  each eviction, and prefills its prompt in chunks no longer than its bound, so neither
  its prompt nor its generation is limited by `max_position_embeddings` (what is: the
  positions it ever uses, its bound plus one chunk: `fit_shifted_positions`); such a prompt past the context needs an explicit
  max_tokens;
- no max_tokens from the client: `default` (completions: OpenAI's 16), or with no
  default all that is left of the context (chat), in both cases at most what is left of
  `capacity` (the context or the whole KV pool, the smaller) — never past the context,
  even under rope shift: only a client that asks gets an unbounded-length request.

Whether the KV pool can hold the request is not decided here: that depends on the
policy's bound and is `EngineCore.add_request`'s reservation arithmetic.
"""

from __future__ import annotations

from scheduler.outputs import RequestRejected

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def shifts_rope(kv_policy: object) -> bool:
    """True for a validated `kv_policy` config with `rope: "shift"`."""
    return getattr(kv_policy, "rope", "original") == "shift"


def fit_shifted_positions(bound: int, chunk: int, prompt_len: int, total: int,
                          max_model_len: int, block_size: int) -> int:
    """The prefill chunk of a `rope: "shift"` request whose policy keeps at most `bound`
    tokens (a step's budget `chunk` otherwise): no longer than the context leaves beside
    the bound, so every position it is given stays inside the context.

    Raises RequestRejected ("kv_policy") when even that cannot hold: the most tokens a
    step holds — bound + one chunk in prefill, bound + the new token in decode — pass
    the context (a window as wide as the context)."""
    chunk = min(chunk, max(block_size, max_model_len - bound))
    span = max(min(prompt_len, bound + chunk), min(total - 1, bound + 1))
    if span > max_model_len:
        raise RequestRejected(
            f"under rope shift this kv_policy holds up to {span} tokens in a step (its "
            f"bound plus one prefill chunk), past the model's context length "
            f"{max_model_len}; lower its window", "kv_policy")
    return chunk


def fit_max_tokens(prompt_len: int, max_tokens: int | None, max_model_len: int, *,
                   rope_shift: bool = False, default: int | None = None,
                   capacity: int | None = None) -> int:
    """The max_tokens a request runs with (`max_tokens` itself when given).

    Raises RequestRejected whose `param` is "prompt" when the prompt alone leaves no room
    to generate, "max_tokens" when prompt + max_tokens passes the context.
    """
    if not rope_shift and (prompt_len > max_model_len or (
            prompt_len == max_model_len and max_tokens != 0)):
        raise RequestRejected(
            f"the prompt has {prompt_len} tokens; the model's context length is "
            f"{max_model_len}, which leaves no room to generate", "prompt")
    if max_tokens is None:
        limit = max_model_len if capacity is None else min(capacity, max_model_len)
        room = limit - prompt_len
        if room < 1:
            hint = " (give max_tokens: under rope shift a request may run past it)" \
                if rope_shift else ""
            raise RequestRejected(
                f"the prompt ({prompt_len} tokens) leaves no room to generate within "
                f"{limit} tokens (the context or the whole KV pool){hint}", "prompt")
        return room if default is None else min(default, room)
    total = prompt_len + max_tokens
    if total > max_model_len and not rope_shift:
        raise RequestRejected(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
            f"the model's context length {max_model_len}", "max_tokens")
    return max_tokens
