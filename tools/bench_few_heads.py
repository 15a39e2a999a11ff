#!/usr/bin/env python3
"""Time the few-heads Gluon kernel's shipped forms (kernels/gluon_few_heads.py) against the plain Triton kernel on one
GPU: fp8 and nvfp4_ds_mla caches ("-nvfp4" names), H = 16 and 12 by default, K = 2048, against the copy bandwidth
measured in the same run.

Each form runs a batch as TritonDecode does: choose_plan's plan (whole rows, then a split tail) and choose_lead's
lead, so its times are the ones plan_cost chooses between (benchmarks/fit_plan_cost.py reads the JSON). One process,
each call in a CUDA graph rotating over input sets past 2x the L2, accuracy against the float32 reference first (5
rows, holes, a count-0 row, 1 and 3 splits). "copy" is the KV bytes (rows x K x row bytes) over the copy bandwidth
(vllm_kimi_dsa.timing.ceilings). Prints a table, writes DIR/few_heads_bench.json.

    python3 tools/bench_few_heads.py --out DIR [--rows 1,5,20,80,160,320] [--heads 16,12] [--only NAMES]
        [--splits '80:1,2,3;5:8,16,32' --probe few-tail-regv]   (the probe: one launch at each split count, H = 16)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from vllm_kimi_dsa import planning  # noqa: E402
from vllm_kimi_dsa.timing import ceilings  # noqa: E402
from vllm_kimi_dsa.formats import LATENT_DIM, quantize_rows, row_bytes  # noqa: E402
from vllm_kimi_dsa.kernels import common as kcommon  # noqa: E402
from vllm_kimi_dsa.kernels import gluon_few_heads as fh  # noqa: E402
from vllm_kimi_dsa.kernels import gluon_seesaw as gs  # noqa: E402
from vllm_kimi_dsa.kernels import triton_decode as td  # noqa: E402
from vllm_kimi_dsa.kernels.common.gluon import gluon_available, gluon_unavailable_reason  # noqa: E402
from bench_gluon import accuracy_case  # noqa: E402
from vllm_kimi_dsa.timing import cuda_graph_time_us, rotation_sets  # noqa: E402

K = 2048
CACHE_ROWS = 1 << 20
SSCALE = 1.0 / math.sqrt(192.0) * 0.25 * 0.125  # softmax scale x q_scale x k_scale, as the suite's
OSCALE = 0.125
# name -> the few-heads kernel's params (the names of earlier runs' JSON, which fit_plan_cost reads by default)
VARIANTS = {"few-tail-regv": lambda: fh.reg_v_params(),  # one CTA an SM
            "few-tail-regv-2cta-early": lambda: fh.reg_v_params(2),  # two CTAs an SM
            # 8-head blocks (1..8 heads: no padding to 16), one and two CTAs an SM
            "few-tail-regv-h8": lambda: fh.reg_v_params(block_h=8),
            "few-tail-regv-h8-2cta-early": lambda: fh.reg_v_params(2, block_h=8),
            # nvfp4_params: the e4m3 form
            "few-tail-nvfp4": lambda: fh.nvfp4_params(),
            # the seesaw kernel's nvfp4 form (one 64-head block, heads past H masked) on <= 32 heads: the
            # alternative to the few-heads form's one pass a 16-head block above 16 heads
            "seesaw-tail-nvfp4": lambda: gs.nvfp4_seesaw_params()}
# the plain kernel at its default config: "triton*" one launch at choose_splits' count, "triton-tail*" the plan
NAMES = ["triton", "triton-nvfp4", "triton-tail", "triton-tail-nvfp4", *VARIANTS]


def _fmt(name: str) -> str:
    return "nvfp4_ds_mla" if name.endswith("-nvfp4") else "fp8"


def _params(name: str) -> fh.FewHeadsParams | gs.SeesawParams:
    return VARIANTS[name]()


def _config(name: str, heads: int) -> planning.Config:
    if name.startswith("triton"):
        return planning.default_config(heads, _fmt(name))
    return _params(name).config(heads)


def _launch(name: str, heads: int, lead_tiles: int = 0):
    """launch(query, kv_rows, slots, counts, out, lse, ws, splits) of one kernel call (and its combine)."""
    fmt, cfg = _fmt(name), _config(name, heads)
    if name.startswith("triton"):
        def launch(q, kv, s, c, o, lse, ws, splits):
            td.sparse_mla_decode(q, kv, s, c, fmt=fmt, softmax_scale=SSCALE, output_scale=OSCALE, out=o, lse=lse,
                                 workspace=ws, config=cfg, splits=splits)
        return launch
    params = _params(name)
    module_launch = gs.launch if name.startswith("seesaw") else fh.launch

    def launch(q, kv, s, c, o, lse, ws, splits):
        module_launch(q, kv, s, c, o, lse, SSCALE, OSCALE, ws, splits, params, lead_tiles)
    return launch


def _runner(name: str, q, kv, slots, counts, out, lse, ws, splits: int | None = None):
    """A call of kernel `name` on these inputs: at `splits` splits in one launch, or (None) through the batch's plan.
    ws: scratch for either (make_workspace with the plan's config)."""
    rows, heads, width = q.shape[0], q.shape[1], slots.shape[1]
    if splits is not None:
        launch = _launch(name, heads)
        return lambda: launch(q, kv, slots, counts, out, lse, ws, splits)
    cfg, sms = _config(name, heads), kcommon.num_sms(q.device)
    if name in ("triton", "triton-nvfp4"):
        plan = (0, planning.choose_splits(rows, heads, width, cfg, sms))
    else:
        plan = planning.choose_plan(rows, heads, width, cfg, sms)
    lead = 0 if name.startswith("triton") else planning.choose_lead(rows, heads, width, cfg, sms)
    first, tail = _launch(name, heads, lead), _launch(name, heads)
    return lambda: kcommon.run_plan(first, plan, q, kv, slots, counts, out, lse, ws, split_launch=tail)


def _workspace(name: str, heads: int, rows: int, dev, splits: int = 1) -> kcommon.Workspace:
    return kcommon.make_workspace(dev, heads=heads, max_rows=rows, widths=(K,), fmt=_fmt(name),
                                  config=_config(name, heads), min_entries=rows * splits * heads)


def _time(name: str, heads: int, rows: int, kv, dev, g, splits: int | None = None) -> float:
    """µs per call at `rows` rows (K slots each into the CACHE_ROWS cache), in a CUDA graph over input sets past 2x
    the L2."""
    sets = rotation_sets(rows * K * row_bytes(_fmt(name)), lo=1, hi=24)
    ws = _workspace(name, heads, rows, dev, splits or 1)
    counts = torch.full((rows,), K, device=dev, dtype=torch.int32)
    calls = []
    for _ in range(sets):
        q = (torch.randn(rows, heads, 576, device=dev, generator=g) * 4).to(torch.float8_e4m3fn)
        slots = torch.randint(0, CACHE_ROWS, (rows, K), device=dev, generator=g, dtype=torch.int32)
        out = torch.empty(rows, heads, LATENT_DIM, dtype=torch.bfloat16, device=dev)
        lse = torch.empty(rows, heads, device=dev)
        calls.append(_runner(name, q, kv, slots, counts, out, lse, ws, splits))
    return cuda_graph_time_us(calls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--rows", default="1,5,20,80,160,320")
    p.add_argument("--heads", default="16,12")
    p.add_argument("--only", default="", help=f"comma-separated kernel names of {NAMES} (default: all)")
    p.add_argument("--splits", default="", help="probe a kernel at H=16 in one launch, e.g. '80:1,2,3;5:8,16,32'")
    p.add_argument("--probe", default="few-tail-regv", help="the kernel name --splits probes")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_few_heads.py needs a CUDA GPU")
    rows_list = [int(r) for r in a.rows.split(",")]
    heads_list = [int(h) for h in a.heads.split(",")]
    names = [n for n in NAMES if not a.only or n in a.only.split(",")]
    if not gluon_available():
        print(f"Gluon unavailable: {gluon_unavailable_reason()}; timing the plain kernel only")
        names = [n for n in names if n.startswith("triton")]
    dev = torch.device("cuda")
    ceil = ceilings(dev, quick=True)
    print(f"copy {ceil['copy_GBps']:.0f} GB/s (read + written)", flush=True)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(CACHE_ROWS, 576, device=dev, generator=g) * 8
    caches = {fmt: quantize_rows(x, fmt) for fmt in ("fp8", "nvfp4_ds_mla")}
    results: dict[str, dict] = {}
    for heads in heads_list:
        q5, s5, c5, refs, src = accuracy_case(heads, K, caches, x, dev, g)
        for name in names:
            key, fmt = f"{name}/H{heads}", _fmt(name)
            kv = caches[fmt]
            ref, ref_lse = refs[fmt]
            rec: dict = {"times": {}}
            results[key] = rec
            try:
                for splits in (1, 3):
                    out = torch.full((5, heads, LATENT_DIM), float("nan"), dtype=torch.bfloat16, device=dev)
                    lse = torch.full((5, heads), float("nan"), device=dev)
                    _runner(name, q5, kv, s5, c5, out, lse, _workspace(name, heads, 5, dev, splits), splits)()
                    torch.cuda.synchronize()
                    fin = torch.isfinite(ref_lse)
                    rel = float((out.float() - ref).norm() / ref.norm())
                    rel_src = float((out.float() - src).norm() / src.norm())
                    ok = (bool(torch.isfinite(out).all()) and bool((out[1] == 0).all())
                          and bool(torch.isneginf(lse[1]).all()) and bool(torch.isfinite(lse[fin]).all()))
                    lse_err = float((lse[fin] - ref_lse[fin]).abs().max()) if ok else float("inf")
                    rec[f"acc_splits{splits}"] = dict(rel_l2=rel, rel_l2_source=rel_src, lse_err=lse_err, ok=ok)
                    print(f"{key:28s} splits={splits}: rel {rel:.2e} (vs unquantized {rel_src:.2e}) "
                          f"lse {lse_err:.2e} {'ok' if ok else 'BAD'}", flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on with the other kernels
                rec["error"] = f"{type(e).__name__}: {e}"
                print(f"{key} FAILED: {rec['error'][:300]}", flush=True)
                traceback.print_exc()
                continue
            for rows in rows_list:
                us = _time(name, heads, rows, kv, dev, g)
                gbps = rows * K * row_bytes(fmt) / us / 1e3
                plan = planning.choose_plan(rows, heads, K, _config(name, heads), kcommon.num_sms(dev))
                rec["times"][rows] = dict(us=us, plan=plan, kv_GBps=gbps, copy_frac=gbps / ceil["copy_GBps"])
                print(f"{key:28s} rows {rows:4d}: {us:8.1f} us  plan {plan}  {gbps:6.0f} GB/s  "
                      f"{gbps / ceil['copy_GBps']:.2f} of copy", flush=True)
    probe = []
    for item in filter(None, a.splits.split(";")):
        rows_s, counts_s = item.split(":")
        for sp in (int(c) for c in counts_s.split(",")):
            us = _time(a.probe, 16, int(rows_s), caches[_fmt(a.probe)], dev, g, sp)
            probe.append(dict(kernel=a.probe, rows=int(rows_s), splits=sp, us=us))
            print(f"splits probe {a.probe} H=16: rows {rows_s:>4s} splits {sp:2d}: {us:8.1f} us", flush=True)
    print(f"\n{'kernel':28s} " + " ".join(f"{r:>13d}" for r in rows_list) + "   (µs (fraction of copy), K=2048)")
    for key, rec in results.items():
        cells = [f"{t['us']:7.1f} ({t['copy_frac']:.2f})" if (t := rec["times"].get(r)) else f"{'-':>13s}"
                 for r in rows_list]
        print(f"{key:28s} " + " ".join(cells))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "few_heads_bench.json").write_text(json.dumps(
        dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
             K=K, ceilings=ceil, results=results, splits_probe=probe, floor="rows*K*row bytes of KV at copy_GBps"),
        indent=1))


if __name__ == "__main__":
    main()
