"""One rule for prompt + max_tokens against the context (`scheduler/limits.py`), applied
once, by `scheduler/resolve.py`, on both ways in (HTTP and the offline `LLM`); the engine
(`AsyncEngine.submit`, `EngineCore.add_request`) runs what it resolved: a `kv_policy` with
`rope: "shift"` may generate past the model's positions; any other request past the
context is refused, naming `max_tokens`; with no max_tokens the default never runs past
the context."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine.sampling import SamplingParams
from scheduler.async_engine import AsyncEngine, GenerationRequest
from scheduler.engine_core import EngineConfig, EngineCore
from scheduler.limits import DEFAULT_MAX_TOKENS, fit_max_tokens
from scheduler.llm import LLM
from scheduler.outputs import RequestRejected
from scheduler.resolve import resolve_request
from server.app import build_app
from server.settings import ServerSettings
from server.testing import ServerThread
from tests.tiny_models import make_tiny_model

MODEL = "tiny"
CONTEXT = 64  # the tiny model's max_position_embeddings
SHIFT = {"name": "streaming", "sink": 4, "window": 16, "rope": "shift"}
ORIGINAL = {"name": "streaming", "sink": 4, "window": 16}  # rope: original
PROMPT = list(range(5, 25))  # 20 byte tokens
PAST = 100  # PROMPT + PAST = 120 > CONTEXT
MSG = [{"role": "user", "content": "hi"}]


def rejected(fn: Any, *args: Any, **kwargs: Any) -> str | None:
    with pytest.raises(RequestRejected) as e:
        fn(*args, **kwargs)
    return e.value.param


# ---- the rule ------------------------------------------------------------------------

def test_given_max_tokens() -> None:
    assert fit_max_tokens(20, 44, CONTEXT) == 44  # exactly the context
    assert rejected(fit_max_tokens, 20, 45, CONTEXT) == "max_tokens"
    assert fit_max_tokens(20, 10_000, CONTEXT, rope_shift=True) == 10_000
    # the prompt alone: one token of room, or (rope shift) all of the context
    assert rejected(fit_max_tokens, CONTEXT, 1, CONTEXT) == "prompt"
    assert fit_max_tokens(CONTEXT, 5, CONTEXT, rope_shift=True) == 5
    # under rope shift a prompt past the context is prefilled in bounded chunks
    assert fit_max_tokens(4 * CONTEXT, 5, CONTEXT, rope_shift=True) == 5
    assert rejected(fit_max_tokens, 4 * CONTEXT, None, CONTEXT, rope_shift=True) == "prompt"


def test_default_max_tokens() -> None:
    assert fit_max_tokens(20, None, CONTEXT) == 44  # chat: what the context leaves
    assert fit_max_tokens(20, None, CONTEXT, rope_shift=True) == 44  # never past it
    assert fit_max_tokens(20, None, CONTEXT, capacity=32) == 12  # the pool holds less
    assert fit_max_tokens(20, None, CONTEXT, default=DEFAULT_MAX_TOKENS) == 16
    assert fit_max_tokens(60, None, CONTEXT, default=DEFAULT_MAX_TOKENS) == 4  # clipped
    assert rejected(fit_max_tokens, CONTEXT, None, CONTEXT, rope_shift=True) == "prompt"
    assert rejected(fit_max_tokens, 40, None, CONTEXT, capacity=32) == "prompt"


# ---- every way in ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama",
                           max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def engine(model_dir: str) -> AsyncEngine:
    return AsyncEngine.from_config(EngineConfig(model=model_dir, num_blocks=128))


@pytest.fixture(scope="module")
def server(engine: AsyncEngine, model_dir: str) -> Iterator[ServerThread]:
    app = build_app(engine, ServerSettings(served_model_names=[MODEL], model_path=model_dir))
    with ServerThread(app) as s:
        yield s


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def stream(http: httpx.Client, path: str, body: dict) -> tuple[list[dict], dict]:
    """The SSE chunks' choices and the final usage."""
    with http.stream("POST", path, json={**body, "stream": True,
                                         "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        raw = r.read().decode()
    chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
    assert raw.rstrip().endswith("data: [DONE]")
    return [c for ch in chunks for c in ch["choices"]], chunks[-1]["usage"]


def assert_400(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "context_length_exceeded", err
    assert err["type"] == "invalid_request_error"


def test_http_rope_shift_streams_past_the_context(http: httpx.Client) -> None:
    choices, usage = stream(http, "/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "max_tokens": PAST, "temperature": 0,
        "ignore_eos": True, "kv_policy": SHIFT})
    assert usage["prompt_tokens"] == len(PROMPT) and usage["completion_tokens"] == PAST
    assert usage["prompt_tokens"] + usage["completion_tokens"] > CONTEXT
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
    kv = usage["kv_cache"]
    assert kv["evicted_tokens"] > 0 and kv["peak_live_tokens"] < CONTEXT
    # chat too, with the newer field name
    choices, usage = stream(http, "/v1/chat/completions", {
        "model": MODEL, "messages": MSG, "max_completion_tokens": PAST, "ignore_eos": True,
        "kv_policy": SHIFT})
    assert usage["completion_tokens"] == PAST > CONTEXT
    # a prompt 4x the context, prefilled in chunks of the policy's bound
    long = [5 + (7 * i) % 200 for i in range(4 * CONTEXT)]
    choices, usage = stream(http, "/v1/completions", {
        "model": MODEL, "prompt": long, "max_tokens": 8, "ignore_eos": True,
        "kv_policy": SHIFT})
    assert usage["prompt_tokens"] == 4 * CONTEXT and usage["completion_tokens"] == 8
    assert usage["kv_cache"]["peak_live_tokens"] <= CONTEXT
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": long,
                                           "kv_policy": SHIFT})  # no max_tokens
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_http_past_the_context_is_a_400_on_max_tokens(http: httpx.Client) -> None:
    over = CONTEXT - len(PROMPT) + 1
    for policy in (None, "full", ORIGINAL):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": over}
        if policy is not None:
            body["kv_policy"] = policy
        assert_400(http.post("/v1/completions", json=body), "max_tokens")
        assert_400(http.post("/v1/completions", json={**body, "stream": True}), "max_tokens")
    chat = {"model": MODEL, "messages": MSG}
    assert_400(http.post("/v1/chat/completions", json={**chat, "max_tokens": CONTEXT}),
               "max_tokens")
    assert_400(http.post("/v1/chat/completions",
                         json={**chat, "max_completion_tokens": CONTEXT}),
               "max_completion_tokens")
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                            "max_tokens": over - 1, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == over - 1


