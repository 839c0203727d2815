"""Host lists of ints as int64 tensors: how a step's plan (rows, positions, slots,
input ids) crosses into torch.

Why not `torch.tensor(values)`: it inspects every element's Python type on the way in
(~60 ns an int), so the few hundred ints of a 64-request decode step cost tens of
microseconds a call. `array("q")` converts in C and `torch.frombuffer` wraps its buffer
without a copy (the tensor keeps the array alive): about 3x less.
"""

from __future__ import annotations

from array import array

import torch


def int64_tensor(values: list[int]) -> torch.Tensor:
    """A new 1-D int64 CPU tensor of `values` (ints; OverflowError past int64)."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def bool_tensor(values: list[bool]) -> torch.Tensor:
    """A new 1-D bool CPU tensor of `values` (one byte each, as torch stores bools)."""
    if not values:
        return torch.empty(0, dtype=torch.bool)
    return torch.frombuffer(bytearray(values), dtype=torch.bool)
