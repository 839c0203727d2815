"""kvpress's presses under our quality protocol, for the kvpress rows of bench_policies (issue 20).

Why: a policy that is far worse than full cache on the demo model is either a weak
method on this model or a bug in ours; the same method's kvpress press, run on the same
windows and needle prompts with the same budgets, tells which. kvpress 0.5.5 pins an
older transformers, so this script runs in its own venv (`make kvpress-venv`) and
imports nothing of kvserve: `benchmarks/kvpress_compare.py` writes the exchange file
(windows, needle prompts, budgets), this script writes back per-window log-likelihoods
and the greedy needle answers, and the kvserve side scores the answers with
`demo_model.evaluate.needle`'s own rule.

Protocol, as `benchmarks/policy_eval.py` runs ours (000_8900623ad98b28fb.txt §4.1):

- perplexity: the prompt (first `prompt_len` tokens of a window) is prefilled in one
  forward with the press compressing it to the budget (compression ratio 1 − B/n); the
  continuation is teacher-forced one token at a time at its true position, and scored.
  Where kvpress can compress while decoding (`DecodingPress` around a `ScorerPress`,
  compression_interval 1, target_size B) the cache is re-compressed to B after every
  token, as our policies keep it ("prefill+decode"). SnapKV and PyramidKV score with
  their last `window_size` queries, which a decoding press never holds (it clears its
  hidden-state buffer at every compression), so they compress the prompt only and the
  cache grows during decoding ("prefill"), as our snapkv does (002 §3.2).
- needle: each prompt compressed to round(fraction × its length), then 8 greedy tokens
  (EOS ignored), decoded under the same decoding press.
- AdaKV ("<m>@adakv", issue 65): kvpress's `AdaKVPress` around the method's press
  (alpha_safeguard `ALPHA`, as our `heads: adaptive`): the layer's B × kv heads pairs go
  to the best scores of all its heads, each head keeping at least ALPHA × B. It masks
  rather than evicts (the dropped pairs stay in the cache, their keys overwritten with a
  key no query attends to), so `max_cache_after_step` counts the pairs a kv head
  attends to (the mean over heads). It decodes where the press does and scores a pair
  by that pair alone: kvpress's `DecodingPress` takes an `AdaKVPress` and re-masks the
  whole cache to B a head after every token, the masked pairs (their fake keys scoring
  lowest) staying masked. KeyDiffPress compresses the prompt only (`ADAKV_PREFILL`):
  its anchor, the mean key direction, would count the fake keys and rank the real ones
  against them (decoding, its needle accuracy fell to 20 / 63 / 67% at 10 / 25 / 50%
  on the demo model where the prompt-only press keeps 38 / 73 / 91%). Not for ObservedAttentionPress (AdaKVPress refuses eager attention, which that
  press needs) nor PyramidKVPress (AdaKVPress calls a press's `score` only, and
  PyramidKV's per-layer budgets live in its `compress`: it would be SnapKV at one
  budget a layer).

One change to kvpress, which leaves every kept set as it is: `ScorerPress.compress`
gathers the kept pairs in `topk` order, which on CPU is not position order (ties and
all), and StreamingLLMPress (it drops "the oldest after the sinks" by cache index) and
ObservedAttentionPress (it divides by the queries that saw each index) read the cache
index as the position. Compressed once, as kvpress's pipeline does, that is harmless; a
decoding press compresses again at every token, and StreamingLLMPress then drops a
token of the topk shuffle's choosing instead of the oldest. `ordered_topk` keeps the
kept indices sorted, so the cache stays in time order.

    .venv-kvpress/bin/python -m benchmarks.kvpress_quality --exchange in.json --out out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from typing import Any

import torch

# our method -> (kvpress class, constructor arguments matching our defaults, can decode)
PRESSES: dict[str, tuple[str, dict[str, Any], bool]] = {
    "streaming": ("StreamingLLMPress", {"n_sink": 4}, True),
    "knorm": ("KnormPress", {}, True),
    "keydiff": ("KeyDiffPress", {}, True),
    "tova": ("TOVAPress", {}, True),
    "snapkv": ("SnapKVPress", {"window_size": 32, "kernel_size": 5}, False),
    "pyramid": ("PyramidKVPress", {"window_size": 32, "kernel_size": 1, "beta": 20}, False),
    "h2o": ("ObservedAttentionPress", {}, True),  # needs eager attention
    # compresses the prompt once, as our expected_attention (kvpress's defaults are ours)
    "expected_attention": ("ExpectedAttentionPress", {}, False),
}
# ... whose press kvpress's AdaKVPress can wrap (module docstring): "<m>@adakv"
ADAKV = ("knorm", "keydiff", "tova", "snapkv", "expected_attention")
ADAKV_PREFILL = ("keydiff",)  # ... which compress the prompt only under AdaKV (docstring)
ALPHA = 0.2  # AdaKV's safeguard, policies/heads.py ALPHA (kvpress's default too)


def ratio_for(n: int, budget: int) -> float:
    """Compression ratio whose kvpress `compute_n_kept` (int(n·(1 − r))) is `budget`."""
    return 0.0 if budget >= n else 1.0 - (budget + 0.5) / n


@contextlib.contextmanager
def ordered_topk():
    """`ScorerPress.compress` with the kept indices in position order (module docstring):
    the same top `compute_n_kept` by score, gathered in cache order."""
    from kvpress.presses.scorer_press import ScorerPress
    from kvpress.utils import compute_n_kept

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
        kept = scores.topk(compute_n_kept(keys.shape[2], self.compression_ratio), dim=-1)
        idx = kept.indices.sort(dim=-1).values[..., None].expand(-1, -1, -1, keys.shape[-1])
        return keys.gather(2, idx).contiguous(), values.gather(2, idx).contiguous()

    real = ScorerPress.compress
    ScorerPress.compress = compress
    try:
        yield
    finally:
        ScorerPress.compress = real


def head_mean(press):
    """`press` ranking by the mean of its score over kv heads, the one set per layer our
    pool keeps (docs/policies.md, "Agreement with kvpress"): method "<m>@layer" isolates
    what that constraint costs from any other difference."""
    score = press.score

    def mean_score(module, hidden_states, keys, values, attentions, kw):
        s = score(module, hidden_states, keys, values, attentions, kw)
        return s.mean(dim=1, keepdim=True).expand_as(s)

    press.score = mean_score
    return press


def press_name(method: str) -> str:
    """How a row names its press: "KnormPress", "KnormPress, head mean" (`head_mean`),
    "AdaKVPress(KnormPress)"; "none" for the full cache."""
    if method == "full":
        return "none"
    base, _, level = method.partition("@")
    cls = PRESSES[base][0]
    return {"layer": f"{cls}, head mean", "adakv": f"AdaKVPress({cls})"}.get(level, cls)


def make_press(method: str, n: int, budget: int):
    """The press for `method` ("<m>", "<m>@layer" (`head_mean`) or "<m>@adakv" (AdaKV,
    module docstring)) keeping `budget` of an `n`-token prompt (a head's, AdaKV's mean),
    with a decoding press keeping the cache at `budget` where the press can decode."""
    base, _, level = method.partition("@")
    if base not in PRESSES or level not in ("", "layer", "adakv") or (
            level == "adakv" and base not in ADAKV):
        raise ValueError(f"no kvpress press for {method!r}")
    import kvpress

    cls, kwargs, decodes = PRESSES[base]
    if "window_size" in kwargs:  # SnapKV asserts more queries than its window
        kwargs = {**kwargs, "window_size": min(kwargs["window_size"], n - 1)}

    def build(**extra):
        press = getattr(kvpress, cls)(**kwargs, **extra)
        if level == "adakv":
            return kvpress.AdaKVPress(press, alpha_safeguard=ALPHA)
        return head_mean(press) if level == "layer" else press

    prefill = build(compression_ratio=ratio_for(n, budget))
    if not decodes or (level == "adakv" and base in ADAKV_PREFILL):
        return prefill, "prefill"
    decode = kvpress.DecodingPress(base_press=build(), compression_interval=1,
                                   target_size=budget, hidden_states_buffer_size=0)
    return kvpress.PrefillDecodingPress(prefilling_press=prefill, decoding_press=decode), \
        "prefill+decode"


@torch.no_grad()
def continue_forced(model, ids: torch.Tensor, prompt_len: int, press) -> tuple[list[float], int]:
    """Per row of `ids` [B, T]: the summed natural log-likelihood of tokens prompt_len..T−1
    (the prompt prefilled under `press`, the rest forced one at a time); and the largest
    cache length seen after a decode step (layer 0), a check that the budget held."""
    from transformers import DynamicCache

    cache, total, most = DynamicCache(), torch.zeros(ids.shape[0], dtype=torch.float64), 0
    with press(model) if press is not None else contextlib.nullcontext():
        logits = model(input_ids=ids[:, :prompt_len], past_key_values=cache,
                       logits_to_keep=1).logits[:, -1]
        for t in range(prompt_len, ids.shape[1]):
            total += torch.log_softmax(logits.double(), -1).gather(1, ids[:, t:t + 1])[:, 0]
            if t + 1 == ids.shape[1]:
                break
            pos = torch.full((ids.shape[0], 1), t)
            logits = model(input_ids=ids[:, t:t + 1], past_key_values=cache,
                           position_ids=pos).logits[:, -1]
            most = max(most, attended(model, cache))
    return total.tolist(), most


def attended(model, cache) -> int:
    """Layer 0's cache length, less what AdaKVPress masks there (its
    `masked_key_indices`: the pairs it dropped, still in the cache), as the mean over
    rows and kv heads, rounded up: what a kv head attends to."""
    n = cache.get_seq_length(0)
    masked = getattr(model.model.layers[0].self_attn, "masked_key_indices", None)
    if masked is None:
        return n
    rows_heads = cache.layers[0].keys.shape[0] * cache.layers[0].keys.shape[1]
    return n - len(masked[0]) // rows_heads


@torch.no_grad()
def greedy(model, prompt: list[int], new_tokens: int, press) -> list[int]:
    """`new_tokens` greedy tokens after `prompt` (EOS ignored), positions kept true."""
    from transformers import DynamicCache

    cache, out = DynamicCache(), []
    with press(model) if press is not None else contextlib.nullcontext():
        logits = model(input_ids=torch.tensor([prompt]), past_key_values=cache,
                       logits_to_keep=1).logits[0, -1]
        for i in range(new_tokens):
            out.append(int(logits.argmax()))
            if i + 1 == new_tokens:
                break
            logits = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache,
                           position_ids=torch.tensor([[len(prompt) + i]])).logits[0, -1]
    return out


def run(ex: dict[str, Any], methods: list[str], progress: bool = True) -> dict[str, Any]:
    """Every method × budget of the exchange file, plus the full cache (no press)."""
    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    models = {impl: AutoModelForCausalLM.from_pretrained(
        ex["model"], dtype=torch.float32, attn_implementation=impl).eval()
        for impl in ("sdpa", "eager")}
    windows, p_len = torch.tensor(ex["windows"]), ex["prompt_len"]
    out: dict[str, Any] = {"versions": {
        "kvpress": getattr(kvpress, "__version__", "0.5.5"),
        "transformers": transformers.__version__, "torch": str(torch.__version__)},
        "rows": []}
    configs = [("full", 1.0)] + [(m, b) for b in ex["budgets"] for m in methods]
    for method, frac in configs:
        t0 = time.perf_counter()
        model = models["eager" if method.startswith("h2o") else "sdpa"]
        budget = round(frac * windows.shape[1])
        press, protocol = (None, "full") if method == "full" else \
            make_press(method, p_len, budget)
        ll, most = continue_forced(model, windows, p_len, press)
        answers = []
        for p in ex["needle_prompts"]:
            b = round(frac * len(p))
            pr = None if method == "full" else make_press(method, len(p), b)[0]
            answers.append(greedy(model, p, ex["max_new_tokens"], pr))
        scored = windows.shape[0] * (windows.shape[1] - p_len)
        row = {"method": method, "press": press_name(method),
               "budget": frac, "budget_tokens": budget, "protocol": protocol,
               "window_loglik": ll, "scored_tokens": scored,
               "nll": -sum(ll) / scored, "ppl": math.exp(-sum(ll) / scored),
               "max_cache_after_step": most, "needle_answers": answers,
               "wall_s": time.perf_counter() - t0}
        out["rows"].append(row)
        if progress:
            print(f"[kvpress] {method} {frac:.0%} ({protocol}): ppl {row['ppl']:.3f}, cache "
                  f"≤ {most}, {row['wall_s']:.1f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--exchange", required=True, help="JSON from benchmarks/kvpress_compare.py")
    ap.add_argument("--out", required=True, help="JSON to write")
    ap.add_argument("--methods", default=",".join(PRESSES))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with open(args.exchange, encoding="utf-8") as f:
        ex = json.load(f)
    with ordered_topk():
        result = run(ex, [m for m in args.methods.split(",") if m])
    result["kept_order"] = "position (ordered_topk)"
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
