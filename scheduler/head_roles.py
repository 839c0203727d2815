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
with `--kv-layout head` starts (`load_roles`); the measurement itself is
scheduler/measure_roles.py (it runs an engine, which loads this module).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

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


def dumps(roles: dict[str, Any]) -> str:
    """The roles file's text: one key a line, a layer's heads a row."""
    rows = [f" {json.dumps(k)}: " + ("[" + ", ".join(json.dumps(r) for r in v) + "]"
                                     if isinstance(v, list) else json.dumps(v))
            for k, v in roles.items()]
    return "{\n" + ",\n".join(rows) + "\n}\n"
