"""One small Gluon decode launch for `compute-sanitizer --tool racecheck --racecheck-report hazard`: the hazard
report names the shared-memory offsets, to tell the kernel's own buffers (Q, K ring, V16, mbarriers: the first
~176.5 KB) from the state Triton's warp_specialize lowering keeps after them.

    python3 tools/racecheck_gluon.py [gluon|seesaw] [field=value ...]
(the 64-head kernel or the seesaw kernel, default gluon; fields: GluonParams' / SeesawParams' overrides, integers)"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from vllm_kimi_dsa.formats import LATENT_DIM, quantize_rows  # noqa: E402
from vllm_kimi_dsa.kernels.gluon_decode import gluon_sparse_mla_decode  # noqa: E402
from vllm_kimi_dsa.kernels.gluon_seesaw import SeesawParams, seesaw_sparse_mla_decode  # noqa: E402
from vllm_kimi_dsa.reference import reference_decode  # noqa: E402

kind = sys.argv[1] if len(sys.argv) > 1 else "gluon"
overrides = {k: int(v) for k, v in (a.split("=") for a in sys.argv[2:])}
if kind == "seesaw":
    def decode(*args, **kwargs):
        return seesaw_sparse_mla_decode(*args, **kwargs, params=SeesawParams(**overrides))
else:
    def decode(*args, **kwargs):
        return gluon_sparse_mla_decode(*args, **kwargs, **overrides)

dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
rows, heads, width = 2, 128, 256
kv = quantize_rows(torch.randn(4096, 576, device=dev, generator=g), "fp8")
q = torch.randn(rows, heads, 576, device=dev, generator=g).to(torch.float8_e4m3fn)
slots = torch.randint(0, 4096, (rows, width), device=dev, generator=g, dtype=torch.int32)
counts = torch.tensor([width, 77], device=dev, dtype=torch.int32)
out = torch.empty(rows, heads, LATENT_DIM, dtype=torch.bfloat16, device=dev)
lse = torch.empty(rows, heads, device=dev)
h = decode(q, kv, slots, counts, softmax_scale=0.05, output_scale=1.0, out=out, lse=lse, splits=1)
torch.cuda.synchronize()
ref, _ = reference_decode(q, kv, slots, counts, fmt="fp8", softmax_scale=0.05, output_scale=1.0)
rel = float((out.float() - ref).norm() / ref.norm())
print(kind, overrides, "smem bytes", h.metadata.shared, "finite", bool(torch.isfinite(out).all()), f"rel L2 {rel:.2e}")
