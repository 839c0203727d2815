"""A model's generation_config.json as the default sampling fields of requests that leave
them unset (vLLM's `--generation-config auto|vllm|DIR`; engine/generation_defaults.py),
through a real server on loopback: unset fields take the file's values, sent ones (an
explicit `temperature: 1` included) are the client's, `vllm` ignores the file, a folder
replaces it, max_new_tokens lowers only the default max_tokens; bad folders and values
stop `kvserve serve` before the model loads."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.generation_defaults import FILE, SamplingDefaults, read_sampling_defaults
from scheduler.limits import DEFAULT_MAX_TOKENS
from scheduler.llm import LLM
from scheduler.resolve import ModelLimits, resolve_request
from server.cli import main
from server.testing import ServerThread
from tests.live_server import tiny_server
from tests.tiny_models import make_tiny_model

NOEOS = {"ignore_eos": True}
# Greedy by default; top_p shows in a response object (it echoes the values run).
GREEDY = {"temperature": 0.0, "top_p": 0.95, "max_new_tokens": 6, "do_sample": False}


def _write(folder: Path, **fields: object) -> Path:
    """`fields` merged into folder/generation_config.json (created if absent)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / FILE
    raw = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**raw, **fields}))
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = make_tiny_model("llama", tmp_path_factory.mktemp("gen") / "llama")
    _write(Path(path), **GREEDY)
    return path


@pytest.fixture(scope="module")
def auto(model_dir: str) -> Iterator[httpx.Client]:
    with tiny_server(model_dir) as s, _http(s) as c:
        yield c


def _http(s: ServerThread) -> httpx.Client:
    return httpx.Client(base_url=s.url, timeout=60)


def _texts(c: httpx.Client, **body: object) -> list[str]:
    r = c.post("/v1/completions", json={"prompt": "Once upon", "n": 4, "seed": 7, **NOEOS,
                                        **body})
    assert r.status_code == 200, r.text
    return [ch["text"] for ch in r.json()["choices"]]


def _usage(c: httpx.Client, path: str, **body: object) -> int:
    base = ({"prompt": "Once upon"} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "Hi"}]})
    r = c.post(path, json={**base, **NOEOS, **body})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["completion_tokens"]


