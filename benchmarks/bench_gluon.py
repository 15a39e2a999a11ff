#!/usr/bin/env python3
"""Time the warp-specialized Gluon decode against the Triton kernel's default config on one H200 (fp8, H=128, K=2048).

Both run on the same data in one process, each call inside a CUDA graph that rotates over input sets larger than
2x the L2 (timing.cuda_graph_time_us / rotation_sets, as sweep_configs.py). Accuracy first: rel L2 and max LSE error of
each kernel against the float32 reference on a 5-row case with holes and a count-0 row. Prints a table, writes
$OUT/gluon_bench.json.

    PYTHONPATH=. python3 benchmarks/bench_gluon.py --out DIR [--rows 5,20,80,320] [--width 2048]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from vllm_kimi_dsa.formats import LATENT_DIM, quantize_rows, row_bytes  # noqa: E402
from vllm_kimi_dsa.kernels import triton_decode as td  # noqa: E402
from vllm_kimi_dsa.kernels.gluon_decode import GluonParams, gluon_sparse_mla_decode  # noqa: E402
from vllm_kimi_dsa.kernels.common.gluon import gluon_available, gluon_unavailable_reason  # noqa: E402
from vllm_kimi_dsa.planning import gluon_config  # noqa: E402
from vllm_kimi_dsa.kernels.gluon_decode import launch as gluon_launch  # noqa: E402
from vllm_kimi_dsa.kernels.gluon_seesaw import (  # noqa: E402
    SeesawParams, pv_fp8_seesaw_params, seesaw_sparse_mla_decode)
from vllm_kimi_dsa.backends.hopper.variants import seesaw_takes  # noqa: E402
from vllm_kimi_dsa.kernels.gluon_seesaw import launch as seesaw_launch  # noqa: E402
from vllm_kimi_dsa.reference import reference_decode, source_reference_decode  # noqa: E402
from vllm_kimi_dsa.timing import cuda_graph_time_us, rotation_sets  # noqa: E402
from vllm_kimi_dsa import planning  # noqa: E402
from vllm_kimi_dsa.kernels import common as kcommon  # noqa: E402

K = 2048
HEADS = 128
CACHE_ROWS = 1 << 20
SSCALE = 1.0 / math.sqrt(192.0) * 0.25 * 0.125
OSCALE = 0.125
# name -> GluonParams overrides (the default, then one field changed at a time); "triton" is triton_decode's default.
# "tail_split" is not a kernel parameter: the batch runs choose_plan's tail-split plan (whole waves unsplit, the rest
# split) through the same kernel.
GLUON_VARIANTS: dict[str, dict] = {"gluon": {}, "gluon-tail": {"tail_split": True}, "gluon-v2": {"v_slots": 2},
                                   "gluon-bn32-ks4-vs4": {"block_n": 32, "k_stages": 4, "v_slots": 4}}
# gluon_seesaw's kernel: name -> SeesawParams overrides (and "tail_split" as above)
SEESAW_VARIANTS: dict[str, dict] = {
    "seesaw": {}, "seesaw-tail": {"tail_split": True},
    # two / one P.V operands in flight; the gatherer's registers (WG1's = consumer_regs, WG0's = 504 - both)
    "seesaw-pv1-tail": {"pv_in_flight": 1, "tail_split": True},
    "seesaw-pv4-p40-tail": {"pv_in_flight": 4, "producer_regs": 40, "consumer_regs": 232, "tail_split": True},
    "seesaw-p40-tail": {"producer_regs": 40, "consumer_regs": 232, "tail_split": True},
    "seesaw-p56-tail": {"producer_regs": 56, "tail_split": True},
    "seesaw-ks3-tail": {"k_stages": 3, "tail_split": True},
    # P.V on e4m3 wgmma (P rounded to e4m3): the shipped form
    "seesaw-pvfp8-tail": {**dataclasses.asdict(pv_fp8_seesaw_params()), "tail_split": True},
    # nvfp4_ds_mla rows (the gatherer converts them to e4m3 K stages): the shipped form, then one change at a time
    "seesaw-nvfp4-tail": {"nvfp4": True, "k_stages": 3, "tail_split": True},
    "seesaw-nvfp4-cvt16-tail": {"nvfp4": True, "k_stages": 3, "cvt_rows": 16, "tail_split": True},
    "seesaw-nvfp4-p56-tail": {"nvfp4": True, "k_stages": 3, "producer_regs": 56, "consumer_regs": 208,
                              "tail_split": True},
}

# both 64-head kernels in one tail-split plan, as TritonDecode binds them: each launch on the seesaw kernel where
# variants.seesaw_takes, on gluon_decode's otherwise
MIXED_VARIANTS: tuple[str, ...] = ("mixed-tail",)


def kernel_params(overrides: dict) -> tuple[dict, bool]:
    """(the kernel-parameter overrides, whether the variant runs the tail-split plan)."""
    return {k: v for k, v in overrides.items() if k != "tail_split"}, bool(overrides.get("tail_split"))


def tail_split_call(launch, cfg: planning.Config, q, kv, slots, counts, out, lse, ws):
    """A call running choose_plan's tail-split plan for this batch through `launch` (a kernel module's launch with
    its params bound: launch(query, kv_rows, slots, counts, out, lse, softmax_scale, output_scale, ws, splits))."""
    rows, heads, width = q.shape[0], q.shape[1], slots.shape[1]
    plan = planning.choose_plan(rows, heads, width, cfg, kcommon.num_sms(q.device))
    if ws is None or (plan[1] > 1 and (rows - plan[0]) * plan[1] * heads > ws.capacity):
        ws = kcommon.make_workspace(q.device, heads=heads, max_rows=rows, widths=(width,), config=cfg)
    return lambda: kcommon.run_plan(launch, plan, q, kv, slots, counts, out, lse, SSCALE, OSCALE, ws)


def _runner(name: str, q, kv, slots, counts, out, lse, ws, splits):
    if name in ("triton", "triton-nvfp4"):
        fmt = _fmt(name)
        cfg = planning.default_config(HEADS, fmt)
        return lambda: td.sparse_mla_decode(q, kv, slots, counts, fmt=fmt, softmax_scale=SSCALE, output_scale=OSCALE,
                                            out=out, lse=lse, workspace=ws, config=cfg, splits=splits)
    if name in MIXED_VARIANTS:
        sp, gp = SeesawParams(), GluonParams()

        def takes(splits: int, alone: bool) -> bool:
            return seesaw_takes(K, splits, alone=alone)

        def mixed(*args):  # args[0]: the launch's rows (all of them: a one-launch plan), args[-1]: its splits
            alone = args[0].shape[0] == q.shape[0]
            return seesaw_launch(*args, sp) if takes(args[-1], alone) else gluon_launch(*args, gp)
        return tail_split_call(mixed, sp.config(), q, kv, slots, counts, out, lse, ws)
    if name in SEESAW_VARIANTS:
        overrides, tail = kernel_params(SEESAW_VARIANTS[name])
        sp = SeesawParams(**overrides)
        if tail:
            return tail_split_call(lambda *a: seesaw_launch(*a, sp), sp.config(), q, kv, slots, counts, out, lse, ws)
        return lambda: seesaw_sparse_mla_decode(q, kv, slots, counts, softmax_scale=SSCALE, output_scale=OSCALE,
                                                out=out, lse=lse, workspace=ws, splits=splits, params=sp)
    overrides, tail = kernel_params(GLUON_VARIANTS[name])
    params = GluonParams(**overrides)
    if tail:
        return tail_split_call(lambda *a: gluon_launch(*a, params), params.config(), q, kv, slots, counts, out, lse, ws)
    return lambda: gluon_sparse_mla_decode(q, kv, slots, counts, softmax_scale=SSCALE, output_scale=OSCALE, out=out,
                                           lse=lse, workspace=ws, splits=splits, **dataclasses.asdict(params))


def time_rotated(make_call, rows: int, heads: int, splits: int, row_nbytes: int, dev, g):
    """µs per call of make_call(q, slots, counts, out, lse, ws)() at `rows` rows of `heads` heads, K = 2048 slots
    into a CACHE_ROWS cache of `row_nbytes`-byte rows, in a CUDA graph over input sets past 2x the L2, with split
    scratch for exactly `splits` splits (make_workspace sizes for choose_splits' picks). Also bench_few_heads'. Returns (µs, workspace, outs, lses, sets)."""
    sets = rotation_sets(rows * K * row_nbytes, lo=1, hi=24)
    qs = [(torch.randn(rows, heads, 576, device=dev, generator=g) * 4).to(torch.float8_e4m3fn) for _ in range(sets)]
    ss = [torch.randint(0, CACHE_ROWS, (rows, K), device=dev, generator=g, dtype=torch.int32) for _ in range(sets)]
    cs = torch.full((rows,), K, device=dev, dtype=torch.int32)
    outs = [torch.empty((rows, heads, LATENT_DIM), dtype=torch.bfloat16, device=dev) for _ in range(sets)]
    lses = [torch.empty((rows, heads), device=dev) for _ in range(sets)]
    need = rows * splits * heads
    ws = kcommon.Workspace(part_out=torch.empty(need * LATENT_DIM, dtype=kcommon.PARTIAL_DTYPE, device=dev),
                      part_lse=torch.empty(need, device=dev),
                      dummy_lse=torch.empty(rows * heads, device=dev), capacity=need, max_rows=rows, heads=heads)
    us = cuda_graph_time_us([make_call(qs[i], ss[i], cs, outs[i], lses[i], ws) for i in range(sets)])
    return us, ws, outs, lses, sets


def accuracy_case(heads: int, width: int, caches: dict, source: torch.Tensor, dev, g):
    """The batch both Gluon benches check each kernel on first: 5 rows of `width` slots into the caches, -1 holes, a
    count-0 row. Returns (q, slots, counts, each format's reference (out, lse), the unquantized rows' answer), and
    prints each format's own quantization error (its reference against the unquantized rows')."""
    cache_rows = source.shape[0]
    q = (torch.randn(5, heads, 576, device=dev, generator=g) * 4).to(torch.float8_e4m3fn)
    slots = torch.randint(0, cache_rows, (5, width), device=dev, generator=g, dtype=torch.int32)
    slots[torch.rand(5, width, device=dev, generator=g) < 0.05] = -1
    counts = torch.tensor([width, 0, 1000, width - 1, 77], device=dev, dtype=torch.int32)
    refs = {fmt: reference_decode(q, kv, slots, counts, fmt=fmt, softmax_scale=SSCALE, output_scale=OSCALE)
            for fmt, kv in caches.items()}
    src = source_reference_decode(q, source, slots, counts, softmax_scale=SSCALE, output_scale=OSCALE)[0]
    for fmt, (ref_o, _) in refs.items():
        print(f"{fmt} reference vs the unquantized rows, H={heads}: rel "
              f"{float((ref_o - src).norm() / src.norm()):.2e}")
    return q, slots, counts, refs, src


def _fmt(name: str) -> str:
    """The cache format a kernel name reads (SeesawParams(nvfp4=True): nvfp4_ds_mla)."""
    return "nvfp4_ds_mla" if name == "triton-nvfp4" or SEESAW_VARIANTS.get(name, {}).get("nvfp4") else "fp8"


def _time(name: str, rows: int, splits: int, kv, cfg: planning.Config, dev, g):
    """µs per call of kernel `name` at `rows` rows and `splits` splits (time_rotated)."""
    return time_rotated(lambda q, s, c, o, lse, ws: _runner(name, q, kv, s, c, o, lse, ws, splits),
                        rows, HEADS, splits, row_bytes(_fmt(name)), dev, g)


def _config(name: str) -> planning.Config:
    if name in ("triton", "triton-nvfp4"):
        return planning.default_config(HEADS, _fmt(name))
    if name in MIXED_VARIANTS:
        return SeesawParams().config()
    if name in SEESAW_VARIANTS:
        return SeesawParams(**kernel_params(SEESAW_VARIANTS[name])[0]).config()
    return gluon_config(GluonParams(**kernel_params(GLUON_VARIANTS[name])[0]).block_n)


def main() -> None:
    global K, HEADS
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--rows", default="5,20,80,160,320")
    p.add_argument("--splits", default="",
                   help="also probe a kernel (--probe) at given split counts, e.g. '80:1,2,3,4;5:8,11,16'")
    p.add_argument("--only", default="", help="comma-separated kernel names (default: triton + every Gluon variant)")
    p.add_argument("--width", type=int, default=K, help="top-k slots a row (a multiple of 128; default 2048)")
    p.add_argument("--probe", default="gluon", help="the kernel names --splits probes (comma-separated)")
    p.add_argument("--heads", type=int, default=HEADS, help="query heads (> 32; default 128)")
    a = p.parse_args()
    K, HEADS = a.width, a.heads
    rows_list = [int(r) for r in a.rows.split(",")]
    names = ["triton", "triton-nvfp4", *GLUON_VARIANTS, *SEESAW_VARIANTS, *MIXED_VARIANTS]
    if a.only:
        names = [n for n in names if n in a.only.split(",")]
    if not gluon_available():
        print(f"Gluon kernel unavailable: {gluon_unavailable_reason()}; timing triton only")
        names = [n for n in names if n == "triton"]
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(CACHE_ROWS, 576, device=dev, generator=g) * 8
    kvs = {fmt: quantize_rows(x, fmt) for fmt in ("fp8", "nvfp4_ds_mla")}
    q5, s5, c5, refs, src = accuracy_case(HEADS, K, kvs, x, dev, g)
    results: dict[str, dict] = {}
    for name in names:
        rec: dict = {"times": {}, "fmt": _fmt(name)}
        results[name] = rec
        kv = kvs[_fmt(name)]
        ref, ref_lse = refs[_fmt(name)]
        for splits in (1, 3):
            out = torch.full((5, HEADS, LATENT_DIM), float("nan"), dtype=torch.bfloat16, device=dev)
            lse = torch.full((5, HEADS), float("nan"), device=dev)
            t0 = time.time()
            try:
                h = _runner(name, q5, kv, s5, c5, out, lse, None, splits)()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - report and go on with the other kernels
                rec["error"] = f"{type(e).__name__}: {e}"
                print(f"{name} splits={splits} FAILED: {rec['error'][:300]}", flush=True)
                traceback.print_exc()
                break
            fin = torch.isfinite(ref_lse)
            rel = float((out.float() - ref).norm() / ref.norm())
            lse_err = float((lse[fin] - ref_lse[fin]).abs().max()) if bool(torch.isfinite(lse[fin]).all()) else float("inf")
            ok = bool(torch.isfinite(out).all()) and bool((out[1] == 0).all()) and bool(torch.isneginf(lse[1]).all())
            rel_src = float((out.float() - src).norm() / src.norm())
            rec[f"acc_splits{splits}"] = dict(rel_l2=rel, rel_l2_source=rel_src, lse_err=lse_err, ok=ok,
                                              compile_s=time.time() - t0)
            rec["regs"] = getattr(h, "n_regs", None)
            rec["spills"] = getattr(h, "n_spills", None)
            rec["smem"] = getattr(getattr(h, "metadata", None), "shared", None)
            print(f"{name:20s} splits={splits}: rel {rel:.2e} (vs unquantized {rel_src:.2e}) lse {lse_err:.2e} "
                  f"{'ok' if ok else 'BAD'} "
                  f"regs {rec['regs']} spills {rec['spills']} smem {rec['smem']}", flush=True)
        if "error" in rec:
            continue
        cfg = _config(name)
        for rows in rows_list:
            splits = planning.choose_splits(rows, HEADS, K, cfg, sms)
            try:
                us, ws, outs, lses, sets = _time(name, rows, splits, kv, cfg, dev, g)
            except Exception as e:  # noqa: BLE001
                print(f"{name} rows={rows} timing FAILED: {e}", flush=True)
                rec["times"][rows] = dict(error=str(e))
                continue
            flops = 2 * rows * HEADS * K * 1088
            rec["times"][rows] = dict(us=us, splits=splits, tflops=flops / us / 1e6)
            if name == "gluon" and splits > 1:
                # the split combine alone (its share of the small-batch time): rows x H x splits fp32 partials
                rec["times"][rows]["combine_us"] = cuda_graph_time_us(
                    [lambda i=i: kcommon.combine(ws, outs[i], lses[i], splits, OSCALE) for i in range(sets)])
                print(f"{'':20s} the combine alone: {rec['times'][rows]['combine_us']:.1f} us", flush=True)
            print(f"{name:20s} rows {rows:4d}: {us:8.1f} us  splits {splits}  {flops / us / 1e6:6.1f} TF/s", flush=True)
    for probe_name in a.probe.split(","):
        probe = []
        for item in filter(None, a.splits.split(";")):
            rows_s, counts_s = item.split(":")
            picked = planning.choose_splits(int(rows_s), HEADS, K, _config(probe_name), sms)
            for sp in (int(c) for c in counts_s.split(",")):
                us = _time(probe_name, int(rows_s), sp, kvs[_fmt(probe_name)], _config(probe_name), dev, g)[0]
                probe.append(dict(kernel=probe_name, rows=int(rows_s), splits=sp, us=us, choose_splits=picked))
                print(f"splits probe {probe_name}: rows {rows_s:>4s} splits {sp:2d}: {us:8.1f} us "
                      f"(choose_splits picks {picked})", flush=True)
        results.setdefault(probe_name, {})["splits_probe"] = probe
    print()
    print(f"{'kernel':25s} " + " ".join(f"{r:>10d}" for r in rows_list) + f"   (µs, H={HEADS}, K={K})")
    for name, rec in results.items():
        if "times" not in rec:
            continue
        cells = [f"{rec['times'][r]['us']:10.1f}" if "us" in rec["times"].get(r, {}) else f"{'-':>10s}" for r in rows_list]
        print(f"{name:25s} " + " ".join(cells))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gluon_bench.json").write_text(json.dumps(
        dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
             K=K, heads=HEADS, results=results), indent=1))


if __name__ == "__main__":
    main()
