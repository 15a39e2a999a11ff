"""FlashInferCore: scales, dispatch by batch size, buffer views, convert + decode end to end.

Kernel numerics are tested per kernel; here a reference-computing stand-in (conftest) isolates the core's
own logic, and one end-to-end test runs the real Triton kernel (interpreter on CPU, GPU when present).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import computed_operands, fp8_wgmma_dims
from decode_checks import check_decode

from vllm_kimi_dsa.convert import convert_topk_reference
from vllm_kimi_dsa.core import FlashInferCore
from vllm_kimi_dsa.reference import reference_decode
from vllm_kimi_dsa.synthetic import StandInImpl, StandInLayer, make_buffers, make_step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = ("fp8", "nvfp4_ds_mla")


def _core(fmt, heads, rows_max, width, kernels, **kw):
    impl = StandInImpl(kv_cache_dtype=fmt)
    layer = StandInLayer(_q_scale_float=0.07, _k_scale_float=0.03)
    buffers = make_buffers(rows_max, heads, width, DEVICE)
    return FlashInferCore(impl, layer, heads, buffers, kernels, **kw), impl, layer, buffers


@pytest.mark.parametrize("fmt", FORMATS)
def test_scales_fold_the_per_tensor_descales(reference_kernels, fmt):
    core, impl, layer, _ = _core(fmt, 16, 4, 128, {4: "triton"})
    setup = reference_kernels.instances[0].setup
    if fmt == "fp8":
        assert setup.softmax_scale == pytest.approx(impl.scale * layer._q_scale_float * layer._k_scale_float)
        assert setup.output_scale == pytest.approx(layer._k_scale_float)
    else:  # nvfp4 rows carry their own block scales
        assert setup.softmax_scale == pytest.approx(impl.scale * layer._q_scale_float)
        assert setup.output_scale == 1.0
    assert setup.fmt == fmt and setup.heads == 16 and setup.return_lse


def test_one_kernel_object_per_name_and_rows_routed_by_table(reference_kernels):
    kernels = {1: "triton", 3: "prims_ts", 5: "triton", 7: "prims_ts"}
    core, *_ = _core("fp8", 64, 8, 128, kernels, capacities=[4, 8])
    by_rows = {rows: k.setup.row_counts for k in reference_kernels.instances for rows in k.setup.row_counts}
    assert len(reference_kernels.instances) == 2
    assert by_rows == {1: (1, 5), 5: (1, 5), 3: (3, 7), 7: (3, 7)}
    for rows in kernels:
        step = make_step(rows, 64, 128, "fp8", device=DEVICE, seed=rows)
        core.run(step.query, step.cache, step.topk, step.metadata)
    called = {k.setup.row_counts: [c["rows"] for c in k.calls] for k in reference_kernels.instances}
    assert called == {(1, 5): [1, 5], (3, 7): [3, 7]}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads", [128, 96, 64, 32, 16, 12, 48, 24, 8, 6, 4, 2, 1])
def test_run_writes_reference_into_the_models_buffers(reference_kernels, fmt, heads):
    rows, width = 3, 256
    core, impl, layer, buffers = _core(fmt, heads, 5, width, {rows: "triton"})
    step = make_step(rows, heads, width, fmt, device=DEVICE, empty_rows=1, block_stride=80, seed=heads)
    out, lse = core.run(step.query, step.cache, step.topk, step.metadata)
    # views of the model's buffers, not copies
    assert out.data_ptr() == buffers[2].data_ptr() and lse.data_ptr() == buffers[3].data_ptr()
    assert out.shape == (rows, heads, 512) and lse.shape == (rows, heads)
    kv_rows, stride = core.rows(step.cache, 64)
    assert stride == 80
    slots, counts = convert_topk_reference(
        step.topk, step.metadata.req_id_per_token, step.metadata.block_table, block_size=64, rows_per_block_stride=80
    )
    assert torch.equal(buffers[0][:rows], slots) and torch.equal(buffers[1][:rows], counts)
    assert counts[0] == 0 and bool((counts[1:] > 0).all())
    ref_out, ref_lse = reference_decode(
        step.query, kv_rows, slots, counts, fmt=fmt, softmax_scale=core.softmax_scale, output_scale=core.output_scale
    )
    # the stand-in writes the float32 reference; only the bf16 store rounds (2**-8 relative)
    torch.testing.assert_close(out.float(), ref_out, rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse)
    assert torch.isneginf(lse[0]).all() and (out[0] == 0).all()
    # rows past the batch keep their poison
    assert torch.isnan(buffers[2][rows * heads * 512 :]).all()


def test_decode_takes_every_planned_width(reference_kernels):
    core, *_ = _core("fp8", 16, 2, 256, {2: "triton"}, widths=(128, 256, 512))
    assert reference_kernels.instances[0].setup.widths == (128, 256, 512)
    step = make_step(2, 16, 512, "fp8", device=DEVICE)
    slots, counts = convert_topk_reference(
        step.topk, step.metadata.req_id_per_token, step.metadata.block_table, block_size=64, rows_per_block_stride=64
    )
    core.decode(step.query, step.cache, slots, counts, 64)
    assert reference_kernels.instances[0].calls[-1]["width"] == 512
    with pytest.raises(ValueError, match="width 384 was never planned"):
        core.decode(step.query, step.cache, slots[:, :384].contiguous(), counts, 64)


def test_capacities_must_hold_every_prims_ts_batch(reference_kernels):
    with pytest.raises(ValueError, match="rows"):
        _core("fp8", 16, 8, 128, {8: "prims_ts"}, capacities=[4])


@pytest.mark.skipif(
    importlib.util.find_spec("vllm_kimi_dsa.kernels.triton_decode") is None, reason="the triton kernel is not built yet"
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_end_to_end_with_the_triton_kernel(fmt):
    rows, heads, width = (5, 128, 2048) if DEVICE == "cuda" else (2, 16, 256)
    core, *_ = _core(fmt, heads, rows, width, {rows: "triton"})
    step = make_step(rows, heads, width, fmt, device=DEVICE, empty_rows=1, seed=7)
    out, lse = core.run(step.query, step.cache, step.topk, step.metadata)
    kv_rows, _ = core.rows(step.cache, 64)
    slots, counts = core.buffers.slots[:rows], core.buffers.counts[:rows]
    kernel = core.decode_kernel(rows)
    # against the decode the kernel computes (conftest.computed_operands: a Gluon nvfp4 form's values), with the
    # per-element bound of decode_checks (its fp8 wgmma logit bound included): this random-byte cache's logits reach
    # the hundreds (nvfp4 values up to 2688, negative block scales, no k_scale), a peaked softmax, where a logit
    # error e moves an output by up to 2e max|v|
    query, kv_rows, fmt_c, ss, os_ = computed_operands(kernel, fmt, step.query, kv_rows, core.softmax_scale,
                                                       core.output_scale)
    check_decode(out, lse, query, kv_rows, slots, counts, fmt_c, ss, os_, config=getattr(kernel, "config", None),
                 wgmma=fp8_wgmma_dims(kernel, fmt) or False)
    assert torch.isneginf(lse[0]).all()
