"""The embedded demo model: a small Llama trained on CPython's own documentation and sources.

Why it exists: ``kvserve serve`` must work offline with no weights downloaded, and the KV
eviction policies can only be compared on a model whose attention has learned something
(random weights tell nothing about which tokens matter). See ``docs/demo-model.md``.

Only what the runtime needs lives here: the checkpoint directory ``model/`` (package data,
served by default) and its name; ``model_kv4/`` is a variant with 4 kv heads instead of 2
(uptrained from it, for per-head KV: ``--model`` names it, never the default). How they
were made (corpus, tokenizer, training, the evaluation harness) is the top-level
``demo_model`` package, which is not installed.
"""

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "model"
DEMO_MODEL_NAME = "kvserve-demo-llama-4m"
