#!/usr/bin/env python3
"""Pictures of the Hopper Gluon kernels' runs: few_heads_bench.json (bench_few_heads.py: µs vs rows at H = 16 / 12
with the copy-bandwidth floor of the same run) and gluon_bench.json (bench_gluon.py: µs vs rows at H = 128).

    python3 tools/plot_gluon.py --few FEW_JSON [--gluon GLUON_JSON] [--few-keys few/H16,few-tail/H16] --out PNG

The few-heads panel draws FP8-cache runs only (its floor is the 576-byte rows at the copy bandwidth), or the
keys given.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROW_BYTES = 576  # FP8 per-tensor cache rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--few", required=True)
    p.add_argument("--gluon", default=None)
    p.add_argument("--few-keys", default="", help="comma-separated result keys to draw (default: every FP8 one)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    keys = set(filter(None, a.few_keys.split(",")))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    few = json.loads(Path(a.few).read_text())
    panels = 2 if a.gluon else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), squeeze=False)
    ax = axes[0][0]
    copy = few["ceilings"]["copy_GBps"]
    k = few["K"]
    all_rows: set[int] = set()
    for name, rec in few["results"].items():
        if (name not in keys) if keys else ("nvfp4" in name):
            continue
        rows = sorted(int(r) for r in rec.get("times", {}))
        if not rows:
            continue
        all_rows.update(rows)
        ax.plot(rows, [rec["times"][str(r)]["us"] for r in rows], marker="o", label=name)
    rows = sorted(all_rows)
    ax.plot(rows, [r * k * ROW_BYTES / copy / 1e3 for r in rows], "k--", label="floor: KV bytes at copy bandwidth")
    ax.plot(rows, [r * k * ROW_BYTES / (0.75 * copy) / 1e3 for r in rows], "k:", label="target: 75% of copy")
    ax.set(xscale="log", yscale="log", xlabel="rows (decode tokens)", ylabel="µs per call",
           title=f"FP8 cache, K={k}, few heads ({few['device']})")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    if a.gluon:
        g = json.loads(Path(a.gluon).read_text())
        ax = axes[0][1]
        for name, rec in g["results"].items():
            rows = sorted(int(r) for r, t in rec.get("times", {}).items() if "us" in t)
            if rows:
                ax.plot(rows, [rec["times"][str(r)]["us"] for r in rows], marker="o", label=name)
        rows = [5, 20, 80, 320]
        ax.plot(rows, [2 * r * g["heads"] * g["K"] * 1088 / 600e12 * 1e6 for r in rows], "k:",
                label="target: 600 TFLOP/s-eq")
        ax.set(xscale="log", yscale="log", xlabel="rows (decode tokens)", ylabel="µs per call",
               title=f"FP8 cache, K={g['K']}, H={g['heads']}")
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
