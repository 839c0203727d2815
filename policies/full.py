"""`full`: keep every token (the default policy).

The engine does not even build this policy for a request (no statistics, no plan); it
exists so the catalog is complete and callers can treat every config alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.base import Eviction, Needs, StepView
from policies.config import FullPolicyConfig


@dataclass
class FullPolicy:
    """No eviction: needs nothing, returns an empty plan, keeps seq_len tokens."""

    config: FullPolicyConfig = field(default_factory=FullPolicyConfig)
    name: str = "full"
    needs: Needs = field(default_factory=Needs)

    def step(self, view: StepView) -> Eviction:
        return {}

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        return seq_len
