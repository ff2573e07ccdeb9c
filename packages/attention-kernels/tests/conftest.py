"""Run Triton kernels on CPU tensors through the interpreter; set before triton is imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
