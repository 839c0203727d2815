"""Command-line options shared by `python -m loadtest` (bench serve) and the soak."""

from __future__ import annotations

import argparse
import json
import os

from loadtest.client import BACKENDS, ClientConfig
from loadtest.workloads import (
    SHAREGPT_OUTPUT,
    SHAREGPT_PROMPT,
    LengthDist,
    TextMaker,
    WorkloadConfig,
    load_tokenizer,
    parse_policy_mix,
)


def add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root, without /v1 (default %(default)s)")
    g.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions (default) or /v1/chat/completions")
    g.add_argument("--model", default=None,
                   help="model name to send (default: the first of /v1/models, if any)")
    g.add_argument("--backend", choices=BACKENDS, default="openai",
                   help="openai: kvserve, vLLM and most servers; transformers: "
                   "`transformers serve` (no ignore_eos/kv_policy fields)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default env OPENAI_API_KEY)")
    g.add_argument("--header", action="append", default=[], metavar="NAME=VALUE")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--no-ignore-eos", action="store_true",
                   help="let requests stop at end-of-sequence (default: exact lengths)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="ask for logprobs, so streamed tokens can be counted against usage")
    g.add_argument("--extra-body", default=None, metavar="JSON",
                   help="fields merged into every request body")
    g.add_argument("--request-timeout", type=float, default=600.0)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default="synthetic",
                   choices=("synthetic", "sharegpt", "long", "shared-prefix"))
    g.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON (--workload sharegpt)")
    g.add_argument("--num-prompts", type=int, default=100, help="requests per level")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--prompt-len-median", type=float, default=SHAREGPT_PROMPT.median)
    g.add_argument("--prompt-len-sigma", type=float, default=SHAREGPT_PROMPT.sigma)
    g.add_argument("--output-len-median", type=float, default=SHAREGPT_OUTPUT.median)
    g.add_argument("--output-len-sigma", type=float, default=SHAREGPT_OUTPUT.sigma)
    g.add_argument("--min-len", type=int, default=4, help="shortest prompt and output")
    g.add_argument("--max-prompt-len", type=int, default=SHAREGPT_PROMPT.hi)
    g.add_argument("--max-output-len", type=int, default=SHAREGPT_OUTPUT.hi)
    g.add_argument("--max-model-len", type=int, default=None,
                   help="keep prompt + output under this (the server's context)")
    g.add_argument("--long-prompt-len", type=int, default=768, help="--workload long")
    g.add_argument("--num-system-prompts", type=int, default=4, help="--workload shared-prefix")
    g.add_argument("--system-prompt-len", type=int, default=256, help="--workload shared-prefix")
    g.add_argument("--kv-policy-mix", default=None,
                   help="per-request kv_policy: 'full:0.5,streaming:0.5' or JSON "
                   "'[[0.5, \"full\"], [0.5, {\"name\": \"streaming\", \"window\": 64}]]'")
    g.add_argument("--token-ids", action="store_true", help="send prompts as token ids")
    g.add_argument("--vocab-size", type=int, default=None, help="--token-ids without --tokenizer")
    g.add_argument("--tokenizer", default=None,
                   help="local tokenizer directory for exact prompt lengths (default: "
                   "--model when it is a directory)")
    g.add_argument("--chars-per-token", type=float, default=4.0,
                   help="length estimate without a tokenizer")


def client_from_args(a: argparse.Namespace) -> ClientConfig:
    headers = dict(h.split("=", 1) for h in a.header)
    if a.api_key:
        headers.setdefault("Authorization", f"Bearer {a.api_key}")
    return ClientConfig(endpoint=a.endpoint, model=a.model, backend=a.backend,
                        temperature=a.temperature, ignore_eos=not a.no_ignore_eos,
                        logprobs=a.logprobs,
                        extra_body=json.loads(a.extra_body) if a.extra_body else {},
                        headers=headers)


def workload_from_args(a: argparse.Namespace) -> tuple[WorkloadConfig, TextMaker]:
    tok_path = a.tokenizer or (a.model if a.model and os.path.isdir(a.model) else None)
    tokenizer = load_tokenizer(tok_path)
    vocab = a.vocab_size or (len(tokenizer) if tokenizer is not None else None)
    mix = parse_policy_mix(a.kv_policy_mix)
    if mix and a.backend == "transformers":
        raise SystemExit("--kv-policy-mix: the transformers backend has no kv_policy field")
    if a.workload == "sharegpt" and not a.dataset_path:
        raise SystemExit("--workload sharegpt needs --dataset-path FILE")
    cfg = WorkloadConfig(
        kind=a.workload, num_requests=a.num_prompts, seed=a.seed,
        prompt=LengthDist(a.prompt_len_median, a.prompt_len_sigma, a.min_len, a.max_prompt_len),
        output=LengthDist(a.output_len_median, a.output_len_sigma, a.min_len, a.max_output_len),
        max_model_len=a.max_model_len, sharegpt_path=a.dataset_path,
        long_prompt_len=a.long_prompt_len, num_system_prompts=a.num_system_prompts,
        system_prompt_len=a.system_prompt_len, policy_mix=mix, token_ids=a.token_ids,
        vocab_size=vocab, chat="chat" in a.endpoint)
    if a.token_ids and vocab is None:
        raise SystemExit("--token-ids needs --tokenizer or --vocab-size")
    return cfg, TextMaker(a.seed, tokenizer, a.chars_per_token)


def floats(spec: str) -> list[float]:
    return [float(x) for x in spec.split(",") if x.strip()]
