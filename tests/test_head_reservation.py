"""A bounded request's reservation on a per-head pool (`KVCacheManager.reservation` with
`slack_tokens`; scheduler/pool_shape.py `reserve_slack`): each lane reserves its bound,
the step's token and 16 tokens of room, not a whole page of room, so longer per-head pages
do not cost every lane a page; a request still never outgrows what it reserved."""

from __future__ import annotations

import json

import pytest
import torch

from engine.sampling import SamplingParams
from scheduler.engine_config import EngineConfig
from scheduler.llm import LLM
from scheduler.pool_shape import page_tokens
from tests.pools import run_within_reservations
from tests.tiny_models import make_tiny_model, resolved

GEN = 120
BOUNDED = [
    {"name": "knorm", "budget": 64},
    {"name": "tova", "budget": 64},
    {"name": "h2o", "budget": 64, "window": 8},
    {"name": "pyramid", "budget": 64, "obs_window": 8},  # lanes of different bounds
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


def _lanes(path: str) -> int:
    with open(f"{path}/config.json") as f:
        c = json.load(f)
    return c["num_hidden_layers"] * c["num_key_value_heads"]


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 250, (n,), generator=g).tolist()


def _gen() -> SamplingParams:
    return SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True, detokenize=False)


def test_a_lane_reserves_16_tokens_of_room_not_a_page(llama: str) -> None:
    """knorm at 64 tokens: 64 + 1 + 16 = 81 tokens a lane, 3 pages of 32 where a page of
    room would make it 4; a per-layer pool keeps its rule (a block of room: 6 of 16)."""
    lanes, cfg = _lanes(llama), {"name": "knorm", "budget": 64}
    got = {}
    for layout, bs in (("head", 32), ("layer", 16)):
        eng = LLM(llama, num_blocks=10_000, block_size=bs, kv_layout=layout).engine
        eng.add_request("r", _prompt(0, 24), _gen(), kv_policy=resolved(eng, cfg))
        got[layout] = eng.requests["r"].reserve_blocks
    assert got["head"] == lanes * 3
    assert got["layer"] == lanes // 2 * 6  # the tiny llama has 2 kv heads a layer


@pytest.mark.parametrize("cfg", BOUNDED, ids=lambda c: c["name"])
def test_per_head_requests_stay_within_their_reservation(llama: str, cfg: dict) -> None:
    """A pool of exactly `fits` reservations over 32-token per-head pages: as many run
    at once as it holds, none is preempted, none needs a page past its reservation
    (compacted before its room runs out while others wait), and all memory comes back."""
    probe = LLM(llama, num_blocks=10_000, block_size=32, kv_layout="head").engine
    probe.add_request("probe", _prompt(0, 24), _gen(), kv_policy=resolved(probe, cfg))
    reserve = probe.requests["probe"].reserve_blocks
    fits = 4
    eng = LLM(llama, num_blocks=fits * reserve, block_size=32, kv_layout="head").engine
    for i in range(12):
        eng.add_request(f"r{i}", _prompt(i, 24), _gen(), kv_policy=resolved(eng, cfg))
    assert run_within_reservations(eng) == fits


@pytest.mark.parametrize(("head_dim", "dtype", "full", "evicting"), [
    (32, torch.float32, 64, 32),    # the 3m model
    (64, torch.bfloat16, 64, 32),   # 160m
    (128, torch.bfloat16, 32, 16),  # Llama-3-8B
])
def test_an_evicting_default_policy_takes_shorter_pages(
        head_dim: int, dtype: torch.dtype, full: int, evicting: int) -> None:
    """A per-head pool whose requests evict by default (`--default-kv-policy`) takes
    pages of 4 KiB of K, one serving `full` 8 KiB."""
    shape = type("Shape", (), {"head_dim": head_dim})()
    for policy, tokens in (("full", full), ("snapkv", evicting),
                           ({"name": "knorm", "budget": 0.25}, evicting)):
        config = EngineConfig(model="m", kv_layout="head",
                              default_kv_policy=policy)  # type: ignore[arg-type]
        assert page_tokens(config, shape, dtype) == tokens  # type: ignore[arg-type]
