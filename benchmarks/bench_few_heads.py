#!/usr/bin/env python3
"""Time the few-heads Gluon decode (kernels/gluon_few_heads.py) against the Triton kernel's default config on one
H200: fp8 cache (and nvfp4_ds_mla: "-nvfp4" names), H = 16 and 12, K = 2048, against the copy bandwidth measured in
the same run.

Same method as bench_gluon.py: one process, each call inside a CUDA graph rotating over input sets larger than 2x
the L2, accuracy against the float32 reference first (5 rows, holes, a count-0 row). The floor of a call is its
KV bytes (rows x K x 576) at the copy bandwidth (bytes read + written / s, bench_suite.ceilings): "copy" in the
table is that fraction. Prints a table, writes $OUT/few_heads_bench.json.

    PYTHONPATH=. python3 benchmarks/bench_few_heads.py --out DIR [--rows 1,5,20,80,160,320] [--splits '80:1,2,3']
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_gluon import (  # noqa: E402
    CACHE_ROWS,
    K,
    OSCALE,
    P32,
    SSCALE,
    kernel_params,
    partials_workspace,
    split_name,
    tail_split_call,
    time_rotated,
)
from bench_suite import ceilings  # noqa: E402

from vllm_kimi_dsa.formats import LATENT_DIM, quantize_rows, row_bytes  # noqa: E402
from vllm_kimi_dsa.kernels import triton_decode as td  # noqa: E402
from vllm_kimi_dsa.kernels.gluon_decode import gluon_available, gluon_unavailable_reason  # noqa: E402
from vllm_kimi_dsa.kernels.gluon_few_heads import FewHeadsParams, few_heads_sparse_mla_decode  # noqa: E402
from vllm_kimi_dsa.kernels.gluon_few_heads import launch as few_heads_launch  # noqa: E402
from vllm_kimi_dsa.kernels.gluon_few_heads import launch_stream, stream_entries  # noqa: E402
from vllm_kimi_dsa.reference import reference_decode  # noqa: E402

# reg_v at two CTAs an SM (reg_v_params(2) without pv_early, which depends on the Triton version)
_TWO_CTA = {"reg_v": True, "k_stages": 2, "pv_in_flight": 2, "ctas_per_sm": 2, "producer_regs": 56}
# name -> FewHeadsParams overrides (the default, then one field changed at a time); "triton" is td's default config.
# Names ending in "-nvfp4" run on an nvfp4_ds_mla cache (352-byte rows); their fraction of copy counts those bytes.
VARIANTS: dict[str, dict] = {"few": {}, "few-k3v3": {"k_stages": 3, "v_slots": 3},
                             "few-joined": {"split_producer": False},
                             "few-nvfp4": {"k_stages": 3, "v_slots": 4, "nvfp4": True},
                             # the nvfp4 ring / conversion-step shapes its GPU tests also cover
                             "few-cvt16-nvfp4": {"k_stages": 3, "v_slots": 4, "nvfp4": True, "cvt_rows": 16},
                             "few-cvt8-nvfp4": {"k_stages": 3, "v_slots": 4, "nvfp4": True, "cvt_rows": 8},
                             "few-k2v5-nvfp4": {"k_stages": 2, "v_slots": 5, "nvfp4": True},
                             # choose_plan's tail-split plan (bench_gluon.tail_split_call) through the default kernel
                             "few-tail": {"tail_split": True},
                             "few-tail-nvfp4": {"k_stages": 3, "v_slots": 4, "nvfp4": True, "tail_split": True},
                             # P.V's latent through registers (reg_v: no converter, no V16 ring), K ring 4 / 3
                             "few-regv": {"reg_v": True},
                             "few-regv-k3": {"reg_v": True, "k_stages": 3},
                             "few-tail-regv": {"reg_v": True, "k_stages": 3, "tail_split": True},
                             # two P.V chunks in flight (the register budget of two CTAs an SM), one CTA an SM
                             "few-regv-k3-pv2": {"reg_v": True, "k_stages": 3, "pv_in_flight": 2},
                             # reg_v at two CTAs an SM: K ring 2 each, 128 registers a thread at launch (gatherer
                             # 56 / consumer 200, or 72 / 184)
                             "few-regv-2cta": _TWO_CTA,
                             "few-regv-2cta-p72": {**_TWO_CTA, "producer_regs": 72},
                             "few-tail-regv-2cta": {**_TWO_CTA, "tail_split": True},
                             # P.V of tile it - 1 issued (its stage freed) before waiting for tile it
                             "few-tail-regv-early": {"reg_v": True, "k_stages": 3, "pv_early": True,
                                                     "tail_split": True},
                             "few-tail-regv-2cta-early": {**_TWO_CTA, "pv_early": True, "tail_split": True},
                             # the stream-K grid (launch_stream) on the two-CTA form, and on one CTA an SM
                             "few-stream-2cta": {**_TWO_CTA, "pv_early": True, "stream": True},
                             "few-stream-regv": {"reg_v": True, "k_stages": 3, "stream": True}}
# "triton-tail*": td's default config through choose_plan's tail-split plan (whether the `tl` configs gain from it)
NAMES = ["triton", *VARIANTS, "triton-nvfp4", "triton-tail", "triton-tail-nvfp4",
         *(n + P32 for n in ("few-tail", "few-tail-regv", "few-tail-regv-2cta-early", "few-tail-nvfp4"))]


def _fmt(name: str) -> str:
    return "nvfp4_ds_mla" if split_name(name)[0].endswith("-nvfp4") else "fp8"


def _config(name: str, heads: int) -> td.Config:
    if name.startswith("triton"):
        return td.default_config(heads, _fmt(name))
    return _params(name).config()


def _params(name: str) -> FewHeadsParams:
    return FewHeadsParams(**kernel_params(VARIANTS[split_name(name)[0]])[0])


def _runner(name: str, q, kv, slots, counts, out, lse, ws, splits):
    name = split_name(name)[0]  # the partial dtype comes with ws
    if name.startswith("triton"):
        fmt, cfg = _fmt(name), _config(name, q.shape[1])
        if name.startswith("triton-tail"):
            def tl_launch(q_, kv_, s_, c_, o_, l_, sscale, oscale, ws_, sp):
                return td._launch(q_, kv_, s_, c_, o_, l_, fmt, sscale, oscale, ws_, cfg, sp)
            return tail_split_call(tl_launch, cfg, q, kv, slots, counts, out, lse, ws)
        return lambda: td.sparse_mla_decode(q, kv, slots, counts, fmt=fmt, softmax_scale=SSCALE, output_scale=OSCALE,
                                            out=out, lse=lse, workspace=ws, config=cfg, splits=splits)
    params = _params(name)
    if params.stream:  # its own workspace (the partial entries of one wave of CTAs), made before timing
        heads, sms = q.shape[1], td.num_sms(q.device)
        ws = td.make_workspace(q.device, heads=heads, max_rows=q.shape[0], widths=(slots.shape[1],),
                               config=params.config(heads), min_entries=stream_entries(heads, params, sms))
        return lambda: launch_stream(q, kv, slots, counts, out, lse, SSCALE, OSCALE, ws, params)
    if kernel_params(VARIANTS[name])[1]:
        return tail_split_call(lambda *a: few_heads_launch(*a, params), params.config(), q, kv, slots, counts, out,
                               lse, ws)
    return lambda: few_heads_sparse_mla_decode(q, kv, slots, counts, softmax_scale=SSCALE, output_scale=OSCALE, out=out,
                                               lse=lse, workspace=ws, splits=splits, params=params)


def _time(name: str, heads: int, rows: int, splits: int, kv, dev, g) -> float:
    return time_rotated(lambda q, s, c, o, lse, ws: _runner(name, q, kv, s, c, o, lse, ws, splits),
                        rows, heads, splits, row_bytes(_fmt(name)), dev, g, split_name(name)[1])[0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--rows", default="1,5,20,80,160,320")
    p.add_argument("--heads", default="16,12")
    p.add_argument("--only", default="", help="comma-separated kernel names (default: triton + every variant)")
    p.add_argument("--splits", default="", help="probe a kernel at H=16, e.g. '80:1,2,3;5:8,16,32'")
    p.add_argument("--probe", default="few", help="the kernel name --splits probes")
    a = p.parse_args()
    rows_list = [int(r) for r in a.rows.split(",")]
    heads_list = [int(h) for h in a.heads.split(",")]
    names = list(NAMES)
    if a.only:
        names = [n for n in names if n in a.only.split(",")]
    if not gluon_available():
        print(f"Gluon unavailable: {gluon_unavailable_reason()}; timing triton only")
        names = ["triton"]
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ceil = ceilings(dev, quick=True)
    print(f"copy {ceil['copy_GBps']:.0f} GB/s (read + written)", flush=True)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(CACHE_ROWS, 576, device=dev, generator=g) * 8
    caches = {fmt: quantize_rows(x, fmt) for fmt in ("fp8", "nvfp4_ds_mla")}
    del x
    results: dict[str, dict] = {}
    for heads in heads_list:
        q5 = (torch.randn(5, heads, 576, device=dev, generator=g) * 4).to(torch.float8_e4m3fn)
        s5 = torch.randint(0, CACHE_ROWS, (5, K), device=dev, generator=g, dtype=torch.int32)
        s5[torch.rand(5, K, device=dev, generator=g) < 0.05] = -1
        c5 = torch.tensor([K, 0, 1000, K - 1, 77], device=dev, dtype=torch.int32)
        refs = {fmt: reference_decode(q5, kv, s5, c5, fmt=fmt, softmax_scale=SSCALE, output_scale=OSCALE)
                for fmt, kv in caches.items()}
        for name in names:
            key = f"{name}/H{heads}"
            fmt = _fmt(name)
            kv = caches[fmt]
            ref, ref_lse = refs[fmt]
            rec: dict = {"times": {}}
            results[key] = rec
            try:
                for splits in (1, 3):
                    out = torch.full((5, heads, LATENT_DIM), float("nan"), dtype=torch.bfloat16, device=dev)
                    lse = torch.full((5, heads), float("nan"), device=dev)
                    ws5 = partials_workspace(name, _config(name, heads), 5, heads, splits, dev)
                    h = _runner(name, q5, kv, s5, c5, out, lse, ws5, splits)()
                    torch.cuda.synchronize()
                    fin = torch.isfinite(ref_lse)
                    rel = float((out.float() - ref).norm() / ref.norm())
                    ok = (bool(torch.isfinite(out).all()) and bool((out[1] == 0).all())
                          and bool(torch.isneginf(lse[1]).all()) and bool(torch.isfinite(lse[fin]).all()))
                    lse_err = float((lse[fin] - ref_lse[fin]).abs().max()) if ok else float("inf")
                    rec[f"acc_splits{splits}"] = dict(rel_l2=rel, lse_err=lse_err, ok=ok)
                    rec["regs"], rec["spills"] = getattr(h, "n_regs", None), getattr(h, "n_spills", None)
                    print(f"{key:16s} splits={splits}: rel {rel:.2e} lse {lse_err:.2e} {'ok' if ok else 'BAD'} "
                          f"regs {rec['regs']} spills {rec['spills']}", flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on with the other kernels
                rec["error"] = f"{type(e).__name__}: {e}"
                print(f"{key} FAILED: {rec['error'][:300]}", flush=True)
                traceback.print_exc()
                continue
            cfg = _config(name, heads)
            for rows in rows_list:
                splits = td.choose_splits(rows, heads, K, cfg, sms)
                us = _time(name, heads, rows, splits, kv, dev, g)
                gbps = rows * K * row_bytes(fmt) / us / 1e3
                rec["times"][rows] = dict(us=us, splits=splits, kv_GBps=gbps, copy_frac=gbps / ceil["copy_GBps"])
                print(f"{key:16s} rows {rows:4d}: {us:8.1f} us  splits {splits:2d}  {gbps:6.0f} GB/s  "
                      f"{gbps / ceil['copy_GBps']:.2f} of copy", flush=True)
    probe = []
    for item in filter(None, a.splits.split(";")):
        rows_s, counts_s = item.split(":")
        picked = td.choose_splits(int(rows_s), 16, K, _config(a.probe, 16), sms)
        for sp in (int(c) for c in counts_s.split(",")):
            us = _time(a.probe, 16, int(rows_s), sp, caches[_fmt(a.probe)], dev, g)
            probe.append(dict(kernel=a.probe, rows=int(rows_s), splits=sp, us=us, choose_splits=picked))
            print(f"splits probe {a.probe} H=16: rows {rows_s:>4s} splits {sp:2d}: {us:8.1f} us (picks {picked})",
                  flush=True)
    print()
    print(f"{'kernel':16s} " + " ".join(f"{r:>13d}" for r in rows_list) + "   (µs (fraction of copy), K=2048)")
    for key, rec in results.items():
        cells = [f"{t['us']:7.1f} ({t['copy_frac']:.2f})" if (t := rec["times"].get(r)) else f"{'-':>13s}"
                 for r in rows_list]
        print(f"{key:16s} " + " ".join(cells))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "few_heads_bench.json").write_text(json.dumps(
        dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
             K=K, ceilings=ceil, results=results, splits_probe=probe, floor="rows*K*576 B of KV at copy_GBps"),
        indent=1))


if __name__ == "__main__":
    main()
