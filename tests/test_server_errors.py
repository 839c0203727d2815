"""Every error case answers in OpenAI's shape with the right status and `param`; random
malformed bodies never produce a 5xx and never stop the server."""

from __future__ import annotations

import json
import random
import time
import types
import typing
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from scheduler.async_engine import AsyncEngine
from scheduler.engine_core import EngineConfig
from server.app import build_app
from server.settings import ServerSettings
from server.testing import ServerThread
from tests.tiny_models import make_tiny_model

MODEL = "tiny"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[ServerThread]:
    engine = AsyncEngine.from_config(EngineConfig(model=model_dir, num_blocks=512))
    app = build_app(engine, ServerSettings(served_model_names=[MODEL], model_path=model_dir,
                                           max_body_bytes=64 * 1024))
    with ServerThread(app) as s:
        yield s


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def assert_error(r: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


COMPLETION_400 = [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": 1e308}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 10**12}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 100_000}, "max_tokens"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "seed": 2**70}, "seed"),
    ({"prompt": "x", "priority": "high"}, "priority"),
    ({"prompt": "x", "stream": "maybe"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "x", "guided_json": {"type": "nope"}}, "guided_json"),
    ({"prompt": "x", "guided_choice": []}, "guided_choice"),
    ({"prompt": "x", "structured_outputs": {"regex": "a+("}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"choice": "ab"}}, "structured_outputs"),
    ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ({"prompt": "x", "bad_words": ["x"]}, "bad_words"),
    ({"prompt": "x", "allowed_token_ids": [99999]}, "allowed_token_ids"),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "x", "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
    ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt": "x", "logit_bias": {"five": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": "up"}}, "logit_bias.5"),
    ({"prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids"),
    ({"prompt": "x", "kv_policy": "nope"}, "kv_policy"),
    ({"prompt": "x", "kv_policy": 5}, "kv_policy"),
    ({"prompt": "x", "kv_policy": {"budget": 3}}, "kv_policy.name"),
    ({"prompt": "x", "kv_policy": {"name": "nope"}}, "kv_policy.name"),
    ({"prompt": "x", "kv_policy": {"name": "streaming", "window": 0}}, "kv_policy.window"),
    ({"prompt": "x", "kv_policy": {"name": "streaming", "windw": 8}}, "kv_policy.windw"),
    ({"prompt": "x", "kv_policy": {"name": "full", "window": 3}}, "kv_policy.window"),
    ({"prompt": [5, 99999]}, "prompt"),
    ({"prompt": [5, -1]}, "prompt.1"),
    ({"prompt": [[5], [6, "x"]]}, "prompt.1.1"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "a" * 300}, "prompt"),
    ({"prompt": "x" * 200, "max_tokens": 100}, "max_tokens"),
    ({}, "prompt"),
    ({"prompt": None}, "prompt"),
]

CHAT_400 = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content.0.type"),
    ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": MSG, "tools": [{"type": "function"}]}, "tools.0.function"),
    ({"messages": MSG, "logit_bias": {"1.5": 1}}, "logit_bias"),
    ({"messages": MSG, "echo": True}, "echo"),
    ({"messages": MSG, "functions": [{"name": "f"}]}, "functions"),
    ({"messages": MSG, "continue_final_message": True}, "continue_final_message"),
    ({"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"messages": MSG, "chat_template_kwargs": 5}, "chat_template_kwargs"),
    ({"messages": MSG, "max_completion_tokens": 10**9}, "max_completion_tokens"),
    ({"messages": MSG, "max_tokens": 10**9}, "max_tokens"),
    ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "a" * 300}]}, "messages"),
    ({"messages": MSG, "kv_policy": {"name": "full", "sink": -1}}, "kv_policy.sink"),
]


