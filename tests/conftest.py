"""Shared pytest setup."""

import os

import torch

# Triton kernels run on CPU through the interpreter; it must be chosen before anything
# imports triton (kvpool.triton_attention decorates its kernels at import time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Test models are tiny: a second OpenMP thread only adds synchronisation, and on a busy
# 2-core machine it makes every op wait for a descheduled thread.
torch.set_num_threads(1)
