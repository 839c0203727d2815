"""Our policies against NVIDIA kvpress, the reference implementations (issue 20).

tests/data/kvpress_demo.pt holds the scores kvpress 0.5.5 computed on the demo model
for one 192-token prompt (`benchmarks/kvpress_reference.py`, run in kvpress's own venv:
it pins an older transformers). Here the same prompt runs through our engine, each
policy configured as the press at compression ratio 0.5, and we compare what the policy
saw and chose at the end of the prompt:

- scores: kvpress scores per kv head, we keep one set per layer; each of our scores is
  kvpress's reduced the way the policy documents (mean over kv heads; for snapkv and h2o
  up to the constant of a sum instead of a mean), so they must agree to float error;
- kept sets: ours must be the top of kvpress's head-mean score (exact up to near ties
  between two transformers versions' float rounding), and for streaming kvpress's set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.demo import DEMO_MODEL_DIR
from engine.sampling import SamplingParams
from policies.base import head_mean
from policies.norms import knorm_scores
from policies.rows import RowsView
from policies.snapkv import pool_scores
from scheduler.engine_core import EngineConfig, EngineCore
from scheduler.resolve import resolve_request
from tests.policy_recording import step_recording
from tests.policy_views import LayersView, LayerView

REFERENCE = Path(__file__).parent / "data" / "kvpress_demo.pt"


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    return torch.load(REFERENCE)


@pytest.fixture(scope="module")
def ours(ref: dict[str, Any]) -> dict[str, tuple[LayersView, dict[int, torch.Tensor]]]:
    return run_ours(ref)


def run_ours(ref: dict[str, Any]) -> dict[str, tuple[LayersView, dict[int, torch.Tensor]]]:
    """Per policy: what its `select` saw when the prompt completed (as one request's
    per-layer view) and its plan."""
    n = len(ref["prompt"])
    kept = int(n * (1 - ref["compression_ratio"]))  # kvpress compute_n_kept
    configs = {
        "streaming": {"name": "streaming", "sink": 4, "window": kept - 4},
        "knorm": {"name": "knorm", "budget": kept},
        "keydiff": {"name": "keydiff", "budget": kept},
        "tova": {"name": "tova", "budget": kept},
        "snapkv": {"name": "snapkv", "budget": kept, "obs_window": ref["window"],
                   "kernel_size": 5},
        "h2o": {"name": "h2o", "budget": n},  # scores only: nothing evicted
    }
    # On the CPU whatever else the machine has: the references were recorded there, and
    # the comparisons are exact up to fp32 rounding of one device.
    core = EngineCore(EngineConfig(model=str(DEMO_MODEL_DIR), num_blocks=1024, device="cpu",
                                   enable_prefix_caching=False))
    seen: dict[str, tuple[LayersView, dict[int, torch.Tensor]]] = {}
    names: dict[type, str] = {}  # the request of each policy class (one each)
    for name, cfg in configs.items():
        core.add_request(name, ref["prompt"], SamplingParams(max_tokens=2),
                         kv_policy=resolve_request(core.limits, cfg).kv_policy)
        names[type(core.requests[name].policy)] = name
    assert len(names) == len(configs)

    def record(cls: type, view: RowsView, drop: torch.Tensor | None) -> None:
        if view.prefill_done[0]:
            seen[names[cls]] = _as_step(view, drop)

    step_recording(core, record)
    assert set(seen) == set(configs)
    return seen


def _as_step(view: RowsView, drop: torch.Tensor | None) -> tuple[LayersView, dict[int, torch.Tensor]]:
    """One request's rows (a group of one: every policy here has its own) as the
    per-layer view and plan {layer: dropped positions}."""
    assert view.num_requests == 1
    layers, plan = [], {}
    for layer in range(view.num_layers):
        live = view.live[layer]
        pos = view.positions[layer][live]
        layers.append(LayerView(
            positions=pos,
            attention=None if view.attention is None else view.attention[layer][..., live],
            key_norm=None if view.key_norm is None else view.key_norm[layer][live],
            keys=None if view.keys is None else view.keys[layer][live],
            key_diversity=None if view.key_diversity is None else view.key_diversity[layer][live]))
        if drop is not None and bool(drop[layer].any()):
            plan[layer] = view.positions[layer][drop[layer]]
    return LayersView(seq_len=view.seq_len[0], prompt_len=view.prompt_len[0],
                    num_new=view.num_new, prefill_done=view.prefill_done[0],
                    block_size=view.block_size, layers=layers), plan


def _kept(view: LayersView, plan: dict[int, torch.Tensor], layer: int) -> set[int]:
    pos = view.layers[layer].positions
    drop = plan.get(layer, pos[:0])
    return set(pos[~torch.isin(pos, drop)].tolist())


def _top(scores: torch.Tensor, k: int) -> set[int]:
    return set(scores.topk(k).indices.tolist())


def _jaccard(a: set[int], b: set[int]) -> float:
    return len(a & b) / len(a | b)


def _check_selection(name: str, ref, ours, reduce) -> None:
    """Our score == kvpress's reduced (`reduce`: layer view -> (ours, theirs)), and our
    kept set is the top of kvpress's reduced score."""
    view, plan = ours[name]
    n = len(ref["prompt"])
    k = int(n * (1 - ref["compression_ratio"]))
    for layer, lv in enumerate(view.layers):
        theirs = ref["scores"][name][layer]  # [Hkv, n]
        mine, reduced = reduce(lv, theirs)
        torch.testing.assert_close(mine, reduced, atol=2e-4, rtol=2e-3)
        agreement = _jaccard(_kept(view, plan, layer), _top(theirs.mean(dim=0), k))
        assert agreement >= 0.95, (name, layer, agreement)


