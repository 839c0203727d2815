"""Shared pytest setup."""

import os

import torch

# Triton kernels run on CPU through the interpreter; it must be chosen before anything
# imports triton (kvpool.triton_attention decorates its kernels at import time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
