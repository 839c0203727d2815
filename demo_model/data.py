"""Training text and synthetic recall documents for the demo model.

The corpus is text that every CPython installation carries, so training needs no download:

1. ``topics``: every entry of ``pydoc_data.topics.topics`` (the language reference / library
   help texts that ``help('for')`` shows), one document per topic, sorted by topic name.
2. ``code``: the ``.py`` sources of the running interpreter's stdlib: every top-level
   ``Lib/*.py`` file (except ``this.py``, which is ROT13 text) plus the packages listed in
   ``STDLIB_PACKAGES`` (recursively, skipping any ``test``/``tests``/``idle_test`` directory).
3. ``docstrings``: module, class and function docstrings extracted with ``ast`` from the same
   files, one document per file. They add English prose in the documentation register.

Order is deterministic (sorted relative paths). A document is held out when the SHA-256 of its
name falls in the first ``HELDOUT_PERCENT`` percent, so the split does not depend on order or
on the Python patch version for files that exist in both.

The recall generator plants a pass key (or key–value facts) at a chosen depth in filler text and
asks for it at the end. Documents are built in token space so their length is exact.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import sys
import sysconfig
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

STDLIB_PACKAGES: tuple[str, ...] = (
    "asyncio", "collections", "concurrent", "ctypes", "curses", "dbm", "email", "html", "http",
    "importlib", "json", "logging", "multiprocessing", "re", "sqlite3", "tomllib", "unittest",
    "urllib", "venv", "wsgiref", "xml", "xmlrpc", "zoneinfo",
)  # fmt: skip
EXCLUDED_FILES: tuple[str, ...] = ("this.py",)
TEST_DIRS: frozenset[str] = frozenset({"test", "tests", "idle_test"})
HELDOUT_PERCENT = 4

FILLER_TEXT = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = " What is the pass key? The pass key is"
FACT_NEEDLE = " The value of {name} is {value}. "
FACT_QUESTION = " What is the value of {name}? The value of {name} is"
ANSWER = " {value}."
FACT_WORDS: tuple[str, ...] = (
    "alpha", "amber", "arrow", "basil", "cedar", "cobalt", "comet", "coral", "delta", "ember",
    "falcon", "fern", "garnet", "harbor", "hazel", "indigo", "iris", "jade", "juniper", "kestrel",
    "lemon", "lilac", "maple", "marble", "meadow", "nectar", "nickel", "olive", "onyx", "orchid",
    "pepper", "pine", "quartz", "raven", "river", "saffron", "silver", "spruce", "tango", "thistle",
    "topaz", "umber", "velvet", "violet", "walnut", "willow", "yarrow", "zephyr", "zinc", "basin",
)  # fmt: skip


@dataclass(frozen=True)
class Document:
    """One training/held-out document: ``source`` is ``topics``, ``code`` or ``docstrings``."""

    name: str
    source: str
    text: str
    heldout: bool


def stdlib_dir() -> Path:
    """The running interpreter's pure-Python stdlib directory (``Lib/``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(name: str, percent: int = HELDOUT_PERCENT) -> bool:
    """Held-out membership by name hash: stable across runs and independent of ordering."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 100 < percent


def source_files(root: Path | None = None) -> list[Path]:
    """The stdlib ``.py`` files used, as sorted paths (see module docstring for the rule)."""
    root = root or stdlib_dir()
    files = [p for p in root.glob("*.py") if p.name not in EXCLUDED_FILES]
    for pkg in STDLIB_PACKAGES:
        for p in (root / pkg).rglob("*.py"):
            if not TEST_DIRS.intersection(p.relative_to(root).parts[:-1]):
                files.append(p)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _statements(tree: ast.AST) -> Iterator[ast.AST]:
    """`ast.walk`'s nodes (breadth first, the same order) that are statements or hold them
    (except handlers, match cases): where a def can be. Skipping expressions makes the
    corpus's docstring pass ~5x faster and keeps its text as `ast.walk` ordered it."""
    todo = deque([tree])
    while todo:
        node = todo.popleft()
        yield node
        todo.extend(c for c in ast.iter_child_nodes(node)
                    if isinstance(c, ast.stmt | ast.excepthandler | ast.match_case))


