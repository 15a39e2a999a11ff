"""The one table of Gluon kernel variants TritonDecode binds on Hopper, and the Triton versions each was verified on.

A variant runs by itself only on the versions of VERIFIED_TRITON (GPU-tested there); VLLM_KIMI_DSA_GLUON=1 asks
for it on any version Gluon's API supports, =0 never. Elsewhere the plain kernel runs.

Which kernel takes which head count a rank (1..128; heads past H in a kernel's block are zero queries, masked at
the store: the query is never copied or padded in memory), fp8 cache:

| heads | kernel (hopper_kernel) |
| --- | --- |
| 1..8 | few heads, 8-head blocks ("few-fp8-h8"; where not verified, one 16-head block) |
| 9..16 | few heads, one 16-head block |
| 17..32 | few heads, two 16-head blocks (each CTA gathers the rows; the second mostly from L2) |
| 33..128 | the 64-head kernels (seesaw / gluon_decode): one or two 64-head blocks |

nvfp4_ds_mla: 1..16 few heads (one 16-head block), 17..32 few heads below NVFP4_SEESAW_MIN_ROWS rows and the seesaw
nvfp4 form from there, 33..128 the seesaw nvfp4 form. The plain Triton kernel (elsewhere) takes every count in
16-, 32- or 64-head blocks (planning.default_config).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vllm_kimi_dsa.heads import FEW_HEADS_MAX
from vllm_kimi_dsa.host_math import cdiv
from vllm_kimi_dsa.kernels import gluon_decode, gluon_few_heads, gluon_seesaw
from vllm_kimi_dsa.kernels.common.gluon import triton_is
from vllm_kimi_dsa.planning import Config, few_heads_config

# variant -> the Triton versions on which it passed its GPU tests (on the H200; the nvfp4 forms' current code, the
# row shift with fp16 scales, on the H100: every nvfp4 GPU case on 3.6 and 3.8, docs/history.md v25)
VERIFIED_TRITON: dict[str, tuple[str, ...]] = {
    "gluon64": ("3.6", "3.8"),  # gluon_decode: fp8, > 32 heads
    "seesaw": ("3.6", "3.8"),  # gluon_seesaw: fp8, > 32 heads, the launches seesaw_takes
    # gluon_seesaw's P.V on e4m3 (VLLM_KIMI_DSA_FP8_PV=1): fp8, > 32 heads, every launch
    "seesaw-pv-fp8": ("3.6", "3.8"),
    # gluon_seesaw's nvfp4 form (e4m3 K stages): nvfp4_ds_mla, > 32 heads every launch, 17..32 heads the plans of
    # NVFP4_SEESAW_MIN_ROWS rows or more
    "seesaw-nvfp4": ("3.6", "3.8"),
    "few-fp8": ("3.6", "3.8"),  # gluon_few_heads reg_v, one and two CTAs an SM, <= 16 heads
    "few-fp8-multi": ("3.6", "3.8"),  # ... 17..32 heads (16-head blocks)
    # gluon_few_heads reg_v with 8-head blocks (block_h=8), one and two CTAs an SM, 1..8 heads: not yet GPU-tested
    # (issue 42's device run tests and times it against the 16-head block; until then 1..8 heads pad to 16)
    "few-fp8-h8": (),
    "few-nvfp4": ("3.6", "3.8"),  # gluon_few_heads nvfp4 (e4m3 form), <= 16 heads
    "few-nvfp4-multi": ("3.6", "3.8"),  # ... 17..32 heads
    "pv_early": ("3.6", "3.8"),  # the two-CTA reg_v form's P.V issued before the wait for the next tile
}
# the seesaw kernel takes unsplit launches of rows of at least this many 64-token tiles (and every one-launch plan);
# a split tail after whole rows runs faster on gluon_decode's kernel
SEESAW_MIN_TILES = 8
# nvfp4 at 17..32 heads: plans of at least this many rows run on the seesaw kernel's nvfp4 form (one 64-head block,
# each row converted once) instead of the few-heads form (each row converted once a 16-head block). H100, K 2048,
# 32 heads, seesaw vs few-heads µs: 1 row 11.4 / 10.0, 5: 15.4 / 14.6, 8: 16.4 / 16.4, 20: 26.7 / 28.3,
# 80: 77.3 / 87.4, 160: 140.4 / 162.6, 320: 259.8 / 307.6 (benchmarks/results/latest/v24-e4m3-row-shift, bench_few_heads)
NVFP4_SEESAW_MIN_ROWS = 8


def verified(variant: str) -> bool:
    """Whether this Triton is one the variant passed its GPU tests on."""
    return triton_is(VERIFIED_TRITON[variant])


def seesaw_takes(width: int, splits: int, alone: bool = False) -> bool:
    """Whether a launch over rows `width` slots wide split `splits` ways runs on the seesaw kernel: the one launch
    of a plan (alone), split or not, and otherwise unsplit rows of at least SEESAW_MIN_TILES tiles."""
    return alone or (splits == 1 and cdiv(width, gluon_seesaw.BLOCK_N) >= SEESAW_MIN_TILES)


@dataclass(frozen=True)
class GluonChoice:
    """The Gluon kernels bound for one (format, heads).

    params / launch: every launch's kernel unless `large` takes it. config: the plan Config of the batch's plans.
    large / large_launch: few heads fp8, the params of each occupancy, picked per plan by plan cost (for both of its
    launches); > 32 heads, the seesaw kernel's, for the launches seesaw_takes (seesaw: which of the two `large` is);
    nvfp4 17..32 heads, the seesaw kernel's nvfp4 form for every launch of the plans of large_from_rows rows or more.
    verified: whether this Triton is one every bound variant passed its GPU tests on.
    variant: the VERIFIED_TRITON name of `params` (what hopper_kernel reports).
    """

    params: Any
    launch: Any
    config: Config
    large: tuple[Any, ...] = ()
    large_launch: Any = None
    seesaw: bool = False
    large_from_rows: int = 0
    verified: bool = True
    variant: str = ""


# fp8 at most this many heads runs the few-heads kernel's 8-head blocks where "few-fp8-h8" is verified
H8_MAX_HEADS = gluon_few_heads.BLOCK_HS[0]


def hopper_kernel(fmt: str, heads: int, want: str = "", fp8_pv: bool = False) -> str:
    """The VERIFIED_TRITON name of the Gluon kernel gluon_choice binds for (fmt, heads) on this Triton (its
    large-batch alternatives aside), or "tl" (the plain kernel, want "0"): the module docstring's table as code."""
    choice = gluon_choice(fmt, heads, want, fp8_pv)
    return "tl" if choice is None else choice.variant


