"""The embedded demo model: a small Llama trained on CPython's own documentation and sources.

Why it exists: ``kvserve serve`` must work offline with no weights downloaded, and the KV
eviction policies can only be compared on a model whose attention has learned something
(random weights tell nothing about which tokens matter). See ``docs/demo-model.md``.

Modules:
- ``data``: the training corpus (exactly which stdlib text) and synthetic long-range recall docs.
- ``tokenizer``: byte-level BPE (~4k vocab) saved in Hugging Face format.
- ``train``: builds and trains the model, exports it to ``engine/demo/model``.
- ``evaluate``: held-out bits per byte and needle-in-a-haystack, with a pluggable backend.
"""

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "model"
DEMO_MODEL_NAME = "kvserve-demo-llama-4m"
