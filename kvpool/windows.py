"""Sliding-window lanes: what a windowed lane holds, and which prefix hits it can take.

Hybrid memory, as vLLM's hybrid KV cache manager (vllm/v1/core/single_type_kv_cache_manager.py,
`SlidingWindowManager`): a lane whose layer attends to a window of `w` positions keeps
only the pages that window still reaches, freed as it moves (`SeqCache.drop_before`),
and memory is counted that way everywhere a request's size is: admission, reservation,
preemption, the pool's size and the longest request it holds. A layer with no window
(a global layer) holds the whole context. A query at position p sees keys at
positions > p - w (`ModelConfig.sliding_windows`), so a chunk of n tokens from position
s needs positions s - w + 1 .. s + n - 1 in its windowed lanes, and the engine trims each
lane once its oldest page holds nothing any later query sees (`trim_positions`).

Prefix caching over such lanes (vLLM's `SlidingWindowManager.find_longest_cache_hit`):
a cached prefix of k pages is reusable only where every windowed lane still has the
pages the first query after it sees, those from position k·bs - w + 1 on; the pages
before that may be gone (`longest_hit`), and a hit takes no reference on them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# A "window" that never trims: the lanes of global layers.
NO_WINDOW = 2**62


def lane_windows(windows: Sequence[int | None], heads: int) -> list[int | None]:
    """Per lane (lane l·heads + h: a per-head pool's), its layer's window."""
    return [w for w in windows for _ in range(heads)]


def window_blocks(window: int, chunk: int, block_size: int) -> int:
    """The most pages a lane of `window` holds while chunks of up to `chunk` tokens are
    appended to it and it is trimmed after each: positions s - w + 1 .. s + chunk - 1,
    w + chunk - 1 of them, from wherever in its page the oldest one falls."""
    return -(-(window + max(1, chunk) - 2) // block_size) + 1


def lane_blocks(tokens: int, window: int | None, chunk: int, block_size: int) -> int:
    """Pages one lane holds at most over a request of `tokens` tokens."""
    whole = -(-tokens // block_size)
    return whole if window is None else min(whole, window_blocks(window, chunk, block_size))


def request_blocks(tokens: int, windows: Sequence[int | None], chunk: int,
                   block_size: int, bound: int | None = None) -> int:
    """Pages (all lanes) a request of `tokens` tokens holds at most, its prefill in
    chunks of at most `chunk`; `bound`: the most tokens a global lane keeps (a policy's)."""
    global_tokens = tokens if bound is None else min(tokens, bound)
    return sum(lane_blocks(global_tokens if w is None else tokens, w, chunk, block_size)
               for w in windows)


def longest_request(blocks: int, windows: Sequence[int | None], chunk: int,
                    block_size: int, most: int) -> int:
    """The longest request (up to `most` tokens) whose pages fit in `blocks`."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if request_blocks(mid, windows, chunk, block_size) <= blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


def vllm_block_lanes(windows: Sequence[int | None]) -> int:
    """The lanes one of vLLM's blocks spans, for reporting the pool in vLLM's units: every
    lane where all are of one kind; else, as vLLM's hybrid manager groups layers
    (vllm/v1/core/kv_cache_utils.py, `_get_kv_cache_groups_uniform_page_size`), the
    fewest lanes of one kind (one window, or global), or the most where that is under
    1.5 times the fewest (each group then that many lanes, a block one page of each)."""
    kinds: dict[int | None, int] = {}
    for w in windows:
        kinds[w] = kinds.get(w, 0) + 1
    fewest, most = min(kinds.values()), max(kinds.values())
    return most if most < 1.5 * fewest else fewest


def trim_positions(windows: torch.Tensor, computed: int) -> torch.Tensor:
    """[lanes] the first position each lane's later queries still see, once `computed`
    tokens are in (0 for global lanes): `windows` [lanes], NO_WINDOW for global ones."""
    return (computed + 1 - windows).clamp_(min=0)


def first_needed(hit_blocks: int, window: int, block_size: int) -> int:
    """The first page a windowed lane needs of a prefix hit of `hit_blocks` pages."""
    return max(0, hit_blocks * block_size - window + 1) // block_size


def longest_hit(groups: Sequence[tuple[int, ...]], windows: Sequence[int | None],
                block_size: int) -> int:
    """The longest prefix of `groups` (cached pages, one id a lane, -1 where a windowed
    lane's page is gone) a request can start from: k pages such that every windowed lane
    has its pages first_needed(k) .. k - 1 (vLLM scans for the same run from the right).
    Global lanes' pages are never missing from a group (publishing needs them all)."""
    k = len(groups)
    lanes = [i for i, w in enumerate(windows) if w is not None]
    if k == 0 or not lanes:
        return k
    present = torch.tensor(groups, dtype=torch.int64)[:, lanes] >= 0  # [k, m]
    j = torch.arange(k)[:, None]
    last_missing = torch.where(present, -1, j).cummax(dim=0).values
    run = j - last_missing  # present pages in a row ending at page j
    hits = torch.arange(1, k + 1)[:, None]
    w = torch.tensor([windows[i] for i in lanes])[None, :]
    need = hits - (hits * block_size - w + 1).clamp(min=0) // block_size
    ok = (run >= need).all(dim=1).nonzero()
    return int(ok[-1]) + 1 if ok.numel() else 0
