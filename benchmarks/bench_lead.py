#!/usr/bin/env python3
"""Lead plans (planning.choose_lead) by hand: one launch of a Gluon kernel at given (splits, lead_tiles) against
the plan the model picks, on the same rotated inputs (bench_gluon.time_rotated, CUDA graphs). H200 only.

    python3 benchmarks/bench_lead.py --out DIR --heads 128 --rows 46,48 --forms 2:0,2:25,2:26,2:27,2:28

Forms are splits:lead (lead 0: even splits). H > 32 runs the seesaw kernel, H <= 32 reg_v at two CTAs an SM (the
forms TritonDecode binds at these sizes). Writes lead_bench.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench_gluon as bg  # noqa: E402
from vllm_kimi_dsa.formats import quantize_rows, row_bytes  # noqa: E402
from vllm_kimi_dsa import planning  # noqa: E402

K = 2048
SMS = 132


def kernel(heads: int):
    """(launch, params) of the form TritonDecode binds at these head counts."""
    if heads > 32:
        from vllm_kimi_dsa.kernels import gluon_seesaw as gs

        return gs.launch, gs.SeesawParams()
    from vllm_kimi_dsa.kernels import gluon_few_heads as fh

    return fh.launch, fh.reg_v_params(2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--rows", default="46,48")
    p.add_argument("--forms", default="2:0,2:25,2:26,2:27,2:28")
    a = p.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    kv = quantize_rows(torch.randn(bg.CACHE_ROWS, 576, device=dev, generator=g) * 8, "fp8")
    launch, params = kernel(a.heads)
    cfg = params.config(a.heads)
    forms = [tuple(int(x) for x in f.split(":")) for f in a.forms.split(",")]
    results = []
    for rows in (int(r) for r in a.rows.split(",")):
        plan, lead = planning.choose_plan(rows, a.heads, K, cfg, SMS), planning.choose_lead(rows, a.heads, K, cfg, SMS)
        picked = [] if plan[0] else [(plan[1], lead)]  # the model's one-launch plan (a two-launch one: not here)
        line = []
        for splits, lead_tiles in picked + forms:
            def make(q, s, c, o, lse, ws, splits=splits, lead_tiles=lead_tiles):
                return lambda: launch(q, kv, s, c, o, lse, bg.SSCALE, bg.OSCALE, ws, splits, params, lead_tiles)
            us = bg.time_rotated(make, rows, a.heads, splits, row_bytes("fp8"), dev, g)[0]
            tag = f"{splits}:{lead_tiles}" + ("*" if (splits, lead_tiles) in picked and not line else "")
            results.append(dict(heads=a.heads, rows=rows, splits=splits, lead=lead_tiles, us=us,
                                picked=tag.endswith("*")))
            line.append(f"{tag} {us:6.1f}")
        print(f"H={a.heads} rows={rows} plan {plan} lead {lead}: " + "  ".join(line), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lead_bench.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
