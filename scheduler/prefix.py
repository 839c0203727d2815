"""Prefix-cache keys: a chain hash over full blocks of prompt tokens.

hash_i = H(hash_{i-1}, tokens of block i, cache_salt). Chaining makes a block's key
depend on everything before it (a block is reusable only after the same prefix), and
the salt keeps tenants apart: two tenants with the same prompt get different keys, so
neither can share, nor probe by timing, the other's cached prefix
(003_12df107fdefa535c.txt, "prefix caching" and "multi-tenant" sections). blake2b, not
Python's hash(), so keys cannot be collided on purpose.
"""

from __future__ import annotations

import hashlib
import struct


def block_hashes(prompt_ids: list[int], block_size: int, salt: str | None) -> list[int]:
    """Keys of the prompt's full blocks that may be served from the cache.

    The block holding the last prompt token is never included: that token is always
    recomputed to produce the first logits, and a shared block must never be written.
    """
    n = (len(prompt_ids) - 1) // block_size
    out: list[int] = []
    parent = hashlib.blake2b((salt or "").encode(), digest_size=16).digest()
    for i in range(n):
        chunk = prompt_ids[i * block_size : (i + 1) * block_size]
        digest = hashlib.blake2b(parent + struct.pack(f"<{len(chunk)}q", *chunk),
                                 digest_size=16).digest()
        out.append(int.from_bytes(digest[:8], "little", signed=True))
        parent = digest
    return out
