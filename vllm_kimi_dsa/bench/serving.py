"""The suite's serving section: our kernels and the Hopper peers on the batches vLLM sends, time against work.

Per (heads, rows) four count distributions -- every row full (the decode section's workload), uniform in [1, K], a
serving mix (log-normal contexts between 100 and 32,000 tokens, count = min(context, K)) and skewed (one full row,
the rest 1..128) -- each record with its work ratio sum(counts) / (rows K) and proportionality (t / t_full) / work;
serving_table and plot_time_vs_work draw the JSON's "serving" key.

Ours: the kernel as the core binds it (triton/fp8, VLLM_KIMI_DSA_SCHEDULE's default) and its scheduled launches
(triton-sched/fp8: the device planner divides each call's tiles from its counts). FlashMLA as vLLM's FLASHMLA_SPARSE
calls it: ids -1 past each count (it walks all K), a fresh scheduler metadata in every call (made in its time, as a
step's first layer makes it). fa3 as a page-table kernel takes it: planned per input set on each row's valid prefix
and its count (its plan is a host call, outside the graph). Every kernel of a point is timed in turn, the suite's
rounds (timing.interleaved_us), in a CUDA graph over input sets that read past 2x L2, each set its own counts.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Callable

import torch

from vllm_kimi_dsa.bench import suite as bs
from vllm_kimi_dsa.bench.peers import fa3, flashmla
from vllm_kimi_dsa.formats import HEAD_DIM, LATENT_DIM
from vllm_kimi_dsa.timing import interleaved_us, make_timer, spread

DISTRIBUTIONS = ("full", "uniform", "serving", "skewed")
ROWS = (8, 32, 128, 320)
HEADS = (128, 16, 64, 24, 8, 4)  # in the order run: the probe points (128, 16) first
QUICK_ROWS = (32, 320)
QUICK_HEADS = (128, 16)
CONTEXT_MIN, CONTEXT_MAX = 100, 32000  # the serving mix's contexts: log-normal, mean and spread in log space below
CONTEXT_LOG_MEAN = 0.5 * (math.log(CONTEXT_MIN) + math.log(CONTEXT_MAX))
CONTEXT_LOG_SD = (math.log(CONTEXT_MAX) - math.log(CONTEXT_MIN)) / 4  # the range is the mean +- 2 sd, clipped to it
SKEW_SHORT = 128  # skewed: the short rows' most ids
OURS = {"triton/fp8": "static", "triton-sched/fp8": "counts"}  # our kernels here -> VLLM_KIMI_DSA_SCHEDULE
PEER_KINDS = ("fa3/bf16", bs.FLASHMLA_KIND)


def points(quick: bool, rows: tuple[int, ...] | None, heads: tuple[int, ...] | None) -> tuple[tuple, tuple]:
    """(rows, heads) the section runs, heads in the order given: --rows / --heads where given, else its own (QUICK_*
    under --quick)."""
    return (tuple(sorted(set(rows or (QUICK_ROWS if quick else ROWS)))),
            tuple(dict.fromkeys(heads or (QUICK_HEADS if quick else HEADS))))


def warm(suite: bs.Suite, data: bs.Data, rows_list: tuple[int, ...], heads_list: tuple[int, ...]) -> None:
    """One eager call of each of our kernels at every point (Triton compiles them, the scheduled ones' planner too),
    while the peers build; failures are left for the section to record."""
    dev = suite.device
    for heads in heads_list:
        for rows in rows_list:
            inp = ragged_inputs(rows, heads, 1, "uniform", dev, data.base_rows, bf16=False)
            for kind, schedule in OURS.items():
                fmt = kind.split("/", 1)[1]
                try:
                    bs.triton_kernel(fmt, heads, rows, dev, schedule=schedule)(
                        inp["q8"][0], data.window(fmt, 0), inp["slots"][0], inp["counts"][0], inp["outs"][0])
                except Exception:  # noqa: BLE001 - recorded where it is measured
                    pass
    if dev.type == "cuda":
        torch.cuda.synchronize()
    bs.log(f"{suite.elapsed()} serving: ours compiled at every point")


def draw_counts(dist: str, rows: int, width: int, g: torch.Generator, device: torch.device) -> torch.Tensor:
    """(rows,) int32 counts of one batch of `dist` (DISTRIBUTIONS), every count in [1, width]."""
    if dist == "full":
        return torch.full((rows,), width, dtype=torch.int32, device=device)
    if dist == "uniform":
        return torch.randint(1, width + 1, (rows,), dtype=torch.int32, device=device, generator=g)
    if dist == "serving":
        z = torch.randn((rows,), device=device, generator=g)
        ctx = torch.exp(CONTEXT_LOG_MEAN + CONTEXT_LOG_SD * z).clamp(CONTEXT_MIN, CONTEXT_MAX)
        return ctx.floor().clamp(max=width).to(torch.int32)
    if dist == "skewed":
        c = torch.randint(1, SKEW_SHORT + 1, (rows,), dtype=torch.int32, device=device, generator=g)
        c[0] = width
        return c
    raise ValueError(f"dist must be one of {DISTRIBUTIONS}, got {dist!r}")


def ragged_inputs(rows: int, heads: int, sets: int, dist: str, device: torch.device, base_rows: int,
                  bf16: bool) -> dict[str, Any]:
    """The (rows, H, dist) inputs every kernel gets, per input set: counts drawn from `dist`, slots of requests of
    2K tokens (bs.request_slots) with -1 past each count (as vLLM's indexer leaves them), fp8 queries (and the same
    in BF16), outputs; "work": the sets' mean sum(counts) / (rows K)."""
    width = bs.K
    g = torch.Generator(device=device).manual_seed(rows * 1000 + heads * 10 + DISTRIBUTIONS.index(dist))
    counts, slots = [], []
    for _ in range(sets):
        c = draw_counts(dist, rows, width, g, device)
        s = bs.request_slots(rows, g, device, base_rows)[1]
        s[torch.arange(width, device=device) >= c.unsqueeze(1)] = -1
        counts.append(c)
        slots.append(s.contiguous())
    q8 = [(torch.randn((rows, heads, HEAD_DIM), device=device, generator=g) / bs.Q_SCALE).to(torch.float8_e4m3fn)
          for _ in range(sets)]
    work = float(torch.stack(counts).double().mean()) / width
    return {"counts": counts, "slots": slots, "q8": q8, "q16": [q.to(torch.bfloat16) for q in q8] if bf16 else [],
            "outs": [torch.empty((rows, heads, LATENT_DIM), dtype=torch.bfloat16, device=device) for _ in range(sets)],
            "work": work}


def kernel_calls(kind: str, data: bs.Data, rows: int, heads: int, inp: dict[str, Any],
                 peer: dict[str, Any] | None) -> tuple[list[Callable[[], Any]], dict[str, Any]]:
    """One call per input set of `kind` at (rows, H) and its record's fields (the suite's point_kernels, with the
    counts of each set)."""
    dev = inp["counts"][0].device
    sets = len(inp["q8"])
    window = lambda fmt, s: data.window(fmt, bs.pool_of(s)[1])  # noqa: E731 - set s's cache rows
    if kind in OURS:
        fmt = kind.split("/", 1)[1]
        call = bs.triton_kernel(fmt, heads, rows, dev, schedule=OURS[kind])
        calls = [lambda s=s: call(inp["q8"][s], window(fmt, s), inp["slots"][s], inp["counts"][s], inp["outs"][s])
                 for s in range(sets)]
        return calls, {"fmt": fmt, "impl": call.impl, "q_bytes": 1, "compute": "fp8qk", "kv_kind": fmt}
    if kind == bs.FLASHMLA_KIND:
        p = flashmla.make_peer(bs.flashmla_source(peer[kind]), heads, rows, bs.K, sm_scale=bs.SCALE * bs.Q_SCALE,
                               device=dev, fresh_metadata=True)
        calls = [lambda s=s: p.run(inp["q16"][s], window("fp8_ds_mla", s), inp["slots"][s]) for s in range(sets)]
        return calls, {"fmt": "fp8_ds_mla", "impl": f"{p.describe()}; metadata made in every call",
                       "padded_heads": p.padded, "q_bytes": 2, "compute": "bf16", "kv_kind": "fp8_ds_mla"}
    kv = kind.split("/", 1)[1]
    wrappers = []
    for s in range(sets):  # a page table of each set's valid prefixes, planned with their counts
        f = fa3.make_peer(kv, heads, rows, bs.K, sm_scale=bs.SCALE * bs.Q_SCALE,
                          kv_scale=bs.K_SCALE if kv == "fp8" else 1.0, device=dev)
        f.plan(inp["slots"][s], inp["counts"][s].cpu())
        wrappers.append(f)
    kv_kind = "bf16" if kv == "bf16" else "fp8"
    calls = [lambda s=s: wrappers[s].run(inp["q16"][s], window(kv_kind, s), inp["outs"][s]) for s in range(sets)]
    return calls, {"fmt": kv_kind, "impl": "planned per set on its counts", "q_bytes": 2, "compute": "bf16",
                   "kv_kind": kv_kind}


def work_metrics(rows: int, heads: int, us: float, work: float, info: dict[str, Any],
                 ceil: dict[str, Any]) -> dict[str, Any]:
    """bs.metrics of the useful work of a batch whose counts sum to `work` of rows x K: the KV bytes and flops scaled
    by it (query and output are not), so each record carries its own floor."""
    m = bs.metrics(rows, heads, us, info["kv_kind"], info["q_bytes"], info["compute"], ceil,
                   heads_run=info.get("padded_heads"))
    run = m["heads_run"]
    io = rows * run * (HEAD_DIM * info["q_bytes"] + LATENT_DIM * 2)
    floor_bw = (work * m["kv_bytes"] + io) / (ceil["copy_GBps"] * 1e9) * 1e6
    floor_fl = work * m["floor_flops_us"]
    floor = max(floor_bw, floor_fl)
    return {**m, "tflops": round(m["tflops"] * work, 2), "kv_GBps": round(m["kv_GBps"] * work, 1),
            "kv_bytes": work * m["kv_bytes"], "flops": work * m["flops"],
            "floor_us": round(floor, 3), "floor_bw_us": round(floor_bw, 3), "floor_flops_us": round(floor_fl, 3),
            "floor_bound": "bandwidth" if floor_bw >= floor_fl else "compute", "of_floor": round(floor / us, 3)}


def serving_section(suite: bs.Suite, data: bs.Data, ceil: dict[str, Any], peer: dict[str, Any] | None,
                    rows_list: tuple[int, ...], heads_list: tuple[int, ...]) -> None:
    """Every (heads, rows, distribution): our kernels and each usable peer built on the same inputs, captured and
    timed in turn; records with work and proportionality (against the same kernel's `full` record of the point),
    ratios of ours over each peer (bs.pair_ratio) with each side's fraction of its own floor; into suite.serving."""
    dev = suite.device
    out = suite.serving = {"records": [], "ratios": [], "distributions": list(DISTRIBUTIONS),
                           "context": {"min": CONTEXT_MIN, "max": CONTEXT_MAX, "log_mean": CONTEXT_LOG_MEAN,
                                       "log_sd": CONTEXT_LOG_SD}, "skew_short": SKEW_SHORT}
    for heads in heads_list:
        for rows in rows_list:
            kinds = list(OURS) + [k for k in PEER_KINDS if peer and peer.get(k, {}).get("usable_heads", {}).get(heads)]
            full: dict[str, float] = {}
            for dist in DISTRIBUTIONS:
                sets = bs.n_sets(rows, suite.l2)
                inp = ragged_inputs(rows, heads, sets, dist, dev, data.base_rows, bf16=len(kinds) > len(OURS))
                recs = _point(suite, data, ceil, rows, heads, dist, kinds, inp, peer, sets)
                for kind, rec in recs.items():
                    if dist == "full":
                        full[kind] = rec["us"]
                    if kind in full:
                        rec["full_us"] = full[kind]
                        rec["proportionality"] = round(rec["us"] / full[kind] / rec["work"], 4)
                    out["records"].append(rec)
                    suite.record(rec)
                for ours in OURS:
                    for kind in recs:
                        if ours in recs and kind not in OURS:
                            r = {**bs.pair_ratio(recs[ours], recs[kind]), "dist": dist, "work": recs[ours]["work"]}
                            out["ratios"].append(r)
                            bs.log(f"{' ' * 9}{dist:>8} {ours} / {kind} = {r['ratio']:.3f} "
                                   f"[{r['ratio_min']:.3f}, {r['ratio_max']:.3f}]; of own floor "
                                   f"{r['ours_of_floor']:.2f} vs {r['peer_of_floor']:.2f}")
                del inp
            suite.dump()


def _point(suite: bs.Suite, data: bs.Data, ceil: dict[str, Any], rows: int, heads: int, dist: str, kinds: list[str],
           inp: dict[str, Any], peer: dict[str, Any] | None, sets: int) -> dict[str, dict[str, Any]]:
    """One (heads, rows, dist): every kind built and captured, timed in turn; its records by kind. Each kind's calls
    (and what only they hold: peers' plan buffers, a kernel's workspace) stay referenced until its timer is closed:
    a captured graph replays into the addresses it was captured with."""
    built, timers, held = {}, {}, {}
    for kind in kinds:
        what = {"section": "serving", "kernel": kind, "rows": rows, "heads": heads, "dist": dist}
        got = suite.guarded(what, lambda kind=kind: kernel_calls(kind, data, rows, heads, inp, peer))
        if got is None:
            continue
        timer = suite.guarded(what, lambda calls=got[0]: make_timer(calls, suite.device))
        if timer is not None:
            built[kind], timers[kind], held[kind] = got[1], timer, got[0]
    times: dict[str, list[float]] = {}
    if timers:
        what = {"section": "serving", "kernel": "+".join(timers), "rows": rows, "heads": heads, "dist": dist}
        times = suite.guarded(what, lambda: interleaved_us(timers, suite.repeats,
                                                           reps_time_s=suite.args.reps_time)) or {}
    for timer in timers.values():
        timer.close()
    held.clear()  # the graphs are gone: the calls may go
    recs = {}
    for kind, values in times.items():
        info, st = built[kind], spread(values)
        recs[kind] = {"section": "serving", "dist": dist, "kernel": kind, "rows": rows, "heads": heads,
                      "sets": sets, "repeats": len(values), "work": round(inp["work"], 4),
                      **{k: v for k, v in info.items() if k not in ("q_bytes", "compute", "kv_kind")},
                      **work_metrics(rows, heads, st["us"], inp["work"], info, ceil), **st}
    return recs


# ---------------------------------------------------------------- tables and the picture, from the JSON


def serving_table(section: dict[str, Any]) -> str:
    """Markdown: per (heads, rows) and kernel, µs per distribution (proportionality; fraction of the floor), then
    ours / FlashMLA per distribution (the targets: proportionality <= 1.15 from 32 rows, <= 0.5x FlashMLA on the
    serving mix)."""
    recs = section.get("records", [])
    dists = section.get("distributions", list(DISTRIBUTIONS))
    lines = ["| H | rows | kernel | " + " | ".join(f"{d} µs (prop.; of floor)" for d in dists) + " |",
             "|---|---|---|" + "---|" * len(dists)]
    for heads in sorted({r["heads"] for r in recs}, reverse=True):
        for rows in sorted({r["rows"] for r in recs if r["heads"] == heads}):
            here = [r for r in recs if (r["heads"], r["rows"]) == (heads, rows)]
            for kind in sorted({r["kernel"] for r in here}, key=lambda k: (k not in OURS, k)):
                cells = []
                for d in dists:
                    hit = [r for r in here if (r["kernel"], r["dist"]) == (kind, d)]
                    cells.append(f"{hit[0]['us']:.1f} ({hit[0].get('proportionality', float('nan')):.2f}; "
                                 f"{hit[0]['of_floor']:.2f})" if hit else "-")
                lines.append(f"| {heads} | {rows} | {kind} | " + " | ".join(cells) + " |")
    ratios = section.get("ratios", [])
    if ratios:
        lines += ["", "| H | rows | ours / peer | " + " | ".join(f"{d} (work)" for d in dists) + " |",
                  "|---|---|---|" + "---|" * len(dists)]
        for key in sorted({(r["heads"], r["rows"], r["ours"], r["peer"]) for r in ratios},
                          key=lambda k: (-k[0], k[1], k[2], k[3])):
            cells = []
            for d in dists:
                hit = [r for r in ratios if (r["heads"], r["rows"], r["ours"], r["peer"], r["dist"]) == (*key, d)]
                cells.append(f"{hit[0]['ratio']:.2f} [{hit[0]['ratio_min']:.2f}-{hit[0]['ratio_max']:.2f}] "
                             f"({hit[0]['work']:.2f})" if hit else "-")
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} / {key[3]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def proportionality_summary(section: dict[str, Any], min_rows: int = 32) -> dict[str, Any]:
    """Per kernel, the worst proportionality over the ragged distributions at >= min_rows rows, and its point."""
    out: dict[str, Any] = {}
    for r in section.get("records", []):
        if r["dist"] == "full" or r["rows"] < min_rows or "proportionality" not in r:
            continue
        best = out.get(r["kernel"])
        if best is None or r["proportionality"] > best["proportionality"]:
            out[r["kernel"]] = {k: r[k] for k in ("proportionality", "heads", "rows", "dist", "work", "us")}
    return out


def plot_time_vs_work(section: dict[str, Any], out_dir: str | Path) -> Path:
    """serving_time_vs_work.png: per head count, each kernel's time over its all-full time against the work ratio
    (every rows and distribution of the section), the proportional line y = x dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in section.get("records", []) if "full_us" in r]
    heads_all = sorted({r["heads"] for r in recs}, reverse=True)
    cols = min(3, max(1, len(heads_all)))
    nrow = max(1, math.ceil(len(heads_all) / cols))
    fig, axes = plt.subplots(nrow, cols, figsize=(5.2 * cols, 4.2 * nrow), squeeze=False)
    markers = dict(zip(sorted({r["rows"] for r in recs}), "osD^v<>p*"))
    for ax, heads in zip(axes.flat, heads_all):
        for kind in sorted({r["kernel"] for r in recs}):
            pts = [r for r in recs if r["heads"] == heads and r["kernel"] == kind]
            color = {"triton/fp8": "tab:blue", "triton-sched/fp8": "tab:purple", "fa3/bf16": "tab:orange",
                     bs.FLASHMLA_KIND: "tab:brown"}.get(kind)
            for rows in sorted({r["rows"] for r in pts}):
                xy = sorted((r["work"], r["us"] / r["full_us"]) for r in pts if r["rows"] == rows)
                ax.plot([x for x, _ in xy], [y for _, y in xy], marker=markers.get(rows, "o"), color=color,
                        linestyle="-", alpha=0.8, label=f"{kind} {rows} rows")
        ax.plot([0, 1], [0, 1], "k--", alpha=0.5, label="time = work")
        ax.set_xlim(0, 1.05)
        ax.set_xlabel("work: sum(counts) / (rows K)")
        ax.set_ylabel("time / all-full time")
        ax.set_title(f"H = {heads}")
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(heads_all):]:
        ax.axis("off")
    if heads_all:
        axes.flat[0].legend(fontsize=6, ncol=2)
    fig.suptitle("serving section: time against work (each kernel against its own all-full time)", fontsize=10)
    fig.tight_layout()
    path = Path(out_dir) / "serving_time_vs_work.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def median_proportionality(section: dict[str, Any], kernel: str) -> float | None:
    """The median proportionality of a kernel over the section's ragged records (a one-number summary for logs)."""
    vals = [r["proportionality"] for r in section.get("records", [])
            if r["kernel"] == kernel and r["dist"] != "full" and "proportionality" in r]
    return round(statistics.median(vals), 3) if vals else None


__all__ = ["DISTRIBUTIONS", "HEADS", "OURS", "QUICK_HEADS", "QUICK_ROWS", "ROWS", "draw_counts", "kernel_calls",
           "median_proportionality", "plot_time_vs_work", "points", "proportionality_summary", "ragged_inputs",
           "serving_section", "serving_table", "warm", "work_metrics"]
