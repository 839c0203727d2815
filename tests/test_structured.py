"""Structured outputs (engine/structured.py): a random-weight model's output follows the
grammar it was given: a choice, a regex, a JSON schema, any JSON; bad specs are refused
naming their field, offline and over HTTP (both layouts' engines, and the OpenAI client's
`response_format`)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from engine.sampling import SamplingParams, StructuredOutput
from scheduler.llm import LLM
from scheduler.outputs import RequestRejected
from server.testing import ServerThread
from tests.live_server import openai_client, tiny_server
from tests.tiny_models import make_tiny_model

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "pick", "n"],
          "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["red", "green"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 9}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("so") / "llama")


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, num_blocks=256, block_size=4)


def _no_space(llm: LLM) -> dict[int, float]:
    """Whitespace all but banned: a random model may otherwise fill max_tokens with the
    whitespace JSON allows between tokens."""
    return {llm.tokenizer.encode(c, add_special_tokens=False)[0]: -100.0 for c in " \n\t\r"}


def _run(llm: LLM, so: StructuredOutput, n: int = 6, **kw) -> list:
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=s, structured=so, **kw)
              for s in range(n)]
    return llm.generate(["x"] * n, params)


def test_choice_regex_and_schema_are_followed(llm: LLM) -> None:
    for o in _run(llm, StructuredOutput("choice", json.dumps(["yes", "no", 'a "b"']))):
        assert o.text in ("yes", "no", 'a "b"') and o.finish_reason == "stop"
    for o in _run(llm, StructuredOutput("regex", r"[0-9]{3}-[a-z]{2}")):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", o.text) and o.finish_reason == "stop"
    outs = _run(llm, StructuredOutput("json", json.dumps(SCHEMA)), logit_bias=_no_space(llm))
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in outs}) > 1  # sampled: the grammar allows, the seeds pick


def test_any_json_and_greedy_rows_beside_unconstrained_ones(llm: LLM) -> None:
    """json_object: `{}` once `}` is pushed up; a constrained greedy row in a batch does
    not change its unconstrained neighbours."""
    close = llm.tokenizer.encode("}", add_special_tokens=False)[0]
    out = _run(llm, StructuredOutput("json_object"), n=1, logit_bias={**_no_space(llm), close: 30.0})
    assert out[0].text == "{}"
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = llm.generate(["ab", "cd"], plain)
    mixed = llm.generate(["ab", "x", "cd"], [plain, SamplingParams(
        max_tokens=8, temperature=0, structured=StructuredOutput("regex", "z+"), ignore_eos=True),
        plain])
    assert [mixed[0].token_ids, mixed[2].token_ids] == [o.token_ids for o in alone]
    assert set(mixed[1].text) == {"z"}


@pytest.mark.parametrize("so", [StructuredOutput("regex", "[0-9", "guided_regex"),
                                StructuredOutput("json", '{"type": "nope"}', "response_format"),
                                StructuredOutput("grammar", "root ::= ", "guided_grammar")])
def test_a_bad_spec_is_refused_naming_its_field(llm: LLM, so: StructuredOutput) -> None:
    with pytest.raises(RequestRejected) as e:
        llm.engine.add_request("bad", [5, 6], SamplingParams(structured=so))
    message = str(e.value)
    assert e.value.param == so.param and message.startswith(f"{so.param}: ")
    assert ".cc:" not in message and not re.search(r"\[\d\d:\d\d:\d\d\]", message)  # no xgrammar source/time
    assert not llm.engine.has_unfinished()


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[ServerThread]:
    with tiny_server(model_dir, ("tiny",)) as s:
        yield s


def test_over_http(server: ServerThread, llm: LLM) -> None:
    client: openai.OpenAI = openai_client(server)
    bias = {str(k): v for k, v in _no_space(llm).items()}
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=80, seed=1,
        logit_bias=bias, response_format={"type": "json_schema",
                                          "json_schema": {"name": "x", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.completions.create(model="tiny", prompt="x", max_tokens=20, seed=2,
                                  extra_body={"guided_choice": ["up", "down"]})
    assert r.choices[0].text in ("up", "down")
    r = client.completions.create(model="tiny", prompt="x", max_tokens=20, seed=3,
                                  extra_body={"structured_outputs": {"regex": "ab?c"}})
    assert r.choices[0].text in ("ac", "abc")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for body, param in [({"guided_regex": "[0-9"}, "guided_regex"),
                            ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
                            ({"response_format": {"type": "xml"}}, "response_format"),
                            ({"response_format": {"type": "json_schema"}}, "response_format"),
                            ({"structured_outputs": {"xml": "a"}}, "structured_outputs")]:
            resp = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **body})
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["param"] == param, resp.text
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
