"""Train the embedded demo model on one CPU core and export it in Hugging Face format.

    # stage 1: language + sparse recall (the committed model stopped it at step 1482, 40 min)
    python -m demo_model.train --out runs/stage1 --steps 2715 --stop-at-step 1482
    # stage 2: retrieval (dense copy practice + packed recall docs), 57 min
    python -m demo_model.train --init-from runs/stage1 --stage2 --steps 2665 --out engine/demo/model
    # the 4-kv-head variant: kv heads copied (expand_heads.py), then stage 2 again, 48 min
    python -m demo_model.train --init-from engine/demo/model --expand-kv-heads 4 --stage2 \\
        --fp32 --steps 500 --minutes 48 --out engine/demo/model_kv4 --plot runs/kv4/loss.png

Why it looks like this: an hour of one CPU core buys ~10M tokens, so the model is small
(~3.8M parameters, 4 layers, GQA 8/2 heads) and trained with bf16 autocast (AMX/AVX-512 make it
~1.7x faster than fp32 there; without them, on an AVX2 Zen 3, a bf16 step took 16x an fp32 one:
``--fp32``). Stage 1 trains on 256-token rows first (cheap, where most language is learned),
then 1,024-token rows; 40–50% of rows end in a synthetic recall document (pass key /
key–value facts planted at a random depth, asked for at the end).

What we learned: with one sparse recall document per row (≈5 answer digits per 1,024 tokens)
retrieval had not emerged after 6M tokens, so stage 2 adds dense induction practice (a random
list of codes and words, then the same list again: every repeated token needs a look back) and
packs several recall documents per row. Retrieval then appeared within ~100 steps. A single run
with that mixture from the start is the obvious next recipe (untested here).

With ``--minutes`` and no ``--steps`` a short calibration on a throwaway model decides the step
count; the chosen count is recorded, and ``--steps N`` reproduces a run (fixed seeds; bf16 CPU
kernels may differ across CPU generations, so bit-exactness needs the same hardware and torch).
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from demo_model.data import RecallGenerator, corpus_manifest, load_corpus
from demo_model.expand_heads import expand_kv_heads
from demo_model.tokenizer import EOS, save_hf_tokenizer, train_tokenizer
from engine.demo import DEMO_MODEL_NAME

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class TrainConfig:
    """Everything that determines a run; written to ``training_config.json`` with the model."""

    seed: int = 1234
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    intermediate_size: int = 688
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    tokens_per_step: int = 4096
    short_len: int = 256
    long_len: int = 1024
    short_fraction: float = 0.3  # share of steps trained at short_len
    recall_fraction_short: float = 0.4  # share of rows ending in a recall document
    recall_fraction_long: float = 0.5
    passkey_share: float = 0.6  # of recall docs; the rest are key-value facts
    text_filler_share: float = 0.5  # of recall docs; the rest use the repeated sentences
    source_weights: dict[str, float] = field(
        default_factory=lambda: {"topics": 0.15, "docstrings": 0.25, "code": 0.6})
    answer_weight: float = 4.0  # loss weight of recall answer tokens
    lr: float = 2e-3
    min_lr_fraction: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bf16: bool = True
    threads: int = 1
    steps: int = 0  # 0: calibrate from minutes
    minutes: float = 55.0
    log_every: int = 10
    checkpoint_minutes: float = 10.0
    init_from: str = ""  # continue from an exported model (stage 2) instead of a fresh init
    recall_packing: bool = False  # recall rows hold several recall documents back to back
    stage: str = "1"
    copy_share: float = 0.0  # of recall docs: dense induction practice (stage 2)
    stop_at_step: int = 0  # end early (the schedule still spans `steps`): reproduces stage 1
    max_minutes_factor: float = 1.25  # stop early (and export) if the machine is slower than calibrated
    expand_kv_heads: int = 0  # copy init_from's kv heads up to this many first (expand_heads.py)


def build_model(cfg: TrainConfig):
    """The Llama model, initialised from ``cfg.seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    if cfg.init_from:
        model = LlamaForCausalLM.from_pretrained(cfg.init_from, dtype=torch.float32)
        if cfg.expand_kv_heads:
            expand_kv_heads(model, cfg.expand_kv_heads)
        return model
    lc = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=None,
        attn_implementation="sdpa")
    return LlamaForCausalLM(lc)


