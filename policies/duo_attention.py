"""DuoAttention (`duo`): retrieval heads keep every token, streaming heads only the
attention sinks and a recent window (Xiao et al., arXiv 2410.10819; kvpress
`DuoAttentionPress`). Per (layer, kv head), so it needs a per-head pool
(`--kv-layout head`), where what a streaming head drops goes back to the pool.

Which heads stream: the `streaming_ratio` share of the (layer, kv head) pairs that score
lowest in the served model's head roles (`kv_head_roles.json` beside the model, made by
`kvserve head-roles`, scheduler/head_roles.py: how much the model's answer to synthetic
pass-key prompts suffers when that head alone keeps sinks + window), or the lanes a
request names itself (`streaming_heads`, lane = layer × kv heads + head). The paper
learns a gate per head by distillation on the same kind of prompts; the roles file's
ablation measures the same thing (the output's change when the head streams) directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from pydantic import Field, field_validator

from policies.base import Needs
from policies.config import ContextDefault, EvictingPolicyConfig, HeadsMode
from policies.rows import RowsView, drop_earliest


class DuoConfig(EvictingPolicyConfig):
    """DuoAttention's streaming heads keep `sink` + `window` (the paper's 128 + 256 at
    long contexts; here 4 sinks and 1/16 of the context)."""

    name: Literal["duo"] = "duo"
    streaming_ratio: float = Field(0.5, ge=0.0, le=1.0, description=(
        "Share of the (layer, kv head) pairs that stream (keep sink + window): those the "
        "model's head roles (`kvserve head-roles`) score least needed for retrieval."))
    streaming_heads: list[int] | None = Field(None, description=(
        "The lanes that stream (layer × kv heads + head), instead of streaming_ratio "
        "and the roles file."))
    sink: int = Field(4, ge=0, description="First tokens a streaming head keeps.")
    window: int = Field(256, ge=1, description="Most recent tokens a streaming head keeps.")

    CONTEXT_DEFAULTS: ClassVar[dict[str, ContextDefault]] = {"window": ContextDefault(1 / 16)}

    @field_validator("heads")
    @classmethod
    def _per_head(cls, value: HeadsMode | None) -> HeadsMode | None:
        if value not in (None, "uniform"):
            raise ValueError("duo keeps tokens per kv head: heads must be uniform")
        return value


def streaming_lanes(config: DuoConfig, roles: torch.Tensor | None, lanes: int) -> list[bool]:
    """Per lane, whether it streams: the named lanes, else the `streaming_ratio` share
    of the lanes with the lowest role scores (ties to the lower lane, as a stable sort)."""
    if config.streaming_heads is not None:
        named = set(config.streaming_heads)
        return [lane in named for lane in range(lanes)]
    assert roles is not None and roles.numel() == lanes, "no head roles for this model"
    n = round(config.streaming_ratio * lanes)
    out = [False] * lanes
    for lane in torch.argsort(roles, stable=True)[:n].tolist():
        out[lane] = True
    return out


@dataclass
class DuoPolicy:
    """DuoAttention (Xiao et al., arXiv 2410.10819; kvpress `DuoAttentionPress`):
    streaming heads keep their first `sink` and last `window` live tokens after every
    step (StreamingLLM's set, prompt chunks included), retrieval heads everything."""

    config: DuoConfig
    name: str = "duo"
    needs: Needs = field(default_factory=Needs)
    _streams: list[bool] | None = field(default=None, repr=False)

    @staticmethod
    def select(policies: list[DuoPolicy], view: RowsView) -> torch.Tensor | None:
        p = policies[0]
        c = p.config
        if p._streams is None:  # one config, one server: the same lanes every step
            p._streams = streaming_lanes(c, view.head_roles, view.num_layers)
        r, cap = view.num_requests, c.sink + c.window
        drop = [n - cap if n > cap and p._streams[i // r] else 0
                for i, n in enumerate(view.lengths)]
        return drop_earliest(view, drop, c.sink)

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        """A retrieval head keeps everything: no bound on any one lane."""
        return seq_len
