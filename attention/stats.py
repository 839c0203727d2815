"""What a forward's attention hands the eviction policies, per request: the attention
mass over its slots, KeyDiff's scores, its new tokens' K/V norms and its prompt's
pre-RoPE query sums, as the forward computed them. Here, below the model runner and the
KV-cache manager, because both read it: the runner fills it, the manager's policy bridge
(kvpool/policy_rows.py) reads it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class QueryStats:
    """An input's pre-RoPE query sums over this step's prompt tokens in the range its
    `SeqInput.query_stats` named, per layer and query head, in float64 (a covariance is
    their difference: E[qqᵀ] - μμᵀ), the model's RoPE frequencies, which rotate their
    mean to the positions still to come (Expected Attention), and its softmax scale."""

    total: torch.Tensor  # [L, Hq, D] Σq
    outer: torch.Tensor | None  # [L, Hq, D, D] Σqqᵀ, if asked
    count: int  # the tokens summed
    inv_freq: torch.Tensor  # [rotary_dim // 2] float32
    scaling: float  # RoPE's attention scaling (yarn), in cos and sin as the model applies them
    attn_scale: float  # the attention softmax's scale (ModelConfig.attn_scale)


@dataclass(slots=True)
class AttentionMass:
    """One input's statistics from the forward (attention mass, KeyDiff's scores, its
    tokens' K/V norms), kept as its group's whole tensors and a row, so a group of any
    size costs one stack and one copy, and a batched consumer selects its rows in one op.

    `group`: [L, B, Tq, Hkv, S] float32 on the host (None unless `wants_attention`):
    for each layer, row and query, the probability of every slot summed over its kv
    group's query heads (Hkv = 1: over every head, where the decode kernel summed them
    for a policy that reads no head apart); S indexes the row's slots in table order (slot j =
    table[j // bs] at offset j % bs). `key_diversity`: [L, B, S] float32, KeyDiff's
    score of every live slot (0 elsewhere), None unless asked and fused."""

    group: torch.Tensor | None
    row: int
    num_tokens: int  # the input's queries (the first Tq of its row)
    key_diversity: torch.Tensor | None = None
    # The step's mass went into the input's `accumulate` state or `ring` (`group` is None).
    accumulated: bool = False
    # `wants_norms`: the step's tokens' ‖K‖ and ‖V‖ per kv head as stored, [L, T, Hkv]
    # float32 on the host (every input's, packed token axis), and where this input's
    # tokens start on it.
    key_norm: torch.Tensor | None = None
    value_norm: torch.Tensor | None = None
    token: int = 0
    queries: QueryStats | None = None  # `SeqInput.query_stats`: its prompt's query sums

    def layers(self) -> torch.Tensor:
        """[L, num_tokens, Hkv, S]: this input's mass, indexable by layer."""
        assert self.group is not None
        return self.group[:, self.row, : self.num_tokens]
