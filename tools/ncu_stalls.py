#!/usr/bin/env python3
"""Where a warp-specialized kernel's warps wait: read ncu's per-SASS source page (CSV) and sum the stall samples of
each hot loop (a backward branch over > 50 instructions; QGMMA inside: a consumer, LDGSTS: the producer), then list
the top instructions. Made by `tools/device_run.sh ncu` (its sass CSV):

    python3 tools/ncu_stalls.py sass_source.csv [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    opener = gzip.open if a.csv.endswith(".gz") else open
    with opener(a.csv, "rt") as f:
        rows = [r for r in csv.reader(f)]
    hdr_i = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    hdr, data = rows[hdr_i], rows[hdr_i + 1:]
    ix = {h: i for i, h in enumerate(hdr)}
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    samples = [int(r[ix["Warp Stall Sampling (All Samples)"]] or 0) for r in data]
    execs = [int(r[ix["Instructions Executed"]] or 0) for r in data]
    addr = [int(r[ix["Address"]], 16) for r in data]
    src = [r[ix["Source"]].strip() for r in data]
    where = {x: i for i, x in enumerate(addr)}
    # a tile loop: a backward branch over > 50 instructions taken many times a warp, before the last EXIT (past it
    # lie the out-of-line mbarrier retry stubs, which branch back too)
    last_exit = max(i for i, s in enumerate(src) if "EXIT" in s)
    once = execs[0]
    loops = []
    for i, s in enumerate(src):
        m = re.search(r"BRA (0x[0-9a-f]+)", s)
        if (m and i < last_exit and execs[i] > 4 * once and int(m.group(1), 16) in where
                and where[int(m.group(1), 16)] < i - 50):
            lo = where[int(m.group(1), 16)]
            body = " ".join(src[lo:i + 1])
            kind = "consumer" if "GMMA" in body else "producer" if "LDGSTS" in body else "other"
            loops.append((lo, i, kind))
    total = sum(samples)
    print(f"{total} samples, {len(data)} instructions")
    for lo, hi, kind in loops:
        n = sum(samples[lo:hi + 1])
        per = collections.Counter()
        for k in range(lo, hi + 1):
            for s in stalls:
                per[s[6:]] += int(data[k][ix[s]] or 0)
        iters = max(execs[lo:hi + 1])
        print(f"{kind:8s} loop [{lo}, {hi}] {hi - lo + 1} instrs, {iters} warp-iterations: {n} samples "
              f"({n / total:.0%}): " + ", ".join(f"{k} {v / max(n, 1):.0%}" for k, v in per.most_common(6)))
    print("top instructions (index, samples, executed, main stalls):")
    for k in sorted(range(len(data)), key=lambda k: -samples[k])[:a.top]:
        main = sorted(((int(data[k][ix[s]] or 0), s[6:]) for s in stalls), reverse=True)[:2]
        print(f"  {k:5d} {samples[k]:6d} {execs[k]:8d}  {src[k][:64]:64s} " + " ".join(f"{s} {v}" for v, s in main))


if __name__ == "__main__":
    main()
