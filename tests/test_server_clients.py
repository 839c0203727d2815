"""Real clients, unchanged: what the official `openai` client and vLLM-speaking tools ask
for beyond generation. `client.models.retrieve`, vLLM's `/tokenize` and `/detokenize`,
and `usage.prompt_tokens_details.cached_tokens` from the prefix cache, on a real uvicorn
(127.0.0.1, ephemeral port)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from server.testing import ServerThread
from tests.live_server import openai_client, tiny_server
from tests.tiny_models import make_tiny_model

MODEL = "tiny"
SLASHED = "org/tiny-chat"  # Hugging Face style ids hold a slash
NOEOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[ServerThread]:
    with tiny_server(model_dir, (MODEL, SLASHED)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# ---- GET /v1/models/{id} -------------------------------------------------------------
def test_models_retrieve(client: openai.OpenAI) -> None:
    m = client.models.retrieve(MODEL)
    assert (m.id, m.object, m.owned_by) == (MODEL, "model", "kvserve")
    listed = {x.id: x for x in client.models.list()}
    assert listed[MODEL].created == m.created
    assert client.models.retrieve(SLASHED).id == SLASHED
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("no-such-model")
    err = exc.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model", err
    assert "no-such-model" in err["message"]


def test_models_retrieve_404_shape(http: httpx.Client) -> None:
    err = _error(http.get("/v1/models/nope/deeper"), 404)
    assert err["type"] == "invalid_request_error" and err["code"] == "model_not_found"


# ---- /tokenize and /detokenize -------------------------------------------------------
def test_tokenize_prompt_matches_completion_usage(http: httpx.Client, client: openai.OpenAI,
                                                  model_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = "hello tokenizer world"
    r = http.post("/tokenize", json={"model": MODEL, "prompt": prompt})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) > 0 and body["token_strs"] is None
    assert body["max_model_len"] == client.models.retrieve(MODEL).model_extra["max_model_len"]
    usage = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage
    assert body["count"] == usage.prompt_tokens
    # the same ids as a completion sent as token ids
    ids = client.completions.create(model=MODEL, prompt=body["tokens"], max_tokens=1).usage
    assert ids.prompt_tokens == body["count"]

    bare = http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()
    assert body["tokens"] == tok.encode(prompt)
    assert bare["tokens"] == tok.encode(prompt, add_special_tokens=False)
    strs = http.post("/tokenize", json={"prompt": prompt, "return_token_strs": True}).json()
    assert len(strs["token_strs"]) == strs["count"] and all(
        isinstance(s, str) for s in strs["token_strs"])


def test_tokenize_chat_matches_chat_usage(http: httpx.Client, client: openai.OpenAI) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    body = http.post("/tokenize", json={"model": MODEL, "messages": msgs}).json()
    usage = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1).usage
    assert body["count"] == usage.prompt_tokens == len(body["tokens"])
    no_gen = http.post("/tokenize", json={"messages": msgs,
                                         "add_generation_prompt": False}).json()
    assert no_gen["count"] < body["count"]
    assert body["tokens"][:no_gen["count"]] == no_gen["tokens"]
    # continue_final_message: the last (assistant) message is left open for the model
    partial = [*msgs, {"role": "assistant", "content": "Sure, the"}]
    cont = http.post("/tokenize", json={"messages": partial, "add_generation_prompt": False,
                                       "continue_final_message": True}).json()
    text = http.post("/detokenize", json={"tokens": cont["tokens"]}).json()["prompt"]
    assert text.endswith("Sure, the"), text


def test_detokenize_round_trip(http: httpx.Client) -> None:
    prompt = "round trip: def f(x): return x"
    ids = http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False}
                    ).json()["tokens"]
    r = http.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": prompt}, r.text


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                   "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {"tokens": [1, 99999]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens.1"),
    ("/detokenize", {"tokens": ["1"]}, 400, "tokens.0"),
    ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
])
def test_tokenize_errors(http: httpx.Client, path: str, body: dict, status: int,
                         param: str) -> None:
    assert _error(http.post(path, json=body), status)["param"] == param


# ---- usage.prompt_tokens_details.cached_tokens ------------------------------------------
def _long_prompt() -> str:
    """Unique (no earlier test cached it) and many blocks long."""
    return f"{uuid.uuid4().hex} " + "the prefix cache " * 5


def test_cached_tokens_completions(client: openai.OpenAI) -> None:
    prompt = _long_prompt()
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=NOEOS)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                       extra_body=NOEOS)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert cached == second.usage.model_extra["kv_cache"]["prefix_hit_tokens"]
    assert cached % 16 == 0  # whole blocks (block_size 16)
    # streaming: the final usage chunk carries it too
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, stream=True,
        stream_options={"include_usage": True}, extra_body=NOEOS))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_cached_tokens_chat_stream_and_not(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": _long_prompt()}]
    first = list(client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=2, stream=True,
        stream_options={"include_usage": True}, extra_body=NOEOS))
    assert first[-1].usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                           extra_body=NOEOS)
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens


def test_cached_tokens_count_each_prompt_once(client: openai.OpenAI) -> None:
    """n samples of a new prompt: the later samples share what the first computed, but
    none of the prompt was cached when the request came in."""
    prompt = _long_prompt()
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=3,
                                  extra_body=NOEOS)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.usage.model_extra["kv_cache"]["prefix_hit_tokens"] > 0  # the siblings' hits
    again = client.completions.create(model=MODEL, prompt=[prompt, prompt], max_tokens=2, n=2,
                                      extra_body=NOEOS)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached <= again.usage.prompt_tokens
    assert cached % 2 == 0 and cached // 2 <= again.usage.prompt_tokens // 2
