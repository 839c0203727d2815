"""Our per-head policies against NVIDIA kvpress's per-head presses (issue 65).

tests/data/kvpress_demo.pt holds the scores kvpress 0.5.5 computed per kv head on the
demo model for one 192-token prompt (tests/test_kvpress_agreement.py compares the
per-layer pool with their head means). Over a per-head pool (`kv_layout="head"`) each
(layer, kv head) is a row of the policy's view, so here every head's kept set must be
the top of kvpress's score *for that head* (`"heads": "uniform"`), and with
`"heads": "adaptive"` the set kvpress's `AdaKVPress` keeps from those scores (AdaKV,
arXiv 2407.11550: the layer's H·k to the best scores of all its heads, each head's top
int(0.2·k) kept first). TOVA is left out: kvpress's TOVAPress averages the heads (the
per-layer test pins it); ours per head ranks each head's own attention.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.demo import DEMO_MODEL_DIR
from engine.sampling import SamplingParams
from policies.heads import ALPHA
from policies.rows import RowsView
from scheduler.engine_core import EngineConfig, EngineCore
from scheduler.resolve import resolve_request
from tests.policy_recording import step_recording

REFERENCE = Path(__file__).parent / "data" / "kvpress_demo.pt"
HEADS = 2  # the demo model's kv heads


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    return torch.load(REFERENCE)


def _kept_per_lane(ref: dict[str, Any], cfg: dict[str, Any]) -> list[set[int]]:
    """Every lane's kept positions after the prompt, as the policy planned them."""
    core = EngineCore(EngineConfig(model=str(DEMO_MODEL_DIR), num_blocks=2048, device="cpu",
                                   kv_layout="head", enable_prefix_caching=False))
    core.add_request("r", ref["prompt"], SamplingParams(max_tokens=2),
                     kv_policy=resolve_request(core.limits, cfg).kv_policy)
    kept: list[set[int]] = []

    def record(cls: type, view: RowsView, drop: torch.Tensor | None) -> None:
        if view.prefill_done[0]:
            assert view.num_requests == 1 and view.heads == HEADS
            for lane in range(view.num_layers):
                pos = view.positions[lane]
                gone = torch.zeros_like(pos, dtype=torch.bool) if drop is None else drop[lane]
                kept.append(set(pos[(pos >= 0) & ~gone].tolist()))

    step_recording(core, record)
    assert len(kept) == core.kv.num_layers
    return kept


def _budget(ref: dict[str, Any]) -> int:
    return int(len(ref["prompt"]) * (1 - ref["compression_ratio"]))  # kvpress's n_kept


def _adakv(scores: torch.Tensor, k: int) -> list[set[int]]:
    """kvpress `AdaKVPress.compress`'s kept sets from per-head scores [H, n]."""
    h, n = scores.shape
    s = scores.clone()
    safe = int(k * ALPHA)
    s.scatter_(-1, s.topk(safe, dim=-1).indices, torch.finfo(s.dtype).max)
    pruned = (-s.reshape(-1)).topk(h * (n - k)).indices
    keep = torch.ones(h * n, dtype=torch.bool)
    keep[pruned] = False
    return [set(torch.nonzero(row).view(-1).tolist()) for row in keep.view(h, n)]


def _jaccard(a: set[int], b: set[int]) -> float:
    return len(a & b) / len(a | b)


def _scores(ref: dict[str, Any], name: str) -> list[torch.Tensor]:
    """kvpress's per-head scores [H, n] of each layer, as the policy ranks them: SnapKV
    scores the window above everything (kept), as its press does."""
    out = []
    for t in ref["scores"][name]:
        t = t.clone().float()
        if name == "snapkv":
            t[:, -ref["window"]:] = torch.finfo(t.dtype).max
        out.append(t)
    return out


CONFIGS = {
    "knorm": lambda k, ref: {"name": "knorm", "budget": k},
    "keydiff": lambda k, ref: {"name": "keydiff", "budget": k},
    "snapkv": lambda k, ref: {"name": "snapkv", "budget": k, "obs_window": ref["window"],
                              "kernel_size": 5, "sink": 0},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_head_keeps_the_top_of_its_own_press_score(ref, name: str) -> None:
    """uniform: lane (layer, h) keeps the top k of kvpress's head-h score (not the
    head mean): at least 95% agreement for every head (near ties between two
    transformers versions' rounding aside), and the heads of a layer keep different sets
    somewhere (else this would not tell per-head from per-layer)."""
    k = _budget(ref)
    kept = _kept_per_lane(ref, {**CONFIGS[name](k, ref), "heads": "uniform"})
    differ = False
    for layer, scores in enumerate(_scores(ref, name)):
        lanes = kept[layer * HEADS : (layer + 1) * HEADS]
        differ |= lanes[0] != lanes[1]
        for h, mine in enumerate(lanes):
            assert len(mine) == k, (name, layer, h, len(mine))
            theirs = set(scores[h].topk(k).indices.tolist())
            assert _jaccard(mine, theirs) >= 0.95, (name, layer, h, _jaccard(mine, theirs))
    assert differ, name


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_adaptive_keeps_what_adakv_press_keeps(ref, name: str) -> None:
    """adaptive: every head keeps what AdaKVPress keeps from kvpress's scores: the same
    count a head (up to a token moved by a near tie) and ≥ 95% of the same tokens; the
    layer as a whole keeps exactly H·k, and some layer's heads keep unequal counts."""
    k = _budget(ref)
    kept = _kept_per_lane(ref, {**CONFIGS[name](k, ref), "heads": "adaptive"})
    unequal = False
    for layer, scores in enumerate(_scores(ref, name)):
        lanes = kept[layer * HEADS : (layer + 1) * HEADS]
        assert sum(len(x) for x in lanes) == HEADS * k, (name, layer)
        unequal |= len(lanes[0]) != len(lanes[1])
        for h, (mine, theirs) in enumerate(zip(lanes, _adakv(scores, k))):
            assert abs(len(mine) - len(theirs)) <= 1, (name, layer, h, len(mine), len(theirs))
            assert _jaccard(mine, theirs) >= 0.95, (name, layer, h, _jaccard(mine, theirs))
            assert len(mine) >= int(k * ALPHA)
    assert unequal, name