def gluon_choice(fmt: str, heads: int, want: str, fp8_pv: bool = False) -> GluonChoice | None:
    """The Gluon kernels for (fmt, heads) under VLLM_KIMI_DSA_GLUON=`want` ("" unset, "1", "0"), before availability;
    None where only the plain kernel runs (want "0"). fp8_pv (VLLM_KIMI_DSA_FP8_PV): fp8 at > 32 heads, every
    launch on the seesaw kernel's P.V-on-e4m3 form where it was verified (or want "1"), else the default kernels."""
    if want == "0":
        return None
    if heads > FEW_HEADS_MAX:
        if fmt != "fp8":  # nvfp4: every launch on the seesaw kernel (gluon_decode's has no nvfp4 form)
            nv = gluon_seesaw.nvfp4_seesaw_params()
            return GluonChoice(nv, gluon_seesaw.launch, nv.config(), verified=verified("seesaw-nvfp4"),
                               variant="seesaw-nvfp4")
        if fp8_pv and (want == "1" or verified("seesaw-pv-fp8")):
            # faster than the default pair at every batch measured, split tails included (docs/hopper-kernels.md)
            pv = gluon_seesaw.pv_fp8_seesaw_params()
            return GluonChoice(pv, gluon_seesaw.launch, pv.config(), verified=verified("seesaw-pv-fp8"),
                               variant="seesaw-pv-fp8")
        params = gluon_decode.GluonParams()
        seesaw = want == "1" or verified("seesaw")
        return GluonChoice(params, gluon_decode.launch, params.config(),
                           large=(gluon_seesaw.SeesawParams(),) if seesaw else (),
                           large_launch=gluon_seesaw.launch if seesaw else None, seesaw=seesaw,
                           verified=verified("gluon64"), variant="gluon64")
    multi = "-multi" if heads > gluon_few_heads.BLOCK_H else ""
    if fmt == "fp8":  # every batch on reg_v, one or two CTAs an SM by plan cost
        # 1..8 heads: 8-head blocks where verified (or asked for), else one 16-head block
        block_h = 8 if heads <= H8_MAX_HEADS and (want == "1" or verified("few-fp8-h8")) else gluon_few_heads.BLOCK_H
        variant = "few-fp8-h8" if block_h == 8 else "few-fp8" + multi
        two = gluon_few_heads.reg_v_params(ctas_per_sm=2, block_h=block_h)
        if not verified("pv_early"):
            two = dataclasses.replace(two, pv_early=False)
        params = gluon_few_heads.reg_v_params(block_h=block_h)
        return GluonChoice(params, gluon_few_heads.launch, few_heads_config(block_h), large=(params, two),
                           large_launch=gluon_few_heads.launch, verified=verified(variant), variant=variant)
    params = gluon_few_heads.nvfp4_params()
    if not multi:
        return GluonChoice(params, gluon_few_heads.launch, params.config(), verified=verified("few-nvfp4"),
                           variant="few-nvfp4")
    return GluonChoice(params, gluon_few_heads.launch, params.config(), large=(gluon_seesaw.nvfp4_seesaw_params(),),
                       large_launch=gluon_seesaw.launch, large_from_rows=NVFP4_SEESAW_MIN_ROWS,
                       verified=verified("few-nvfp4-multi") and verified("seesaw-nvfp4"), variant="few-nvfp4-multi")
