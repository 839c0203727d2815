"""paged_eviction (001 Algorithms 1-3): token eviction to the budget at the end of the
prompt, then whole-block drops only when the newest block fills and n > budget."""

import torch

from policies.catalog import build_policy
from policies.paged_eviction import token_scores
from tests.policy_views import LayerView, arange, run_step, view

BS = 4


class Harness:
    """One layer, one kv head; ‖K‖ = 1 so S_i = ‖V_i‖ = value[pos]."""

    def __init__(self, budget, values: dict[int, float], **cfg):
        self.policy = build_policy({"name": "paged_eviction", "budget": budget, **cfg})
        self.values = values
        self.live = arange(0)
        self.seq = 0

    def step(self, num_new: int, prompt_len: int) -> list[int] | None:
        new = torch.arange(self.seq, self.seq + num_new)
        done = self.seq < prompt_len <= self.seq + num_new
        self.seq += num_new
        self.live = torch.cat([self.live, new])
        vn = torch.tensor([[self.values.get(int(p), 1.0)] for p in self.live])
        lv = LayerView(positions=self.live, key_norm=torch.ones_like(vn), value_norm=vn)
        plan = run_step(self.policy, view([lv], self.seq, prompt_len, num_new, done, BS))
        if 0 not in plan:
            return None
        self.live = self.live[~torch.isin(self.live, plan[0])]
        return plan[0].tolist()


PROMPT_VALUES = {0: 5, 1: 1, 2: 7, 3: 2, 4: 9, 5: 3, 6: 8, 7: 0.5, 8: 6, 9: 4}


def test_token_score_is_value_over_key_norm_mean_over_heads():
    vn = torch.tensor([[2.0, 4.0], [1.0, 1.0]])
    kn = torch.tensor([[1.0, 2.0], [4.0, 0.5]])
    assert torch.allclose(token_scores(vn, kn), torch.tensor([2.0, 1.125]))


def test_prefill_drops_lowest_ratio_down_to_budget_only_when_prompt_done():
    h = Harness(6, PROMPT_VALUES)
    assert h.step(6, prompt_len=10) is None  # first chunk: prompt not complete
    assert h.step(4, prompt_len=10) == [1, 3, 5, 7]  # E = L - C = 4 lowest ‖V‖/‖K‖
    assert h.live.tolist() == [0, 2, 4, 6, 8, 9]


def test_decode_drops_lowest_block_when_newest_block_fills():
    values = dict(PROMPT_VALUES) | {10: 0.1, 11: 0.2, 14: 9, 15: 9}
    h = Harness(6, values)
    h.step(10, prompt_len=10)  # kept order [0, 2, 4, 6, 8, 9]: n = 6
    assert h.step(1, 10) is None  # n = 7: newest block (kept 4..7) not full
    # n = 8 fills it; 8 > 6: blocks [0,2,4,6] mean 7.25 vs [8,9,10,11] mean 2.575
    assert h.step(1, 10) == [8, 9, 10, 11]
    assert h.live.tolist() == [0, 2, 4, 6]
    for _ in range(3):
        assert h.step(1, 10) is None  # n = 5, 6, 7
    # n = 8: [0,2,4,6] mean 7.25 vs [12,13,14,15] mean (1+1+9+9)/4 = 5 -> drop the newer
    assert h.step(1, 10) == [12, 13, 14, 15]


def test_older_block_goes_when_it_scores_lowest():
    values = dict(PROMPT_VALUES) | {10: 10, 11: 10}
    h = Harness(6, values)
    h.step(10, prompt_len=10)
    h.step(1, 10)
    # [0,2,4,6]: 7.25 < [8,9,10,11]: (6+4+10+10)/4 = 7.5
    assert h.step(1, 10) == [0, 2, 4, 6]
    assert h.live.tolist() == [8, 9, 10, 11]


def test_no_block_drop_while_within_budget():
    h = Harness(12, PROMPT_VALUES)
    assert h.step(10, prompt_len=10) is None  # 10 <= 12
    assert h.step(1, 10) is None and h.step(1, 10) is None  # n = 12 fills a block, not > C
    for _ in range(3):
        assert h.step(1, 10) is None
    assert h.step(1, 10) is not None  # n = 16 > 12
    assert h.live.numel() == 12


def test_live_count_oscillates_within_budget_plus_block():
    h = Harness(6, {})
    h.step(10, prompt_len=10)
    sizes = []
    for _ in range(40):
        h.step(1, 10)
        sizes.append(h.live.numel())
    assert max(sizes) == 7 and min(sizes) == 4  # between 4 and C + B - 1 = 9, here 7
    assert h.policy.max_live(50, 10) == 9  # block size learnt from the views
    assert h.policy.max_live(50, 10, BS) == 9


def test_ratio_budget_resolves_on_sequence_length():
    h = Harness(0.5, PROMPT_VALUES)
    h.step(10, prompt_len=10)  # C = 5: keep 9, 8, 7, 6, 5 valued tokens
    assert h.live.tolist() == [0, 2, 4, 6, 8]


def test_block_drops_of_packed_rows_match_rows_with_holes():
    """`_block_drops` skips its sort when every row is packed (the engine's steady state
    with `compact`): the same tokens in kept order, packed or with holes between them,
    lose the same logical blocks."""
    from policies.paged_eviction import _block_drops

    g = torch.Generator().manual_seed(0)
    n_rows, w, bs = 6, 64, 4
    lengths = torch.randint(20, 40, (n_rows,), generator=g).tolist()
    drop = [1, 2, 0, 3, 1, 1]
    values = [torch.rand(n, generator=g) for n in lengths]
    packed_live = torch.arange(w) < torch.tensor(lengths)[:, None]
    packed = torch.zeros(n_rows, w)
    holes_live = torch.zeros(n_rows, w, dtype=torch.bool)
    holes = torch.zeros(n_rows, w)
    for i, v in enumerate(values):
        packed[i, : lengths[i]] = v
        slots = torch.sort(torch.randperm(w, generator=g)[: lengths[i]]).values
        holes_live[i, slots] = True
        holes[i, slots] = v
    a = _block_drops(packed, packed_live, lengths, bs, drop)
    b = _block_drops(holes, holes_live, lengths, bs, drop)
    for i in range(n_rows):  # dropped kept-order ranks
        assert a[i, packed_live[i]].tolist() == b[i, holes_live[i]].tolist()
        assert int(a[i].sum()) == bs * drop[i]


def test_window_keeps_the_recent_tokens_and_blocks():
    """`window` (not in 001; default 0): the last tokens are never candidates — in the
    prompt plan, and in decode every block overlapping them."""
    values = PROMPT_VALUES | {9: 0.1}
    plain = Harness(6, values)
    assert plain.step(10, prompt_len=10) == [1, 3, 7, 9]  # 9 scores lowest
    h = Harness(6, values, window=2)
    assert h.step(10, prompt_len=10) == [1, 3, 5, 7]  # 8, 9 protected
    assert h.step(1, 10) is None  # n = 7
    # n = 8: [8, 9, 10, 11] (mean 2.03) holds the window (10, 11): the older block goes
    assert h.step(1, 10) == [0, 2, 4, 6]
    assert h.live.tolist() == [8, 9, 10, 11]