def test_streaming_keeps_what_streaming_llm_press_keeps(ref, ours) -> None:
    view, plan = ours["streaming"]
    k = int(len(ref["prompt"]) * (1 - ref["compression_ratio"]))
    for layer in range(len(view.layers)):
        for head in ref["scores"]["streaming"][layer]:
            assert _kept(view, plan, layer) == _top(head, k)


def test_knorm_scores_are_knorm_press_head_mean(ref, ours) -> None:
    _check_selection("knorm", ref, ours,
                     lambda lv, t: (knorm_scores(lv.key_norm), t.mean(dim=0)))


def test_keydiff_scores_are_keydiff_press_head_mean(ref, ours) -> None:
    """The engine's scores (the pool's C++ op where it is built, else keydiff_scores)."""
    _check_selection("keydiff", ref, ours,
                     lambda lv, t: (lv.key_diversity, t.mean(dim=0)))


def test_tova_scores_are_tova_press(ref, ours) -> None:
    """TOVAPress scores the last query's head-averaged attention over every token but
    the newest (which it pins, as we protect it): the same for every kv head."""
    def reduce(lv: LayerView, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert lv.attention is not None
        return head_mean(lv.attention[-1:])[0, :-1], t[0, :-1]
    _check_selection("tova", ref, ours, reduce)


def test_snapkv_scores_are_snapkv_press_head_mean(ref, ours) -> None:
    """SnapKVPress averages over the window's queries and each group's heads where we
    sum: our pooled score is (window x group) times its head mean, before the window."""
    w = ref["window"]

    def reduce(lv: LayerView, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert lv.attention is not None
        groups = 8 // t.shape[0]  # the demo model: 8 query heads over 2 kv heads
        acc = lv.attention[-w:].sum(dim=0)[:, :-w]  # [Hkv, body]
        mine = pool_scores(acc, 5).mean(dim=0) / (w * groups)
        return mine, t.mean(dim=0)[:-w]
    _check_selection("snapkv", ref, ours, reduce)


def test_h2o_accumulates_what_observed_attention_press_observes(ref, ours) -> None:
    """ObservedAttentionPress divides each token's summed attention by the number of
    queries that saw it and averages heads; H2O (and 003) keep the raw sum over all
    heads, on purpose (docs/policies.md): the sums must agree after that division."""
    view, _ = ours["h2o"]
    n = len(ref["prompt"])
    seen_by = torch.arange(n, 0, -1, dtype=torch.float32)
    for layer, lv in enumerate(view.layers):
        assert lv.attention is not None
        heads = lv.attention[0].sum().round()  # each query row sums to H over kv groups
        mine = lv.attention.sum(dim=(0, 1)) / seen_by / heads
        torch.testing.assert_close(mine, ref["scores"]["observed_attention"][layer].mean(dim=0),
                                   atol=2e-5, rtol=2e-3)
