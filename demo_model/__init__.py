"""How the embedded demo model (``engine/demo/model``) was made, and how it is measured.

Not part of the runtime: kvserve serves the checkpoint through ``engine.demo`` and never
imports this package, which is not installed with kvserve (run it from a checkout:
``python -m demo_model.train``, ``python -m demo_model.evaluate``). See ``docs/demo-model.md``.

Modules:
- ``data``: the training corpus (exactly which stdlib text) and synthetic long-range recall docs.
- ``tokenizer``: byte-level BPE (~4k vocab) saved in Hugging Face format.
- ``train``: builds and trains the model, exports it to ``engine/demo/model``.
- ``evaluate``: held-out bits per byte and needle-in-a-haystack, with a pluggable backend
  (``benchmarks/policy_eval.py`` plugs kvserve in, under each ``kv_policy``).
- ``expand_heads``: more kv heads, same function (copies), the start of the 4-kv-head variant
  ``engine/demo/model_kv4``; ``heads``: how different a model's kv heads' kept sets are.
"""
