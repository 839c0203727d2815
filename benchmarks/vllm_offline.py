"""vLLM's offline `LLM.generate` as bench_offline's peer; runs under vLLM's own python.

Not imported by kvserve: `benchmarks/bench_offline.py` starts it with the vLLM venv's
python (loadtest/vllm_peer.py) and keeps it alive for the whole model entry, so the
model loads once and vLLM takes its turn inside every repeat like the other systems.
Each stdin line is a workload (`{"prompts": [[ids]], "output_lens": [n]}`); each answer
is one stdout line, `RESULT {"wall_s", "cpu_s", "lengths"}` (vLLM logs to stdout too).
Only the standard library and vLLM: this venv has nothing of kvserve's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

MARK = "RESULT "


def cpu_seconds() -> float:
    """CPU time of this process and its children: vLLM steps the model in an engine
    process of its own."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += sum(child.cpu_times()[:2])
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    from vllm import LLM, SamplingParams

    # No prefix caching, as kvserve's run: the repeats' prompts would hit the cache.
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len,
              max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
              enable_prefix_caching=False, seed=a.seed)
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        w = json.loads(line)
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                 detokenize=False) for n in w["output_lens"]]
        prompts = [{"prompt_token_ids": ids} for ids in w["prompts"]]
        c0, t0 = cpu_seconds(), time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        print(MARK + json.dumps({"wall_s": wall, "cpu_s": cpu, "lengths": lengths}), flush=True)


if __name__ == "__main__":
    main()
