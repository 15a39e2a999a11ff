"""The suite's pictures and tables from its bench_suite.json: µs and TFLOP/s vs rows per kernel, floors drawn in,
and the markdown tables (bench_suite.md, the prefill table included). Needs matplotlib (the `bench` extra).

    python -m vllm_kimi_dsa.bench.plot JSON [--out-dir DIR]   -> bench_H128.png, bench_H16_H12.png,
                                                                 serving_time_vs_work.png (with a serving
                                                                 section), bench_suite.md (also printed)
DIR defaults to the JSON's folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from vllm_kimi_dsa.bench.prefill import prefill_table
from vllm_kimi_dsa.bench.serving import plot_time_vs_work, proportionality_summary, serving_table

# One colour per kernel family/format, so a kernel and its floor line match.
COLORS = {
    "triton/fp8": "tab:blue", "triton/nvfp4_ds_mla": "tab:green", "fa3/bf16": "tab:orange", "fa3/fp8": "tab:red",
    "torch/fp8->bf16": "tab:gray", "convert+triton/fp8": "tab:purple", "triton-pv8/fp8": "tab:cyan",
    "flashmla/fp8_ds_mla": "tab:brown",
}
HEAD_GROUPS = {"bench_H128.png": (128,), "bench_H16_H12.png": (16, 12), "bench_H24_H8_H4.png": (24, 8, 4)}


def load(path: str | Path) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "results" not in data:
        raise ValueError(f"{path}: not a bench_suite.json (no 'results')")
    return data


def decode_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    return _section(data, "decode")


def _series(recs: list[dict[str, Any]], kernel: str, heads: int, key: str) -> tuple[list[int], list[float]]:
    pts = sorted((r["rows"], r[key]) for r in recs if r["kernel"] == kernel and r["heads"] == heads)
    return [p[0] for p in pts], [p[1] for p in pts]


def plot(data: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """One PNG per head group present in the JSON: per head count, µs vs rows (log-log) and TFLOP/s-eq vs rows,
    floors dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    recs = decode_rows(data)
    kernels = sorted({r["kernel"] for r in recs})
    gpu = data.get("info", {}).get("gpu", "?")
    written = []
    for name, group in HEAD_GROUPS.items():
        heads_here = [h for h in group if any(r["heads"] == h for r in recs)]
        if not heads_here:
            continue
        fig, axes = plt.subplots(len(heads_here), 2, figsize=(12, 4.2 * len(heads_here)), squeeze=False)
        for row, heads in enumerate(heads_here):
            ax_us, ax_tf = axes[row]
            for k in kernels:
                x, us = _series(recs, k, heads, "us")
                if not x:
                    continue
                color = COLORS.get(k)
                _, tf = _series(recs, k, heads, "tflops")
                _, floor = _series(recs, k, heads, "floor_us")
                _, flops = _series(recs, k, heads, "flops")
                ax_us.plot(x, us, "o-", color=color, label=k)
                ax_us.plot(x, floor, "--", color=color, alpha=0.6, label=f"{k} floor")
                ax_tf.plot(x, tf, "o-", color=color, label=k)
                ax_tf.plot(x, [f / (t * 1e-6) / 1e12 for f, t in zip(flops, floor)], "--", color=color, alpha=0.6,
                           label=f"{k} floor")
            for ax, ylabel in ((ax_us, "µs per call"), (ax_tf, "TFLOP/s-equivalent")):
                ax.set_xscale("log")
                ax.set_xlabel("rows (decode tokens)")
                ax.set_ylabel(ylabel)
                ax.set_title(f"H={heads}, K=2048 — {gpu}")
                ax.grid(True, which="both", alpha=0.3)
            ax_us.set_yscale("log")
            ax_us.legend(fontsize=7, ncol=2)
        fig.suptitle("sparse MLA decode (dashed: max(bytes / copy bandwidth, flops / matmul rate))", fontsize=10)
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    if data.get("serving", {}).get("records"):
        written.append(plot_time_vs_work(data["serving"], out))
    return written


