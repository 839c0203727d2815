"""Request schemas with OpenAI's field names and bounds.

Bounds live here, not deeper, so that any body that passes validation can be run by the
engine without surprises (no NaN temperature, no seed torch cannot take, no n that
floods the queue). Unknown top-level fields are ignored, like OpenAI-compatible servers
do for fields of newer API versions; unknown fields inside `kv_policy` are an error.

Scalars are strict, as OpenAI's API is: an integer field takes a JSON integer only (not
`"4"`, `5.5`, `5.0` or `true`), a number field an integer or a float (not a string), a
boolean field `true`/`false` only. Lax coercion would run a request other than the one
sent (`"max_tokens": "4"` silently accepted by us, rejected by OpenAI) and hide client
bugs until the client meets a stricter server.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP = 16
MAX_LOGIT_BIAS = 1024  # token ids a request may bias (OpenAI's limit is 300)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TokenIds = list[Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]]
Number = Annotated[float, Strict()]  # a JSON integer or float, never a string or a bool


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        """Many clients send `null` for "not set"; treat it as absent so defaults apply."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Base):
    include_usage: StrictBool = False


class _SamplingFields(_Base):
    """Fields shared by both endpoints. Unknown fields are kept (`model_extra`) so that
    server/sampling_fields.py can refuse the ones vLLM honours and we do not
    (`UNSUPPORTED`), and log the rest as ignored, as vLLM does."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # 0 only for completions with echo (score the prompt; preprocess checks it)
    max_tokens: StrictInt | None = Field(None, ge=0, le=INT64_MAX)
    # Left out (or null), these five take the model's generation_config.json defaults
    # where it sets them (`--generation-config`; server/sampling_fields.py's
    # `with_defaults` tells a sent value from a default by `model_fields_set`).
    temperature: Number = Field(1.0, ge=0.0, le=2.0)
    top_p: Number = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=-1, le=INT64_MAX)
    min_p: Number = Field(0.0, ge=0.0, le=1.0)
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    seed: StrictInt | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: TokenIds | None = Field(None, max_length=256)
    ignore_eos: StrictBool = False
    user: str | None = Field(None, max_length=256)
    priority: StrictInt = Field(0, ge=-(2**31), le=2**31 - 1)
    kv_policy: StrictStr | dict[str, Any] | None = None
    # Salts this request's prefix-cache keys (vLLM's name): only requests with the same
    # salt (and, with API keys, the same key) share cached prefixes.
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    # engine/penalties.py: OpenAI's two, vLLM's repetition penalty (1 = off), and a bias
    # per token id (keys are ids as strings, as OpenAI's; values clamped to [-100, 100]
    # as vLLM does; ids checked against the vocabulary by the engine)
    presence_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Number | None = Field(None, gt=0.0, le=1e6)
    logit_bias: dict[str, Number] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # vLLM's: no EOS, stop token id or stop string before this many tokens
    min_tokens: StrictInt = Field(0, ge=0, le=INT64_MAX)
    # vLLM's: only these token ids may be drawn
    allowed_token_ids: Annotated[TokenIds, Field(min_length=1)] | None = None
    # vLLM's: the matched stop string (or stop token's text) stays in the output text
    include_stop_str_in_output: StrictBool = False
    # vLLM's: False puts special tokens' text (e.g. "</s>") in the output text
    skip_special_tokens: StrictBool = True
    # vLLM's: keep only the prompt's last k tokens (-1: as many as the context holds)
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=-1, le=INT64_MAX)
    # Structured outputs (engine/structured.py): OpenAI's response_format, vLLM's
    # structured_outputs object and its older guided_* fields; at most one of them
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: StrictStr | dict[str, Any] | None = None
    guided_regex: StrictStr | None = None
    guided_choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    guided_grammar: StrictStr | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, v: StreamOptions | None, info: ValidationInfo
                              ) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return v

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: (Annotated[StrictStr, Field(max_length=4_000_000)]
             | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_N)]
             | Annotated[TokenIds, Field(min_length=1)]
             | Annotated[list[Annotated[TokenIds, Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_N)])
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    # vLLM's extension: per choice, every prompt token's logprob, rank and top-N
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: StrictInt | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None


class TextPart(_Base):
    type: Literal["text"]
    text: StrictStr


class FunctionDef(_Base):
    name: Annotated[StrictStr, Field(min_length=1, max_length=256)]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema (server/tools.py checks it)
    strict: StrictBool | None = None


class ToolDef(_Base):
    type: Literal["function"]
    function: FunctionDef


class CalledFunction(_Base):
    name: StrictStr
    arguments: StrictStr | dict[str, Any] = "{}"  # OpenAI's: the arguments' JSON text


class ToolCallParam(_Base):
    """A call in an assistant message of the history (what the server returned)."""

    id: Annotated[StrictStr, Field(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | Annotated[list[TextPart], Field(max_length=1024)] | None = Field(
        None, validate_default=True)
    name: str | None = None
    tool_calls: Annotated[list[ToolCallParam], Field(max_length=1024)] | None = None
    tool_call_id: StrictStr | None = None  # a tool message: the call it answers

    @field_validator("content")
    @classmethod
    def _content_required(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None and info.data.get("role") != "assistant":
            raise ValueError("required for this role")
        return v

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Tool calling (server/tools.py): function tools, "none" / "auto" / "required" / a
    # named function (checked there, so that a 400 names the field plainly)
    tools: Annotated[list[ToolDef], Field(max_length=1024)] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    add_generation_prompt: StrictBool = True
    # vLLM's: the last (assistant) message is left open and continued
    continue_final_message: StrictBool = False
    # vLLM's: extra variables for the chat template (e.g. Qwen3's enable_thinking)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("requires logprobs to be true")
        return v


class TokenizeCompletionRequest(_Base):
    """`POST /tokenize` with a prompt (vLLM's shape)."""

    model: str | None = None
    prompt: Annotated[StrictStr, Field(max_length=4_000_000)]
    add_special_tokens: StrictBool = True  # BOS etc., as /v1/completions encodes a prompt
    return_token_strs: StrictBool = False


class TokenizeChatRequest(_Base):
    """`POST /tokenize` with messages (vLLM's shape): the ids /v1/chat/completions would
    run, so `count` is the chat request's `usage.prompt_tokens`."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    tools: Annotated[list[ToolDef], Field(max_length=1024)] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    # The chat template writes its own special tokens; True adds the tokenizer's on top.
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Base):
    """`POST /detokenize` (vLLM's shape)."""

    model: str | None = None
    tokens: TokenIds
