"""Triton kernels run compiled on a CUDA GPU where there is one, else through the interpreter on
CPU tensors; the interpreter must be chosen before triton is imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
