"""Structured outputs: a request's tokens follow a JSON schema, JSON, a regex, a choice of
strings or an EBNF grammar.

xgrammar (vLLM's default backend, so the same specs are accepted and mean the same) turns
a spec into a grammar over the tokenizer's vocabulary once (its compiler caches them),
and a per-request matcher gives, before each sampled token, the bitmask of the tokens
that keep the output a prefix of the language; the rows' other logits are set to -inf,
and every sampled token is fed back to the matcher. The request finishes when the
grammar is complete and the model draws EOS, or when the matcher allows nothing more.

xgrammar is an optional dependency (`pip install kvserve[structured]`; it pulls Triton):
without it a structured request is refused, naming the field it came in.
"""

from __future__ import annotations

import importlib.util
import json
import re
from typing import Any

import torch

from engine.sampling import StructuredOutput


def available() -> bool:
    """Whether xgrammar is installed (without importing it)."""
    return importlib.util.find_spec("xgrammar") is not None


class Grammars:
    """The compiler for one tokenizer and vocabulary, and the matchers it makes."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        try:
            import xgrammar
        except ImportError:
            self.xgr = None
            return
        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        # one thread: it compiles on the engine's thread, between steps
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)

    def matcher(self, so: StructuredOutput) -> Any:
        """A fresh matcher for `so`; ValueError (why, for the client) if the spec is
        invalid or structured outputs are not installed."""
        if self.xgr is None:
            raise ValueError(f"{so.param}: structured outputs need xgrammar "
                             "(pip install 'kvserve[structured]')")
        c = self.compiler
        try:
            if so.kind == "json":
                grammar = c.compile_json_schema(so.spec, any_whitespace=so.any_whitespace)
            elif so.kind == "json_object":
                grammar = c.compile_builtin_json_grammar()
            elif so.kind == "regex":
                grammar = c.compile_regex(so.spec)
            elif so.kind == "choice":
                choices = json.loads(so.spec)
                grammar = c.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(x, ensure_ascii=False) for x in choices))
            elif so.kind == "grammar":
                grammar = c.compile_grammar(so.spec)
            else:
                raise ValueError(f"unknown structured output kind {so.kind!r}")
        except Exception as e:  # the client's spec: xgrammar's parse errors ("[time]
            # file.cc:83: why", RuntimeError) or anything else it raises on one
            raise ValueError(f"{so.param}: {_why(str(e))}") from None
        return self.xgr.GrammarMatcher(grammar)

    def mask(self, logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
        """Set to -inf, in place, every logit of `rows` that its matcher does not allow."""
        xgr = self.xgr
        assert xgr is not None
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        for row, m in zip(rows, matchers):
            m.fill_next_token_bitmask(bitmask, row)
        with torch.inference_mode():  # the runner's logits are inference tensors
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size,
                                            indices=None if len(rows) == logits.shape[0] else rows)


def _why(message: str) -> str:
    """xgrammar's error without its timestamp and source location."""
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", message.strip()).splitlines()[0]
