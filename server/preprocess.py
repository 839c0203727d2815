"""A validated request body -> the engine requests it stands for (a `Plan`).

Everything that could make the engine fail on user input is checked here (token ids
outside the vocabulary, the `kv_policy` and prompt + max_tokens against the model by
`scheduler/resolve.py`, which the engine then trusts, unsupported fields), so a bad
request becomes a 400 naming its field instead of an error inside a shared batch step.
Tokenization runs on its own single thread: chat templates and long prompts would
otherwise stall the event loop, and one thread means the tokenizer is never used
concurrently.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.sampling import SamplingParams
from policies.config import KVPolicyConfig
from scheduler.async_engine import AsyncEngine, GenerationRequest
from scheduler.limits import DEFAULT_MAX_TOKENS
from scheduler.outputs import RequestRejected
from scheduler.resolve import Resolved, resolve_request
from server.errors import APIError, bad_request
from server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from server.reasoning import REASONING_PARSERS, ReasoningParser
from server.sampling_fields import check_extras, logit_bias, structured_output, with_defaults
from server.settings import ServerSettings
from server.tenants import Tenant, effective_salt
from server.tools import ToolPlan, check_history, plan_tools, template_message

# Used only when the tokenizer ships no chat template (ChatML, the most common one).
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SEED_MOD = 2**63


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    echo_text: str = ""  # the prompt text, prepended to the output when echo is on
    prompt_index: int = 0  # which prompt of a batch (the n samples of one prompt share it)


@dataclass
class Plan:
    id: str
    kind: Literal["completion", "chat", "responses"]
    model: str
    choices: list[Choice]
    policy: KVPolicyConfig  # resolved for the model (scheduler/resolve.py)
    priority: int = 0
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    num_logprobs: int | None = None  # top-N per token when logprobs were asked for
    # vLLM's `prompt_logprobs` field: top-N per prompt token in choices[].prompt_logprobs
    num_prompt_logprobs: int | None = None
    num_prompt_tokens: int = 0  # counted once per distinct prompt (n samples share it)
    max_tokens_param: str = "max_tokens"  # the field the client used, for error messages
    user: str | None = None
    tenant: str | None = None  # the API key's tenant name (quotas, metrics, logs)
    cache_salt: str | None = None  # effective salt: key-derived + the request's cache_salt
    tools: ToolPlan | None = None  # chat with tools: how each choice's text is read back
    # chat with --reasoning-parser: splits each choice's text into reasoning and answer
    reasoning: type[ReasoningParser] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    arrival_time: float = field(default_factory=time.monotonic)

    def engine_requests(self) -> list[GenerationRequest]:
        return [GenerationRequest(c.prompt_ids, c.params, c.request_id, self.priority,
                                  self.policy, self.arrival_time, self.cache_salt, self.tenant)
                for c in self.choices]


class Preprocessor:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenizer")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def check_model(self, model: str | None) -> str:
        names = self.settings.served_model_names
        if model is None:
            return names[0]
        if model not in names:
            raise APIError(404, f"The model `{model}` does not exist. Served models: "
                           f"{', '.join(names)}", param="model", code="model_not_found")
        return model

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ---- per endpoint ----------------------------------------------------------------
    async def completion(self, req: CompletionRequest, tenant: Tenant | None = None) -> Plan:
        model = self.check_model(req.model)
        check_extras(req)
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported", "best_of")
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens 0 is only allowed with echo (it scores the prompt "
                              "without generating)", "max_tokens")
        if req.stream and req.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs are not available when stream is true (use "
                              "echo with logprobs)", "prompt_logprobs")
        prompts = []
        for ids, text in await self._run(self._tokenize_prompts, req.prompt, req.echo):
            if (cut := self._truncate(ids, req.truncate_prompt_tokens)) is not ids:
                ids, text = cut, (await self._run(self.engine.tokenizer.decode, cut)
                                  if req.echo else text)
            self._check_prompt(ids, "prompt")
            prompts.append((ids, text))
        resolved = self._resolve(req.kv_policy, [ids for ids, _ in prompts], req.max_tokens,
                                 "prompt", "max_tokens", DEFAULT_MAX_TOKENS)
        plan = Plan(f"cmpl-{uuid.uuid4().hex}", "completion", model, [], resolved.kv_policy,
                    req.priority, req.stream, req.include_usage, req.echo, req.logprobs,
                    user=req.user, num_prompt_logprobs=req.prompt_logprobs,
                    **_tenancy(req, tenant))
        # echo with logprobs returns the prompt's logprobs too (top-N as asked for the
        # generated tokens); prompt_logprobs asks for them on its own.
        asked = [n for n in (req.logprobs if req.echo else None, req.prompt_logprobs)
                 if n is not None]
        prompt_lp = max(asked) if asked else None
        for p_idx, ((ids, text), max_tokens) in enumerate(zip(prompts, resolved.max_tokens)):
            self._add_choices(plan, req, p_idx, ids, text, max_tokens, req.logprobs, prompt_lp)
        return plan

    async def chat(self, req: ChatCompletionRequest, tenant: Tenant | None = None) -> Plan:
        model = self.check_model(req.model)
        check_extras(req)
        tools = plan_tools(req, self.settings.auto_tool_parser)
        if req.max_tokens == 0:
            raise bad_request("max_tokens 0 is only allowed for completions with echo",
                              "max_tokens")
        ids = self._truncate(await self._run(self._render_chat, req, tools),
                             req.truncate_prompt_tokens)
        self._check_prompt(ids, "messages")
        resolved = self._resolve(
            req.kv_policy, [ids], req.max_completion_tokens or req.max_tokens, "messages",
            "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens")
        n_lp = (req.top_logprobs or 0) if req.logprobs else None
        plan = Plan(f"chatcmpl-{uuid.uuid4().hex}", "chat", model, [], resolved.kv_policy,
                    req.priority, req.stream, req.include_usage, False, n_lp, user=req.user,
                    tools=tools, **_tenancy(req, tenant))
        if req.max_completion_tokens is not None:
            plan.max_tokens_param = "max_completion_tokens"
        self._add_choices(plan, req, 0, ids, "", resolved.max_tokens[0], n_lp)
        # the reasoning is read apart unless the output is JSON by grammar (a JSON
        # response_format, the tools' required / named calls): that text has no reasoning,
        # which deepseek_r1, whose output starts inside it, would otherwise take it for
        structured = plan.choices[0].params.structured
        if self.settings.reasoning_parser is not None and (
                structured is None or structured.kind not in ("json", "json_object")):
            plan.reasoning = REASONING_PARSERS[self.settings.reasoning_parser]
        return plan

    # ---- helpers -----------------------------------------------------------------------
    def _truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: as many
        as the context holds); `ids` itself when nothing is cut."""
        if keep is None:
            return ids
        context = self.engine.max_model_len
        if keep == 0:
            raise bad_request("truncate_prompt_tokens must be -1 or >= 1", "truncate_prompt_tokens")
        if keep > context:
            raise bad_request(f"truncate_prompt_tokens ({keep}) is more than the context "
                              f"({context})", "truncate_prompt_tokens")
        keep = context if keep == -1 else keep
        return ids[-keep:] if 0 < keep < len(ids) else ids

    def _resolve(self, kv_policy: Any, prompts: list[list[int]], requested: int | None,
                 prompt_param: str, max_tokens_param: str, default: int | None = None
                 ) -> Resolved:
        """The request's policy (or the server's default, `--default-kv-policy`) and each
        prompt's max_tokens, resolved for the model once (`scheduler/resolve.py`; the
        engine trusts them). A bad policy raises KVPolicyError (a 400 naming its field);
        a prompt or max_tokens past the context, a 400 naming the field the client used."""
        assert self.engine.limits is not None, "preprocessing runs once the engine loaded"
        try:
            return resolve_request(self.engine.limits, kv_policy,
                                   [(len(ids), requested) for ids in prompts],
                                   default_max_tokens=default)
        except RequestRejected as e:
            param = max_tokens_param if e.param == "max_tokens" else prompt_param
            raise bad_request(str(e), param, "context_length_exceeded") from None

    def _add_choices(self, plan: Plan, req: CompletionRequest | ChatCompletionRequest,
                     p_idx: int, ids: list[int], text: str, max_tokens: int,
                     n_lp: int | None, prompt_lp: int | None = None) -> None:
        vocab = self.engine.vocab_size
        stop_ids = list(req.stop_token_ids or [])
        if any(t >= vocab for t in stop_ids):
            raise bad_request(f"stop_token_ids must be < vocab size {vocab}", "stop_token_ids")
        assert self.engine.limits is not None, "preprocessing runs once the engine loaded"
        sampling = with_defaults(req, self.engine.limits.sampling_defaults)
        if sampling["top_k"] >= vocab:
            sampling["top_k"] = 0
        bias = logit_bias(req)
        structured, skip_special = structured_output(req), req.skip_special_tokens
        if plan.tools is not None:  # the calls' grammar, the parser's special tokens
            structured, skip_special = plan.tools.sampling(structured, skip_special)
        plan.num_prompt_tokens += len(ids)
        for j in range(req.n):
            index = p_idx * req.n + j
            seed = None if req.seed is None else (req.seed + j) % SEED_MOD
            try:
                params = SamplingParams(
                    max_tokens=max_tokens, **sampling, seed=seed, stop=req.stop_list,
                    stop_token_ids=stop_ids, ignore_eos=req.ignore_eos,
                    presence_penalty=req.presence_penalty or 0.0,
                    frequency_penalty=req.frequency_penalty or 0.0,
                    logit_bias=bias, min_tokens=req.min_tokens,
                    allowed_token_ids=req.allowed_token_ids, skip_special_tokens=skip_special,
                    include_stop_str_in_output=req.include_stop_str_in_output,
                    structured=structured,
                    logprobs=None if n_lp is None else min(n_lp, vocab),
                    prompt_logprobs=None if prompt_lp is None else min(prompt_lp, vocab))
            except ValueError as e:
                raise bad_request(str(e), str(e).split(" ")[0]) from None
            plan.choices.append(Choice(index, ids, params, f"{plan.id}-{index}",
                                       text if plan.echo else "", p_idx))

    def _check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise bad_request("the prompt is empty", param)
        vocab = self.engine.vocab_size
        if any(t >= vocab for t in ids):
            raise bad_request(f"prompt token ids must be < vocab size {vocab}", param)

    def _tokenize_prompts(self, prompt: Any, echo: bool) -> list[tuple[list[int], str]]:
        tok = self.engine.tokenizer
        if isinstance(prompt, str):
            return [(tok.encode(prompt), prompt)]
        if prompt and isinstance(prompt[0], str):
            return [(tok.encode(p), p) for p in prompt]
        if prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        limit, vocab = self.engine.max_model_len, self.engine.vocab_size
        # decode only for echo, and only prompts that may pass _check_prompt and _resolve
        return [(list(p), tok.decode(p) if echo and len(p) <= limit and max(p) < vocab else "")
                for p in prompt]

    def _render_chat(self, req: ChatCompletionRequest, tools: ToolPlan | None) -> list[int]:
        return self._render_messages(req.messages, req.add_generation_prompt,
                                     req.continue_final_message,
                                     template_kwargs=req.chat_template_kwargs,
                                     tools=tools.tools if tools else None)

    def _render_messages(self, messages: list[ChatMessage], add_generation_prompt: bool,
                         continue_final_message: bool = False,
                         add_special_tokens: bool = False,
                         template_kwargs: dict[str, Any] | None = None,
                         tools: list[dict[str, Any]] | None = None) -> list[int]:
        if continue_final_message and add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot "
                              "both be true", "continue_final_message")
        tok = self.engine.tokenizer
        own = set(inspect.signature(tok.apply_chat_template).parameters) - {"kwargs"}
        if clash := sorted(own & set(template_kwargs or {})):
            raise bad_request(f"chat_template_kwargs may not set {', '.join(clash)} (the "
                              "request's own fields do)", "chat_template_kwargs")
        check_history(messages)
        msgs = [template_message(m) for m in messages]
        template = None if getattr(tok, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
        # the caller's variables first: ours are the ones the template must see
        extra = {**(template_kwargs or {}), "add_generation_prompt": add_generation_prompt}
        if continue_final_message:
            extra["continue_final_message"] = True
        if tools:  # the model's own template renders them (transformers' `tools`)
            extra["tools"] = tools
        try:
            text = tok.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                           **extra)
        except Exception as e:  # template errors (role order, ...) are the caller's input
            raise bad_request(f"cannot apply the chat template: {e}", "messages") from None
        return tok.encode(text, add_special_tokens=add_special_tokens)

    # ---- /tokenize and /detokenize (vLLM's extension endpoints) ---------------------
    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest
                       ) -> dict[str, Any]:
        """The ids a completion or chat request would run, without running it: clients
        count tokens against `max_model_len` before they send."""
        self.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
            ids = await self._run(self._render_messages, req.messages,
                                  req.add_generation_prompt, req.continue_final_message,
                                  req.add_special_tokens, None, tools)
        else:
            ids = await self._run(self._encode, req.prompt, req.add_special_tokens)
        strs = None
        if req.return_token_strs:
            strs = await self._run(self.engine.tokenizer.convert_ids_to_tokens, ids)
        return {"count": len(ids), "max_model_len": self.engine.max_model_len,
                "tokens": ids, "token_strs": strs}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        vocab = self.engine.vocab_size
        if any(t >= vocab for t in req.tokens):
            raise bad_request(f"token ids must be < vocab size {vocab}", "tokens")
        return {"prompt": await self._run(self.engine.tokenizer.decode, req.tokens)}

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _tenancy(req: CompletionRequest | ChatCompletionRequest, tenant: Tenant | None
             ) -> dict[str, Any]:
    return {"tenant": tenant.name if tenant else None,
            "cache_salt": effective_salt(tenant, req.cache_salt)}
