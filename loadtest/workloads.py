"""Seeded request streams: chat-shaped synthetic, ShareGPT files, long context, shared
system prompts, and a per-request `kv_policy` mix.

Prompts are made of pseudo-words drawn from a seeded vocabulary, so two prompts differ
from their first word (no accidental prefix-cache hits) and the same seed gives the
same run. Lengths are in tokens: with a tokenizer they are exact (each word is
tokenized once, with its leading space), without one a word counts
`len(word) / chars_per_token` tokens. With `token_ids` the prompt is a list of random
token ids instead of text.

ShareGPT-like defaults: prompt and output lengths are log-normal, with medians 100 and
220 tokens and sigmas 1.0 and 0.9, so the means are about 165 and 330 tokens, close to
the ShareGPT means reported in the vLLM paper (161 in, 338 out) and with its long tail.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# syllables for pseudo-words: varied enough that BPE splits them into many token ids
_ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t",
           "v", "w", "z", "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th",
           "tr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "y"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng"]
_PUNCT = [".", ",", "?", "!", ";"]


@dataclass
class RequestSpec:
    """One request to send. `prompt` is text, or token ids; `system` (chat only) is a
    system message sent before the prompt; `tag` groups requests in the report."""

    prompt: str | list[int]
    max_tokens: int
    prompt_len: int  # expected prompt tokens (exact with a tokenizer); usage is authoritative
    kv_policy: str | dict[str, Any] | None = None
    system: str | None = None
    tag: str = "default"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def policy_name(self) -> str:
        p = self.kv_policy
        return "-" if p is None else p if isinstance(p, str) else str(p.get("name"))


@dataclass
class LengthDist:
    """Log-normal lengths clipped to [lo, hi]; sigma 0 means always the median."""

    median: float
    sigma: float
    lo: int = 1
    hi: int = 1 << 20

    def draw(self, rng: random.Random) -> int:
        x = self.median * math.exp(rng.gauss(0.0, self.sigma)) if self.sigma else self.median
        return int(min(self.hi, max(self.lo, round(x))))


SHAREGPT_PROMPT = LengthDist(100, 1.0, 4, 1024)
SHAREGPT_OUTPUT = LengthDist(220, 0.9, 4, 1024)


class TextMaker:
    """Pseudo-word text of a given token length.

    `tokenizer` is anything with `encode(text, add_special_tokens=False)` (a Hugging
    Face tokenizer); without one, a word of n characters counts n / chars_per_token.
    """

    def __init__(self, seed: int = 0, tokenizer: Any = None, chars_per_token: float = 4.0,
                 vocab_words: int = 4096) -> None:
        rng = random.Random(f"vocab-{seed}")
        words: set[str] = set()
        while len(words) < vocab_words:
            n = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
            words.add("".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                              for _ in range(n)))
        self.words = sorted(words)
        self.tokenizer = tokenizer
        self.cpt = chars_per_token
        self._cost: dict[str, int] = {}
        self._by_cost: dict[int, list[str]] | None = None

    def cost(self, word: str) -> int:
        c = self._cost.get(word)
        if c is None:
            if self.tokenizer is not None:
                c = len(self.tokenizer.encode(" " + word, add_special_tokens=False))
            else:
                c = max(1, round((len(word) + 1) / self.cpt))
            self._cost[word] = c
        return c

    def _buckets(self) -> dict[int, list[str]]:
        if self._by_cost is None:
            self._by_cost = {}
            for w in self.words:
                self._by_cost.setdefault(self.cost(w), []).append(w)
        return self._by_cost

    def text(self, n_tokens: int, rng: random.Random) -> str:
        """About `n_tokens` tokens: random words while they fit, then words of the
        right cost for the remainder (exact where the vocabulary allows, give or take
        the first word's missing leading space)."""
        out: list[str] = []
        used = 0
        while used < n_tokens:
            w = rng.choice(self.words)
            if rng.random() < 0.08:
                w += rng.choice(_PUNCT)
            if used + self.cost(w) > n_tokens:
                break
            out.append(w)
            used += self.cost(w)
        buckets = self._buckets()
        while used < n_tokens:
            left = n_tokens - used
            fits = [c for c in buckets if c <= left]
            if not fits:
                break
            c = left if left in buckets else max(fits)
            out.append(rng.choice(buckets[c]))
            used += c
        if not out:  # never an empty prompt
            out.append(rng.choice(buckets[min(buckets)]))
        return " ".join(out)


@dataclass
class WorkloadConfig:
    kind: str = "synthetic"  # synthetic | sharegpt | long | shared-prefix
    num_requests: int = 100
    seed: int = 0
    prompt: LengthDist = field(default_factory=lambda: LengthDist(**vars(SHAREGPT_PROMPT)))
    output: LengthDist = field(default_factory=lambda: LengthDist(**vars(SHAREGPT_OUTPUT)))
    max_model_len: int | None = None  # prompt + output is kept under it
    sharegpt_path: str | None = None
    long_prompt_len: int = 768  # long: prompts of about this length (±10%)
    num_system_prompts: int = 4  # shared-prefix: K system prompts ...
    system_prompt_len: int = 256  # ... of this many tokens each
    policy_mix: list[tuple[float, str | dict[str, Any]]] = field(default_factory=list)
    token_ids: bool = False
    vocab_size: int | None = None  # token_ids: ids drawn from [first_token_id, vocab_size)
    first_token_id: int = 5
    chat: bool = False  # shared-prefix: send the system prompt as a system message


def parse_policy_mix(spec: str | None) -> list[tuple[float, str | dict[str, Any]]]:
    """`full:0.5,streaming:0.5` or a JSON list `[[0.5, "full"], [0.5, {"name": ...}]]`."""
    if not spec:
        return []
    spec = spec.strip()
    if spec.startswith("["):
        mix = [(float(w), p) for w, p in json.loads(spec)]
    else:
        mix = []
        for part in spec.split(","):
            name, _, w = part.partition(":")
            mix.append((float(w or 1), name.strip()))
    if any(w < 0 for w, _ in mix) or sum(w for w, _ in mix) <= 0:
        raise ValueError(f"kv_policy mix needs non-negative weights summing > 0: {spec!r}")
    return mix


def _fit(plen: int, olen: int, max_len: int | None) -> tuple[int, int]:
    """Shrink a (prompt, output) pair to fit the context, keeping at least 1 of each."""
    if max_len is None or plen + olen <= max_len:
        return plen, olen
    olen = max(1, min(olen, max_len // 2))
    return max(1, min(plen, max_len - olen - 1)), olen


def _sharegpt_pairs(path: str) -> list[tuple[str, str]]:
    """(first human turn, first assistant reply) of each conversation in a ShareGPT file."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = []
    for conv in data:
        turns = conv.get("conversations") or conv.get("conversation") or []
        if len(turns) >= 2 and turns[0].get("value") and turns[1].get("value"):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    if not pairs:
        raise ValueError(f"{path}: no conversation with a prompt and a reply")
    return pairs


def build_requests(cfg: WorkloadConfig, maker: TextMaker | None = None) -> list[RequestSpec]:
    """`cfg.num_requests` requests, the same for the same config and seed."""
    return list(iter_requests(cfg, maker))


def iter_requests(cfg: WorkloadConfig, maker: TextMaker | None = None) -> Iterator[RequestSpec]:
    """The requests of `build_requests`, made one at a time (long soaks)."""
    maker = maker or TextMaker(cfg.seed)
    rng = random.Random(f"workload-{cfg.kind}-{cfg.seed}")
    prng = random.Random(f"policy-{cfg.seed}")
    systems = [maker.text(cfg.system_prompt_len, random.Random(f"system-{cfg.seed}-{k}"))
               for k in range(cfg.num_system_prompts)] if cfg.kind == "shared-prefix" else []
    pairs = _sharegpt_pairs(cfg.sharegpt_path) if cfg.kind == "sharegpt" else []
    for i in range(cfg.num_requests):
        olen = cfg.output.draw(rng)
        system = None
        if cfg.kind == "synthetic":
            plen = cfg.prompt.draw(rng)
        elif cfg.kind == "long":
            plen = int(cfg.long_prompt_len * rng.uniform(0.9, 1.1))
        elif cfg.kind == "shared-prefix":
            plen = cfg.prompt.draw(rng)
            system = systems[rng.randrange(len(systems))]
        elif cfg.kind == "sharegpt":
            text, reply = pairs[i % len(pairs)]
            plen = _count(maker, text)
            olen = max(1, min(cfg.output.hi, _count(maker, reply)))
        else:
            raise ValueError(f"unknown workload {cfg.kind!r}")
        sys_len = cfg.system_prompt_len if system is not None else 0
        plen, olen = _fit(plen, olen, None if cfg.max_model_len is None
                          else cfg.max_model_len - sys_len)
        prompt: str | list[int]
        if cfg.token_ids:
            if cfg.vocab_size is None:
                raise ValueError("token_ids needs vocab_size (or a tokenizer)")
            ids = [rng.randrange(cfg.first_token_id, cfg.vocab_size) for _ in range(plen)]
            if system is not None:
                srng = random.Random(f"system-ids-{cfg.seed}-{systems.index(system)}")
                ids = [srng.randrange(cfg.first_token_id, cfg.vocab_size)
                       for _ in range(sys_len)] + ids
                system = None
            prompt = ids
        elif cfg.kind == "sharegpt":
            prompt = pairs[i % len(pairs)][0]
        else:
            prompt = maker.text(plen, rng)
        if system is not None and not cfg.chat:
            prompt, system = system + "\n\n" + str(prompt), None
        policy = _pick(cfg.policy_mix, prng)
        tag = cfg.kind if not cfg.policy_mix else _policy_label(policy)
        yield RequestSpec(prompt, olen, plen + sys_len, policy, system, tag)


def _count(maker: TextMaker, text: str) -> int:
    if maker.tokenizer is not None:
        return len(maker.tokenizer.encode(text, add_special_tokens=False))
    return max(1, round(len(text) / maker.cpt))


def _pick(mix: list[tuple[float, Any]], rng: random.Random) -> Any:
    if not mix:
        return None
    return rng.choices([p for _, p in mix], weights=[w for w, _ in mix])[0]


def _policy_label(policy: str | dict[str, Any] | None) -> str:
    if policy is None or isinstance(policy, str):
        return policy or "-"
    params = ",".join(f"{k}={v}" for k, v in sorted(policy.items()) if k != "name")
    return f"{policy['name']}({params})" if params else str(policy["name"])


def load_tokenizer(path: str | None) -> Any:
    """A Hugging Face tokenizer from a local directory, or None."""
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
