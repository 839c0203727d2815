"""bench_policies on a per-head pool (issue 65): which runs, and what each reports.

A per-head pool (`EngineConfig(kv_layout="head")`) makes a page one (layer, kv head)'s
K/V, so each kv head keeps and frees its own tokens. bench_policies runs a policy there
as "<policy>:<way>" (`policy_eval.variant`): `:head` (kv_policy `heads` uniform),
`:adaptive` (AdaKV, the policies that rank by score) or `:shared` (one set a layer, as
the per-layer pool keeps), and `full` as `full:head`; the pool gets the same bytes as
the per-layer run's (`bench_policies._engine`: the kv-head count × the pages).

- `expand`: `--heads` read into those names beside `--policies`' own;
- `memory`: a run's KV memory by the pool's own counts (pages and bytes at each
  request's peak, and what eviction gave back to the pool);
- `vs_layer`: each per-head row's tok/s over the same policy's per-layer row.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.policy_eval import ADAPTIVE_POLICIES, HEAD_WAYS


def expand(a: argparse.Namespace) -> str | None:
    """`a.heads` ("head,adaptive,...") into a list, its ways of every plain policy of
    `a.policies` that has them appended there (adaptive: `ADAPTIVE_POLICIES` only),
    `full:<way>` moved from the policies to `a.baselines` (and `head` there when
    `a.heads` has it); returns what is wrong, or None."""
    a.heads = [x for x in a.heads.split(",") if x]
    if set(a.heads) - set(HEAD_WAYS):
        return f"--heads: choose from {', '.join(HEAD_WAYS)}"
    # each policy's ways right after it, so they run minutes apart at most, not a round
    a.policies = [y for x in a.policies for y in [x, *(
        f"{x}:{w}" for w in a.heads if ":" not in x and x != "full"
        and (w != "adaptive" or x in ADAPTIVE_POLICIES))]]
    a.baselines += ["head"] * ("head" in a.heads)
    a.baselines += [x[5:] for x in a.policies if x.startswith("full:")]
    # full:head right after full, as each policy's ways after it
    a.baselines = sorted(dict.fromkeys(a.baselines), key=lambda b: b != "head")
    a.policies = [x for x in dict.fromkeys(a.policies) if not x.startswith("full:")]
    return None


def memory(st: object, recs: list[dict], policy: str, layout: str) -> dict:
    """A run's KV memory by the pool's own counts (`st`: its EngineStats, warm-up taken
    off; `recs`: `bench_common.drive`'s requests): the pool's pages (one layer's every kv
    head, or one (layer, kv head)) and their bytes, each request's peak (mean) in pages
    and bytes, what the policy's evictions gave back to the pool (pages, bytes: what a
    waiting request can be admitted into), evicted tokens a request (its slots over
    the tables' lanes), and over a per-head pool the fewest and most live tokens among a
    request's (layer, kv head) lanes at its end (means over requests: how unevenly its
    heads kept tokens)."""
    page = st.block_bytes  # type: ignore[attr-defined]
    freed = st.freed_blocks_by_policy_total.get(policy, 0)  # type: ignore[attr-defined]
    peak = sum(x["peak_blocks"] for x in recs) / len(recs)
    return {"kv_layout": layout, "page_bytes": page,
            "pool_pages": st.blocks_total,  # type: ignore[attr-defined]
            "mean_peak_pages": peak, "mean_peak_bytes": peak * page, "freed_pages": freed,
            "freed_bytes": freed * page,
            "mean_evicted_tokens": sum(x["evicted_tokens"] for x in recs) / len(recs),
            **{f"mean_{k}": sum(x.get(k, 0) for x in recs) / len(recs)
               for k in ("head_live_min", "head_live_max")}}


def tok_s(r: dict) -> float:
    """A row's output tok/s: the median of its rounds (`--rounds`), or its one run's."""
    return statistics.median(x["tok_s"] for x in r.get("rounds") or [r])


def vs_layer(policies: dict[str, dict]) -> None:
    """On every row, over its policy's per-layer row of the same run (`full:head` over
    `full`), None elsewhere or without one: `tok_s_vs_layer`, the medians of their rounds'
    tok/s; `of_ceiling_vs_layer`, of their shares of the ceiling measured right before
    and after each run (the machine's drift between the two runs taken out)."""
    for name, r in policies.items():
        base, _, way = name.partition(":")
        layer = policies.get(base) if way in HEAD_WAYS else None
        r["tok_s_vs_layer"] = tok_s(r) / tok_s(layer) if layer else None
        r["of_ceiling_vs_layer"] = (r["of_ceiling_median"] / layer["of_ceiling_median"]
                                    if layer and "of_ceiling_median" in r else None)
