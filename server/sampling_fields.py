"""A request's sampling fields as the engine takes them: OpenAI's and vLLM's names for
the same things (`logit_bias` keys as token ids, the several ways to ask for structured
output) mapped to `SamplingParams` values, and the vLLM fields kvserve refuses rather
than ignores. 400s name the field (server/preprocess.py calls these per request)."""

from __future__ import annotations

import json
import logging
from typing import Any

from engine.generation_defaults import SamplingDefaults
from engine.sampling import StructuredOutput
from server.errors import bad_request
from server.protocol import ChatCompletionRequest, CompletionRequest

# vLLM request fields that change what is generated and that kvserve does not implement:
# a 400 rather than ignored, so that no client mistakes output made without them for
# output made with them. Other unknown fields are logged, as vLLM logs them, and ignored.
UNSUPPORTED = ("bad_words", "logits_processors", "prompt_embeds", "use_beam_search",
               "functions", "function_call", "echo")
logger = logging.getLogger("kvserve.server")


def check_extras(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse the vLLM fields we do not implement (`UNSUPPORTED`), log the other unknown
    ones (ignored)."""
    extra = req.model_extra or {}
    for name in UNSUPPORTED:
        if extra.get(name) not in (None, False, "", [], {}):
            raise bad_request(f"{name} is not supported by this server", name)
    if ignored := sorted(extra.keys() - set(UNSUPPORTED)):
        logger.warning("request fields ignored: %s", ", ".join(ignored)[:500])


def with_defaults(req: CompletionRequest | ChatCompletionRequest, defaults: SamplingDefaults
                  ) -> dict[str, Any]:
    """temperature, top_p, top_k, min_p and repetition_penalty as the request runs them:
    each the client's when it sent one (`model_fields_set`: an explicit `temperature: 1`
    counts, a `null` does not), else the model's generation-config default
    (`--generation-config`, engine/generation_defaults.py), else the field's own."""
    model, sent = defaults.sampling(), req.model_fields_set
    values = {name: model[name] if name in model and name not in sent else getattr(req, name)
              for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    if values["repetition_penalty"] is None:
        values["repetition_penalty"] = 1.0  # off
    return values


def structured_output(req: CompletionRequest | ChatCompletionRequest) -> StructuredOutput | None:
    """The one grammar a request asks for, from whichever field it used: OpenAI's
    `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs`
    (`json`, `json_object`, `regex`, `choice`, `grammar`) or its `guided_*` fields.
    The spec is compiled (and refused if invalid) by the engine, which names the field."""
    asked: list[StructuredOutput] = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type", "text")
        if kind == "json_object":
            asked.append(StructuredOutput("json_object", "", "response_format"))
        elif kind == "json_schema":
            schema = (rf.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise bad_request("response_format json_schema needs json_schema.schema, "
                                  "an object", "response_format")
            asked.append(StructuredOutput("json", json.dumps(schema), "response_format"))
        elif kind != "text":
            raise bad_request(f"response_format type {kind!r} is not one of text, "
                              "json_object, json_schema", "response_format")
    so = req.structured_outputs or {}
    given = {k: v for k, v in so.items() if v not in (None, False)}
    if other := sorted(given.keys() - {"json", "json_object", "regex", "choice", "grammar"}):
        raise bad_request(f"structured_outputs.{other[0]} is not supported", "structured_outputs")
    fields = [(req.guided_json, "json", "guided_json"), (req.guided_regex, "regex", "guided_regex"),
              (req.guided_choice, "choice", "guided_choice"),
              (req.guided_grammar, "grammar", "guided_grammar"),
              *((given.get(k), k, "structured_outputs") for k in ("json", "regex", "choice",
                                                                   "grammar"))]
    for value, kind, param in fields:
        if value is None:
            continue
        if kind == "json":
            value = value if isinstance(value, str) else json.dumps(value)
        elif kind == "choice":
            if not (isinstance(value, list) and value and all(isinstance(x, str) for x in value)):
                raise bad_request("choice must be a non-empty list of strings", param)
            value = json.dumps(value)
        elif not isinstance(value, str):
            raise bad_request(f"{kind} must be a string", param)
        asked.append(StructuredOutput(kind, value, param))
    if given.get("json_object"):
        asked.append(StructuredOutput("json_object", "", "structured_outputs"))
    if len(asked) > 1:
        raise bad_request("at most one structured output may be asked for (response_format, "
                          "structured_outputs or a guided_* field)", asked[1].param)
    return asked[0] if asked else None


def logit_bias(req: CompletionRequest | ChatCompletionRequest) -> dict[int, float] | None:
    """OpenAI's `logit_bias` ({"token id": bias}) as ids, each bias clamped to [-100,
    100] (vLLM's rule; OpenAI's range). Ids outside the vocabulary are the engine's to
    refuse (`EngineCore.add_request`, a 400 naming the field), as for offline callers."""
    if not req.logit_bias:
        return None
    bias: dict[int, float] = {}
    for key, value in req.logit_bias.items():
        try:
            tok = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}",
                              "logit_bias") from None
        bias[tok] = min(100.0, max(-100.0, float(value)))
    return bias