class RowSampler:
    """Draws training rows (T+1 token ids plus per-target loss weights) from a seeded RNG."""

    def __init__(self, cfg: TrainConfig, streams: dict[str, np.ndarray],
                 gen: RecallGenerator, seed: int) -> None:
        self.cfg, self.streams, self.gen = cfg, streams, gen
        self.rng = np.random.default_rng(seed)
        names = sorted(cfg.source_weights)
        self.names = names
        w = np.array([cfg.source_weights[n] for n in names])
        self.probs = w / w.sum()

    def lm_window(self, n: int) -> list[int]:
        if n <= 0:
            return []
        s = self.streams[self.names[int(self.rng.choice(len(self.names), p=self.probs))]]
        start = int(self.rng.integers(0, len(s) - n))
        return s[start:start + n].tolist()

    def recall_doc(self, max_len: int):
        """One recall document of random kind, filler, depth and length <= ``max_len``."""
        rng, cfg = self.rng, self.cfg
        filler = "text" if rng.random() < cfg.text_filler_share else "repeat"
        if cfg.copy_share and rng.random() < cfg.copy_share:  # no draw in stage 1
            return self.gen.copy(rng, int(rng.integers(min(32, max_len), min(256, max_len) + 1)))
        if rng.random() < cfg.passkey_share or max_len < 160:
            length = int(rng.integers(min(64, max_len), max_len + 1))
            return self.gen.passkey(rng, length, float(rng.random()), filler)
        length = int(rng.integers(min(160, max_len), max_len + 1))
        return self.gen.facts(rng, length, int(rng.integers(2, 6)), filler)

    def row(self, t: int, recall_fraction: float) -> tuple[list[int], list[float], list[tuple[int, int]]]:
        """Returns ids (t+1), target weights (t), and the [start, end) answer target spans.

        A recall row ends in one recall document (preceded by text), or with ``recall_packing``
        is filled with several (more answer tokens per step: stage 2 teaches retrieval)."""
        n = t + 1
        if self.rng.random() >= recall_fraction:
            return self.lm_window(n), [1.0] * t, []
        docs = [self.recall_doc(n)]
        if self.cfg.recall_packing:
            while n - sum(len(d.ids) for d in docs) >= 64:
                docs.append(self.recall_doc(n - sum(len(d.ids) for d in docs)))
        ids = self.lm_window(n - sum(len(d.ids) for d in docs))
        w, spans = [1.0] * t, []
        for d in docs:
            a0 = len(ids) + d.prompt_len - 1
            ids += d.ids
            spans.append((a0, len(ids) - 1))
            for j in range(a0, len(ids) - 1):
                w[j] = self.cfg.answer_weight
        return ids, w, spans

    def batch(self, t: int, recall_fraction: float):
        bsz = max(1, self.cfg.tokens_per_step // t)
        rows = [self.row(t, recall_fraction) for _ in range(bsz)]
        ids = torch.tensor([r[0] for r in rows], dtype=torch.long)
        w = torch.tensor([r[1] for r in rows], dtype=torch.float32)
        amask = torch.zeros(bsz, t, dtype=torch.bool)
        for i, r in enumerate(rows):
            for a0, a1 in r[2]:
                amask[i, a0:a1] = True
        return ids, w, amask


def lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    """Linear warmup then cosine decay to ``min_lr_fraction * lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    p = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_fraction + (1 - cfg.min_lr_fraction) * 0.5 * (1 + math.cos(math.pi * p)))


def make_optimizer(model, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


def train_step(model, opt, cfg: TrainConfig, ids, w, amask, lr: float) -> tuple[float, float]:
    """One optimiser step. Returns (mean token loss, answer-token argmax accuracy or nan)."""
    for g in opt.param_groups:
        g["lr"] = lr
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
        logits = model(input_ids=ids[:, :-1]).logits
    logits = logits.float()
    tgt = ids[:, 1:]
    tok_loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1),
                               reduction="none").view_as(tgt)
    loss = (tok_loss * w).sum() / w.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        acc = float("nan")
        if amask.any():
            acc = (logits.argmax(-1)[amask] == tgt[amask]).float().mean().item()
    return tok_loss.mean().item(), acc


def calibrate_steps(cfg: TrainConfig, sampler: RowSampler) -> int:
    """Time a few steps per phase on a throwaway copy; return steps that fit ``cfg.minutes``."""
    model = build_model(cfg)
    opt = make_optimizer(model, cfg)
    times = {}
    for t, rf in ((cfg.short_len, cfg.recall_fraction_short), (cfg.long_len, cfg.recall_fraction_long)):
        train_step(model, opt, cfg, *sampler.batch(t, rf), lr=1e-4)
        t0 = time.time()
        for _ in range(4):
            train_step(model, opt, cfg, *sampler.batch(t, rf), lr=1e-4)
        times[t] = (time.time() - t0) / 4
    per_step = cfg.short_fraction * times[cfg.short_len] + (1 - cfg.short_fraction) * times[cfg.long_len]
    steps = int(cfg.minutes * 60 / per_step)
    print(f"calibration: {times} s/step -> {steps} steps for {cfg.minutes} min", flush=True)
    return steps


def export(model, tok, cfg: TrainConfig, out: Path, extra: dict) -> None:
    """Hugging Face format: config, fp32 safetensors, tokenizer files, generation config."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.config.name_or_path = DEMO_MODEL_NAME
    model.save_pretrained(str(out), safe_serialization=True)
    save_hf_tokenizer(tok, out, cfg.max_position_embeddings)
    GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0, do_sample=True,
                     temperature=0.7, top_p=0.9, max_new_tokens=128).save_pretrained(str(out))
    name = "training_config.json" if cfg.stage == "1" else f"training_config_stage{cfg.stage}.json"
    (out / name).write_text(
        json.dumps({"name": DEMO_MODEL_NAME, "config": asdict(cfg), **extra}, indent=2) + "\n")


