"""Incremental detokenization with stop strings.

Decoding the whole output every step is quadratic; decoding only the new token breaks
multi-byte characters and tokenizers that merge spaces. The usual window trick (as in
vLLM and HF's TextStreamer): decode a few tokens of context before the new ones and
emit only the characters that appeared, holding back a trailing U+FFFD (an incomplete
UTF-8 sequence). With a Rust tokenizer that needs no clean-up, the tokenizers library's
`DecodeStream` runs the same trick natively. Text that could still become a stop string
is held back too, so a client never sees the start of a stop string that then matches.
"""

from __future__ import annotations

try:  # tokenizers >= 0.21: the same window trick in Rust, one call per token
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - an older tokenizers
    DecodeStream = None


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True,
                 include_stop: bool = False) -> None:
        """`include_stop`: a matched stop string stays at the end of the text (vLLM's
        `include_stop_str_in_output`)."""
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.include_stop = include_stop
        # The Rust tokenizer's own decode is ~10x cheaper than the transformers wrapper;
        # it is the same function unless the wrapper post-processes (space clean-up).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        raw = backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self._raw = backend.decode if raw else tokenizer.decode
        # Where the Rust decode serves, its DecodeStream keeps the window itself: one call
        # per token instead of two decodes of the window (~0.5 against ~2 us a token, the
        # engine step's largest per-request cost once requests detokenize).
        self._stream = (DecodeStream(skip_special_tokens=skip_special_tokens)
                        if raw and DecodeStream else None)
        self._backend = backend
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # all text decoded so far
        self.emitted = 0  # characters of `text` already returned
        # A stop string must end past this many characters: the text of tokens fed
        # with `stops=False` (before `min_tokens`) never stops the request (vLLM's rule).
        self.floor = 0

    def _decode(self, ids: list[int]) -> str:
        return self._raw(ids, skip_special_tokens=self.skip)

    def add(self, token_ids: list[int], stops: bool = True) -> tuple[str, bool]:
        """Feed new tokens; return (text delta safe to emit, whether a stop string matched).
        `stops` False: no stop string may match yet (nothing is held back for one)."""
        if self._stream is not None:
            pieces = [p for t in token_ids if (p := self._stream.step(self._backend, t))]
            if not self.stop:  # nothing is held back: the pieces are the delta
                return "".join(pieces), False
            self.text += "".join(pieces)
        else:
            self._window(token_ids)
        if self.stop and not stops:
            self.floor = len(self.text)
        elif self.stop:
            start = max(0, self.emitted - max(len(s) for s in self.stop))
            hits = [(i, len(s)) for s in self.stop
                    if (i := self.text.find(s, max(start, self.floor - len(s) + 1))) >= 0]
            if hits:
                at, length = min(hits)  # the earliest (of those, the shortest: it matched first)
                self.text = self.text[: at + length if self.include_stop else at]
                return self._take(len(self.text)), True
            hold = max(len(s) for s in self.stop) - 1
            return self._take(max(self.emitted, len(self.text) - hold)), False
        return self._take(len(self.text)), False

    def _window(self, token_ids: list[int]) -> None:
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)

    def flush(self) -> str:
        """The held-back tail, at finish."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        delta = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return delta