def test_http_default_max_tokens_stays_inside_the_context(http: httpx.Client) -> None:
    long = list(range(5, 5 + CONTEXT - 4))  # 4 tokens of room: completions' 16 is clipped
    for policy in ("full", SHIFT):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": long,
                                               "ignore_eos": True, "kv_policy": policy})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG,
                                                "ignore_eos": True})
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT
    whole = list(range(5, 5 + CONTEXT))
    assert_400(http.post("/v1/completions", json={"model": MODEL, "prompt": whole}), "prompt")


def test_async_engine_submit(server: ServerThread, engine: AsyncEngine) -> None:
    """The API side's limits resolve as the core's would: a rope-shift request past the
    context is resolved as asked and streams all of it; any other is refused."""
    async def tokens(policy: Any) -> int:
        req = GenerationRequest(PROMPT, SamplingParams(max_tokens=PAST, ignore_eos=True),
                                kv_policy=policy)
        n = 0
        async with await engine.submit([req]) as s:
            async for out in s:
                n += len(out.new_token_ids)
        return n

    assert engine.limits is not None
    shift = resolve_request(engine.limits, SHIFT, [(len(PROMPT), PAST)])
    assert shift.max_tokens == (PAST,)
    assert server.call(tokens(shift.kv_policy), timeout=120) == PAST
    for policy in (None, ORIGINAL):
        assert rejected(resolve_request, engine.limits, policy,
                        [(len(PROMPT), PAST)]) == "max_tokens"
    assert engine.num_active == 0


def test_engine_add_request(model_dir: str) -> None:
    core = EngineCore(EngineConfig(model=model_dir, num_blocks=128))
    params = SamplingParams(max_tokens=PAST, ignore_eos=True, temperature=0)
    for policy in (None, "full", ORIGINAL):
        assert rejected(resolve_request, core.limits, policy,
                        [(len(PROMPT), PAST)]) == "max_tokens"
    assert rejected(resolve_request, core.limits, None, [(CONTEXT, 1)]) == "prompt"
    shift = resolve_request(core.limits, SHIFT, [(len(PROMPT), PAST)]).kv_policy
    core.add_request("shift", PROMPT, params, kv_policy=shift)
    n = 0
    while core.has_unfinished():
        for out in core.step():
            n += len(out.new_token_ids)
            last = out
    assert n == PAST and last.finish_reason == "length"
    assert core.pool.num_used == 0


def test_rope_shift_prompt_longer_than_the_context(model_dir: str) -> None:
    """Streaming with rope shift: a prompt 4x the model's positions is prefilled in
    chunks no longer than the context leaves beside its bound, renumbered after each, so
    every position stays inside the context (issue 20). A window too wide for the
    context under rope shift is refused, naming the kv_policy."""
    core = EngineCore(EngineConfig(model=model_dir, num_blocks=128, block_size=4))
    long = [5 + (7 * i) % 200 for i in range(4 * CONTEXT)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    # sink + window alone pass the 64 positions: what only the engine can tell (its
    # chunk), so the engine refuses it, naming the kv_policy
    wide = resolve_request(core.limits, {**SHIFT, "window": CONTEXT}).kv_policy
    assert rejected(core.add_request, "wide", long, params, kv_policy=wide) == "kv_policy"
    core.add_request("long", long, params, kv_policy=resolve_request(core.limits, SHIFT).kv_policy)
    seen = 0
    while core.has_unfinished():
        req = core.requests.get("long")
        for out in core.step():
            seen += len(out.new_token_ids)
            last = out
        if req is not None and req.cache is not None:
            assert req.num_computed - req.pos_offset <= CONTEXT  # next position in range
    assert seen == 12 and last.kv is not None and last.kv.evicted_tokens > 0
    # chunks of what the context leaves beside the bound: every position stays in it
    assert last.kv.peak_live_tokens <= CONTEXT
    assert core.pool.num_used == 0


def test_offline_llm(model_dir: str) -> None:
    llm = LLM(model_dir, num_blocks=128)
    over = SamplingParams(max_tokens=CONTEXT - len(PROMPT) + 1)
    with pytest.raises(RequestRejected) as e:
        llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=4), over])
    assert e.value.param == "max_tokens"
    assert not llm.engine.requests and not llm.engine.has_unfinished()  # none left queued
    long = list(range(5, 5 + CONTEXT - 4))
    (out,) = llm.generate([long])  # no params: completions' default, clipped to the room
    assert len(out.token_ids) == 4 or out.finish_reason == "stop"
    assert len(out.token_ids) <= 4
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4
