"""What a step hands the model runner and gets back: its sequences (`SeqInput`), the
attention statistics it returns per request (`AttentionMass`), its output
(`StepOutput`), and the contract of a CUDA graph replay (`DecodeReplay`). Apart from the
runner so that the attention groups, the CUDA graphs and the scheduler read these types
without importing the runner (no import loop)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from attention.stats import AttentionMass
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
