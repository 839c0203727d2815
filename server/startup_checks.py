"""The server's start-up checks: what a user fixes on the command line or in the
environment, found before the model loads, reported as one `kvserve: error:` line with
exit status 2. No torch at import: the CLI sets the CPU threads before torch loads."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any, NoReturn

from engine.demo import DEMO_MODEL_DIR as DEMO_MODEL

USAGE_ERROR = 2  # argparse's status for a bad command line; ours for every start-up check


def fail(message: str) -> NoReturn:
    """One line on stderr and exit 2: a start-up error the user fixes on the command line
    (or in the environment), found before any model is loaded."""
    error_line(message)
    raise SystemExit(USAGE_ERROR)


def error_line(message: str) -> None:
    """`kvserve: error: ...` on stderr, one line."""
    print(f"kvserve: error: {' '.join(message.split())}", file=sys.stderr)


def usage_error(e: BaseException) -> bool:
    """Whether a load failure is one the user fixes with an option, not a broken model:
    a KV pool sized from the memory left after the weights that holds no request."""
    from attention.sizing import KVPoolTooSmall

    return isinstance(e, KVPoolTooSmall)


def resolve_model(arg: str | None) -> str:
    path = Path(arg) if arg else DEMO_MODEL
    if not path.is_dir():
        hint = ("the bundled demo model is not there (it is built separately)"
                if arg is None else "no such directory")
        fail(f"--model {str(path)!r}: {hint}; pass --model DIR (a Hugging Face "
             "checkpoint directory with config.json, weights and tokenizer)")
    return str(path)


def default_kv_policy(value: str, kv_layout: str = "layer") -> Any:
    """`--default-kv-policy`: a policy name or a JSON `kv_policy` object, checked exactly
    as a request's `kv_policy` is (policies/config.py), and against `--kv-layout` (a
    per-head policy on a per-layer pool), so a typo stops the server at once instead of
    failing every request that names no policy."""
    from policies.catalog import parse_kv_policy
    from policies.config import KVPolicyError
    from scheduler.resolve import check_layout

    text = value.strip()
    parsed: Any = text
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except ValueError as e:
            fail(f"--default-kv-policy is not valid JSON: {e}")
    try:
        config = parse_kv_policy(parsed)
        check_layout(config, kv_layout == "head")
    except KVPolicyError as e:
        fail(f"--default-kv-policy: {e}")
    return config


def add_generation_config_arg(engine: argparse._ArgumentGroup) -> None:
    """`kvserve serve --generation-config` (vLLM's flag), beside the model's options."""
    engine.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                        help="defaults of the sampling fields a request leaves unset "
                        "(temperature, top_p, top_k, min_p, repetition_penalty; "
                        "max_new_tokens lowers the default max_tokens): auto takes them "
                        "from the model's generation_config.json, vllm ignores the file "
                        "(kvserve's own defaults), DIR reads DIR/generation_config.json")


def check_generation_config(value: str, model: str) -> None:
    """`--generation-config` read before the model loads: a folder that is not there or
    holds no generation_config.json, or a file with a value no request could send, stops
    the server (exit 2)."""
    from engine.generation_defaults import read_sampling_defaults

    try:
        read_sampling_defaults(model, value)
    except ValueError as e:
        hint = "; --generation-config vllm ignores the file" if value == "auto" else ""
        fail(f"--generation-config {value}: {e}{hint}")


def check_kv_cache_dtype(value: str) -> None:
    """`--kv-cache-dtype` checked before the model loads (exit 2), after torch may load."""
    from scheduler.engine_core import KV_CACHE_DTYPES

    if value not in KV_CACHE_DTYPES:
        fail(f"--kv-cache-dtype {value!r}: choose from {', '.join(KV_CACHE_DTYPES)}")


def check_byte_sizes(a: argparse.Namespace) -> None:
    """`--kv-cache-memory`, `--swap-space` and env KVSERVE_MEMORY_LIMIT read as byte
    sizes before the model loads (exit 2 on one that is not)."""
    from native.memory import ENV_LIMIT, parse_bytes

    for name, value in (("--kv-cache-memory", a.kv_cache_memory),
                        ("--swap-space", a.swap_space),
                        (ENV_LIMIT, os.environ.get(ENV_LIMIT, "").strip() or None)):
        try:
            if value is not None:
                parse_bytes(value)
        except ValueError as e:
            fail(f"{name}: {e}")


def check_port_free(host: str, port: int) -> None:
    """Bind (host, port) as uvicorn will, and let go: a port in use is then a clear
    one-line error at once. Without it, uvicorn runs the lifespan (which starts loading
    the model) before it binds, and a failed bind then waits for the whole load before
    it exits with status 1."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as e:
        fail(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --port "
             "or stop what is using it")


def add_tool_call_args(serve: argparse.ArgumentParser) -> None:
    """`kvserve serve`'s tool-calling options, under vLLM's names (beside their check,
    which keeps cli.py short)."""
    from server.tool_parsers import PARSERS

    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='answer tool_choice "auto" (the default when a request has '
                       "tools) by reading calls from the model's text with "
                       "--tool-call-parser; without it such requests are a 400, as in vLLM")
    serve.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help=f"the model's tool-call format: {', '.join(PARSERS)} "
                       "(docs/agents.md: which fits which model family)")
    from server.reasoning import REASONING_PARSERS

    serve.add_argument("--reasoning-parser", default=None, metavar="NAME",
                       help="split chat answers into reasoning_content and content: "
                       f"{', '.join(REASONING_PARSERS)} (docs/agents.md)")
    serve.add_argument("--responses-store-size", type=int, default=1000, metavar="N",
                       help="/v1/responses kept for previous_response_id (least recently "
                       "used evicted first; 0 keeps none)")


def check_tool_call_args(a: argparse.Namespace) -> None:
    """An unknown `--tool-call-parser`, or `--enable-auto-tool-choice` without one,
    stops the server before the model loads (exit 2, the known names listed)."""
    from server.tool_parsers import PARSERS

    names = ", ".join(PARSERS)
    if a.tool_call_parser is not None and a.tool_call_parser not in PARSERS:
        fail(f"--tool-call-parser {a.tool_call_parser!r} is not a tool-call parser; "
             f"choose from {names}")
    if a.enable_auto_tool_choice and a.tool_call_parser is None:
        fail(f"--enable-auto-tool-choice needs --tool-call-parser NAME (one of {names})")
    from server.reasoning import REASONING_PARSERS

    if a.reasoning_parser is not None and a.reasoning_parser not in REASONING_PARSERS:
        fail(f"--reasoning-parser {a.reasoning_parser!r} is not a reasoning parser; "
             f"choose from {', '.join(REASONING_PARSERS)}")
    if a.responses_store_size < 0:
        fail("--responses-store-size must be >= 0")


def agent_settings(a: argparse.Namespace) -> dict[str, Any]:
    """The ServerSettings fields of the reasoning and /v1/responses options."""
    return {"reasoning_parser": a.reasoning_parser,
            "responses_store_size": a.responses_store_size}
