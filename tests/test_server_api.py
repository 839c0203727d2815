"""The OpenAI-compatible API on a real uvicorn (127.0.0.1, ephemeral port) with the
official `openai` client and httpx: results, streaming, usage, parity with the offline
engine, seeded n>1, and the documented fields."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine.sampling import SamplingParams
from scheduler.llm import LLM
from server.testing import ServerThread
from tests.live_server import openai_client, tiny_server
from tests.tiny_models import make_tiny_model

MODEL = "tiny"
NOEOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[ServerThread]:
    with tiny_server(model_dir, (MODEL,)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def offline(model_dir: str) -> LLM:
    return LLM(model_dir, num_blocks=256)


def test_completion_sync(client: openai.OpenAI, offline: LLM) -> None:
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=8,
                                  temperature=0, extra_body=NOEOS)
    ref = offline.generate(["hello world"], SamplingParams(max_tokens=8, temperature=0,
                                                           ignore_eos=True))[0]
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.prompt_ids)
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == len(ref.prompt_ids) + 8
    kv = r.usage.model_extra["kv_cache"]
    assert kv["policy"] == "full" and kv["peak_blocks"] > 0 and kv["evicted_tokens"] == 0
    assert len(ref.prompt_ids) <= kv["peak_live_tokens"] <= len(ref.prompt_ids) + 8


def test_completion_stream_sync(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="abc", max_tokens=6, temperature=0,
                                     extra_body=NOEOS)
    chunks = list(client.completions.create(
        model=MODEL, prompt="abc", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=NOEOS))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_sync_and_stream(client: openai.OpenAI) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5,
                                       temperature=0, extra_body=NOEOS)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 5
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5,
                                            temperature=0, stream=True, extra_body=NOEOS)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_async_client(server: ServerThread) -> None:
    async def main() -> None:
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        r = await ac.completions.create(model=MODEL, prompt="xyz", max_tokens=4,
                                        temperature=0, extra_body=NOEOS)
        parts = []
        async for c in await ac.completions.create(model=MODEL, prompt="xyz", max_tokens=4,
                                                   temperature=0, stream=True,
                                                   extra_body=NOEOS):
            parts.append(c.choices[0].text)
        assert "".join(parts) == r.choices[0].text
        chat = await ac.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "yo"}], max_completion_tokens=3,
            stream=True, stream_options={"include_usage": True}, extra_body=NOEOS)
        chunks = [c async for c in chat]
        assert chunks[-1].usage.completion_tokens == 3
        await ac.close()

    asyncio.run(main())


def test_seeded_n3_is_reproducible(client: openai.OpenAI) -> None:
    def run() -> list[str]:
        r = client.completions.create(model=MODEL, prompt="once upon", max_tokens=8, n=3,
                                      seed=1234, temperature=1.0, extra_body=NOEOS)
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert r.usage.completion_tokens == 24
        return [c.text for c in r.choices]

    a, b = run(), run()
    assert a == b
    assert len(set(a)) > 1  # seed, seed+1, seed+2: different samples


def test_batched_prompts_and_token_ids(client: openai.OpenAI, offline: LLM) -> None:
    ids = offline.tokenizer.encode("hi there")
    r = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=4,
                                  temperature=0, n=2, extra_body=NOEOS)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    as_text = client.completions.create(model=MODEL, prompt=["hi there"], max_tokens=4,
                                        temperature=0, extra_body=NOEOS)
    assert {c.text for c in r.choices} == {as_text.choices[0].text}  # same prompt, greedy
    assert r.usage.prompt_tokens == 2 * len(ids)


def test_logprobs_echo_stop(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="ab", max_tokens=3, temperature=0,
                                  logprobs=2, extra_body=NOEOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    r = client.completions.create(model=MODEL, prompt="ab", max_tokens=3, echo=True,
                                  extra_body=NOEOS)
    assert r.choices[0].text.startswith("ab")
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}],
                                       max_tokens=3, logprobs=True, top_logprobs=2,
                                       extra_body=NOEOS)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    base = client.completions.create(model=MODEL, prompt="ab", max_tokens=12, temperature=0,
                                     extra_body=NOEOS).choices[0].text
    stop = next(ch for ch in base[2:] if ch.isprintable() and ch != "\ufffd")
    s = client.completions.create(model=MODEL, prompt="ab", max_tokens=12, temperature=0,
                                  stop=[stop], extra_body=NOEOS)
    assert s.choices[0].finish_reason == "stop" and stop not in s.choices[0].text


def test_kv_policy_and_extras(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for policy in ("full", {"name": "full"}, None):
            body = {"prompt": "hi", "max_tokens": 2, "kv_policy": policy, "priority": -3,
                    "user": "u1", "top_k": 5, "top_p": 0.9, "min_p": 0.05, "seed": 7,
                    "stop_token_ids": [2], "frequency_penalty": 0}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["kv_cache"]["policy"] == "full"


def test_eviction_policy_shows_in_usage(client: openai.OpenAI) -> None:
    policy = {"name": "streaming", "sink": 4, "window": 16}
    r = client.completions.create(model=MODEL, prompt="y" * 60, max_tokens=30,
                                  extra_body={"kv_policy": policy, **NOEOS})
    kv = r.usage.model_extra["kv_cache"]
    assert kv["policy"] == "streaming" and kv["evicted_tokens"] > 0
    assert kv["peak_live_tokens"] < 60 + 30 - 1


def test_probes_models_version(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        assert c.get("/health").json() == {"status": "ok"}
        assert c.get("/ready").status_code == 200
        models = c.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert "version" in c.get("/version").json()


def test_kv_policies_listing(server: ServerThread) -> None:
    """GET /v1/kv_policies: every policy, its parameters' schema and meaning, and the
    defaults resolved for this model's context."""
    with httpx.Client(base_url=server.url, timeout=10) as c:
        ctx = c.get("/v1/models").json()["data"][0]["max_model_len"]
        body = c.get("/v1/kv_policies").json()
    assert body["object"] == "list"
    by_name = {p["name"]: p for p in body["data"]}
    assert len(by_name) == 13 and all(p["object"] == "kv_policy" for p in body["data"])
    assert [p["name"] for p in body["data"] if p["server_default"]] == ["full"]
    budget = by_name["tova"]["parameters"]["budget"]
    assert budget["default"] == round(0.25 * ctx) and "anyOf" in budget
    assert by_name["streaming"]["parameters"]["rope"]["enum"] == ["original", "shift"]


