"""`EngineConfig`: what an `EngineCore` is built from (the model and its dtypes, the KV
pool's size, batching limits, the default kv_policy, preemption, the CPU and CUDA paths),
and the dtype names it takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.quant import FORMATS
from kvpool.manager import MIN_PREFILL_CHUNK

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
KV_CACHE_DTYPES = ("auto", *DTYPES, *FORMATS)  # what --kv-cache-dtype accepts
KV_LAYOUTS = ("layer", "head")  # what --kv-layout accepts


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto = the checkpoint's dtype
    kv_cache_dtype: str = "auto"  # auto = the model's dtype; narrower halves K/V bytes
    # What one page of the pool holds: "layer" = one layer's every kv head (one kept set
    # per layer), "head" = one (layer, kv head), so each head keeps and frees its own
    # tokens (docs/memory.md, "Pages per head"). `num_blocks` counts pages.
    kv_layout: str = "layer"
    device: str = "auto"  # auto = cuda when available
    # Tokens a page holds; None: 16 on a per-layer pool, on a per-head pool what
    # scheduler/pool_shape.py's `page_tokens` picks (pages of >= 8 KiB of K).
    block_size: int | None = None
    num_blocks: int | None = None  # wins over kv_cache_memory
    # Bytes for the pool, e.g. "2GiB"; None: sized from the memory left after the weights
    # (attention/sizing.py: half of what is available on a CPU, vLLM's 0.9 on CUDA, capped
    # at max_num_seqs sequences of max_model_len tokens).
    kv_cache_memory: str | int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # Shortest prefill chunk of a prompt whose policy bounds it (kvpool/manager.py
    # `prefill_chunk`): longer chunks prefill faster and let scoring policies rank more
    # of the prompt at once, for more memory per request.
    min_prefill_chunk: int = MIN_PREFILL_CHUNK
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    seed: int = 0  # seeds drawn for requests that give none
    default_kv_policy: str = "full"  # for requests that name none
    # Where requests' default sampling fields come from (vLLM's --generation-config):
    # "auto" the model's generation_config.json, "vllm" none (the server's own), or a
    # folder holding one (engine/generation_defaults.py).
    generation_config: str = "auto"
    watermark: float = 0.01  # fraction of blocks kept free when admitting new requests
    preemption_mode: str = "recompute"  # swap | recompute | auto
    # A preempted request comes back only once its growth to max_tokens fits, so it is
    # preempted at most once (False: vLLM's behaviour, back on what it needs now).
    reserve_preempted: bool = True
    swap_space: str | int = "1GiB"  # host memory for swapped-out blocks
    enable_prefix_caching: bool = True
    tenant_quotas: dict[str, float] | None = None  # tenant -> fraction of the pool
    # A step's requests of equal policies run as one group (kvpool/policy_rows.py);
    # False: every request a group of one (the same plans).
    batch_policies: bool = True
    # StreamingLLM at its window writes each decode token over its oldest past the sinks
    # (kvpool/tables.py's ring): exactly its window's blocks, the paper's cache; False
    # appends and evicts after the step (a block more a layer while it runs).
    streaming_ring: bool = True
    # Hybrid memory (vLLM's hybrid KV cache manager): a sliding-window layer keeps only
    # its window's pages, and admission, reservation, preemption, prefix caching and the
    # pool's size count it so (kvpool/windows.py); a kv_policy acts on the global layers.
    # False keeps every layer's whole context, as a model without windows (for comparison).
    hybrid_kv_cache: bool = True
    # On a CPU, linear layers run on oneDNN-prepacked weights (engine/cpu_linear.py);
    # False keeps torch's dense F.linear (for comparison).
    cpu_prepack: bool = True
    # How each linear layer's layout is chosen: "measure" (timed on this CPU at start,
    # cached per machine) or "vendor" (the vendor rules); None: env KVSERVE_KERNEL_CHOICE,
    # else measure (engine/linear_choice.py).
    cpu_kernels: str | None = None
    # On CUDA, decode steps replay CUDA graphs (engine/cuda_graphs.py); True runs them
    # eagerly (vLLM's --enforce-eager).
    enforce_eager: bool = False
    # With CUDA graphs, plan and launch a decode step while the one before it runs on the
    # GPU (`EngineCore.step`; vLLM's --async-scheduling); False waits for every step's
    # tokens before planning the next.
    async_scheduling: bool = True
