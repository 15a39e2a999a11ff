#!/usr/bin/env python3
"""A small core run for compute-sanitizer (memcheck / racecheck): the converter, the shipped decode kernels and the
combine, both cache formats, 16 / 32 / 128 heads, checked against the float32 reference.

    compute-sanitizer --tool memcheck python3 tools/sanitize_case.py [--tiny]   (tools/device_run.sh memcheck)

Tiny batches of each path (3 rows, width 256), then batches whose plan on 132 SMs takes the other launches: H = 128,
80 rows at width 512 (66 whole rows + 14 split 4 ways); H = 128, 200 rows (the seesaw kernel); H = 16 / 32, 160
rows (two CTAs an SM); nvfp4 H = 16, 160 rows and H = 128, 80 rows (the e4m3 forms: their rel L2 against the exact
reference is the e4m3 rounding's, larger on these random-byte caches, whose block scales span e4m3's whole range,
than on rows quantized from N(0,1) data). With VLLM_KIMI_DSA_FP8_PV=1 the fp8 H = 128 batches run the P.V-on-e4m3
form (P rounded to e4m3; its error is in docs/hopper-kernels.md). --tiny: the tiny batches only (racecheck takes minutes on the rest).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from vllm_kimi_dsa.core import FlashInferCore  # noqa: E402
from vllm_kimi_dsa.reference import reference_decode  # noqa: E402
from vllm_kimi_dsa.synthetic import StandInImpl, StandInLayer, make_buffers, make_step  # noqa: E402

# (fmt, heads, buffer rows, width, batch sizes)
TINY = [(fmt, heads, 3, 256, (1, 3)) for fmt in ("fp8", "nvfp4_ds_mla") for heads in (16, 32, 128)]
PLANS = [("fp8", 128, 80, 512, (80,)), ("fp8", 128, 200, 256, (200,)), ("fp8", 16, 160, 512, (160,)),
         ("fp8", 32, 160, 512, (160,)), ("nvfp4_ds_mla", 16, 160, 512, (160,)),
         ("nvfp4_ds_mla", 128, 80, 512, (80,))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="the 3-row batches only")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sanitize_case.py needs a CUDA GPU")
    dev = torch.device("cuda")
    worst = 0.0
    for fmt, heads, rows, width, batches in TINY + ([] if a.tiny else PLANS):
        buffers = make_buffers(rows, heads, width, dev)
        core = FlashInferCore(StandInImpl(kv_cache_dtype=fmt), StandInLayer(), heads, buffers,
                              {b: "triton" for b in (1, *batches)}, kv_cache_dtype=fmt)
        for r in batches:
            step = make_step(r, heads, width, fmt, device=dev, empty_rows=1 if r > 1 else 0, seed=heads + r)
            out, lse = core.run(step.query, step.cache, step.topk, step.metadata)
            torch.cuda.synchronize()
            kv, _ = core.rows(step.cache, step.metadata.block_size)
            ref, _ = reference_decode(step.query, kv, buffers[0][:r], buffers[1][:r], fmt=core.fmt,
                                      softmax_scale=core.softmax_scale, output_scale=core.output_scale)
            err = float((out.float() - ref).norm() / ref.norm().clamp(min=1e-30))
            worst = max(worst, err)
            print(f"{fmt} H={heads} rows={r}: rel L2 {err:.2e}", flush=True)
    print(f"sanitize case done, worst rel L2 {worst:.2e}", flush=True)


if __name__ == "__main__":
    main()
