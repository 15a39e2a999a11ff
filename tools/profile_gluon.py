"""Two launches of a Gluon decode kernel for ncu: profile the second with `ncu -k regex:<kernel> -s 1 -c 1 ...`
(`bash tools/device_run.sh ncu ARGS`). Default: the 64-head kernel, H=128, K=2048, fp8, 80 rows, one split;
`--kernel few` the few-heads kernel (default H=16, 264 rows: two full waves of 132 SMs); `--kernel seesaw`
gluon_seesaw's 64-head kernel.

    python3 tools/profile_gluon.py [--kernel gluon|few|seesaw] [--rows N] [--heads H] [--params k=v,...]
        [--width K] [--splits S] [--fmt fp8|nvfp4_ds_mla]

--params: FewHeadsParams (few) or SeesawParams (seesaw) overrides (e.g. reg_v=1,k_stages=4).
--fmt nvfp4_ds_mla: the few-heads or seesaw kernel's nvfp4 form (nvfp4_params / nvfp4_seesaw_params, then --params).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from vllm_kimi_dsa.formats import LATENT_DIM, quantize_rows
from vllm_kimi_dsa.kernels.gluon_decode import gluon_sparse_mla_decode
from vllm_kimi_dsa.kernels.gluon_few_heads import (
    FewHeadsParams,
    few_heads_sparse_mla_decode,
    nvfp4_params,
)
from vllm_kimi_dsa.kernels.gluon_seesaw import (
    SeesawParams,
    nvfp4_seesaw_params,
    seesaw_sparse_mla_decode,
)

p = argparse.ArgumentParser()
p.add_argument("--kernel", choices=("gluon", "few", "seesaw"), default="gluon")
p.add_argument("--rows", type=int, default=None)
p.add_argument("--heads", type=int, default=None)
p.add_argument("--width", type=int, default=2048, help="top-k slots a row")
p.add_argument("--splits", type=int, default=1, help="KV splits (> 1: fp32 partials and the combine)")
p.add_argument("--params", default="", help="few-heads kernel: FewHeadsParams overrides, k=v,...")
p.add_argument("--fmt", choices=("fp8", "nvfp4_ds_mla"), default="fp8", help="cache format (nvfp4: few / seesaw)")
a = p.parse_args()
nvfp4 = a.fmt == "nvfp4_ds_mla"
if nvfp4 and a.kernel == "gluon":
    p.error("--fmt nvfp4_ds_mla needs --kernel few or seesaw")
few = a.kernel == "few"
rows = a.rows or (264 if few else 80)
heads = a.heads or (16 if few else 128)
width = a.width
run = {"few": few_heads_sparse_mla_decode, "seesaw": seesaw_sparse_mla_decode}.get(a.kernel, gluon_sparse_mla_decode)
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
kv = quantize_rows(torch.randn(1 << 20, 576, device=dev, generator=g) * 8, a.fmt)
q = (torch.randn(rows, heads, 576, device=dev, generator=g) * 4).to(torch.float8_e4m3fn)
slots = torch.randint(0, 1 << 20, (rows, width), device=dev, generator=g, dtype=torch.int32)
counts = torch.full((rows,), width, device=dev, dtype=torch.int32)
out = torch.empty(rows, heads, LATENT_DIM, dtype=torch.bfloat16, device=dev)
extra = {}
if a.kernel in ("few", "seesaw") and (a.params or nvfp4):
    base = (nvfp4_params() if few else nvfp4_seesaw_params()) if nvfp4 else (FewHeadsParams() if few else SeesawParams())
    extra["params"] = replace(base, **{k: int(v) for k, v in (kv_.split("=") for kv_ in a.params.split(",") if kv_)})
for _ in range(2):
    run(q, kv, slots, counts, softmax_scale=0.01, output_scale=1.0, out=out, splits=a.splits, **extra)
torch.cuda.synchronize()
print("profiled", a.kernel, a.fmt, "rows", rows, "heads", heads, "K", width, "splits", a.splits)
