"""Prompt logprobs over HTTP on a real uvicorn: `echo` + `logprobs` (legacy format, the
official `openai` client), `max_tokens: 0` scoring, vLLM's `prompt_logprobs` field,
streaming with echo, and the prefix cache next to scoring requests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from server.testing import ServerThread
from tests.live_server import openai_client, tiny_server
from tests.tiny_models import make_tiny_model

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[ServerThread]:
    with tiny_server(model_dir, (MODEL,), block_size=4) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _ids(http: httpx.Client, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def _post(http: httpx.Client, **body: Any) -> dict[str, Any]:
    r = http.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_logprobs_max_tokens_0_with_the_openai_client(
        client: openai.OpenAI, http: httpx.Client, model_dir: str) -> None:
    """What lm-eval's loglikelihood requests do: echo the prompt with its logprobs and
    generate nothing. The values are transformers' log-softmax on the same tokens."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2,
                                  max_tokens=0)
    c = r.choices[0]
    ids = _ids(http, PROMPT)
    assert c.text == PROMPT and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # keyed by token text: two byte tokens that both decode to U+FFFD share one key
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [ref[j - 1, ids[j]].item() for j in range(1, len(ids))]
    worst = max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], expected))
    assert worst < 1e-3, worst
    for j in range(1, len(ids)):
        assert max(lp.top_logprobs[j].values()) == pytest.approx(ref[j - 1].max().item(),
                                                                 abs=1e-3)


def test_echo_logprobs_with_generated_tokens(http: httpx.Client) -> None:
    """Prompt tokens first, then the generated ones, which are those of the same request
    without echo; text is prompt + completion."""
    base = _post(http, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1,
                 ignore_eos=True)["choices"][0]
    echo = _post(http, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1,
                 ignore_eos=True, echo=True)["choices"][0]
    n = len(_ids(http, PROMPT))
    assert echo["text"] == PROMPT + base["text"]
    lp, gen = echo["logprobs"], base["logprobs"]
    assert len(lp["tokens"]) == n + 4
    assert lp["tokens"][n:] == gen["tokens"]
    assert lp["token_logprobs"][n:] == pytest.approx(gen["token_logprobs"], abs=1e-5)
    scored = _post(http, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)["choices"][0]
    assert lp["token_logprobs"][:n] == scored["logprobs"]["token_logprobs"]
    # offsets run on from the prompt's into the generated tokens
    assert lp["text_offset"] == sorted(lp["text_offset"])


def test_vllm_prompt_logprobs_field(http: httpx.Client) -> None:
    """vLLM's shape: None, then per prompt token {token id: {logprob, rank,
    decoded_token}}, the prompt token first, then the top N."""
    ids = _ids(http, PROMPT)
    body = _post(http, prompt=PROMPT, max_tokens=1, temperature=0, prompt_logprobs=3)
    c = body["choices"][0]
    assert c["logprobs"] is None
    plp = c["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    echo = _post(http, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)["choices"][0]
    for j, d in enumerate(plp[1:], 1):
        first, *top = d.items()
        assert first[0] == str(ids[j]) and set(first[1]) == {"logprob", "rank",
                                                             "decoded_token"}
        assert first[1]["logprob"] == echo["logprobs"]["token_logprobs"][j]
        ranks = [v["rank"] for _, v in top]
        assert 3 <= len(d) <= 4 and ranks == sorted(ranks) and ranks[0] in (1, 2)
        if first[1]["rank"] <= 3:  # the prompt token is among the top 3: not repeated
            assert len(d) == 3
        else:
            assert ranks == [1, 2, 3]
        assert all(isinstance(v["decoded_token"], str) for v in d.values())
    none = _post(http, prompt=PROMPT, max_tokens=1)["choices"][0]
    assert "prompt_logprobs" not in none


def test_batch_and_n_each_score_their_own_prompt(http: httpx.Client) -> None:
    prompts = ["hello there", "a longer second prompt, with more tokens"]
    body = _post(http, prompt=prompts, n=2, max_tokens=0, echo=True, logprobs=1)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for c in body["choices"]:
        p = prompts[c["index"] // 2]
        assert c["text"] == p
        assert len(c["logprobs"]["tokens"]) == len(_ids(http, p))
    assert body["choices"][0]["logprobs"] == body["choices"][1]["logprobs"]


def test_stream_echo_with_logprobs(http: httpx.Client) -> None:
    """Streaming follows vLLM: the prompt is echoed in the choice's first chunk with its
    logprobs and the first generated tokens'; the stream adds up to the non-streamed
    response."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
            "logprobs": 1, "echo": True, "ignore_eos": True}
    whole = _post(http, **body)["choices"][0]
    chunks = _stream(http, body)
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(PROMPT) and first["logprobs"]["token_logprobs"][0] is None
    text = "".join(c["choices"][0]["text"] for c in chunks)
    lps = [x for c in chunks if c["choices"][0]["logprobs"]
           for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert text == whole["text"] and lps == whole["logprobs"]["token_logprobs"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    scoring = _stream(http, {**body, "max_tokens": 0})
    assert [c["choices"][0]["text"] for c in scoring] == [PROMPT, ""]
    assert scoring[0]["choices"][0]["logprobs"]["tokens"] == whole["logprobs"]["tokens"][:-3]


def _stream(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [x[len("data: "):] for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_repeated_prompt_is_scored_again_not_served_from_the_prefix_cache(
        http: httpx.Client) -> None:
    """The second scoring request of the same prompt still returns every prompt token's
    logprob (it computed the prompt: cached_tokens 0); a plain request then hits."""
    prompt = "a prompt long enough to fill a few blocks of the prefix cache " * 2
    n = len(_ids(http, prompt))
    runs = [_post(http, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
            for _ in range(2)]
    for body in runs:
        assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == n
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert runs[0]["choices"][0]["logprobs"] == runs[1]["choices"][0]["logprobs"]
    plain = _post(http, prompt=prompt, max_tokens=1)
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 4 * 4  # the last token is always computed
