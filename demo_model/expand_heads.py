"""Give a GQA Llama more KV heads without changing what it computes (uptraining's first step).

In grouped-query attention (arXiv:2305.13245) query head ``h`` reads kv head
``h // (num_heads // num_kv_heads)``. Going from ``K`` to ``N`` kv heads (``N`` a multiple of
``K`` dividing ``num_heads``) copies each kv head's ``k_proj`` / ``v_proj`` rows to the ``N / K``
new heads that its query heads now map to, so every query head still sees the same keys and
values and the logits are unchanged. The GQA paper goes the other way (mean-pooling MHA heads
into groups and uptraining); here the copies start identical and continued training makes them
diverge, which gives the per-head KV policies (``kv_policy.heads``) heads that differ more.

The committed variant ``engine/demo/model_kv4`` (4 kv heads, 2 query heads each) was made from
the demo model with stage 2 of ``demo_model.train`` (one thread, seed 1234)::

    python -m demo_model.train --init-from engine/demo/model --expand-kv-heads 4 --stage2 \\
        --fp32 --steps 500 --minutes 48 --out engine/demo/model_kv4 --plot runs/kv4/loss.png
    python -m demo_model.evaluate --model engine/demo/model_kv4

``python -m demo_model.expand_heads SRC OUT --kv-heads N`` writes the expanded model without
training (the starting point of that run).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def expand_kv_heads(model, num_kv_heads: int) -> None:
    """In place: ``model`` (an HF ``LlamaForCausalLM``) gets ``num_kv_heads`` kv heads."""
    cfg = model.config
    old, heads = cfg.num_key_value_heads, cfg.num_attention_heads
    if num_kv_heads == old:
        return
    if num_kv_heads < old or num_kv_heads % old or heads % num_kv_heads:
        raise ValueError(f"--expand-kv-heads {num_kv_heads}: must be a multiple of the model's "
                         f"{old} kv heads that divides its {heads} query heads")
    rep = num_kv_heads // old
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    for layer in model.model.layers:
        attn = layer.self_attn
        for name in ("k_proj", "v_proj"):
            proj: torch.nn.Linear = getattr(attn, name)
            new = torch.nn.Linear(proj.in_features, num_kv_heads * head_dim,
                                  bias=proj.bias is not None, dtype=proj.weight.dtype)
            with torch.no_grad():
                # kv head j's rows, repeated for the rep new heads that take its query heads
                w = proj.weight.view(old, head_dim, -1).repeat_interleave(rep, dim=0)
                new.weight.copy_(w.reshape(num_kv_heads * head_dim, -1))
                if proj.bias is not None:
                    new.bias.copy_(proj.bias.view(old, head_dim).repeat_interleave(rep, dim=0).flatten())
            setattr(attn, name, new)
        attn.num_key_value_groups = heads // num_kv_heads
    cfg.num_key_value_heads = num_kv_heads


def main(argv: list[str] | None = None) -> None:
    from transformers import LlamaForCausalLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="HF model directory (e.g. engine/demo/model)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--kv-heads", type=int, required=True)
    args = ap.parse_args(argv)
    model = LlamaForCausalLM.from_pretrained(str(args.src), dtype=torch.float32)
    expand_kv_heads(model, args.kv_heads)
    model.save_pretrained(str(args.out), safe_serialization=True)
    for name in TOKENIZER_FILES:  # verbatim: the same tokenizer and chat template
        if (args.src / name).is_file():
            shutil.copy(args.src / name, args.out / name)

if __name__ == "__main__":
    main()
