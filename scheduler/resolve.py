"""A request's `kv_policy` and `max_tokens`, resolved against the served model once.

`resolve_request` is the one place a request's `kv_policy` is parsed (a name or an
object -> its validated config, `policies/catalog.py`), given the defaults that are a
share of the model's context (`KVPolicyConfig.for_context`), and its max_tokens fitted to
the context (`scheduler/limits.py`'s rule). The server's preprocessing and the offline
`LLM.generate` call it before anything is queued; the engine (`AsyncEngine.generate` and
`submit`, `EngineCore.add_request`) takes what it made as it is: a config object, never a
string or a mapping to parse again, and a max_tokens it does not fit again.

Nothing here knows HTTP: a bad policy raises KVPolicyError, whose `param` names the
field (`kv_policy`, `kv_policy.window`, ...), and a prompt or max_tokens past the context
raises RequestRejected, whose `param` is "prompt" or "max_tokens"; the server answers
either with a 400 naming the field, the offline API lets them through.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.catalog import parse_kv_policy
from policies.config import KVPolicyConfig, KVPolicyError
from scheduler.limits import fit_max_tokens, shifts_rope


@dataclass(frozen=True)
class ModelLimits:
    """What resolving a request needs to know of the served model: made once when the
    engine loads (`EngineCore.limits`), and handed to the API side in its `CoreInfo`."""

    max_model_len: int
    max_request_tokens: int  # min(context, whole pool) in tokens: a default's ceiling
    default_kv_policy: KVPolicyConfig  # for requests that name none, resolved for the model
    per_head: bool = False  # the pool's pages are per (layer, kv head) (`--kv-layout head`)

    @classmethod
    def of(cls, max_model_len: int, max_request_tokens: int,
           default_kv_policy: object, per_head: bool = False) -> ModelLimits:
        """`default_kv_policy` (`--default-kv-policy`: a name, an object or a config;
        None: full) parsed and resolved for the model, once for every request."""
        config = parse_kv_policy(default_kv_policy or "full")
        check_heads(config, per_head)
        return cls(max_model_len, max_request_tokens, config.for_context(max_model_len),
                   per_head)


def check_heads(config: KVPolicyConfig, per_head: bool) -> None:
    """A policy's `heads` against the pool: keeping tokens per head needs pages per head."""
    heads = getattr(config, "heads", None)
    if heads in ("uniform", "adaptive") and not per_head:
        raise KVPolicyError(f"kv_policy ({config.name}): heads {heads!r} keeps tokens per kv "
                            "head, which needs a per-head pool (the server's --kv-layout "
                            "head); this one keeps one set a layer: use 'shared'",
                            "kv_policy.heads")


@dataclass(frozen=True)
class Resolved:
    """A request as the engine takes it."""

    kv_policy: KVPolicyConfig  # validated, with the model's context-share defaults
    max_tokens: tuple[int, ...]  # one per prompt, in order: fitted to the context


def resolve_request(limits: ModelLimits, kv_policy: object = None,
                    prompts: Sequence[tuple[int, int | None]] = (), *,
                    default_max_tokens: int | None = None) -> Resolved:
    """`kv_policy` (a name, an object, a config; None: the server's default) and each of
    `prompts`' (prompt length, requested max_tokens) resolved for the model of `limits`.

    A max_tokens of None gets `default_max_tokens` (completions: OpenAI's 16), or with no
    default all that is left of the context (chat), at most what the whole KV pool holds.
    The policy is parsed first, so a bad policy is the error even if a prompt is also too
    long. Raises KVPolicyError or RequestRejected (see the module docstring).
    """
    config = (limits.default_kv_policy if kv_policy is None
              else parse_kv_policy(kv_policy).for_context(limits.max_model_len))
    check_heads(config, limits.per_head)
    rope_shift = shifts_rope(config)
    return Resolved(config, tuple(
        fit_max_tokens(prompt_len, max_tokens, limits.max_model_len, rope_shift=rope_shift,
                       default=default_max_tokens, capacity=limits.max_request_tokens)
        for prompt_len, max_tokens in prompts))
