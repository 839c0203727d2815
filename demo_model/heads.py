"""How different a model's kv heads are, as a per-head KV cache sees them.

    python -m demo_model.heads --model engine/demo/model --model engine/demo/model_kv4 \\
        --expanded 4 --out results/demo_model_heads.json

For each prompt and layer, each kv head ranks the prompt as SnapKV does (arXiv:2404.14469:
the attention of the last ``window`` queries, summed over the head's query group, pooled
over neighbouring positions with ``policies.snapkv.pool_scores``) and keeps its top share of
the tokens before the window. Two heads of one layer that keep the same set gain nothing from
``--kv-layout head``; the figure is the mean Jaccard overlap of those kept sets over pairs of
heads of a layer (1 = identical, ≈ k / (2n - k) for random sets). The spread (std over a
layer's query heads) of the mean attention entropy is a second, policy-free measure.

``--expanded N`` adds the first model with its kv heads copied to N (``expand_heads``):
the same function, so what its overlaps show beyond the original's comes from splitting the
query groups alone, and an uptrained variant is compared with that starting point.
Prompts: held-out stdlib code (``demo_model.data``) and pass-key documents, fixed seeds.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np
import torch

from demo_model.data import ANSWER
from demo_model.evaluate import load_eval_data
from demo_model.expand_heads import expand_kv_heads
from policies.snapkv import pool_scores


def prompts(model_dir: Path, n: int, length: int, seed: int = 0) -> dict[str, list[list[int]]]:
    """``n`` held-out code windows and ``n`` pass-key prompts (text filler), ``length`` tokens."""
    data = load_eval_data(model_dir)
    code = [i for s, _, ids in data.heldout if s == "code" for i in ids]
    starts = np.linspace(0, len(code) - length, n).astype(int)
    rng = np.random.default_rng(seed)
    answer = len(data.recall.encode(ANSWER.format(value="12345")))  # as evaluate.needle
    keys = [data.recall.passkey(rng, length + answer, float(d), "text") for d in np.linspace(0, 1, n)]
    return {"heldout": [[data.bos_id, *code[s:s + length - 1]] for s in starts],
            "passkey": [k.ids[:k.prompt_len] for k in keys]}


@torch.inference_mode()
def measure(model, batches: dict[str, list[list[int]]], keep: float, window: int,
            kernel: int, origin: int) -> dict:
    """Per prompt set and layer: mean kept-set Jaccard over kv-head pairs, and the spread of
    the query heads' attention entropy. With more kv heads than ``origin`` (the model it was
    expanded from) also the overlap of sibling pairs (copies of one original head)."""
    cfg = model.config
    hkv, group = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    out: dict = {}
    for name, rows in batches.items():
        jac = np.zeros((cfg.num_hidden_layers, hkv, hkv))
        ent_std = np.zeros(cfg.num_hidden_layers)
        for ids in rows:
            att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
            t = len(ids)
            n, k = t - window, int(keep * t) - window
            for layer, a in enumerate(att):  # a: [1, Hq, T, T]
                score = a[0, :, -window:, :n].sum(1).view(hkv, group, n).sum(1)
                kept = [set(pool_scores(s, kernel).topk(k).indices.tolist()) for s in score]
                for i, j in itertools.product(range(hkv), repeat=2):
                    jac[layer, i, j] += len(kept[i] & kept[j]) / len(kept[i] | kept[j]) / len(rows)
                p = a[0].clamp_min(1e-12)
                ent = -(p * p.log()).sum(-1).mean(-1)  # [Hq]: mean over queries
                ent_std[layer] += ent.std().item() / len(rows)
        pairs = list(itertools.combinations(range(hkv), 2))
        out[name] = {
            "kv_heads": hkv, "kept": k, "scored": n,
            "random_overlap": k / (2 * n - k),
            "overlap_by_layer": [float(np.mean([jac[li, i, j] for i, j in pairs]))
                                 for li in range(cfg.num_hidden_layers)],
            "overlap_matrix": jac.round(3).tolist(),
            "entropy_std_by_layer": ent_std.round(4).tolist(),
        }
        out[name]["overlap"] = float(np.mean(out[name]["overlap_by_layer"]))
        rep = hkv // origin
        if rep > 1:
            sib = [(i, j) for i, j in pairs if i // rep == j // rep]
            out[name]["sibling_overlap"] = float(np.mean(jac[:, [i for i, _ in sib], [j for _, j in sib]]))
            out[name]["cross_overlap"] = float(np.mean(
                jac[:, [i for i, j in pairs if (i, j) not in sib], [j for i, j in pairs if (i, j) not in sib]]))
    return out


def main(argv: list[str] | None = None) -> None:
    from transformers import LlamaForCausalLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, action="append", required=True)
    ap.add_argument("--expanded", type=int, default=0,
                    help="also the first --model with its kv heads copied to this many")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--keep", type=float, default=0.25, help="share of the prompt kept")
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--kernel", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = prompts(args.model[0], args.prompts, args.length)

    def load(path: Path):
        return LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                attn_implementation="eager").eval()

    models = [(str(p), load(p)) for p in args.model]
    if args.expanded:
        m = load(args.model[0])
        expand_kv_heads(m, args.expanded)
        models.insert(1, (f"{args.model[0]} expanded to {args.expanded} kv heads", m))
    origin = models[0][1].config.num_key_value_heads
    res = {"settings": {k: v for k, v in vars(args).items() if k not in ("model", "out")},
           "models": {name: measure(m, batches, args.keep, args.window, args.kernel, origin)
                      for name, m in models}}
    for name, r in res["models"].items():
        for prompt_set, v in r.items():
            print(f"{name}: {prompt_set} overlap {v['overlap']:.3f} by layer "
                  f"{[round(x, 3) for x in v['overlap_by_layer']]} (random {v['random_overlap']:.3f}, "
                  f"siblings {v.get('sibling_overlap', float('nan')):.3f}); "
                  f"entropy std {v['entropy_std_by_layer']}")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
