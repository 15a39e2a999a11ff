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


import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_kimi_dsa.kernels.base import DecodeSetup  # noqa: E402
from vllm_kimi_dsa.reference import reference_decode  # noqa: E402


class ReferenceKernel:
    """A test double of a DecodeKernel that computes the float32 reference into the buffers.

    It records its setup and calls so core tests can see what the core handed each kernel.
    """

    name = "reference"
    instances: list["ReferenceKernel"] = []

    def __init__(self, setup: DecodeSetup) -> None:
        self.setup = setup
        self.calls: list[dict] = []
        ReferenceKernel.instances.append(self)

    def __call__(self, query, kv_rows, slots, counts, out, lse, *, block_size, rows_per_block_stride):
        self.calls.append(
            dict(rows=query.shape[0], width=slots.shape[1], block_size=block_size, stride=rows_per_block_stride)
        )
        ref_out, ref_lse = reference_decode(
            query, kv_rows, slots, counts,
            fmt=self.setup.fmt, softmax_scale=self.setup.softmax_scale, output_scale=self.setup.output_scale,
        )
        out.copy_(ref_out)
        if lse is not None:
            lse.copy_(ref_lse)


@pytest.fixture
def reference_kernels(monkeypatch):
    """Make every kernel name build a ReferenceKernel (the core's logic runs for real around it)."""
    import vllm_kimi_dsa.kernels as kernels

    ReferenceKernel.instances = []
    monkeypatch.setattr(kernels, "kernel_class", lambda name: ReferenceKernel)
    return ReferenceKernel