def _response(c: httpx.Client, **body: object) -> dict:
    r = c.post("/v1/responses", json={"input": "Hi", **NOEOS, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_unset_fields_take_the_model_defaults(auto: httpx.Client) -> None:
    """temperature 0 from the file: four seeded samples of a request that sends none are
    one greedy text (the explicit temperature 0's); an explicit temperature 1 samples."""
    greedy = _texts(auto)
    assert len(set(greedy)) == 1 and greedy == _texts(auto, temperature=0, seed=99)
    assert len(set(_texts(auto, temperature=1))) > 1  # the client's 1, not the file's 0
    assert len(set(_texts(auto, temperature=None))) == 1  # null is unset, as in vLLM
    r = _response(auto)
    assert (r["temperature"], r["top_p"]) == (0.0, 0.95)
    r = _response(auto, temperature=0.5, top_p=1)
    assert (r["temperature"], r["top_p"]) == (0.5, 1.0)


def test_max_new_tokens_is_the_default_max_tokens(auto: httpx.Client) -> None:
    """6 for chat (instead of the context's room), completions (instead of 16) and
    responses; a max_tokens the client sends is kept, above the file's too."""
    assert _usage(auto, "/v1/chat/completions") == 6
    assert _usage(auto, "/v1/completions") == 6
    assert _response(auto)["usage"]["output_tokens"] == 6
    assert _usage(auto, "/v1/chat/completions", max_tokens=9) == 9
    assert _usage(auto, "/v1/completions", max_tokens=9) == 9
    assert _response(auto, max_output_tokens=9)["usage"]["output_tokens"] == 9


def test_offline_generate_without_params(model_dir: str, auto: httpx.Client) -> None:
    """`LLM.generate` with no params takes the same defaults: the server's greedy text."""
    (out,) = LLM(model_dir, num_blocks=64).generate(["Once upon"])
    assert len(out.token_ids) <= 6 and _texts(auto, n=1)[0].startswith(out.text)


def test_vllm_ignores_the_file(model_dir: str) -> None:
    with tiny_server(model_dir, generation_config="vllm") as s, _http(s) as c:
        assert len(set(_texts(c))) > 1
        assert _usage(c, "/v1/completions") == DEFAULT_MAX_TOKENS
        assert _usage(c, "/v1/chat/completions", max_tokens=9) == 9
        r = _response(c, max_output_tokens=4)
        assert (r["temperature"], r["top_p"]) == (1.0, 1.0)


def test_a_folder_replaces_the_model_file(model_dir: str, tmp_path: Path) -> None:
    """The folder's file alone: its top_k 1 (greedy whatever the temperature) and
    max_new_tokens 3; the model's own temperature 0 and top_p are not read."""
    folder = _write(tmp_path / "gc", top_k=1, max_new_tokens=3)
    with tiny_server(model_dir, generation_config=str(folder)) as s, _http(s) as c:
        assert len(set(_texts(c))) == 1 and _usage(c, "/v1/chat/completions") == 3
        assert len(set(_texts(c, top_k=0))) > 1
        r = _response(c)
        assert (r["temperature"], r["top_p"], r["usage"]["output_tokens"]) == (1.0, 1.0, 3)


def test_reading_the_file(tmp_path: Path) -> None:
    model = _write(tmp_path / "m", temperature=0.6, top_k=20, min_p=0, top_p=None,
                   repetition_penalty=1.05, max_new_tokens=64, do_sample=True)
    d = read_sampling_defaults(str(model))
    assert d == SamplingDefaults(temperature=0.6, top_k=20, min_p=0.0, repetition_penalty=1.05,
                                 max_tokens=64, source=str(model / FILE))
    assert d.sampling() == {"temperature": 0.6, "top_k": 20, "min_p": 0.0,
                            "repetition_penalty": 1.05}
    assert read_sampling_defaults(str(model), "vllm") == SamplingDefaults()
    assert read_sampling_defaults(str(tmp_path)) == SamplingDefaults()  # no file: none
    for bad, words in (({"temperature": -1}, "temperature must be >= 0"),
                       ({"top_p": 0}, "top_p must be in (0, 1]"),
                       ({"top_k": 2.5}, "top_k must be an integer"),
                       ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
                       ({"min_p": "0.1"}, "min_p must be a number")):
        _write(tmp_path / "bad", **bad)
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            read_sampling_defaults(str(model), str(tmp_path / "bad"))
        (tmp_path / "bad" / FILE).unlink()


def test_default_max_tokens_is_the_smaller() -> None:
    """The file's max_new_tokens against completions' 16 and chat's room: the smaller;
    a max_tokens the caller gave is kept."""
    for file_max, completions, chat in ((5, 5, 5), (64, 16, 64), (None, 16, 200 - 10)):
        limits = ModelLimits.of(200, 1000, None,
                                sampling_defaults=SamplingDefaults(max_tokens=file_max))
        assert resolve_request(limits, None, [(10, None)],
                               default_max_tokens=DEFAULT_MAX_TOKENS).max_tokens == (completions,)
        assert resolve_request(limits, None, [(10, None), (10, 100)]).max_tokens == (chat, 100)


@pytest.mark.parametrize("flag, words", [
    ("/no/such/folder", "--generation-config /no/such/folder: no such directory"),
    ("EMPTY", "the folder has no generation_config.json"),
    ("auto", "temperature must be >= 0, not -0.5; --generation-config vllm ignores"),
])
def test_bad_flag_or_file_stops_the_server(flag: str, words: str, tmp_path: Path,
                                           model_dir: str,
                                           capsys: pytest.CaptureFixture) -> None:
    model = model_dir
    if flag == "EMPTY":
        flag = str(tmp_path)
    elif flag == "auto":  # a copy of the model whose own file is broken
        model = str(_write(tmp_path / "m", temperature=-0.5))
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", model, "--generation-config", flag, "--port", "1"])
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--generation-config" in lines[0] and words in lines[0]