@pytest.mark.parametrize(("body", "param"), COMPLETION_400, ids=lambda x: str(x)[:40])
def test_completion_400(http: httpx.Client, body: dict, param: str) -> None:
    assert_error(http.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize(("body", "param"), CHAT_400, ids=lambda x: str(x)[:40])
def test_chat_400(http: httpx.Client, body: dict, param: str) -> None:
    assert_error(http.post("/v1/chat/completions", json=body), 400, param)


def _leaf_types(annotation: Any) -> set[Any]:
    """The types a field takes: Optional, unions and Annotated constraints unwrapped."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set().union(*(_leaf_types(a) for a in typing.get_args(annotation)))
    if typing.get_origin(annotation) is typing.Annotated:
        return _leaf_types(typing.get_args(annotation)[0])
    return {annotation}


def _scalar_fields(schema: type, kind: type) -> list[str]:
    return sorted(name for name, f in schema.model_fields.items()
                  if _leaf_types(f.annotation) - {type(None)} == {kind})


# What OpenAI answers 400 to and lax pydantic would coerce: strings for numbers, floats
# (even integral ones) and booleans for integers, numbers and strings for booleans.
BAD_SCALARS = {int: ["4", 5.5, 5.0, True], float: ["0.5", True], bool: ["true", 1, 0]}


@pytest.mark.parametrize("kind", [int, float, bool], ids=lambda k: k.__name__)
def test_scalar_fields_are_strict(http: httpx.Client, kind: type) -> None:
    from server.protocol import ChatCompletionRequest, CompletionRequest

    endpoints = [("/v1/completions", CompletionRequest, {"prompt": "x", "max_tokens": 1}),
                 ("/v1/chat/completions", ChatCompletionRequest,
                  {"messages": MSG, "max_tokens": 1})]
    checked = 0
    for path, schema, base in endpoints:
        names = _scalar_fields(schema, kind)
        assert names, schema  # the introspection finds the fields it should
        for name in names:
            for value in BAD_SCALARS[kind]:
                err = assert_error(http.post(path, json={**base, name: value}), 400, name)
                assert name in err["message"], err
                checked += 1
    expected_ints = {"max_tokens", "top_k", "n", "seed", "priority", "logprobs", "best_of",
                     "max_completion_tokens", "top_logprobs", "prompt_logprobs", "min_tokens",
                     "truncate_prompt_tokens"}
    if kind is int:
        found = set(_scalar_fields(CompletionRequest, int)) | set(
            _scalar_fields(ChatCompletionRequest, int))
        assert found == expected_ints
    assert checked > 10
    body = {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}
    assert_error(http.post("/v1/completions", json=body), 400, "stream_options.include_usage")


def test_strict_scalars_still_take_what_openai_takes(http: httpx.Client) -> None:
    """A JSON integer is a valid number (temperature 0, top_p 1), and null is unset."""
    body = {"prompt": "x", "max_tokens": 2, "temperature": 0, "top_p": 1, "min_p": 0,
            "seed": -3, "n": 1, "logprobs": None, "stream": False, "echo": False}
    assert http.post("/v1/completions", json=body).status_code == 200


def test_bad_json_unknown_model_routes(http: httpx.Client) -> None:
    for raw in (b"{bad", b"[1, 2]", b"", b"\xff\xfe", b"[" * 100_00 + b"]" * 100_00, b"null"):
        assert_error(http.post("/v1/completions", content=raw,
                               headers={"content-type": "application/json"}), 400)
    assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404,
                 "model", "model_not_found")
    assert_error(http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MSG}),
                 404, "model", "model_not_found")
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)
    # unknown top-level fields are ignored (newer OpenAI fields), not an error
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1,
                                              "store": True}).status_code == 200


def test_413_body_too_large(server: ServerThread, http: httpx.Client) -> None:
    big = {"prompt": "x" * (100 * 1024)}
    assert_error(http.post("/v1/completions", json=big), 413, code="request_too_large")

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"y" * 1024
        yield b'"}'

    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/v1/completions", content=chunks(),
                   headers={"content-type": "application/json"})
    assert_error(r, 413)


def _fuzz_value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["int", "neg", "huge", "float", "str", "bool", "none", "list", "dict", "unicode"]
    k = rng.choice(kinds if depth < 3 else kinds[:7])
    return {
        "int": lambda: rng.randint(-10, 300),
        "neg": lambda: -rng.randint(1, 10**6),
        "huge": lambda: rng.choice([10**30, -(10**30), 1e300, -1e300, 2**63, 2**64]),
        "float": lambda: rng.uniform(-5, 5),
        "str": lambda: rng.choice(["", "x", "full", "h2o", "-1", "1e9", "null"]),
        "bool": lambda: rng.random() < 0.5,
        "none": lambda: None,
        "list": lambda: [_fuzz_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
        "dict": lambda: {rng.choice(["name", "x", "window", "sink", "budget"]):
                         _fuzz_value(rng, depth + 1) for _ in range(rng.randint(0, 3))},
        "unicode": lambda: "\u2603\ud7ff\U0001f600",
    }[k]()


FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "min_p", "n", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs",
          "top_logprobs", "echo", "user", "priority", "kv_policy", "stream", "stream_options",
          "model"]


def _fuzz_body(rng: random.Random) -> tuple[str, bytes]:
    path = rng.choice(["/v1/completions", "/v1/chat/completions"])
    roll = rng.random()
    if roll < 0.1:  # not JSON at all / truncated JSON
        base = json.dumps({"prompt": "x", "messages": MSG}).encode()
        return path, rng.choice([base[: rng.randint(0, len(base) - 1)],
                                 bytes(rng.randrange(256) for _ in range(20))])
    body: dict[str, Any] = ({"prompt": "hi"} if "chat" not in path else {"messages": MSG})
    body["max_tokens"] = 1
    for f in rng.sample(FIELDS, rng.randint(1, 4)):
        body[f] = _fuzz_value(rng)
    if rng.random() < 0.3:  # unknown fields in an otherwise valid-looking kv_policy
        body["kv_policy"] = {"name": rng.choice(["full", "streaming", 3]),
                             rng.choice(["windw", "sink", "x"]): _fuzz_value(rng)}
    return path, json.dumps(body).encode()


def test_fuzz_never_5xx(server: ServerThread, http: httpx.Client) -> None:
    rng = random.Random(20240601)
    statuses: dict[int, int] = {}
    for _ in range(200):
        path, raw = _fuzz_body(rng)
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (raw[:300], r.text)
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert statuses.get(400, 0) > 100, statuses
    assert http.get("/health").status_code == 200
    ok = http.post("/v1/completions", json={"prompt": "still alive", "max_tokens": 2})
    assert ok.status_code == 200
    engine = server.server.config.app.state.engine
    deadline = time.monotonic() + 10
    while engine.num_active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_active == 0


def test_auth_queue_full_and_draining(model_dir: str) -> None:
    """401 without the key, 429 with Retry-After when the queue is full, 503 draining."""
    engine = AsyncEngine.from_config(EngineConfig(model=model_dir, num_blocks=512,
                                                  max_num_seqs=1), max_queued_requests=1)
    engine.add_step_listener(lambda _: time.sleep(0.02))  # keep request A running for seconds
    settings = ServerSettings(served_model_names=[MODEL], model_path=model_dir,
                              api_key="sekrit")
    auth = {"Authorization": "Bearer sekrit"}
    with ServerThread(build_app(engine, settings)) as s, \
            httpx.Client(base_url=s.url, timeout=60) as c:
        assert_error(c.post("/v1/completions", json={"prompt": "x"}), 401,
                     code="invalid_api_key")
        assert_error(c.post("/v1/completions", json={"prompt": "x"},
                            headers={"Authorization": "Bearer wrong"}), 401)
        assert c.get("/health").status_code == 200  # probes need no key
        assert c.get("/v1/models", headers=auth).status_code == 200

        long = {"prompt": "a", "max_tokens": 240, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=long, headers=auth) as running:
            next(running.iter_lines())  # A holds the only sequence slot
            with httpx.Client(base_url=s.url, timeout=60) as c2, \
                    c2.stream("POST", "/v1/completions", json=long, headers=auth) as waiting:
                assert waiting.status_code == 200  # B is admitted and waits in the queue
                r = c.post("/v1/completions", json={"prompt": "c"}, headers=auth)
                assert_error(r, 429, code="queue_full")
                assert int(r.headers["retry-after"]) >= 1
        # drain: /ready and new requests answer 503, /health stays up
        assert s.call(engine.drain(5.0)) in (True, False)
        r = c.get("/ready")
        assert_error(r, 503, code="draining")
        assert_error(c.post("/v1/completions", json={"prompt": "x"}, headers=auth), 503,
                     code="draining")
        assert c.get("/health").status_code == 200

