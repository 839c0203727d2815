"""Expected Attention (Devoto et al. 2025, "Expected Attention: KV Cache Compression by
Estimating Attention from Future Queries Distribution", arXiv 2510.00636; NVIDIA
kvpress `ExpectedAttentionPress`): compress the prompt once, keeping the tokens that the
queries still to come are expected to attend to most.

The queries of the positions after the prompt are unknown, but a layer's pre-RoPE
queries are close to Gaussian: with their mean μ and covariance Σ over the prompt (per
query head) and RoPE's rotation averaged over the next `n_future_positions` positions,
R̄, a future query is q ~ N(R̄μ, R̄ΣR̄ᵀ), and a key k's expected exp(q·k/√d) is
exp(k·R̄μ/√d + kᵀR̄ΣR̄ᵀk / 2d) (the paper's eq. for E[exp(qᵀk/√d)]); with the model's own
softmax scale s in place of 1/√d (Gemma's query_pre_attn_scalar), exp(s k·R̄μ + s² kᵀR̄ΣR̄ᵀk / 2).
Query-agnostic: no extra pass, only sums the forward already has (`Needs.query_stats`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from pydantic import Field

from policies.base import Needs, StepView, prompt_once_live, resolve_budget
from policies.config import Budget, ContextDefault, EvictingPolicyConfig, budget_field
from policies.heads import adaptive_drops
from policies.rows import RowsView, drop_lowest


class ExpectedAttentionConfig(EvictingPolicyConfig):
    """Defaults from kvpress 0.5.5's `ExpectedAttentionPress`: 512 future positions, 4
    sinks, the covariance and the ‖V‖ rescaling on, epsilon 0."""

    ADAPTIVE: ClassVar[bool] = True
    name: Literal["expected_attention"] = "expected_attention"
    budget: Budget = budget_field(2048, "Prompt tokens kept per layer (per kv head over "
                                  "a per-head pool), the sinks included")
    n_future_positions: int = Field(512, ge=1, description=(
        "Positions after the prompt whose queries are expected: RoPE's rotation is "
        "averaged over them."))
    n_sink: int = Field(4, ge=0, description=(
        "First tokens always kept, and left out of the query statistics (their queries "
        "are outliers)."))
    use_covariance: bool = Field(True, description=(
        "Model the future queries' covariance too, not only their mean."))
    use_vnorm: bool = Field(True, description=(
        "Rescale each token's expected attention by its value norm: (score + epsilon) "
        "× ‖V‖₂."))
    epsilon: float = Field(0.0, ge=0.0, description=(
        "Added to the expected attention before the ‖V‖ rescaling."))

    CONTEXT_DEFAULTS: ClassVar[dict[str, ContextDefault]] = {"budget": ContextDefault(0.5)}


def mean_rotation(inv_freq: torch.Tensor, scaling: float, start: int, count: int,
                  dim: int) -> torch.Tensor:
    """R̄ [dim, dim] float64: RoPE's rotation (rotate_half layout, `scaling` in cos and sin
    as the model applies them) averaged over positions start .. start + count - 1, as
    kvpress's `apply_avg_rope` builds it; dims past the rotary ones pass through."""
    half = inv_freq.numel()
    freqs = torch.arange(start, start + count, dtype=torch.float32)[:, None] * inv_freq.float()
    cos = (freqs.cos() * scaling).double().mean(dim=0)
    sin = (freqs.sin() * scaling).double().mean(dim=0)
    r = torch.eye(dim, dtype=torch.float64)
    i = torch.arange(half)
    r[i, i] = cos
    r[i + half, i + half] = cos
    r[i, i + half] = -sin
    r[i + half, i] = sin
    return r


