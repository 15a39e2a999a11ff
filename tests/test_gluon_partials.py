"""GPU tests of the split partials (PARTIAL_DTYPE, fp16) through every Gluon decode kernel.

Each kernel writes its split partial in fp16: the 64-head kernel from its wgmma accumulator through
glcommon.wgmma_store_layout, the seesaw kernel and reg_v (one or two
CTAs an SM) and both nvfp4 (e4m3) forms through glcommon.latent_store_layout.
Inputs are test_gluon_decode's (holes, junk past counts, a count-0 row, a 1-token row, an all-holes row); outputs
and the scratch are poisoned with NaN first, so an entry a kernel leaves unwritten fails. Tolerance: the kernel's
own check plus the partials' rounding (test_triton_decode.PARTIAL_ERR: 2^-11 of max |v| * output_scale for fp16);
nvfp4 against the fp8 decode it computes (on formats.nvfp4_e4m3_values of the rows).
Hopper only: skips with the reason elsewhere (the plain Triton kernel's are tested on CPU in
test_triton_decode.test_partial_dtype).
"""

from __future__ import annotations

import pytest
import torch

from conftest import GLUON_GPU, VALUES
from test_gluon_decode import _case, _poisoned
from test_triton_decode import PARTIAL_ERR
from test_triton_decode import _check as triton_check
from vllm_kimi_dsa.kernels.gluon_decode import gluon_sparse_mla_decode
from vllm_kimi_dsa.planning import gluon_config
from vllm_kimi_dsa.kernels.gluon_few_heads import few_heads_sparse_mla_decode, nvfp4_params, reg_v_params
from vllm_kimi_dsa.planning import few_heads_config
from vllm_kimi_dsa.formats import nvfp4_e4m3_values
from vllm_kimi_dsa.kernels.gluon_seesaw import SeesawParams, nvfp4_seesaw_params, seesaw_sparse_mla_decode
from vllm_kimi_dsa.kernels import common as kcommon

GPU = GLUON_GPU
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (kernel, params, rows, heads, width, splits)
CASES = [
    ("gluon", None, 5, 128, 2048, 11),
    ("gluon", None, 7, 96, 1024, 3),
    ("seesaw", SeesawParams(), 5, 128, 2048, 3),
    ("seesaw", SeesawParams(), 19, 64, 2048, 2),
    ("few", reg_v_params(), 5, 32, 2048, 4),
    ("few", reg_v_params(), 5, 16, 2048, 16),
    ("few", reg_v_params(), 19, 12, 1024, 2),
    ("few", reg_v_params(2), 5, 16, 2048, 32),
    ("few", reg_v_params(2), 7, 24, 1024, 3),
    ("nvfp4", nvfp4_params(), 5, 12, 2048, 8),
    ("seesaw", nvfp4_seesaw_params(), 5, 128, 2048, 3),
]


def _id(c) -> str:
    kernel, params, rows, heads, width, splits = c
    form = "regv2" if getattr(params, "ctas_per_sm", 1) == 2 else "regv" if getattr(params, "reg_v", False) else ""
    form += "-nvfp4" if getattr(params, "nvfp4", False) else ""
    return f"{kernel}{form}-r{rows}-h{heads}-k{width}-s{splits}"


@GPU
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_partials_match_reference(case) -> None:
    dtype = kcommon.PARTIAL_DTYPE
    kernel, params, rows, heads, width, splits = case
    fmt = "nvfp4_ds_mla" if getattr(params, "nvfp4", False) else "fp8"
    q, kv, slots, counts, ss, os_ = _case(rows, heads, width, seed=rows * 7 + heads + splits, fmt=fmt)
    config = gluon_config() if kernel in ("gluon", "seesaw") else params.config(heads)
    ws = kcommon.make_workspace(DEVICE, heads=heads, max_rows=rows, widths=(width,), fmt=fmt, config=config,
                                      min_entries=rows * splits * heads)
    ws.part_out.fill_(float("nan"))
    out, lse = _poisoned(rows, heads)
    args = dict(softmax_scale=ss, output_scale=os_, out=out, lse=lse, workspace=ws, splits=splits)
    if kernel == "gluon":
        gluon_sparse_mla_decode(q, kv, slots, counts, **args)
    elif kernel == "seesaw":
        seesaw_sparse_mla_decode(q, kv, slots, counts, params=params, **args)
    else:
        few_heads_sparse_mla_decode(q, kv, slots, counts, params=params, **args)
    torch.cuda.synchronize()
    kv_fmt = "fp8"
    if fmt == "nvfp4_ds_mla":  # the e4m3 forms compute an fp8 decode of these values
        kv, kv_fmt = nvfp4_e4m3_values(kv), VALUES
    check_config = gluon_config() if kernel in ("gluon", "seesaw") else few_heads_config()
    triton_check(out, lse, q, kv, slots, counts, kv_fmt, ss, os_, config=check_config, wgmma=True,
                 partial_err=PARTIAL_ERR[dtype])
