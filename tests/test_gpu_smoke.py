"""The GPU smoke part: every kernel form the Hopper dispatcher can launch, run once against the float32 reference.

The forms come from the dispatcher itself (tests/served_forms.py: every head count 1..128, both cache formats, the
LSE on and off, VLLM_KIMI_DSA_GLUON unset and 0, VLLM_KIMI_DSA_FP8_PV 0 and 1, VLLM_KIMI_DSA_SCHEDULE static and
counts, every plan of 1..512 rows), one test a form, on the batch size that first launched it; the test asserts that
form really ran. Run it first in every session that changes a kernel (`tools/device_run.sh tests part=smoke`).
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import computed_operands, fp8_wgmma_dims
from decode_checks import P_ERR, P_ERR_E4M3, check_decode, random_case
import served_forms

GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
pytestmark = pytest.mark.skipif(not GPU, reason="runs every served kernel form on a CUDA GPU (Hopper)")

FORMS = list(served_forms.served_forms().values()) if GPU else []


def _form_id(form: served_forms.Form) -> str:
    w = form.launch.where
    return (f"{form.name}-{w['fmt']}-H{w['heads']}-r{w['rows']}-lse{int(w['lse'])}-gluon{w['gluon'] or 'default'}"
            f"-pv{w['fp8_pv']}-{w['schedule']}")


@pytest.mark.parametrize("form", FORMS, ids=_form_id)
def test_served_form_matches_reference(form: served_forms.Form) -> None:
    from vllm_kimi_dsa.backends.hopper import TritonDecode
    from vllm_kimi_dsa.kernels.base import DecodeSetup

    w = form.launch.where
    fmt, heads, rows = w["fmt"], w["heads"], w["rows"]
    q, kv, slots, counts, ss, os_ = random_case(rows, heads, served_forms.WIDTH, fmt, seed=1000 + heads + rows)
    setup = DecodeSetup(device=q.device, fmt=fmt, heads=heads, row_counts=(rows,), capacities=(),
                        widths=(served_forms.WIDTH,), return_lse=w["lse"], softmax_scale=ss, output_scale=os_)
    with served_forms.as_on_hopper(w["gluon"], w["fp8_pv"], w["schedule"]):
        kernel = TritonDecode(setup)
    out = torch.full((rows, heads, 512), float("nan"), dtype=torch.bfloat16, device=q.device)
    lse = torch.full((rows, heads), float("nan"), device=q.device) if w["lse"] else None
    launches: list[served_forms.Launch] = []
    with served_forms.recorded_launches(launches, run=True):
        kernel(q, kv, slots, counts, out, lse, block_size=1, rows_per_block_stride=1)
    torch.cuda.synchronize()
    keys = [served_forms.form_key(launch) for launch in launches]
    assert form.key in keys, f"the form did not run; the call launched {[k.split('|')[0] for k in keys]}"
    query, rows_c, fmt_c, ss_c, os_c = computed_operands(kernel, fmt, q, kv, ss, os_)
    pv_fp8 = any(getattr(p, "pv_fp8", False) for p in kernel.plan_params[rows, served_forms.WIDTH])
    check_decode(out, lse, query, rows_c, slots, counts, fmt_c, ss_c, os_c, config=kernel.config,
                 wgmma=fp8_wgmma_dims(kernel, fmt) or False, p_err=P_ERR_E4M3 if pv_fp8 else P_ERR)
