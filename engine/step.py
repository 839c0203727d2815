"""What a step hands the model runner and gets back: its sequences (`SeqInput`), the
attention statistics it returns per request (`AttentionMass`, and the prompt query sums
`QuerySums` gathers for it), its output (`StepOutput`), and the contract of a CUDA
graph replay (`DecodeReplay`). Apart from the
runner so that the attention groups, the CUDA graphs and the scheduler read these types
without importing the runner (no import loop)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from attention.stats import AttentionMass, QueryStats
from engine.rope import RotaryEmbedding, apply_rotary
from engine.sampler import TokenScores
from kvpool.seq_cache import SeqCache

if TYPE_CHECKING:
    from kvpool.manager import DecodeBatch

AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class PromptScoring:
    """Score the chunk's own next tokens (prompt logprobs): rows `offset ..
    offset + len(targets) - 1` of the chunk, row j's target being the token after it."""

    offset: int  # first row of the chunk to score
    targets: list[int]  # the token each scored row predicts (the prompt's next tokens)
    top_n: int  # alternatives per row


@dataclass(slots=True)
class SeqInput:
    """One request's share of a step."""

    token_ids: list[int]  # the tokens computed this step (a prefill chunk or one token)
    start_pos: int  # original position of token_ids[0]
    # Pool slots to write K/V to: [L, n] from SeqCache.append; None for a decode token
    # whose slots are a column of the step's `DecodeBatch.slots` (in input order).
    slots: torch.Tensor | None
    cache: SeqCache
    wants_logits: bool  # the chunk reaches the end of the known tokens
    wants_attention: bool = False  # return per-slot attention mass (eviction policies)
    score: PromptScoring | None = None  # prompt logprobs of this chunk's rows
    # Return KeyDiff's per-slot score from the decode kernel (`Needs.key_diversity`),
    # where the runner's attention fuses it (`fuses_key_diversity`); else nothing, and
    # the policy bridge asks the pool's op.
    wants_key_diversity: bool = False
    attention_heads: bool = False  # the mass per kv head (`Needs.attention_heads`)
    # Return the K and V norms of this step's tokens (`Needs.new_key_norm` /
    # `new_value_norm`), taken as the runner writes them (`new_norms`).
    wants_norms: bool = False
    # With wants_attention: the name of the per-slot state of the cache's tables the
    # step's mass goes into (`Needs.accumulate`). A decode token on the kernel, once the
    # state exists, has its row added there during attention and gets no mass back
    # (`AttentionMass.accumulated`); anywhere else the mass is returned as usual.
    accumulate: str | None = None
    # With wants_attention: the window ring this decode token's mass is written into
    # (`Needs.ring`: ring state, its total's state, fixed-point bits) and the token's
    # index in its sequence (its column is that mod the ring's size); on the kernel, as
    # `accumulate`, the mass is not returned.
    ring: tuple[str, str, int, int] | None = None
    # (first, end, outer): sum the pre-RoPE queries of this step's tokens at positions in
    # [first, end) per layer and query head, and their outer products if `outer`
    # (`Needs.query_stats`; end: the prompt's length), returned as `AttentionMass.queries`.
    query_stats: tuple[int, int, bool] | None = None


@dataclass
class StepOutput:
    # [N, V] float32 on the model's device, a row per wants_logits; None where `ids` is
    logits: torch.Tensor | None
    # seq index -> attention statistics, for the inputs that asked (wants_attention,
    # wants_norms, or wants_key_diversity where fused)
    attention: dict[int, AttentionMass] = field(default_factory=dict)
    # seq index -> its scored rows (SeqInput.score), on the host
    scores: dict[int, TokenScores] = field(default_factory=dict)
    graph: bool = False  # a CUDA graph's replay (engine/cuda_graphs.py) computed it
    # [N] int64, each row's argmax token, where a greedy step's LM head computed them
    # without writing its logits (`execute(greedy=True)`, `compute_greedy`)
    ids: torch.Tensor | None = None


# A step's input ids taken on the device: (the ids a step in flight sampled, the row of
# them each input takes), for async scheduling (scheduler/engine_core.py).
IdsFrom = tuple[torch.Tensor, list[int]]


class DecodeReplay(Protocol):
    """A decode step run as a CUDA graph's replay (engine/cuda_graphs.py: `DecodeGraphs`),
    or None where the step does not fit a captured graph (the eager path runs it)."""

    def run(self, inputs: list[SeqInput], decode: DecodeBatch,
            ids_from: IdsFrom | None) -> StepOutput | None: ...


def new_norms(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """‖K‖ and ‖V‖ per token and kv head ([T, Hkv] float32) of a layer's K/V [T, Hkv, D]
    as an unquantized pool of `dtype` stores them: the same values, laid out as the pool
    hands them back (`KVStorage.gather_stats`: contiguous fp32 rows), so the same norms
    bit for bit. The policies that keep each token's score from the step that computed
    it (knorm, paged_eviction) read these instead of gathering the step's slots back out
    of the pool after the step (an index built per (layer, request) on the host and a
    gather: most of their step's bridge, issue 18)."""
    return (torch.linalg.vector_norm(k.to(dtype).contiguous().float(), dim=-1),
            torch.linalg.vector_norm(v.to(dtype).contiguous().float(), dim=-1))


class QuerySums:
    """The pre-RoPE query sums of the step's inputs that asked (`SeqInput.query_stats`),
    gathered layer by layer as the forward hands each layer's q to attention.

    The model hands q rotated (in place, by the fused RoPE op), so the asked rows are
    rotated back: q = R(-θ) q_rot / s, the inverse of RoPE at their positions (a rotation:
    exact up to rounding). Summed in float64, so that the covariance the policy takes as
    a difference, E[qqᵀ] - μμᵀ, loses nothing to cancellation."""

    def __init__(self, inputs: list[SeqInput], offsets: list[int], rotary: RotaryEmbedding,
                 device: torch.device, attn_scale: float) -> None:
        self.attn_scale = attn_scale
        # per asking input: (its index, its first and end rows on the packed axis, outer)
        self.spans: list[tuple[int, int, int, bool]] = []
        positions: list[int] = []
        for i, s in enumerate(inputs):
            if s.query_stats is None:
                continue
            first, end, outer = s.query_stats
            lo = max(first, s.start_pos) - s.start_pos
            hi = max(lo, min(end, s.start_pos + len(s.token_ids)) - s.start_pos)
            self.spans.append((i, offsets[i] + lo, offsets[i] + hi, outer))
            positions.extend(range(s.start_pos + lo, s.start_pos + hi))
        self.rows = torch.tensor([r for _, a, b, _ in self.spans for r in range(a, b)],
                                 dtype=torch.int64, device=device)
        cos, sin = rotary.cos_sin(torch.tensor(positions, dtype=torch.int64, device=device),
                                  scaled=False)
        self.cos, self.sin = cos, -sin  # R(-θ)
        self.inv_freq, self.scaling = rotary.inv_freq.float().cpu(), rotary.attention_scaling
        self.total: list[torch.Tensor] = []  # per layer [rows of every span, Hq, D] sums
        self.outer: list[torch.Tensor] = []

    def add(self, q: torch.Tensor) -> None:
        """A layer's q [T, Hq, D] (rotated): its asked rows' sums, per span."""
        x = apply_rotary(q.index_select(0, self.rows).double(), self.cos, self.sin)
        if self.scaling != 1.0:
            x = x / self.scaling
        at, total, outer = 0, [], []
        for _, a, b, want in self.spans:
            part = x[at : at + b - a]
            at += b - a
            total.append(part.sum(dim=0))
            if want:
                outer.append(torch.einsum("thd,the->hde", part, part))
        self.total.append(torch.stack(total))
        if outer:
            self.outer.append(torch.stack(outer))

    def attach(self, attention: dict[int, AttentionMass], inputs: list[SeqInput]) -> None:
        """After the forward: each asking input's sums over every layer, on the host, as
        its `AttentionMass.queries` (one copy for the step)."""
        total = torch.stack(self.total, dim=1).cpu()  # [spans, L, Hq, D]
        outer = torch.stack(self.outer, dim=1).cpu() if self.outer else None
        o = 0
        for j, (i, a, b, want) in enumerate(self.spans):
            mass = attention.get(i) or AttentionMass(None, 0, len(inputs[i].token_ids))
            mass.queries = QueryStats(total[j], outer[o] if want and outer is not None
                                      else None, b - a, self.inv_freq, self.scaling,
                                      self.attn_scale)
            attention[i] = mass
            o += want


def query_sums(inputs: list[SeqInput], offsets: list[int], rotary: RotaryEmbedding,
               device: torch.device, attn_scale: float) -> QuerySums | None:
    """A `QuerySums` for the step if an input asked for its queries' sums, else None."""
    if not any(s.query_stats is not None for s in inputs):
        return None
    return QuerySums(inputs, offsets, rotary, device, attn_scale)