def expected_scores(keys: torch.Tensor, values: torch.Tensor | None, cand: torch.Tensor,
                    mean: torch.Tensor, cov: torch.Tensor | None,
                    epsilon: float, scale: float | None = None) -> torch.Tensor:
    """One row's score per slot, [W] float32, the mean over its kv heads of kvpress's
    per-head score: for each query head the softmax over the candidate slots `cand` [W]
    of s k·μ' (+ s² kᵀΣ'k / 2), averaged over the kv head's query heads, then
    (· + epsilon) × ‖v‖ where `values` [W, Hkv] is given. keys [W, Hkv, D] as stored
    (rotated); mean [Hkv, G, D] and cov [Hkv, G, D, D] already rotated (R̄μ, R̄ΣR̄ᵀ);
    s the model's softmax scale (None: kvpress's 1/√d, which is most models')."""
    d = keys.shape[-1]
    s = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(keys.shape[0], dtype=torch.float32)
    hkv = keys.shape[1]
    for h in range(hkv):
        k = keys[:, h].float()  # [W, D]
        z = mean[h].float() @ k.T * s  # [G, W]
        if cov is not None:
            z += (torch.matmul(k, cov[h].float()) * k).sum(dim=-1) * (s * s / 2)
        p = torch.softmax(z.masked_fill(~cand, float("-inf")), dim=-1).mean(dim=0)
        if values is not None:
            p = (p + epsilon) * values[:, h]
        out += p.masked_fill(~cand, 0.0)
    return out / hkv


@dataclass
class ExpectedAttentionPolicy:
    """Expected Attention (arXiv 2510.00636; kvpress `ExpectedAttentionPress`): at the
    end of the prompt, keeps the `n_sink` first tokens and the prompt tokens future
    queries are expected to attend to most, by their statistics over the prompt.

    Per (layer, query head), the pre-RoPE queries of the prompt's positions from
    `n_sink` on give μ and Σ (population covariance, as kvpress: E[qqᵀ] - μμᵀ); both are
    rotated by R̄, RoPE averaged over the positions P .. P + n_future_positions - 1 after
    the prompt's P tokens (`mean_rotation`); each key k past the sinks scores
    k·R̄μ/√d + kᵀR̄ΣR̄ᵀk/(2d), softmaxed over those keys, averaged over the query heads of
    its kv group, (+ epsilon) × ‖v‖₂ (`expected_scores`). Over a per-head pool each kv
    head keeps its own top C - n_sink (`"heads": "uniform"`, kvpress's own per-head
    sets), or AdaKV spreads the layer's total by these scores (`"adaptive"`, kvpress's
    `AdaKVPress` over it); over a per-layer pool the layer keeps the top of their mean
    over kv heads. C = resolve_budget(budget, P), the sinks included.

    The queries' sums arrive with every prompt chunk (`Needs.query_stats`: the runner
    rotates each layer's q back to before RoPE) and are summed here until the prompt is
    complete, so a chunked prefill ranks with exactly the one-shot statistics. The
    prompt is compressed once, on the step that completes it, and generated tokens are
    never evicted (a statistic of the whole prompt cannot rank part of it, so there is
    no bounded prefill: the prompt's peak is reserved, as for snapkv).
    Bound: min(P, C) + (seq_len - P) once the prompt is complete."""

    config: ExpectedAttentionConfig
    name: str = "expected_attention"
    needs: Needs = field(default_factory=Needs)
    # Σq [lanes, Hkv, G, D], Σqqᵀ [lanes, Hkv, G, D, D] (float64) and the count of the
    # prompt chunks so far, as the view's rows of this request hold them.
    _sum: torch.Tensor | None = field(default=None, repr=False)
    _outer: torch.Tensor | None = field(default=None, repr=False)
    _count: int = 0
    _done: bool = False

    def __post_init__(self) -> None:
        c = self.config
        self.needs = Needs(keys=True, value_norm=c.use_vnorm,
                           query_stats=(c.n_sink, c.use_covariance))

    @staticmethod
    def select(policies: list[ExpectedAttentionPolicy], view: RowsView) -> torch.Tensor | None:
        """Add this step's query sums to each request's; the rows of the requests whose
        prompt is complete keep their C prompt tokens, the others only accumulate."""
        if all(p._done for p in policies):
            return None
        assert view.query_sum is not None and view.rope is not None
        active = []
        for r, (p, s, prompt, done) in enumerate(zip(policies, view.seq_len, view.prompt_len,
                                                       view.prefill_done)):
            if p._done:
                active.append(False)
                continue
            rows = view.rows_of(r)
            total = view.query_sum[rows]
            outer = None if view.query_outer is None else view.query_outer[rows]
            p._sum = total.clone() if p._sum is None else p._sum + total
            if outer is not None:
                p._outer = outer.clone() if p._outer is None else p._outer + outer
            p._count += view.query_count[r]
            active.append(done or s > prompt)
        if not any(active):
            return None
        return _drop(policies, view, active)

    def idle(self, view: StepView) -> bool:
        """After the prompt was compressed the policy never acts again (generated tokens
        are never evicted) and observes nothing."""
        return self._done

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        return prompt_once_live(self.config.budget, seq_len, prompt_len)

    def max_live_decoding(self, seq_len: int, prompt_len: int | None = None,
                          block_size: int | None = None) -> int:
        return prompt_once_live(self.config.budget, seq_len, prompt_len, decoding=True)


