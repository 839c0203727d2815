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
from dataclasses import dataclass, replace

from engine.generation_defaults import NO_DEFAULTS, SamplingDefaults
from policies.catalog import parse_kv_policy
from policies.config import FullPolicyConfig, KVPolicyConfig, KVPolicyError
from policies.duo_attention import DuoConfig
from scheduler.head_roles import ROLES_FILE
from scheduler.limits import fit_max_tokens, shifts_rope


@dataclass(frozen=True)
class ModelLimits:
    """What resolving a request needs to know of the served model: made once when the
    engine loads (`EngineCore.limits`), and handed to the API side in its `CoreInfo`."""

    max_model_len: int
    max_request_tokens: int  # min(context, whole pool) in tokens: a default's ceiling
    default_kv_policy: KVPolicyConfig  # for requests that name none, resolved for the model
    per_head: bool = False  # the pool's pages are per (layer, kv head) (`--kv-layout head`)
    lanes: int = 0  # (layer, kv head) pairs over a per-head pool, layers otherwise
    head_roles: bool = False  # the model has head roles (`kvserve head-roles`) loaded
    sliding_windows: bool = False  # some of the model's layers attend to a window
    # A kv_policy acts on layers that rotate by a RoPE other than the model's `rotary`
    # (Gemma 3's local layers, where the engine keeps them whole: `hybrid_kv_cache` off).
    policy_local_rope: bool = False
    # The model's generation_config.json defaults (`--generation-config`;
    # engine/generation_defaults.py): the server fills a request's unset sampling fields
    # from them, and its max_new_tokens lowers the default max_tokens here.
    sampling_defaults: SamplingDefaults = NO_DEFAULTS

    @classmethod
    def of(cls, max_model_len: int, max_request_tokens: int, default_kv_policy: object,
           per_head: bool = False, lanes: int = 0, head_roles: bool = False,
           sliding_windows: bool = False, policy_local_rope: bool = False,
           sampling_defaults: SamplingDefaults = NO_DEFAULTS) -> ModelLimits:
        """`default_kv_policy` (`--default-kv-policy`: a name, an object or a config;
        None: full) parsed and resolved for the model, once for every request."""
        limits = cls(max_model_len, max_request_tokens, FullPolicyConfig(), per_head, lanes,
                     head_roles, sliding_windows, policy_local_rope, sampling_defaults)
        config = parse_kv_policy(default_kv_policy or "full")
        check_heads(config, limits)
        check_model(config, limits)
        return replace(limits, default_kv_policy=config.for_context(max_model_len))


def check_layout(config: KVPolicyConfig, per_head: bool) -> None:
    """A policy against the pool's layout: keeping tokens per kv head (`heads` uniform or
    adaptive, `duo`) needs pages per head. Also the start-up check of
    `--default-kv-policy` against `--kv-layout`, before the model loads."""
    heads = getattr(config, "heads", None)
    if per_head:
        return
    if heads in ("uniform", "adaptive"):
        raise KVPolicyError(f"kv_policy ({config.name}): heads {heads!r} keeps tokens per kv "
                            "head, which needs a per-head pool (the server's --kv-layout "
                            "head); this one keeps one set a layer: use 'shared'",
                            "kv_policy.heads")
    if isinstance(config, DuoConfig):
        raise KVPolicyError("kv_policy (duo): streaming heads keep tokens per kv head, which "
                            "needs a per-head pool (the server's --kv-layout head)", "kv_policy")


def check_heads(config: KVPolicyConfig, limits: ModelLimits) -> None:
    """`check_layout`, and `duo`'s needs of the model: its head roles, or the lanes it
    streams named (on this model's lanes)."""
    check_layout(config, limits.per_head)
    if not isinstance(config, DuoConfig):
        return
    if config.streaming_heads is None and not limits.head_roles:
        raise KVPolicyError(
            f"kv_policy (duo): this model has no head roles ({ROLES_FILE} beside it: run "
            "`kvserve head-roles --model DIR`), so streaming_ratio cannot pick the heads; "
            "name them in streaming_heads", "kv_policy.streaming_ratio")
    bad = [x for x in config.streaming_heads or () if not 0 <= x < limits.lanes]
    if bad:
        raise KVPolicyError(f"kv_policy (duo): streaming_heads {bad}: a lane is layer × kv "
                            f"heads + head, 0..{limits.lanes - 1} on this model",
                            "kv_policy.streaming_heads")


def check_model(config: KVPolicyConfig, limits: ModelLimits) -> None:
    """What a policy assumes of the model's positions. `rope: "shift"` renumbers the
    kept tokens, where a sliding-window layer measures its window in positions (and
    Gemma 3's local layers rotate by a RoPE base of their own, which the re-rotation
    does not know). Expected Attention models the future queries through the model's
    RoPE, so it cannot score a layer that rotates by another one: with hybrid memory the
    policy acts on the global layers alone (kvpool/windows.py), and it is refused only
    where it would act on the local ones too."""
    if limits.sliding_windows and shifts_rope(config):
        raise KVPolicyError(
            f"kv_policy ({config.name}): rope 'shift' renumbers the kept tokens' positions, "
            "but this model's sliding-window layers measure their windows in positions; "
            "use rope 'original'", "kv_policy.rope")
    if limits.policy_local_rope and config.name == "expected_attention":
        raise KVPolicyError(
            "kv_policy (expected_attention): this model's local layers rotate by a RoPE of "
            "their own, which the policy's model of future queries does not know, and "
            "with the hybrid KV cache off the policy acts on them", "kv_policy.name")


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
    default all that is left of the context (chat), at most what the whole KV pool holds,
    and at most the model's generation-config max_new_tokens (the smaller of the two
    defaults: vLLM takes the smallest of the context's room, the request's max_tokens or
    the file's). A max_tokens the caller gave is kept.
    The policy is parsed first, so a bad policy is the error even if a prompt is also too
    long. Raises KVPolicyError or RequestRejected (see the module docstring).
    """
    config = (limits.default_kv_policy if kv_policy is None
              else parse_kv_policy(kv_policy).for_context(limits.max_model_len))
    check_heads(config, limits)
    check_model(config, limits)
    rope_shift = shifts_rope(config)
    model_default = limits.sampling_defaults.max_tokens
    if model_default is not None:
        default_max_tokens = (model_default if default_max_tokens is None
                              else min(model_default, default_max_tokens))
    return Resolved(config, tuple(
        fit_max_tokens(prompt_len, max_tokens, limits.max_model_len, rope_shift=rope_shift,
                       default=default_max_tokens, capacity=limits.max_request_tokens)
        for prompt_len, max_tokens in prompts))