def _docstrings(source: str) -> str:
    """Module/class/function docstrings of one file joined by blank lines ('' if unparsable)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    nodes = [tree, *(n for n in _statements(tree) if isinstance(
        n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef))]
    parts = [d.strip() for n in nodes if (d := ast.get_docstring(n))]
    return "\n\n".join(parts)


def load_corpus(root: Path | None = None) -> list[Document]:
    """All documents in deterministic order: topics, then code and docstrings per file.

    Parsed once a process (the docstrings' `ast` walk takes ~10 s on a slow CPU, and an
    evaluation per KV dtype or policy set would pay it each time); a fresh list each call."""
    return list(_corpus(root or stdlib_dir()))


@functools.lru_cache(maxsize=2)
def _corpus(root: Path) -> tuple[Document, ...]:
    from pydoc_data.topics import topics

    docs = [Document(f"topics/{k}", "topics", topics[k].strip(), is_heldout(f"topics/{k}"))
            for k in sorted(topics)]
    for path in source_files(root):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        held = is_heldout(rel)
        docs.append(Document(rel, "code", text, held))
        if ds := _docstrings(text):
            docs.append(Document(f"{rel}#docstrings", "docstrings", ds, held))
    return tuple(d for d in docs if d.text)


def corpus_manifest(docs: Sequence[Document]) -> dict:
    """Counts, byte sizes and a content hash per source/split: recorded with the model."""
    out: dict = {"python": sys.version.split()[0], "stdlib": str(stdlib_dir()),
                 "packages": list(STDLIB_PACKAGES), "excluded": list(EXCLUDED_FILES),
                 "heldout_percent": HELDOUT_PERCENT, "splits": {}}
    for split in ("train", "heldout"):
        for src in ("topics", "code", "docstrings"):
            sel = [d for d in docs if d.source == src and d.heldout == (split == "heldout")]
            h = hashlib.sha256()
            for d in sel:
                h.update(d.name.encode() + b"\0" + d.text.encode() + b"\0")
            out["splits"][f"{split}/{src}"] = {
                "documents": len(sel), "bytes": sum(len(d.text.encode()) for d in sel),
                "sha256": h.hexdigest()[:16]}
    return out


@dataclass(frozen=True)
class RecallSample:
    """A recall document: ``ids[:prompt_len]`` is the prompt, the rest the expected answer."""

    ids: list[int]
    prompt_len: int
    answer: str
    depth: float
    kind: str


class RecallGenerator:
    """Builds pass-key and key–value recall documents of an exact token length.

    ``filler_stream`` (token ids of real text) is used for ``filler="text"``; ``"repeat"`` uses
    the classic repeated sentences of the pass-key literature. Documents start with ``bos_id``.
    """

    def __init__(self, encode: Callable[[str], list[int]], bos_id: int,
                 filler_stream: np.ndarray | None = None) -> None:
        self.encode = encode
        self.bos_id = bos_id
        self.filler_stream = filler_stream
        self._repeat = encode(FILLER_TEXT * 8)
        self._cache: dict[str, list[int]] = {}

    def _enc(self, text: str) -> list[int]:
        if text not in self._cache:
            self._cache[text] = self.encode(text)
        return self._cache[text]

    def _filler(self, rng: np.random.Generator, n: int, kind: str) -> list[int]:
        if n <= 0:
            return []
        if kind == "text" and self.filler_stream is not None and len(self.filler_stream) > n:
            start = int(rng.integers(0, len(self.filler_stream) - n))
            return self.filler_stream[start:start + n].tolist()
        reps = n // len(self._repeat) + 2
        off = int(rng.integers(0, len(self._repeat)))
        return (self._repeat * reps)[off:off + n]

    def passkey(self, rng: np.random.Generator, total_len: int, depth: float,
                filler: str = "repeat", digits: int = 5) -> RecallSample:
        """Pass key at ``depth`` (0 = start, 1 = just before the question) in ``total_len`` tokens
        (prompt plus answer)."""
        key = str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))
        needle = self.encode(PASSKEY_NEEDLE.format(key=key))
        question = self._enc(PASSKEY_QUESTION)
        answer = self.encode(ANSWER.format(value=key))
        hay = total_len - 1 - len(needle) - len(question) - len(answer)
        if hay < 0:
            raise ValueError(f"total_len {total_len} too short for a pass-key document")
        filler_ids = self._filler(rng, hay, filler)
        at = round(depth * hay)
        prompt = [self.bos_id, *filler_ids[:at], *needle, *filler_ids[at:], *question]
        return RecallSample(prompt + answer, len(prompt), key, depth, f"passkey/{filler}")

    def copy(self, rng: np.random.Generator, total_len: int) -> RecallSample:
        """Dense induction practice: random codes and words, then the same list again.

        Every token of the repeat is predictable only by looking back, so this teaches the copy
        (induction) mechanism that pass-key retrieval needs far faster than sparse needles do."""
        head, again = self._enc(" Codes:"), self._enc(" Again:")
        body: list[int] = []
        budget = (total_len - 1 - len(head) - len(again)) // 2
        while True:
            if rng.random() < 0.6:
                item = f" {int(rng.integers(10, 100000))}"
            else:
                item = f" {FACT_WORDS[int(rng.integers(len(FACT_WORDS)))]}"
            ids = self._enc(item)
            if len(body) + len(ids) > budget:
                break
            body += ids
        pad = total_len - 1 - len(head) - len(again) - 2 * len(body)
        prompt = [self.bos_id, *self._filler(rng, pad, "repeat"), *head, *body, *again]
        return RecallSample(prompt + body, len(prompt), "", 0.0, "copy")

    def facts(self, rng: np.random.Generator, total_len: int, n_facts: int = 4,
              filler: str = "text") -> RecallSample:
        """``n_facts`` "The value of X is N." facts at random depths; asks for one of them."""
        names = rng.choice(len(FACT_WORDS), size=2 * n_facts, replace=False)
        pairs = [(f"{FACT_WORDS[names[2 * i]]}_{FACT_WORDS[names[2 * i + 1]]}",
                  str(int(rng.integers(1000, 100000)))) for i in range(n_facts)]
        needles = [self.encode(FACT_NEEDLE.format(name=n, value=v)) for n, v in pairs]
        qi = int(rng.integers(0, n_facts))
        question = self.encode(FACT_QUESTION.format(name=pairs[qi][0]))
        answer = self.encode(ANSWER.format(value=pairs[qi][1]))
        hay = total_len - 1 - sum(map(len, needles)) - len(question) - len(answer)
        if hay < 0:
            raise ValueError(f"total_len {total_len} too short for {n_facts} facts")
        filler_ids = self._filler(rng, hay, filler)
        cuts = sorted(int(c) for c in rng.integers(0, hay + 1, size=n_facts))
        prompt, prev = [self.bos_id], 0
        for cut, needle in zip(cuts, needles):
            prompt += filler_ids[prev:cut] + needle
            prev = cut
        prompt += filler_ids[prev:] + question
        depth = cuts[qi] / max(hay, 1)
        return RecallSample(prompt + answer, len(prompt), pairs[qi][1], depth, f"facts/{filler}")