def _fmt(x: Any, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


OURS_FP8 = "triton/fp8"
OURS_NVFP4 = "triton/nvfp4_ds_mla"
OURS_FP8_PV = "triton-pv8/fp8"  # VLLM_KIMI_DSA_FP8_PV=1: P.V on e4m3
PEER_PREFIXES = ("fa3/", "flashmla/")  # the Hopper peers: FlashInfer's fa3, FlashMLA as vLLM runs it
FLASHMLA = "flashmla/fp8_ds_mla"


def _time(recs: list[dict[str, Any]], kernel: str, heads: int, rows: int) -> float | None:
    hit = [r["us"] for r in recs if r["kernel"] == kernel and r["heads"] == heads and r["rows"] == rows]
    return hit[0] if hit else None


def _copy_fraction(recs: list[dict[str, Any]], kernel: str, heads: int, rows: int) -> float | None:
    """The kernel's time at the copy bandwidth over its time: bytes = the selected rows + query + output."""
    hit = [r for r in recs if r["kernel"] == kernel and r["heads"] == heads and r["rows"] == rows]
    return hit[0]["floor_bw_us"] / hit[0]["us"] if hit and hit[0].get("floor_bw_us") else None


def ratio_rows(recs: list[dict[str, Any]], heads: int, show: list[int]) -> list[str]:
    """The ratios the targets are stated in, one table row each: our FP8 (and FP8 with P.V on e4m3) over the fastest
    peer kernel at that size, FlashMLA (padded to 64 / 128 heads, as vLLM runs it) over our FP8 (above 1: ours
    faster), nvfp4_ds_mla over our FP8 (below 1: faster), and our FP8's fraction of the copy bandwidth."""
    peers = sorted({r["kernel"] for r in recs if r["kernel"].startswith(PEER_PREFIXES)})

    def best_peer(rows: int) -> float | None:
        times = [t for k in peers if (t := _time(recs, k, heads, rows)) is not None]
        return min(times) if times else None

    out = []
    for label, num, den in (("fp8 / best peer (time)", lambda n: _time(recs, OURS_FP8, heads, n), best_peer),
                            ("fp8 P.V e4m3 / best peer (time)", lambda n: _time(recs, OURS_FP8_PV, heads, n),
                             best_peer),
                            ("FlashMLA padded / fp8 (time)", lambda n: _time(recs, FLASHMLA, heads, n),
                             lambda n: _time(recs, OURS_FP8, heads, n)),
                            ("nvfp4 / fp8 (time)", lambda n: _time(recs, OURS_NVFP4, heads, n),
                             lambda n: _time(recs, OURS_FP8, heads, n))):
        cells = [f"{a / b:.2f}" if (a := num(n)) is not None and (b := den(n)) else "-" for n in show]
        if any(c != "-" for c in cells):
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    cells = [f"{f:.2f}" if (f := _copy_fraction(recs, OURS_FP8, heads, n)) is not None else "-" for n in show]
    if any(c != "-" for c in cells):
        out.append("| fp8 of copy bandwidth (rows + query + output) | " + " | ".join(cells) + " |")
    return out


def measured_ratio_rows(ratios: list[dict[str, Any]], heads: int, show: list[int]) -> list[str]:
    """The suite's interleaved ratios (JSON 'ratios'): per (ours, peer) a row of `ours / peer` over the rounds,
    median [min-max], and each side's fraction of its own floor (ours / peer)."""
    out = []
    for ours, peer in sorted({(r["ours"], r["peer"]) for r in ratios if r["heads"] == heads}):
        cells = []
        for n in show:
            hit = [r for r in ratios if (r["ours"], r["peer"], r["heads"], r["rows"]) == (ours, peer, heads, n)]
            cells.append(f"{hit[0]['ratio']:.2f} [{hit[0]['ratio_min']:.2f}-{hit[0]['ratio_max']:.2f}] "
                         f"({hit[0]['ours_of_floor']:.2f} / {hit[0]['peer_of_floor']:.2f})" if hit else "-")
        out.append(f"| {ours} / {peer}, in turn (time [range]; each of its own floor) | " + " | ".join(cells) + " |")
    return out


def markdown(data: dict[str, Any], rows_show: tuple[int, ...] | None = None) -> str:
    """The README tables: ceilings; decode µs (TFLOP/s, fraction of floor) and the targets' time ratios per H;
    accuracy; converter; fused."""
    info = data.get("info", {})
    ceil = info.get("ceilings", {})
    recs = decode_rows(data)
    lines = [
        f"Measured on {info.get('gpu', '?')} ({info.get('date', '?')}; torch {info.get('torch', '?')}, "
        f"triton {info.get('triton', '?')}, peer: {info.get('flashinfer', '?')}"
        + (f"; FlashMLA: {info['flashmla']}" if info.get("flashmla") else "")
        + "). K = 2048, CUDA graphs, inputs rotated past L2.",
        "",
        f"Ceilings: copy {_fmt(ceil.get('copy_GBps'), 0)} GB/s (read + written), BF16 matmul "
        f"{_fmt(ceil.get('bf16_TFLOPs'), 0)} TFLOP/s, FP8 matmul {_fmt(ceil.get('fp8_TFLOPs'), 0)} TFLOP/s.",
        "Cells: µs per call (TFLOP/s-eq = 2·rows·H·K·1088/t; fraction of the floor max(bytes/copy, flops/matmul)).",
        "",
    ]
    kernels = sorted({r["kernel"] for r in recs})
    all_rows = sorted({r["rows"] for r in recs})
    show = [r for r in (rows_show or all_rows) if r in all_rows]
    for heads in sorted({r["heads"] for r in recs}, reverse=True):
        lines.append(f"**H = {heads}**")
        lines.append("")
        lines.append("| kernel | " + " | ".join(f"{r} rows" for r in show) + " |")
        lines.append("|---|" + "---|" * len(show))
        for k in kernels:
            cells = []
            for rw in show:
                hit = [r for r in recs if r["kernel"] == k and r["heads"] == heads and r["rows"] == rw]
                sp = f" ±{50 * hit[0]['spread']:.0f}%" if hit and hit[0].get("spread") else ""
                cells.append(f"{hit[0]['us']:.1f} ({hit[0]['tflops']:.0f}; {hit[0]['of_floor']:.2f}){sp}" if hit
                             else "-")
            if any(c != "-" for c in cells):
                lines.append(f"| {k} | " + " | ".join(cells) + " |")
        lines += ratio_rows(recs, heads, show)
        lines += measured_ratio_rows(data.get("ratios", []), heads, show)
        lines.append("")
    acc = data.get("accuracy", [])
    if acc and all("tolerance" in a for a in acc):
        lines += _table(
            "**Error vs float32 on the BF16 source values** (each kernel on its own quantization of the same source; "
            "tolerance = 2x the rel L2 predicted from the kernel's measured rounding of this data)",
            ["kernel", "rows", "H", "rel L2", "tolerance", "within", "vs its own values", "holds"],
            (f"| {a['kernel']} | {a['rows']} | {a['heads']} | {a['rel_l2']:.2e} | {a['tolerance']:.2e} | "
             f"{'yes' if a['within_tolerance'] else 'NO'} | "
             f"{_sci(a, 'rel_l2_own')} | {a.get('holds', '')} |"
             for a in sorted(acc, key=lambda a: (-a["heads"], a["rows"], a["kernel"]))))
        pv = info.get("fp8_pv_default")
        if pv:
            lines += [f"FP8 P.V ({pv['rule']}): {pv['verdict']}.", ""]
    elif acc:
        lines += _table(
            "**Error vs the float32 reference** (ragged counts, -1 tails; nvfp4 also vs the fp8 rows it was packed "
            "from: its own rounding included)",
            ["kernel", "rows", "H", "rel L2", "max abs", "nvfp4: rel L2 vs its source"],
            (f"| {a['kernel']} | {a['rows']} | {a['heads']} | {a['rel_l2']:.2e} | {a['max_abs']:.2e} | "
             f"{_sci(a, 'rel_l2_source')} |"
             for a in sorted(acc, key=lambda a: (a["kernel"], a["rows"], -a["heads"]))))
    conv = _section(data, "convert")
    if conv:
        lines += _table("**Converter vs a copy of the same bytes** (rows·K·4 read + written)",
                        ["rows", "convert µs", "copy µs", "ratio"],
                        (f"| {r['rows']} | {r['us']:.2f} | {r['copy_us']:.2f} | {r['vs_copy']:.2f} |"
                         for r in sorted(conv, key=lambda r: r["rows"])))
    fused = _section(data, "fused")
    if fused:
        lines += _table("**Convert + decode in one graph vs decode alone** (triton, fp8)",
                        ["rows", "H", "both µs", "decode µs", "convert adds µs"],
                        (f"| {r['rows']} | {r['heads']} | {r['us']:.2f} | {r['decode_us']:.2f} | "
                         f"{r['convert_overhead_us']:.2f} |" for r in sorted(fused, key=lambda r: (-r["heads"], r["rows"]))))
    base = _section(data, "torch")
    if base:
        lines += _table("**Plain torch** (gather, dequantize to BF16, BF16 bmm)", ["rows", "H", "µs", "TFLOP/s-eq"],
                        (f"| {r['rows']} | {r['heads']} | {r['us']:.1f} | {r['tflops']:.1f} |"
                         for r in sorted(base, key=lambda r: (-r["heads"], r["rows"]))))
    if data.get("serving", {}).get("records"):
        worst = proportionality_summary(data["serving"])
        lines += ["**Serving section** (count distributions; µs per call (proportionality = (t / t_all-full) / work; "
                  "fraction of the work's floor)); ours / peer per distribution, [range], (work ratio)", "",
                  serving_table(data["serving"]),
                  "Worst proportionality from 32 rows: " + ("; ".join(
                      f"{k} {v['proportionality']:.2f} (H={v['heads']}, {v['rows']} rows, {v['dist']})"
                      for k, v in sorted(worst.items())) or "-"), ""]
    if data.get("prefill"):
        lines += ["**Prefill** (one chunk through serving.LayerStep, eager, vs FlashMLA's sparse prefill as vLLM runs "
                  "it; µs (TFLOP/s-eq; fraction of the floor))", "", prefill_table(data["prefill"]), ""]
    fails = data.get("failures", [])
    if fails:
        lines.append(f"{len(fails)} measurement(s) failed: " + "; ".join(
            f"{f.get('kernel')} rows={f.get('rows')} H={f.get('heads')}: {f.get('error', '')[:80]}" for f in fails[:5]))
    return "\n".join(lines).rstrip() + "\n"


def _section(data: dict[str, Any], section: str) -> list[dict[str, Any]]:
    """The measured records of one of the suite's sections."""
    return [r for r in data["results"] if r.get("section") == section and "us" in r]


def _sci(record: dict[str, Any], key: str) -> str:
    """record[key] as 1.23e-03, "-" where the record has none."""
    return f"{record[key]:.2e}" if key in record else "-"


def _table(title: str, columns: list[str], rows: Any) -> list[str]:
    """A titled markdown table (its body `rows` already formatted as table lines), then a blank line."""
    return [title, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *rows, ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", help="a bench_suite.json (python -m vllm_kimi_dsa bench --out DIR writes DIR/bench_suite.json)")
    ap.add_argument("--out-dir", default=None, help="where the pictures and bench_suite.md go (default: the JSON's folder)")
    ap.add_argument("--rows", default="1,2,4,5,8,16,20,64,80,160,320", help="columns of the markdown table")
    args = ap.parse_args(argv)
    data = load(args.json)
    if args.out_dir is None:
        args.out_dir = str(Path(args.json).parent)
    paths = plot(data, args.out_dir)
    md = markdown(data, tuple(int(x) for x in args.rows.split(",") if x))
    md_path = Path(args.out_dir) / "bench_suite.md"
    md_path.write_text(md)
    print(md)
    print("wrote " + ", ".join(str(p) for p in [*paths, md_path]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
