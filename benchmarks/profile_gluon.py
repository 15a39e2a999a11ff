"""Two launches of the Gluon decode (H=128, K=2048, fp8, 80 rows, one split) for ncu: profile the second with
`ncu -k regex:gluon_decode_kernel -s 1 -c 1 ...` (benchmarks/device_profile_gluon.sh)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from vllm_kimi_dsa.formats import LATENT_DIM, quantize_rows  # noqa: E402
from vllm_kimi_dsa.kernels.gluon_decode import gluon_sparse_mla_decode  # noqa: E402

dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
rows, heads, width = 80, 128, 2048
kv = quantize_rows(torch.randn(1 << 20, 576, device=dev, generator=g) * 8, "fp8")
q = (torch.randn(rows, heads, 576, device=dev, generator=g) * 4).to(torch.float8_e4m3fn)
slots = torch.randint(0, 1 << 20, (rows, width), device=dev, generator=g, dtype=torch.int32)
counts = torch.full((rows,), width, device=dev, dtype=torch.int32)
out = torch.empty(rows, heads, LATENT_DIM, dtype=torch.bfloat16, device=dev)
for _ in range(2):
    gluon_sparse_mla_decode(q, kv, slots, counts, softmax_scale=0.01, output_scale=1.0, out=out, splits=1)
torch.cuda.synchronize()
print("profiled gluon_decode_kernel: rows", rows, "heads", heads, "K", width)
