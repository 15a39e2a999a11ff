"""A small decode case for compute-sanitizer (memcheck / racecheck) of kernels/triton_decode.py.

Reuses the tests' case generator: -1 holes, count-0 rows, out-of-range junk past counts.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import torch  # noqa: E402

import test_triton_decode as T  # noqa: E402

cases = [(5, 16, 256, "fp8", None), (3, 128, 256, "nvfp4_ds_mla", 2), (3, 128, 256, "fp8", 1), (6, 12, 384, "nvfp4_ds_mla", 3)]
if len(sys.argv) > 1:
    cases = cases[: int(sys.argv[1])]
for rows, heads, width, fmt, splits in cases:
    T._run_functional(rows, heads, width, fmt, seed=rows + heads, splits=splits)
    torch.cuda.synchronize()
    print("ok", rows, heads, width, fmt, splits, flush=True)