def test_metrics_parse_and_documented_names_exist(server: ServerThread) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    with httpx.Client(base_url=server.url, timeout=30) as c:
        c.post("/v1/completions", json={"prompt": "m", "max_tokens": 2})
        text = c.get("/metrics").text
    names = set()
    for fam in text_string_to_metric_families(text):
        names.add(fam.name)
        names.update(s.name for s in fam.samples)
    doc = (Path(__file__).parent.parent / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"`(kvserve_[a-z0-9_]+)", doc))
    assert len(documented) > 25
    # the engine process's series exist with --engine-layout process only: there they
    # are checked by tests/test_engine_process.py
    documented = {n for n in documented if not n.startswith("kvserve_engine_process_")}
    missing = sorted(documented - names)
    assert not missing, missing
    assert not any("request_id" in line or "cmpl-" in line for line in text.splitlines()
                   if line.startswith("kvserve_"))


def test_api_doc_covers_every_field() -> None:
    from server.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        DetokenizeRequest,
        TokenizeChatRequest,
        TokenizeCompletionRequest,
    )

    doc = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    for schema in (TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest):
        fields |= set(schema.model_fields)
    fields |= {"include_usage", "kv_cache", "peak_live_tokens", "peak_blocks",
               "evicted_tokens", "prefix_hit_tokens", "prompt_tokens_details",
               "cached_tokens", "count", "max_model_len", "token_strs",
               "GET /v1/models/{id}", "POST /tokenize", "POST /detokenize"}
    missing = sorted(f for f in fields if f"`{f}`" not in doc)
    assert not missing, missing
    assert doc.count("curl ") >= 4


def test_sse_framing(server: ServerThread) -> None:
    body = {"prompt": "s", "max_tokens": 3, "n": 2, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    finished = {}
    for e in events[:-2]:
        assert e.startswith("data: ")
        chunk = json.loads(e[6:])
        for ch in chunk["choices"]:
            assert ch["index"] not in finished  # nothing after a choice's last chunk
            if ch["finish_reason"] is not None:
                finished[ch["index"]] = ch["finish_reason"]
    assert finished == {0: "length", 1: "length"}


def test_penalties_and_logit_bias_reach_the_sampler(client: openai.OpenAI, offline: LLM) -> None:
    """The OpenAI fields (and vLLM's repetition_penalty) give what the offline engine
    gives with the same SamplingParams, on both endpoints; a bias of 100 forces its token."""
    kw = dict(presence_penalty=0.5, frequency_penalty=1.0, logit_bias={"7": 3.5, "9": -100})
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=10,
                                  temperature=0, extra_body={**NOEOS, "repetition_penalty": 1.3},
                                  **kw)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, presence_penalty=0.5,
                            frequency_penalty=1.0, repetition_penalty=1.3,
                            logit_bias={7: 3.5, 9: -100.0})
    ref = offline.generate(["hello world"], params)[0]
    plain = offline.generate(["hello world"], SamplingParams(max_tokens=10, temperature=0,
                                                             ignore_eos=True))[0]
    assert r.choices[0].text == ref.text != plain.text
    assert 9 not in ref.token_ids
    forced = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logit_bias={"5": 100}, extra_body=NOEOS)
    one = offline.engine.tokenizer.decode([5] * 4)
    assert forced.choices[0].message.content == one


def test_vllm_request_extras(client: openai.OpenAI, server: ServerThread, offline: LLM,
                             caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's extra request fields that kvserve implements behave as vLLM's; an unknown
    field is ignored and logged; one that would constrain the output is refused (the
    400s are in tests/test_server_errors.py)."""
    ids = list(range(5, 16))
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                  extra_body={**NOEOS, "truncate_prompt_tokens": 4,
                                              "use_beam_search": False, "foo_bar": 1})
    ref = offline.generate([ids[-4:]], SamplingParams(max_tokens=6, temperature=0,
                                                      ignore_eos=True))[0]
    assert r.usage.prompt_tokens == 4 and r.choices[0].text == ref.text
    assert any("request fields ignored: foo_bar" in m for m in caplog.messages)
    base = client.completions.create(model=MODEL, prompt="ab", max_tokens=12, temperature=0,
                                     extra_body=NOEOS).choices[0].text
    stop = next(ch for ch in base[2:] if ch.isprintable() and ch != "\ufffd")
    kept = client.completions.create(model=MODEL, prompt="ab", max_tokens=12, temperature=0,
                                     stop=[stop], extra_body={**NOEOS, "include_stop_str_in_output": True})
    assert kept.choices[0].text == base[: base.index(stop) + 1]
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello th"}]
    body = {"add_generation_prompt": False, "continue_final_message": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        count = c.post("/tokenize", json={"messages": msgs, **body}).json()["count"]
    cont = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3,
                                          extra_body={**body, "chat_template_kwargs": {"x": 1}})
    assert cont.usage.prompt_tokens == count
