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

from vllm_kimi_dsa.formats import HEAD_DIM, dequantize_rows, nvfp4_e4m3_values  # noqa: E402
from vllm_kimi_dsa.kernels.base import DecodeSetup  # noqa: E402
from vllm_kimi_dsa.kernels.common.gluon import gluon_available, gluon_unavailable_reason  # noqa: E402
from vllm_kimi_dsa.planning import qk_on_fp8_wgmma  # noqa: E402
from vllm_kimi_dsa.reference import reference_decode, source_reference_decode  # noqa: E402

# the Gluon kernels' GPU tests: skipped, with the reason, where Gluon cannot run (CPU CI, other GPUs, other Triton)
GLUON_GPU = pytest.mark.skipif(not gluon_available(), reason=gluon_unavailable_reason() or "gluon unavailable")


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


# Hopper's fp8 wgmma adds the (exact) e4m3 products into an accumulator that keeps about 14
# significant bits (DeepSeek-V3 report, 3.3.2), not fp32's 24: each k-step of 32 dims can lose 2**-14
# of the running sum of |q_d k_d|. A 576-long dot is 18 k-steps (the Gluon nvfp4 forms too: they run
# the fp8 decode of formats.nvfp4_as_fp8 of the rows). The LSE, a soft maximum, inherits that logit bound; a
# logit error e moves each p by a factor exp(+-e), so an output bound gains 2e * max|v|.
WGMMA_STEP_REL = 2.0**-14
ALL_DIMS = slice(0, HEAD_DIM)


def fp8_wgmma(config, fmt: str) -> bool:
    """Whether a triton-kernel config runs Q.K on Hopper's fp8 wgmma (on a GPU; the interpreter sums in fp32)."""
    return torch.cuda.is_available() and qk_on_fp8_wgmma(config, fmt)


# The tests' name for rows given as the float32 values a kernel computes with ((num_rows, 576); e.g.
# formats.nvfp4_e4m3_values): decode_reference and float_rows take it beside the cache formats.
VALUES = "values"


def float_rows(rows: torch.Tensor, fmt: str) -> torch.Tensor:
    """Rows of `fmt` (or VALUES) as float32 (..., 576)."""
    return rows.float() if fmt == VALUES else dequantize_rows(rows, fmt)


def decode_reference(query, rows, slots, counts, *, fmt: str, softmax_scale: float, output_scale: float):
    """reference_decode, or on VALUES rows the same float32 decode of those values."""
    if fmt == VALUES:
        return source_reference_decode(query, rows, slots, counts, softmax_scale=softmax_scale,
                                       output_scale=output_scale)
    return reference_decode(query, rows, slots, counts, fmt=fmt, softmax_scale=softmax_scale,
                            output_scale=output_scale)


def e4m3_form(kernel, fmt: str) -> bool:
    """Whether a "triton" DecodeKernel runs nvfp4_ds_mla through a Gluon e4m3 form (on Hopper, where verified):
    it then computes the fp8 decode of formats.nvfp4_e4m3_values of the rows, not the exact nvfp4 one."""
    return fmt == "nvfp4_ds_mla" and bool(getattr(getattr(kernel, "gluon", None), "nvfp4", False))


def computed_operands(kernel, fmt: str, query, kv_rows, softmax_scale: float, output_scale: float):
    """(query, rows, fmt, softmax_scale, output_scale) of the decode `kernel` computes, for decode_reference: a Gluon
    nvfp4 form's values (e4m3_form: nvfp4_e4m3_values, each value rounded once to e4m3 after its row's shift) as
    VALUES, else the inputs as given."""
    if e4m3_form(kernel, fmt):
        return query, nvfp4_e4m3_values(kv_rows), VALUES, softmax_scale, output_scale
    return query, kv_rows, fmt, softmax_scale, output_scale


def fp8_wgmma_dims(kernel, fmt: str) -> slice | None:
    """The head dims whose Q.K a "triton" DecodeKernel runs on fp8 wgmma (None: none): every dim for the fp8
    wgmma configs and the Gluon nvfp4 forms (on computed_operands' rows); None for the reference stand-in."""
    if e4m3_form(kernel, fmt):
        return ALL_DIMS
    config = getattr(kernel, "config", None)
    return ALL_DIMS if config is not None and fp8_wgmma(config, fmt) else None


def wgmma_logit_bound(query, kv_rows, slots, counts, fmt: str, softmax_scale: float,
                      dims: slice = ALL_DIMS) -> torch.Tensor:
    """(rows,) bound of the fp8-wgmma logit error over `dims`: k-steps * 2**-14 * scale * max_j sum_d |q_d k_jd|
    (rows of `fmt` or VALUES)."""
    steps = -(-(dims.stop - dims.start) // 32)
    bound = torch.zeros(slots.shape[0], device=query.device)
    for i in range(slots.shape[0]):
        c = int(counts[i])
        ids = slots[i, :c][slots[i, :c] >= 0].long()
        if ids.numel():
            k_abs = float_rows(kv_rows[ids], fmt)[:, dims].abs()
            dot = (query[i].float()[:, dims].abs() @ k_abs.T).max()
            bound[i] = dot * abs(softmax_scale) * steps * WGMMA_STEP_REL
    return bound


@pytest.fixture
def reference_kernels(monkeypatch):
    """Make every kernel name build a ReferenceKernel (the core's logic runs for real around it)."""
    import vllm_kimi_dsa.backends.registry as registry

    ReferenceKernel.instances = []
    monkeypatch.setattr(registry, "kernel_class", lambda name: ReferenceKernel)
    return ReferenceKernel
