"""`full`: keep every token (the default policy).

The engine does not even build this policy for a request (no statistics, no plan); it
exists so the catalog is complete and callers can treat every config alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from policies.base import Needs
from policies.config import FullPolicyConfig


@dataclass
class FullPolicy:
    """No eviction: needs nothing, drops nothing, keeps seq_len tokens."""

    config: FullPolicyConfig = field(default_factory=FullPolicyConfig)
    name: str = "full"
    needs: Needs = field(default_factory=Needs)

    @staticmethod
    def select(policies: list[FullPolicy], view: object) -> torch.Tensor | None:
        return None

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        return seq_len