def plot_log(log_path: Path, png: Path, switch_tokens: int | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(log_path.open()))
    if not rows:
        return
    tok = [int(r["tokens"]) / 1e6 for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(tok, [float(r["loss"]) for r in rows], label="train loss (all tokens)")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax2 = ax.twinx()
    acc = [(t, float(r["answer_acc"])) for t, r in zip(tok, rows) if r["answer_acc"] != "nan"]
    if acc:
        ax2.plot(*zip(*acc), color="tab:orange", alpha=0.7, label="recall answer token acc")
    ax2.set_ylabel("answer token accuracy")
    ax2.set_ylim(0, 1)
    if switch_tokens:
        ax.axvline(switch_tokens / 1e6, color="gray", ls="--", lw=1)
    fig.legend(loc="upper right")
    ax.set_title(f"{DEMO_MODEL_NAME} training")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def plot_stages(model_dir: Path, png: Path) -> None:
    """One figure for the whole recipe: stage 1 (LM + sparse recall), then stage 2 (retrieval)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax2 = ax.twinx()
    offset = 0.0
    for name, label, color in (("training_log.csv", "stage 1", "tab:blue"),
                               ("training_log_stage2.csv", "stage 2", "tab:green")):
        path = model_dir / name
        if not path.is_file():
            continue
        rows = list(csv.DictReader(path.open()))
        tok = [offset + int(r["tokens"]) / 1e6 for r in rows]
        ax.plot(tok, [float(r["loss"]) for r in rows], color=color, label=f"{label} loss")
        acc = [(t, float(r["answer_acc"])) for t, r in zip(tok, rows) if r["answer_acc"] != "nan"]
        if acc:
            ax2.plot(*zip(*acc), color=color, alpha=0.35, ls=":", label=f"{label} answer acc")
        if offset:
            ax.axvline(offset, color="gray", ls="--", lw=1)
        offset = tok[-1] if tok else offset
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("train cross-entropy (nats/token)")
    ax2.set_ylabel("recall answer token accuracy")
    ax2.set_ylim(0, 1)
    fig.legend(loc="upper right", fontsize=8)
    ax.set_title(f"{DEMO_MODEL_NAME} training")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "engine/demo/model")
    ap.add_argument("--minutes", type=float, default=55.0)
    ap.add_argument("--steps", type=int, default=0, help="fixed step count (reproduces a run)")
    ap.add_argument("--plot", type=Path, default=REPO_ROOT / "docs/img/demo-model-loss.png")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--init-from", default="", help="stage 2: continue from this exported model")
    ap.add_argument("--stage2", action="store_true",
                    help="retrieval stage: packed recall rows, 1024 tokens only, lower LR")
    ap.add_argument("--stop-at-step", type=int, default=0,
                    help="stop after this step, keeping the --steps schedule (stage 1 used 1482)")
    ap.add_argument("--expand-kv-heads", type=int, default=0,
                    help="with --init-from: first copy its kv heads up to this many (uptraining)")
    ap.add_argument("--fp32", action="store_true",
                    help="no bf16 autocast (without AMX/AVX-512 CPU bf16 is far slower than fp32)")
    ap.add_argument("--plot-only", action="store_true",
                    help="redraw the combined loss plot from the logs in --out and exit")
    args = ap.parse_args(argv)
    if args.plot_only:
        plot_stages(args.out, args.plot)
        return
    cfg = TrainConfig(seed=args.seed, steps=args.steps, minutes=args.minutes,
                      init_from=args.init_from, stop_at_step=args.stop_at_step,
                      expand_kv_heads=args.expand_kv_heads, bf16=not args.fp32)
    if args.expand_kv_heads:
        if not args.init_from:
            ap.error("--expand-kv-heads needs --init-from (it expands a trained model)")
        cfg.num_kv_heads = args.expand_kv_heads
    if args.stage2:
        cfg.stage, cfg.recall_packing, cfg.short_fraction = "2", True, 0.0
        cfg.recall_fraction_long, cfg.lr, cfg.warmup_steps = 0.6, 1e-3, 20
        cfg.copy_share, cfg.checkpoint_minutes = 0.4, 5.0
    torch.set_num_threads(cfg.threads)
    t_start = time.time()

    docs = load_corpus()
    if cfg.init_from:  # the continued model keeps its tokenizer
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(cfg.init_from) / "tokenizer.json"))
    else:
        tok = train_tokenizer(d.text for d in docs if not d.heldout)
    eos_id = tok.token_to_id(EOS)
    streams: dict[str, np.ndarray] = {}
    for src in cfg.source_weights:
        texts = [d.text for d in docs if d.source == src and not d.heldout]
        ids: list[int] = []
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            ids += [eos_id, *enc.ids]
        streams[src] = np.array(ids, dtype=np.int32)
    print({k: len(v) for k, v in streams.items()}, "training tokens per source", flush=True)
    gen = RecallGenerator(lambda s: tok.encode(s, add_special_tokens=False).ids, eos_id,
                          streams["code"])

    if not cfg.steps:
        cfg.steps = calibrate_steps(copy.deepcopy(cfg), RowSampler(cfg, streams, gen, cfg.seed + 1))
    sampler = RowSampler(cfg, streams, gen, cfg.seed)
    model = build_model(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(model, cfg)
    switch = int(cfg.steps * cfg.short_fraction)
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / ("training_log.csv" if cfg.stage == "1" else f"training_log_stage{cfg.stage}.csv")
    extra = {"parameters": n_params, "corpus": corpus_manifest(docs),
             "train_tokens_per_source": {k: len(v) for k, v in streams.items()}}
    print(f"{n_params / 1e6:.2f}M parameters, {cfg.steps} steps (switch to "
          f"{cfg.long_len} at step {switch})", flush=True)

    tokens, t0, last_ckpt = 0, time.time(), time.time()
    hist: list[tuple[float, float]] = []
    switch_tokens = None
    with log_path.open("w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["step", "tokens", "seq_len", "lr", "loss", "answer_acc", "elapsed_s"])
        bar = tqdm(range(cfg.steps), mininterval=30, desc="train")
        for step in bar:
            long = step >= switch
            t = cfg.long_len if long else cfg.short_len
            if long and switch_tokens is None:
                switch_tokens = tokens
            rf = cfg.recall_fraction_long if long else cfg.recall_fraction_short
            lr = lr_at(cfg, step, cfg.steps)
            ids, w, amask = sampler.batch(t, rf)
            loss, acc = train_step(model, opt, cfg, ids, w, amask, lr)
            tokens += ids.numel() - ids.size(0)
            hist.append((loss, acc))
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                ml = float(np.mean([h[0] for h in hist]))
                accs = [h[1] for h in hist if not math.isnan(h[1])]
                ma = float(np.mean(accs)) if accs else float("nan")
                wr.writerow([step + 1, tokens, t, f"{lr:.3e}", f"{ml:.4f}", f"{ma:.3f}",
                             f"{time.time() - t0:.0f}"])
                f.flush()
                bar.set_postfix(loss=f"{ml:.3f}", acc=f"{ma:.2f}", seq=t, refresh=False)
                hist.clear()
            if cfg.stop_at_step and step + 1 >= cfg.stop_at_step:
                extra["stopped_at_step"] = step + 1
                break
            if time.time() - t0 > cfg.minutes * 60 * cfg.max_minutes_factor:
                print(f"time limit reached at step {step + 1}; stopping early", flush=True)
                extra["stopped_early_at_step"] = step + 1
                break
            if time.time() - last_ckpt > cfg.checkpoint_minutes * 60:
                export(model, tok, cfg, args.out, {**extra, "checkpoint_step": step + 1})
                plot_log(log_path, args.plot, switch_tokens)
                last_ckpt = time.time()
    train_s = time.time() - t0
    extra.update({"train_seconds": round(train_s), "total_seconds": round(time.time() - t_start),
                  "train_tokens": tokens, "tokens_per_second": round(tokens / train_s)})
    export(model, tok, cfg, args.out, extra)
    plot_log(log_path, args.plot, switch_tokens)
    print(f"done: {tokens} tokens in {train_s / 60:.1f} min -> {args.out}", flush=True)


if __name__ == "__main__":
    main()
