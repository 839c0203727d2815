"""native/host.py: host lists as tensors the way a step's plan crosses into torch."""

from __future__ import annotations

import gc

import pytest
import torch

from native.host import bool_tensor, int64_tensor


def test_int64_tensor_equals_torch_tensor_and_owns_its_values() -> None:
    values = [0, -1, 7, 2**62, -(2**63)]
    t = int64_tensor(values)
    gc.collect()  # the array behind the tensor lives as long as the tensor
    assert t.dtype == torch.int64 and torch.equal(t, torch.tensor(values, dtype=torch.int64))
    t[0] = 5  # writable, and a copy: the list is untouched
    assert values[0] == 0 and t.tolist()[0] == 5
    assert int64_tensor([]).shape == (0,) and int64_tensor([]).dtype == torch.int64
    with pytest.raises(OverflowError):
        int64_tensor([2**63])
    with pytest.raises(TypeError):
        int64_tensor([1.5])


def test_bool_tensor() -> None:
    assert bool_tensor([True, False, True]).tolist() == [True, False, True]
    assert bool_tensor([]).dtype == torch.bool and bool_tensor([]).numel() == 0
