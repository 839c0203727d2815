"""How much of the attention an attention-free score keeps, on the demo model (issue 20).

Why: knorm, keydiff and paged_eviction never look at attention; they bet that a score
read from the cache — −‖K‖ (Devoto et al., via 001_01037b507c6df960.txt §4.1: "the L2
norm of each Key token is inversely proportional to the cumulative attention score"),
−cos(K, mean K) (KeyDiff) or ‖V‖/‖K‖ (001 Alg. 1) — ranks tokens as attention would.
Where a policy loses perplexity, this says whether the bet holds on this model: for the
held-out windows of the quality table, each layer's prompt keys (post-RoPE, as cached;
a rotation keeps ‖K‖, so the norms are the same before RoPE) are scored, the top
`budget` kept as the policy's prompt plan keeps them (head mean, one set per layer),
and we measure the attention the last `queries` prompt queries give to the kept set
("recall": 1 = the kept set holds all of it), beside streaming's set (sink 4 + the most
recent) and the first token's share (is there an attention sink to protect?).

    python -m benchmarks.score_attention --out results/score_attention_demo.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from benchmarks.policy_eval import SINK, load_data, ppl_windows


def kept_sets(keys: torch.Tensor, values: torch.Tensor, budget: int) -> dict[str, torch.Tensor]:
    """[B, n] bool per policy: the `budget` tokens each score keeps (head mean), keys and
    values [B, Hkv, n, D] as cached."""
    n = keys.shape[2]
    kn = keys.norm(dim=-1).mean(1)
    unit = F.normalize(keys, dim=-1)
    anchor = F.normalize(unit.mean(dim=2, keepdim=True), dim=-1)
    scores = {"knorm": -kn, "paged_eviction": (values.norm(dim=-1) / keys.norm(dim=-1)).mean(1),
              "keydiff": -(unit * anchor).sum(-1).mean(1)}
    out = {}
    for name, s in scores.items():
        mask = torch.zeros_like(s, dtype=torch.bool)
        out[name] = mask.scatter(1, s.topk(budget, dim=1).indices, True)
    stream = torch.zeros(keys.shape[0], n, dtype=torch.bool)
    stream[:, :SINK] = True
    stream[:, n - (budget - SINK):] = True
    out["streaming"] = stream
    return out


@torch.no_grad()
def measure(model_dir: str, windows: int, prompt: int, fractions: list[float],
            queries: int) -> dict:
    from transformers import AutoModelForCausalLM

    data = load_data(model_dir)
    ids = torch.tensor([w[:prompt] for w in ppl_windows(data, windows, 768)])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    out = model(ids, output_attentions=True, use_cache=True)
    res: dict = {"windows": len(ids), "prompt": prompt, "queries": queries, "layers": []}
    for layer, att in enumerate(out.attentions):
        cache = out.past_key_values.layers[layer]
        got = att[:, :, -queries:, :].mean(dim=(1, 2))  # [B, n]: attention received
        row = {"layer": layer, "first_token_share": float(got[:, 0].mean()), "recall": {}}
        for frac in fractions:
            budget = round(frac * 768)  # the quality table's budget (of the window)
            sets = kept_sets(cache.keys, cache.values, budget)
            row["recall"][str(frac)] = {k: float((got * m).sum(1).mean()) for k, m in sets.items()}
        res["layers"].append(row)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo-model", default="engine/demo/model")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--fractions", default="0.25,0.5")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from loadtest.fingerprint import fingerprint

    res = {"command": "python -m benchmarks.score_attention " + " ".join(sys.argv[1:]),
           "fingerprint": fingerprint(),
           **measure(args.demo_model, args.windows, args.prompt,
                     [float(x) for x in args.fractions.split(",")], args.queries)}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
    names = list(res["layers"][0]["recall"][args.fractions.split(",")[0]])
    print("| layer | first-token share | budget | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for r in res["layers"]:
        for frac, rec in r["recall"].items():
            print(f"| {r['layer']} | {r['first_token_share']:.3f} | {float(frac):.0%} | "
                  + " | ".join(f"{rec[k]:.2f}" for k in names) + " |")


if __name__ == "__main__":
    main()
