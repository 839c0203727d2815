"""Evaluation harness for the demo model (and for comparing KV eviction policies on it).

    python -m demo_model.evaluate --model engine/demo/model --out engine/demo/model

Two measurements, both through a small pluggable ``Backend`` so that a kvserve backend (with an
eviction policy active) can be compared with the full-cache transformers reference:

1. Held-out language modelling with teacher forcing: bits per byte and perplexity on the held-out
   stdlib documents (see ``demo_model.data``), against a unigram baseline (token frequencies of
   the training split, add-one smoothed) and a byte-unigram baseline.
2. Needle in a haystack: "The pass key is NNNNN. Remember it." planted at depths 0–100% in
   haystacks of 256/512/768 prompt tokens (768 = 75% of the 1,024 context), asked for at the end,
   greedy decoding, exact match of the digits. Haystack filler is held-out stdlib code (text the
   model never trained on) or the classic repeated sentences; a key–value facts variant too.

Backend contract (keep it this small):
- ``generate(prompt_ids, max_new_tokens) -> list[int]``: greedy continuation (new ids only).
  An eviction backend applies its policy while prefilling/decoding.
- ``score(ids) -> list[float]``: ``len(ids) - 1`` log-probabilities (natural log) of ``ids[i]``
  given ``ids[:i]`` for i ≥ 1. A backend measuring eviction during decode feeds the ids one by one
  (teacher forcing) through its bounded cache; the reference does one full forward pass.
- ``max_context``: the longest ``ids`` the backend accepts.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from demo_model.data import ANSWER, RecallGenerator, load_corpus
from demo_model.tokenizer import EOS
from engine.demo import DEMO_MODEL_DIR

DEPTHS: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
LENGTHS: tuple[int, ...] = (256, 512, 768)
TASKS: tuple[str, ...] = ("passkey/text", "passkey/repeat", "facts/text")
SAMPLE_PROMPTS: tuple[str, ...] = (
    "The \"for\" statement",
    "The import system",
    "def read_config(path):\n    \"\"\"",
)


class Backend(Protocol):
    """What the harness needs from a model; see the module docstring for the contract."""

    max_context: int

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]: ...

    def score(self, ids: Sequence[int]) -> list[float]: ...


class TransformersBackend:
    """Full-cache reference: ``transformers.AutoModelForCausalLM`` in fp32 on CPU."""

    def __init__(self, model_dir: Path | str = DEMO_MODEL_DIR) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.eval()
        self.max_context = int(self.model.config.max_position_embeddings)

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        out = self.model(input_ids=torch.tensor([list(prompt_ids)]), use_cache=True)
        past, new = out.past_key_values, []
        nxt = int(out.logits[0, -1].argmax())
        for _ in range(max_new_tokens):
            new.append(nxt)
            if len(new) == max_new_tokens:
                break
            out = self.model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, int(out.logits[0, -1].argmax())
        return new

    @torch.inference_mode()
    def score(self, ids: Sequence[int]) -> list[float]:
        x = torch.tensor([list(ids)])
        logp = torch.log_softmax(self.model(input_ids=x).logits[0, :-1].float(), dim=-1)
        return logp.gather(1, x[0, 1:, None])[:, 0].tolist()


@dataclass
class EvalData:
    """Tokenised held-out documents, training token counts and the recall generator."""

    tokenizer: object  # tokenizers.Tokenizer
    heldout: list[tuple[str, str, list[int]]]  # (source, text, ids without bos)
    train_counts: Counter
    train_bytes: Counter
    bos_id: int
    recall: RecallGenerator = field(repr=False)


def load_eval_data(model_dir: Path) -> EvalData:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bos = tok.token_to_id(EOS)
    docs = load_corpus()
    held = [d for d in docs if d.heldout]
    train = [d for d in docs if not d.heldout]
    enc = tok.encode_batch([d.text for d in held], add_special_tokens=False)
    heldout = [(d.source, d.text, e.ids) for d, e in zip(held, enc)]
    counts: Counter = Counter()
    byte_counts: Counter = Counter()
    for e, d in zip(tok.encode_batch([d.text for d in train], add_special_tokens=False), train):
        counts.update(e.ids)
        counts[bos] += 1
        byte_counts.update(d.text.encode())
    filler = np.array([i for s, _, ids in heldout if s == "code" for i in ids], dtype=np.int32)
    gen = RecallGenerator(lambda s: tok.encode(s, add_special_tokens=False).ids, bos, filler)
    return EvalData(tok, heldout, counts, byte_counts, bos, gen)


def heldout_lm(backend: Backend, data: EvalData, stride_fraction: float = 0.5,
               progress: bool = True) -> dict:
    """Teacher-forced held-out loss. Long documents use overlapping windows of
    ``max_context`` tokens; each token is scored once, with at least half a window of context."""
    ctx = backend.max_context
    stride = max(1, int(ctx * stride_fraction))
    vocab = max(data.train_counts) + 1
    n_train = sum(data.train_counts.values())
    n_bytes_train = sum(data.train_bytes.values())
    per: dict[str, dict[str, float]] = {}
    t0 = time.time()
    for k, (src, text, ids) in enumerate(data.heldout):
        seq = [data.bos_id, *ids]
        nll, pos = 0.0, 1  # seq[pos:] not yet scored
        while pos < len(seq):
            start = max(0, pos - (ctx - stride)) if pos > 1 else 0
            window = seq[start:start + ctx]
            lps = backend.score(window)
            first = pos - start - 1  # index into lps of the first unscored token
            nll -= sum(lps[first:])
            pos = start + len(window)
        uni = -sum(math.log((data.train_counts[i] + 1) / (n_train + vocab)) for i in ids)
        raw = text.encode()
        byte_uni = -sum(math.log((data.train_bytes[b] + 1) / (n_bytes_train + 256)) for b in raw)
        acc = per.setdefault(src, {"nats": 0.0, "tokens": 0, "bytes": 0, "unigram_nats": 0.0,
                                   "byte_unigram_nats": 0.0, "documents": 0})
        acc["nats"] += nll
        acc["tokens"] += len(ids)
        acc["bytes"] += len(raw)
        acc["unigram_nats"] += uni
        acc["byte_unigram_nats"] += byte_uni
        acc["documents"] += 1
        if progress:
            print(f"  held-out {k + 1}/{len(data.heldout)} ({time.time() - t0:.0f}s)", flush=True)
    total = {key: sum(v[key] for v in per.values()) for key in next(iter(per.values()))}
    out = {}
    for name, v in [*sorted(per.items()), ("all", total)]:
        out[name] = {
            "documents": v["documents"], "tokens": v["tokens"], "bytes": v["bytes"],
            "loss_nats_per_token": v["nats"] / v["tokens"],
            "perplexity": math.exp(v["nats"] / v["tokens"]),
            "bits_per_byte": v["nats"] / math.log(2) / v["bytes"],
            "unigram_bits_per_byte": v["unigram_nats"] / math.log(2) / v["bytes"],
            "byte_unigram_bits_per_byte": v["byte_unigram_nats"] / math.log(2) / v["bytes"],
        }
    return out


def needle(backend: Backend, data: EvalData, trials: int = 20, seed: int = 0,
           lengths: Sequence[int] = LENGTHS, depths: Sequence[float] = DEPTHS,
           tasks: Sequence[str] = TASKS, progress: bool = True) -> dict:
    """Exact-match accuracy per task × prompt length × depth (greedy, 8 new tokens)."""
    answer_len = len(data.recall.encode(ANSWER.format(value="12345")))
    results: dict = {}
    for task in tasks:
        kind, filler = task.split("/")
        for length in lengths:
            for depth in depths:
                rng = np.random.default_rng([seed, length, round(depth * 100), zlib.crc32(task.encode())])
                hits = 0
                for _ in range(trials):
                    if kind == "passkey":
                        s = data.recall.passkey(rng, length + answer_len, depth, filler)
                    else:
                        s = data.recall.facts(rng, length + answer_len, 4, filler)
                    new = backend.generate(s.ids[:s.prompt_len], 8)
                    m = re.search(r"\d+", data.tokenizer.decode(new))
                    hits += bool(m and m.group() == s.answer)
                results.setdefault(task, {}).setdefault(str(length), {})[f"{depth:.2f}"] = hits / trials
            if progress:
                row = results[task][str(length)]
                print(f"  needle {task} len={length}: {row}", flush=True)
    return results


def samples(backend: Backend, data: EvalData, max_new_tokens: int = 60) -> dict[str, str]:
    """Greedy continuations of a few prompts, to show what the model writes."""
    out = {}
    for p in SAMPLE_PROMPTS:
        ids = [data.bos_id, *data.tokenizer.encode(p, add_special_tokens=False).ids]
        out[p] = p + data.tokenizer.decode(backend.generate(ids, max_new_tokens))
    return out


def markdown(results: dict) -> str:
    """The tables that go in the model card."""
    lm = results["heldout"]
    lines = ["| held-out split | docs | tokens | bytes | loss (nats/token) | perplexity "
             "| bits/byte | token-unigram bits/byte | byte-unigram bits/byte |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, v in lm.items():
        lines.append(f"| {name} | {v['documents']} | {v['tokens']} | {v['bytes']} | "
                     f"{v['loss_nats_per_token']:.3f} | {v['perplexity']:.2f} | "
                     f"{v['bits_per_byte']:.3f} | {v['unigram_bits_per_byte']:.3f} | "
                     f"{v['byte_unigram_bits_per_byte']:.3f} |")
    for task, by_len in results["needle"].items():
        depths = list(next(iter(by_len.values())))
        lines += ["", f"Needle `{task}`: exact match by prompt length (rows) and depth (columns), "
                  f"{results['trials']} trials per cell", "",
                  "| length | " + " | ".join(f"{float(d):.0%}" for d in depths) + " | mean |",
                  "|---:|" + "---:|" * (len(depths) + 1)]
        for length, row in by_len.items():
            vals = [row[d] for d in depths]
            lines.append(f"| {length} | " + " | ".join(f"{v:.0%}" for v in vals)
                         + f" | {sum(vals) / len(vals):.0%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEMO_MODEL_DIR)
    ap.add_argument("--out", type=Path, default=None, help="directory for eval_results.{json,md}")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    backend = TransformersBackend(args.model)
    data = load_eval_data(args.model)
    print("held-out language modelling", flush=True)
    results: dict = {"model": str(args.model), "backend": "transformers", "trials": args.trials,
                     "heldout": heldout_lm(backend, data)}
    print(json.dumps(results["heldout"]["all"], indent=1), flush=True)
    print("needle in a haystack", flush=True)
    results["needle"] = needle(backend, data, trials=args.trials)
    results["samples"] = samples(backend, data)
    results["seconds"] = round(time.time() - t0)
    md = markdown(results)
    print(md)
    for p, s in results["samples"].items():
        print(f"--- {p!r}\n{s}\n")
    out = args.out or args.model
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval_results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "eval_results.md").write_text(md)


if __name__ == "__main__":
    main()
