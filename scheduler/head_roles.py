"""The served model's head roles: which (layer, kv head) pairs a long context needs
(retrieval heads) and which do with the attention sinks and a recent window (streaming
heads), for `duo` (policies/duo_attention.py; DuoAttention, arXiv 2410.10819).

`kvserve head-roles` measures them on synthetic pass-key prompts (the grass-is-green
filler and pass-key sentence of Mohtashami & Jaggi's test, which DuoAttention trains its
gates on): for every prompt the log-likelihood of the pass key's answer, teacher-forced,
with every head keeping everything, then with one head at a time streaming (its own
`duo` request, `streaming_heads: [lane]`, on a per-head pool whose short prompt chunks
make the answer attend after the head dropped the middle). A head's score is the mean
drop of that log-likelihood, clipped at 0 and divided by the largest: 1 = the head the
answer needs most. DuoAttention defines a retrieval head the same way (one whose
restriction to sinks + window changes the output most) and learns a gate per head by
distillation instead; the ablation costs one prompt pass per head and prompt.

The scores are saved as `kv_head_roles.json` beside the model and loaded when a server
with `--kv-layout head` starts (`load_roles`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from engine.sampling import SamplingParams

ROLES_FILE = "kv_head_roles.json"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = " What is the pass key? The pass key is"
ANSWER = " {key}."


def roles_path(model_dir: str | Path) -> Path:
    return Path(model_dir) / ROLES_FILE


def load_roles(model_dir: str | Path, num_layers: int, num_kv_heads: int) -> torch.Tensor | None:
    """The scores of `kv_head_roles.json` beside the model as [L·H] float32 (lane
    l·H + h), or None without one. A file made for another shape is a ValueError."""
    path = roles_path(model_dir)
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    scores = torch.tensor(data["scores"], dtype=torch.float32)
    if tuple(scores.shape) != (num_layers, num_kv_heads):
        raise ValueError(f"{path}: scores for {tuple(scores.shape)} (layers, kv heads), the "
                         f"model has ({num_layers}, {num_kv_heads}); run `kvserve head-roles`")
    return scores.reshape(-1)


def passkey_prompts(encode: Any, n: int, length: int, seed: int = 0
                    ) -> list[tuple[list[int], int]]:
    """`n` pass-key prompts of about `length` tokens, the key at evenly spread depths:
    (prompt + answer ids, number of answer tokens at the end)."""
    rng = random.Random(seed)
    filler = encode(FILLER)
    out = []
    for i in range(n):
        key = str(rng.randrange(10_000, 100_000))
        needle, question = encode(NEEDLE.format(key=key)), encode(QUESTION)
        answer = encode(ANSWER.format(key=key))
        hay = max(0, length - len(needle) - len(question) - len(answer))
        body = (filler * (hay // max(1, len(filler)) + 1))[:hay]
        at = round((i + 0.5) / n * hay)
        out.append(([*body[:at], *needle, *body[at:], *question, *answer], len(answer)))
    return out


def compute_roles(llm: Any, num_layers: int, num_kv_heads: int, prompts: int = 8,
                  length: int = 512, sink: int = 4, window: int = 64, seed: int = 0,
                  progress: bool = False) -> dict[str, Any]:
    """Every head's score by the ablation above, on `llm` (a `scheduler.llm.LLM` over a
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


def dumps(roles: dict[str, Any]) -> str:
    """The roles file's text: one key a line, a layer's heads a row."""
    rows = [f" {json.dumps(k)}: " + ("[" + ", ".join(json.dumps(r) for r in v) + "]"
                                     if isinstance(v, list) else json.dumps(v))
            for k, v in roles.items()]
    return "{\n" + ",\n".join(rows) + "\n}\n"


def measure_and_save(model: str, engine_kwargs: dict[str, Any], out: str | None = None,
                     chunk: int = 32, **kw: Any) -> Path:
    """`kvserve head-roles`: the roles of `model` measured on a per-head pool (prefix
    caching off: every ablation computes its own K/V; prompt chunks of `chunk` tokens)
    and written to `out` (default: beside the model). Returns the path."""
    from scheduler.llm import LLM

    args = {**engine_kwargs, "kv_layout": "head", "enable_prefix_caching": False,
            "max_num_batched_tokens": chunk}
    llm = LLM(model, **args)
    mc = llm.engine.model_config
    roles = compute_roles(llm, mc.num_layers, mc.num_kv_heads, progress=True, **kw)
    path = Path(out) if out else roles_path(model)
    path.write_text(dumps(roles))
    return path
