"""The real vLLM (its CPU build) as a measured peer of kvserve (issue 22).

vLLM lives in its own venv (`make vllm-venv` → `.venv-vllm`): it pins its own torch and
transformers, so it never shares a process with kvserve. `bench_serving` starts its
OpenAI server as a child; `bench_offline` runs `benchmarks/vllm_offline.py` under that
venv's python. Both configure it as vLLM's CPU docs say: the OpenMP threads bound to
CPUs (`VLLM_CPU_OMP_THREADS_BIND`, the same number of threads kvserve gets) and the KV
cache size (`VLLM_CPU_KVCACHE_SPACE`, GiB, the same memory as kvserve's pool). Without
the venv the vLLM rows are skipped with a note, so CI never needs it.
"""

from __future__ import annotations

import math
import os
import sys

from engine.cpu_threads import ENV_VARS, allowed_cpus, format_cpu_list

DEFAULT_PYTHON = ".venv-vllm/bin/python"
SERVE_MODULE = "vllm.entrypoints.openai.api_server"  # `vllm serve` fails to find its
# own distribution in this build (PackageNotFoundError: vllm)
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1"}


def missing(python: str) -> str | None:
    """Why vLLM cannot run from `python` (printed in place of its rows), or None."""
    if not os.access(python, os.X_OK):
        return (f"vLLM skipped: no vLLM venv at {python} (`make vllm-venv` creates "
                ".venv-vllm; --vllm-python PATH names another)")
    return None


def settings(threads: int, kv_memory: str) -> dict[str, str]:
    """vLLM's documented CPU settings for `threads` OpenMP threads and a KV cache of
    `kv_memory` (rounded up to whole GiB, vLLM's unit): the first `threads` CPUs this
    process may use, one thread each."""
    from native.memory import parse_bytes

    cpus = allowed_cpus()[:threads]
    return {"VLLM_CPU_OMP_THREADS_BIND": format_cpu_list(cpus),
            "VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(parse_bytes(kv_memory) / 2**30)))}


def env(threads: int, kv_memory: str) -> dict[str, str]:
    """The child's environment: ours without the thread variables (vLLM sets its own
    from the binding) and without our PYTHONPATH (its venv is complete)."""
    base = {k: v for k, v in os.environ.items()
            if k not in (*ENV_VARS, "PYTHONPATH")}
    return {**base, **OFFLINE_ENV, **settings(threads, kv_memory)}


def serve_cmd(python: str, model: str, port: int, dtype: str, max_seqs: int | None,
              max_batched_tokens: int | None, max_model_len: int) -> list[str]:
    """vLLM's OpenAI server on loopback with the scheduler limits kvserve gets (None: its
    own defaults)."""
    limits = ([] if max_seqs is None else ["--max-num-seqs", str(max_seqs)]) + (
        [] if max_batched_tokens is None else ["--max-num-batched-tokens", str(max_batched_tokens)])
    return [python, "-m", SERVE_MODULE, "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", dtype, *limits,
            "--max-model-len", str(max_model_len), "--disable-log-stats"]


def version(python: str) -> str | None:
    import subprocess

    try:
        out = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, **OFFLINE_ENV}, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        print(f"vLLM at {python} does not import: {e}", file=sys.stderr)
        return None
    return out.stdout.strip().splitlines()[-1]
