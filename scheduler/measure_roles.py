"""`kvserve head-roles`: the head roles of scheduler/head_roles.py measured on an
engine (the pass-key ablation its docstring describes) and saved beside the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.sampling import SamplingParams
from scheduler.head_roles import dumps, passkey_prompts, roles_path
from scheduler.llm import LLM


def compute_roles(llm: LLM, num_layers: int, num_kv_heads: int, prompts: int = 8,
                  length: int = 512, sink: int = 4, window: int = 64, seed: int = 0,
                  progress: bool = False) -> dict[str, Any]:
    """Every head's score by the ablation of scheduler/head_roles.py, on `llm` (a `scheduler.llm.LLM` over a
    per-head pool, prefix caching off, short prompt chunks); the roles file's content."""
    bos = getattr(llm.tokenizer, "bos_token_id", None)

    def encode(text: str) -> list[int]:
        return [t for t in llm.tokenizer.encode(text) if t != bos]

    cases = passkey_prompts(encode, prompts, length, seed)
    ids = [([bos] if bos is not None else []) + c for c, _ in cases]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

    def answer_logprobs(kv_policy: object) -> torch.Tensor:
        out = llm.generate(ids, params, kv_policy=kv_policy)
        return torch.tensor([sum(t.logprob for t in o.prompt_logprobs[-k:])
                             for o, (_, k) in zip(out, cases)])

    full = answer_logprobs("full")
    lanes = num_layers * num_kv_heads
    drops = torch.zeros(lanes)
    for lane in range(lanes):
        duo = {"name": "duo", "streaming_heads": [lane], "sink": sink, "window": window}
        drops[lane] = (full - answer_logprobs(duo)).mean()
        if progress:
            print(f"  lane {lane} (layer {lane // num_kv_heads}, kv head "
                  f"{lane % num_kv_heads}): answer log-likelihood drop {drops[lane]:.4f}",
                  flush=True)
    scores = drops.clamp(min=0)
    if float(scores.max()) > 0:
        scores = scores / scores.max()
    return {"format": 1, "method": "pass-key ablation (scheduler/head_roles.py)",
            "num_layers": num_layers, "num_kv_heads": num_kv_heads, "prompts": prompts,
            "length": length, "sink": sink, "window": window, "seed": seed,
            "answer_logprob_full": round(float(full.mean()), 5),
            "drops": [[round(float(x), 6) for x in row]
                      for row in drops.view(num_layers, num_kv_heads)],
            "scores": [[round(float(x), 6) for x in row]
                       for row in scores.view(num_layers, num_kv_heads)]}


def measure_and_save(model: str, engine_kwargs: dict[str, Any], out: str | None = None,
                     chunk: int = 32, **kw: Any) -> Path:
    """`kvserve head-roles`: the roles of `model` measured on a per-head pool (prefix
    caching off: every ablation computes its own K/V; prompt chunks of `chunk` tokens)
    and written to `out` (default: beside the model). Returns the path."""
    args = {**engine_kwargs, "kv_layout": "head", "enable_prefix_caching": False,
            "max_num_batched_tokens": chunk}
    llm = LLM(model, **args)
    mc = llm.engine.model_config
    roles = compute_roles(llm, mc.num_layers, mc.num_kv_heads, progress=True, **kw)
    path = Path(out) if out else roles_path(model)
    path.write_text(dumps(roles))
    return path
