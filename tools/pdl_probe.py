#!/usr/bin/env python3
"""Probe: does programmatic dependent launch of the split combine shorten small batches? The seesaw kernel's
one-launch plans (FP8, K = 2048) timed three ways in one run, in CUDA graphs over inputs rotated past the L2
(bench_gluon.time_rotated): as shipped; the combine launched PDL (griddepcontrol.wait first); and that with the
decode kernel triggering its dependents once its CTAs run. Outputs of the three compared bit for bit.

    python3 tools/pdl_probe.py --out DIR [--rows 1,2,5,8,20,32] [--heads 128,64]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_gluon import CACHE_ROWS, K, OSCALE, SSCALE, time_rotated  # noqa: E402

from vllm_kimi_dsa.planning.cost import plan_and_cost  # noqa: E402
from vllm_kimi_dsa.formats import LATENT_DIM, quantize_rows, row_bytes  # noqa: E402
from vllm_kimi_dsa.kernels import common as kcommon  # noqa: E402
from vllm_kimi_dsa.kernels import gluon_seesaw as gs  # noqa: E402
from vllm_kimi_dsa.kernels.common.gluon import call_kernel  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--rows", default="1,2,5,8,20,32")
    p.add_argument("--heads", default="128,64")
    a = p.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    kv = quantize_rows(torch.randn(CACHE_ROWS, 576, device=dev, generator=g) * 8, "fp8")
    params = gs.SeesawParams()
    sms = kcommon.num_sms(dev)
    results = []
    for heads in (int(h) for h in a.heads.split(",")):
        cfg = params.config(heads)
        hb = triton.cdiv(heads, gs.BLOCK_H)
        for rows in (int(r) for r in a.rows.split(",")):
            (whole, splits), _, lead = plan_and_cost(rows, heads, K, cfg, sms)
            if whole or splits == 1:
                print(f"H {heads} rows {rows}: plan {whole, splits} not a split one-launch plan, skipped")
                continue

            def variant(pdl: bool, trigger: bool):
                consts = gs.kernel_constexprs(dataclasses.replace(params, pdl_trigger=trigger))

                def make(q, s, c, o, lse, ws):
                    def call():
                        call_kernel(gs.seesaw_decode_kernel, (hb, splits, rows), q, kv, s, c, o, lse, SSCALE,
                                    OSCALE, ws, splits, consts, lead_tiles=lead)
                        kcommon.combine_kernel[(heads, rows)](
                            ws.part_out, ws.part_lse, o, lse, heads, splits, o.stride(0), o.stride(1),
                            lse.stride(0), OSCALE, SPLITS=triton.next_power_of_2(splits), D=LATENT_DIM, PDL=pdl,
                            num_warps=kcommon.combine_warps(ws), launch_pdl=pdl)
                    return call
                return make

            rec = {"heads": heads, "rows": rows, "splits": splits, "lead": lead}
            outs = {}
            for name, pdl, trig in (("base", False, False), ("pdl", True, False), ("pdl_trigger", True, True),
                                    ("base2", False, False)):
                g.manual_seed(7)  # the same inputs for each variant
                us, _, o, lse, _ = time_rotated(variant(pdl, trig), rows, heads, splits, row_bytes("fp8"), dev, g)
                rec[f"{name}_us"] = us
                outs[name] = (o[-1].clone(), lse[-1].clone())
            rec["same"] = all(torch.equal(outs[n][0], outs["base"][0]) and torch.equal(outs[n][1], outs["base"][1])
                              for n in outs)
            results.append(rec)
            print(" ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in rec.items()),
                  flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "pdl_probe.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "K": K, "results": results}, indent=1))


if __name__ == "__main__":
    main()