def _drop(policies: list[ExpectedAttentionPolicy], view: RowsView,
          active: list[bool]) -> torch.Tensor | None:
    """The drop mask of the active requests' rows, each keeping C of its m live prompt
    tokens: the first min(n_sink, C) and the best C - n_sink of the rest by
    `expected_scores` (AdaKV's counts where `view.adaptive`); the others drop nothing.
    Each active policy is done afterwards."""
    c = policies[0].config
    assert view.keys is not None
    live, pos = view.live, view.positions
    n_req = view.num_requests
    prompts = view.per_row(view.prompt_len)
    prompt_live = live & (pos < view.row_tensor(prompts))
    m_rows = prompt_live.sum(dim=1).tolist()
    scores = torch.zeros(view.shape, dtype=torch.float32)
    rank = live.cumsum(dim=1)
    drops, sinks, after = [], [], []
    for i, (m, prompt, n) in enumerate(zip(m_rows, prompts, view.lengths)):
        r = i % n_req
        budget = resolve_budget(c.budget, prompt)
        sink = min(c.n_sink, budget)
        drops.append(max(0, m - budget) if active[r] else 0)
        sinks.append(sink)
        after.append(n - m)  # generated tokens (a recomputed request's): never candidates
    rots: dict[int, torch.Tensor] = {}
    inv_freq, scaling = view.rope  # type: ignore[misc]
    for r, p in enumerate(policies):
        if not active[r]:
            continue
        assert p._sum is not None
        count = max(1, p._count)
        mean = p._sum / count  # [lanes, Hkv, G, D]
        prompt = view.prompt_len[r]
        if prompt not in rots:
            rots[prompt] = mean_rotation(inv_freq, scaling, prompt, c.n_future_positions,
                                         mean.shape[-1])
        rot = rots[prompt]
        cov = None
        if p._outer is not None:
            cov = p._outer / count - mean[..., :, None] * mean[..., None, :]
            cov = rot @ cov @ rot.T
        mean = mean @ rot.T
        for lane in range(view.num_layers):
            i = lane * n_req + r
            if drops[i] == 0 and not view.adaptive:
                continue
            cand = prompt_live[i] & (rank[i] > c.n_sink)
            scores[i] = expected_scores(
                view.keys[i], view.value_norm[i] if c.use_vnorm else None, cand,  # type: ignore[index]
                mean[lane], None if cov is None else cov[lane], c.epsilon, view.attn_scale)
        p._done = True
        p.needs = Needs()  # nothing more to observe
        p._sum = p._outer = None
    if not any(drops):
        return None
    if view.adaptive:  # AdaKV over the expected-attention scores (policies/heads.py)
        keep = [n - d for n, d in zip(view.lengths, drops)]
        drops = adaptive_drops(scores, live, view.lengths, keep, view.heads, n_req,
                               sinks, after)
    return drop_lowest(view.positions, scores, drops, sinks, after)
