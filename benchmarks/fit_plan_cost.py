#!/usr/bin/env python3
"""Fit the few-heads plan model's factors (planning.configs.TWO_CTA_TILE_COST, FEW_SPLIT_TILES) to measured times.

TritonDecode picks one or two CTAs an SM for each few-heads fp8 batch by planning.plan_cost (NOTES v15). This
reads bench_few_heads JSON with both forms timed at the same (heads, rows) -- by default few-tail-regv (one CTA an
SM, reg_v_params()) and few-tail-regv-2cta-early (reg_v_params(2)) -- and scores a grid of factors by what their
picks cost: the µs lost over all points (the picked form's time minus the faster one's) and the mispick count.
It prints the current factors' score, the best grid point's and its picks, and writes fit_plan_cost.json.

    python3 benchmarks/fit_plan_cost.py JSON[:ONE,TWO] [...] [--one few-tail-regv] [--two few-tail-regv-2cta-early]

(JSON:ONE,TWO names a file's own variant pair, e.g. a run whose fp16-partial variants carried a suffix.) A pick
within --tie (1%) of the faster time is not counted as a mispick.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from vllm_kimi_dsa.kernels import gluon_few_heads as fh  # noqa: E402
from vllm_kimi_dsa.planning import configs, plan_cost  # noqa: E402

SMS = 132  # the H200's
WIDTH = 2048


def measured_pairs(paths: list[str], one: str, two: str) -> dict[tuple[int, int], tuple[float, float]]:
    """(heads, rows) -> (µs one CTA an SM, µs two) wherever both variants were timed (later files win); a path may
    end in :ONE,TWO (that file's variant names, instead of one and two)."""
    pairs: dict[tuple[int, int], tuple[float, float]] = {}
    for spec in paths:
        path, _, names = spec.partition(":")
        name_one, name_two = names.split(",") if names else (one, two)
        results = json.loads(Path(path).read_text())["results"]
        for key, rec in results.items():
            name, _, h = key.rpartition("/H")
            if name != name_one:
                continue
            other = results.get(f"{name_two}/H{h}", {}).get("times", {})
            for rows, t in rec.get("times", {}).items():
                if rows in other:
                    pairs[int(h), int(rows)] = (t["us"], other[rows]["us"])
    return pairs


def picks(pairs, two_cta_cost: dict[int, float], split_tiles: float) -> dict[tuple[int, int], int]:
    """The form (1 or 2 CTAs an SM) plan_cost picks at each point under these factors."""
    out = {}
    for heads, rows in pairs:
        blocks = min(-(-heads // fh.BLOCK_H), 2)
        costs = {}
        for ctas in (1, 2):
            cfg = dataclasses.replace(fh.reg_v_params(ctas).config(heads), split_tiles=split_tiles)
            if ctas == 2:
                cfg = dataclasses.replace(cfg, tile_cost=two_cta_cost[blocks])
            costs[ctas] = plan_cost(rows, heads, WIDTH, cfg, SMS)
        out[heads, rows] = min(costs, key=costs.get)
    return out


def score(pairs, chosen: dict[tuple[int, int], int], tie: float = 0.01) -> tuple[float, int]:
    """(µs lost over all points, mispicks: picks more than `tie` slower than the faster form)."""
    lost, wrong = 0.0, 0
    for key, (t1, t2) in pairs.items():
        t = t1 if chosen[key] == 1 else t2
        lost += t - min(t1, t2)
        wrong += t > min(t1, t2) * (1 + tie)
    return lost, wrong


def frange(lo: float, hi: float, step: float) -> list[float]:
    return [round(lo + i * step, 4) for i in range(int(round((hi - lo) / step)) + 1)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("json", nargs="+", help="bench_few_heads few_heads_bench.json files")
    p.add_argument("--one", default="few-tail-regv", help="the one-CTA form's variant name")
    p.add_argument("--two", default="few-tail-regv-2cta-early", help="the two-CTA form's variant name")
    p.add_argument("--tie", type=float, default=0.01, help="a pick within this fraction of the faster time is no mispick")
    p.add_argument("--out", default=".")
    a = p.parse_args()
    pairs = measured_pairs(a.json, a.one, a.two)
    if not pairs:
        raise SystemExit(f"no (heads, rows) with both {a.one} and {a.two} timed in {a.json}")
    current = (dict(configs.TWO_CTA_TILE_COST), configs.FEW_SPLIT_TILES)
    cur_lost, cur_wrong = score(pairs, picks(pairs, *current), a.tie)
    print(f"{len(pairs)} points; current TWO_CTA_TILE_COST {current[0]} SPLIT_TILES {current[1]}: "
          f"{cur_lost:.1f} µs lost, {cur_wrong} mispicks")
    best = None
    for c1 in frange(1.2, 2.2, 0.05):
        for c2 in frange(1.2, 2.2, 0.05):
            for s in frange(0.5, 4.0, 0.25):
                lost, wrong = score(pairs, picks(pairs, {1: c1, 2: c2}, s), a.tie)
                # ties go to the factors nearest the current ones (the fewest changes a sweep cannot tell apart)
                near = abs(c1 - current[0][1]) + abs(c2 - current[0][2]) + abs(s - current[1]) / 4
                if best is None or (lost, wrong, near) < best[0]:
                    best = ((lost, wrong, near), {1: c1, 2: c2}, s)
    (lost, wrong, _), cost, split = best
    chosen = picks(pairs, cost, split)
    print(f"best TWO_CTA_TILE_COST {cost} SPLIT_TILES {split}: {lost:.1f} µs lost, {wrong} mispicks")
    for key in sorted(pairs):
        t1, t2 = pairs[key]
        mark = "  <- mispick" if score({key: (t1, t2)}, chosen, a.tie)[1] else ""
        print(f"  H {key[0]:2d} rows {key[1]:4d}: one CTA {t1:7.1f} two {t2:7.1f} -> picks {chosen[key]}{mark}")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "fit_plan_cost.json").write_text(json.dumps({
        "points": [dict(heads=h, rows=r, one_us=t1, two_us=t2) for (h, r), (t1, t2) in sorted(pairs.items())],
        "current": dict(two_cta_tile_cost=current[0], split_tiles=current[1], lost_us=cur_lost, mispicks=cur_wrong),
        "best": dict(two_cta_tile_cost=cost, split_tiles=split, lost_us=lost, mispicks=wrong)}, indent=1))


if __name__ == "__main__":
    main()
