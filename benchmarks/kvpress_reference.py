"""Reference scores from NVIDIA's kvpress, for tests/test_kvpress_agreement.py.

kvpress (0.5.5) pins transformers < 5.3, older than ours, so it lives in its own venv
(`make kvpress-venv`) and this script runs there, importing nothing of kvserve. It runs
each press that implements a method we also ship on one prompt through a Hugging Face
model and records, per layer, the scores the press computed (`ScorerPress.score`:
[kv heads, n], higher = keep) — before any selection, so our tests can compare scores
and kept sets. The output is a small torch file committed as tests/data/, so the suite
compares against the real reference without installing it.

    make kvpress-venv
    .venv-kvpress/bin/python -m benchmarks.kvpress_reference --model engine/demo/model \\
        --prompt-file tests/data/kvpress_demo_prompt.json --out tests/data/kvpress_demo.pt
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

# press name -> (kvpress class name, constructor arguments). The ratio is the fraction
# of the prompt removed; the window sizes are the ones our tests configure.
COMPRESSION_RATIO = 0.5
WINDOW = 8
PRESSES: dict[str, tuple[str, dict[str, Any]]] = {
    "streaming": ("StreamingLLMPress", {"n_sink": 4}),
    "knorm": ("KnormPress", {}),
    "keydiff": ("KeyDiffPress", {}),
    "tova": ("TOVAPress", {}),
    "snapkv": ("SnapKVPress", {"window_size": WINDOW, "kernel_size": 5}),
    "observed_attention": ("ObservedAttentionPress", {}),
    # the paper's defaults: n_future_positions 512, n_sink 4, covariance and ‖v‖ on
    "expected_attention": ("ExpectedAttentionPress", {}),
}


def run(model_dir: str, prompt: list[int]) -> dict[str, Any]:
    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM

    # Eager attention: ObservedAttentionPress reads the attention weights it returns.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids = torch.tensor([prompt])
    out: dict[str, Any] = {"prompt": prompt, "compression_ratio": COMPRESSION_RATIO,
                           "window": WINDOW, "versions": {
                               "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__")
                               else "0.5.5", "transformers": transformers.__version__,
                               "torch": str(torch.__version__)}, "scores": {}}
    for name, (cls_name, kwargs) in PRESSES.items():
        press = getattr(kvpress, cls_name)(compression_ratio=COMPRESSION_RATIO, **kwargs)
        captured: dict[int, torch.Tensor] = {}
        score = press.score

        def recording(module, hidden_states, keys, values, attentions, kw, _score=score,
                      _captured=captured):
            s = _score(module, hidden_states, keys, values, attentions, kw)
            _captured[module.layer_idx] = s[0].detach().float().clone()  # [Hkv, n]
            return s

        press.score = recording
        with torch.no_grad(), press(model):
            model(ids, output_attentions=name == "observed_attention")
        out["scores"][name] = torch.stack([captured[i] for i in sorted(captured)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model directory")
    ap.add_argument("--prompt-file", required=True, help="JSON list of token ids")
    ap.add_argument("--out", required=True, help="torch file to write")
    args = ap.parse_args()
    with open(args.prompt_file, encoding="utf-8") as f:
        prompt = json.load(f)
    result = run(args.model, prompt)
    torch.save(result, args.out)
    print(f"wrote {args.out}: {', '.join(result['scores'])} "
          f"({len(prompt)} tokens, {result['versions']})")


if __name__ == "__main__":
    main()
