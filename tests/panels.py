"""What the tests of kvserve's panel kernel share (tests/test_cpu_linear*.py for linear
layers, tests/test_moe_panels.py for MoE experts): skip where it has no vector path,
and its layouts to run every test in."""

from __future__ import annotations

import pytest
import torch

from engine import cpu_linear

needs_panels = pytest.mark.skipif(not cpu_linear.panels_available(),
                                  reason="no vector panel kernel here (no AVX2)")

# fp32; bf16 widened as read; bf16 pairs by dot products; by FMAs.
LAYOUTS = pytest.mark.parametrize("dtype,pairs,fma", [(torch.float32, False, False),
                                                      (torch.bfloat16, False, False),
                                                      (torch.bfloat16, True, False),
                                                      (torch.bfloat16, True, True)])
