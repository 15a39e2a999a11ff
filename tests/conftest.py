"""Test setup: on a machine without a CUDA GPU, Triton kernels run in its interpreter.

The variables must be set before Triton is imported; vLLM also needs CUDA_VISIBLE_DEVICES=""
on a CPU so it does not swap in a Triton placeholder (SPEC 9).
"""

from __future__ import annotations

import os
import subprocess


def _has_cuda_gpu() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


if not _has_cuda_gpu():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
