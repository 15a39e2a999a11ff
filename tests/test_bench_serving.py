"""The suite's serving section (issue 54): count distributions, work ratios and proportionality, FlashMLA called as
vLLM's FLASHMLA_SPARSE calls it (ids -1 past each count, a fresh scheduler metadata in every call), fa3 planned on
each set's counts, ours static and scheduled; the JSON, the markdown and the time-against-work picture.

CPU: our kernels in Triton's interpreter at K = 128, FlashMLA a stand-in of vLLM's ops module (test_peer_flashmla's:
it checks FlashMLA's argument rules and computes the float64 reference), fa3 test_bench_compare's stand-in; timings
by the host clock (plumbing, not measurement). The CLI wiring: `bench --quick` runs the section.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import weakref

import pytest
import torch

from test_bench_compare import CEIL, _StandInFa3
from test_peer_flashmla import _StandInOps
from vllm_kimi_dsa.bench import plot
from vllm_kimi_dsa.bench import serving as sv
from vllm_kimi_dsa.bench import suite as bs
from vllm_kimi_dsa.bench.peers import flashmla as pf


@pytest.mark.parametrize("dist", sv.DISTRIBUTIONS)
def test_distributions(dist: str) -> None:
    """Each distribution's counts: in [1, K]; full all K; uniform spread over the range; the serving mix from
    min(context, K) with contexts of at least 100 (so counts >= 100) and a share at K; skewed one full row, the rest
    <= 128."""
    g = torch.Generator().manual_seed(1)
    width = 2048
    c = sv.draw_counts(dist, 4000, width, g, torch.device("cpu"))
    assert c.dtype == torch.int32 and int(c.min()) >= 1 and int(c.max()) <= width
    if dist == "full":
        assert bool((c == width).all())
    elif dist == "uniform":
        assert 0.45 < float(c.double().mean()) / width < 0.55 and int(c.min()) < 64 and int(c.max()) > width - 64
    elif dist == "serving":
        full = float((c == width).double().mean())
        # log-normal contexts centred on sqrt(100 * 32000) ~ 1789 tokens: a bit under half reach K
        assert int(c.min()) >= sv.CONTEXT_MIN and 0.35 < full < 0.55, full
    else:
        assert int(c[0]) == width and int(c[1:].max()) <= sv.SKEW_SHORT
    with pytest.raises(ValueError, match="dist must be"):
        sv.draw_counts("zipf", 3, width, g, torch.device("cpu"))


def test_ragged_inputs_leave_minus_one_past_each_count() -> None:
    inp = sv.ragged_inputs(5, 8, 3, "uniform", torch.device("cpu"), 4096, bf16=True)
    assert len(inp["counts"]) == len(inp["slots"]) == len(inp["q8"]) == len(inp["q16"]) == 3
    for c, s in zip(inp["counts"], inp["slots"]):
        live = torch.arange(bs.K) < c.unsqueeze(1)
        assert bool((s[live] >= 0).all()) and bool((s[~live] == -1).all())
    assert inp["work"] == pytest.approx(float(torch.stack(inp["counts"]).double().mean()) / bs.K)
    assert not torch.equal(inp["counts"][0], inp["counts"][1])  # each set its own counts


def test_work_metrics_scale_the_floor_with_the_work() -> None:
    info = {"kv_kind": "fp8", "q_bytes": 1, "compute": "fp8qk"}
    full = sv.work_metrics(32, 128, 40.0, 1.0, info, CEIL)
    half = sv.work_metrics(32, 128, 40.0, 0.5, info, CEIL)
    assert full["floor_us"] == bs.metrics(32, 128, 40.0, "fp8", 1, "fp8qk", CEIL)["floor_us"]
    io = 32 * 128 * (576 + 1024) / (CEIL["copy_GBps"] * 1e9) * 1e6
    assert half["floor_bw_us"] == pytest.approx((full["floor_bw_us"] - io) / 2 + io, abs=2e-3)
    assert half["floor_flops_us"] == pytest.approx(full["floor_flops_us"] / 2, abs=2e-3)
    assert half["tflops"] == pytest.approx(full["tflops"] / 2, abs=0.02)
    # the bytes and rate of the useful work: a record that reports the full batch's bytes for half the work fails
    assert half["kv_GBps"] == pytest.approx(full["kv_GBps"] / 2, abs=0.1)
    assert half["kv_bytes"] == full["kv_bytes"] / 2 and half["flops"] == full["flops"] / 2


@pytest.fixture()
def small(tmp_path, monkeypatch):
    """K = 128, 2 sets a pool, a tiny L2 (the least of 4 input sets a point, in 2 pools); FlashMLA and fa3
    stand-ins."""
    monkeypatch.setattr(bs, "K", 128)
    monkeypatch.setattr(bs, "MAX_SETS", 2)
    ops = _StandInOps()
    monkeypatch.setattr(bs, "flashmla_source", lambda build: (pf.SOURCE_VLLM, ops))
    monkeypatch.setattr(sv.fa3, "make_peer", _StandInFa3)
    args = argparse.Namespace(out=str(tmp_path), reps_time=0.001, repeats=2, quick=True)
    suite = bs.Suite(args, device="cpu")
    suite.l2 = 128 * 352  # 2 rows: two sets read 2x L2; n_sets' least is 4
    data = bs.Data(torch.device("cpu"), base_rows=4096, shift=64, with_bf16=True, fp8_ds_mla=pf.quantize_fp8_ds_mla)
    peer = {bs.FLASHMLA_KIND: {"usable_heads": {8: True}, "records": [{"source": pf.SOURCE_VLLM}]},
            "fa3/bf16": {"usable_heads": {8: True}}}
    return suite, data, peer, ops


def test_section_records_work_proportionality_and_ratios(small, tmp_path) -> None:
    suite, data, peer, ops = small
    sv.serving_section(suite, data, CEIL, peer, (2,), (8,))
    assert not suite.failures, suite.failures
    sec = suite.serving
    recs = {(r["kernel"], r["dist"]): r for r in sec["records"]}
    kinds = set(sv.OURS) | {"fa3/bf16", bs.FLASHMLA_KIND}
    assert set(recs) == {(k, d) for k in kinds for d in sv.DISTRIBUTIONS}
    for (kind, dist), r in recs.items():
        assert r["section"] == "serving" and r["repeats"] == 2 and r["sets"] == bs.n_sets(2, suite.l2) == 4
        full = recs[kind, "full"]
        assert r["full_us"] == full["us"]
        assert r["proportionality"] == pytest.approx(r["us"] / full["us"] / r["work"], rel=1e-3)
        # (at K = 128 the serving mix's contexts of >= 100 tokens fill most rows)
        assert 0 < r["work"] <= 1.0 and (r["work"] == 1.0 if dist == "full" else dist == "serving" or r["work"] < 1)
        assert r["floor_us"] > 0 and r["of_floor"] == pytest.approx(r["floor_us"] / r["us"], abs=1e-3)
    assert recs["triton-sched/fp8", "uniform"]["impl"].endswith("scheduled")
    assert not recs["triton/fp8", "uniform"]["impl"].endswith("scheduled")
    # FlashMLA: every call a fresh metadata object (filled in that call), ids -1 past each count, all K of them
    assert ops.calls and all(c["meta"] == {"initialized": False} for c in ops.calls)
    assert any(bool((c["idx"] == -1).any()) for c in ops.calls) and all(c["idx"].shape[-1] == 128 for c in ops.calls)
    ratios = {(r["ours"], r["peer"], r["dist"]) for r in sec["ratios"]}
    assert ratios == {(o, p, d) for o in sv.OURS for p in ("fa3/bf16", bs.FLASHMLA_KIND) for d in sv.DISTRIBUTIONS}
    suite.dump()
    saved = json.loads((suite.out_dir / "bench_suite.json").read_text())
    assert saved["serving"]["records"] == sec["records"] and saved["serving"]["ratios"] == sec["ratios"]
    # the markdown and the picture from the JSON
    text = plot.markdown(saved)
    assert "**Serving section**" in text and "| 8 | 2 | triton-sched/fp8 |" in text
    assert "triton/fp8 / flashmla/fp8_ds_mla" in text and "Worst proportionality from 32 rows: -" in text
    png = sv.plot_time_vs_work(saved["serving"], tmp_path)
    assert png.exists() and png.stat().st_size > 1000
    png.unlink()


def test_warm_compiles_ours_at_every_point(small) -> None:
    suite, data, _, _ = small
    sv.warm(suite, data, (2,), (8,))  # one eager call each (the interpreter): no failure recorded, nothing timed
    assert not suite.failures and suite.serving is None


class _HeldCalls:
    """make_timer's stand-in that, like GraphTimer, keeps no reference to its calls -- only weak ones, to see whether
    the section still holds them when the replays run."""

    def __init__(self, calls, device) -> None:
        self.refs = [weakref.ref(c) for c in calls]
        for c in calls:  # the eager run and the capture read what the calls hold
            c()

    def time_us(self, **kw) -> float:
        dead = sum(r() is None for r in self.refs)
        assert not dead, f"{dead} of {len(self.refs)} calls freed before their graph's replays"
        return 1.0

    def close(self) -> None:
        pass


def test_section_keeps_every_kinds_calls_until_its_replays(small, monkeypatch) -> None:
    """H200, 2026-12-07: the serving section died with an illegal memory access at its first point (H = 128, 8 rows,
    all full), in the interleaved timing, after every kind's own capture and replay had passed. A CUDA graph reads
    and writes the addresses it was captured with, but _point kept only each kind's record fields: the calls (and
    what only they held: the fa3 peer's per-set FlashInfer wrappers and page tables, the FlashMLA peer's buffers, a
    TritonDecode's workspace once a larger one replaced it in the shared table) went back to the allocator before
    the replays, and the next allocations reused them. Every kind's calls must stay alive until its timer is closed."""
    suite, data, peer, _ = small
    monkeypatch.setattr(sv, "make_timer", _HeldCalls)
    sv.serving_section(suite, data, CEIL, peer, (2,), (8,))
    assert not suite.failures, suite.failures[0].get("error", suite.failures[0])


def test_graph_timer_holds_its_calls(monkeypatch) -> None:
    """GraphTimer kept only len(calls): the graph it captured outlived what the calls held. It must hold the calls
    until close() (torch.cuda stood in for: a CPU cannot capture)."""
    import contextlib
    from types import SimpleNamespace

    from vllm_kimi_dsa import timing

    stream = SimpleNamespace(wait_stream=lambda s: None)
    graph = SimpleNamespace(replay=lambda: None)
    for name, value in {"Stream": lambda: stream, "current_stream": lambda: stream, "synchronize": lambda: None,
                        "stream": lambda s: contextlib.nullcontext(), "CUDAGraph": lambda: graph,
                        "graph": lambda g: contextlib.nullcontext()}.items():
        monkeypatch.setattr(torch.cuda, name, value)

    class Buffers:  # what a call's closure alone holds (a peer's plan buffers, a kernel's workspace)
        pass

    held = Buffers()
    ref = weakref.ref(held)
    timer = timing.GraphTimer([lambda b=held: b])
    del held
    gc.collect()
    assert ref() is not None, "the captured calls' buffers were freed while the graph can still replay"
    timer.close()
    gc.collect()
    assert ref() is None


def test_proportionality_summary_and_median() -> None:
    recs = [{"kernel": "a", "dist": d, "rows": rows, "heads": 16, "work": w, "us": 1.0, "proportionality": p}
            for d, rows, w, p in (("uniform", 32, 0.5, 1.6), ("serving", 128, 0.6, 1.4), ("skewed", 8, 0.1, 9.0),
                                  ("full", 32, 1.0, 1.0))]
    worst = sv.proportionality_summary({"records": recs})
    # the 32-row point counts (the bound is "from 32 rows"); 8 rows are below it; the full rows are no ragged point
    assert worst["a"]["proportionality"] == 1.6 and worst["a"]["rows"] == 32 and worst["a"]["dist"] == "uniform"
    assert sv.median_proportionality({"records": recs}, "a") == pytest.approx(1.6)  # median of 1.6, 1.4, 9.0
    assert sv.median_proportionality({"records": recs}, "b") is None


def test_points_and_the_cli_runs_the_section(monkeypatch) -> None:
    """The section's own points (the issue's), --rows / --heads override them; `bench` (quick too) hands the
    section to the suite, which runs it after the others."""
    assert sv.points(False, None, None) == ((8, 32, 128, 320), (128, 16, 64, 24, 8, 4))
    assert sv.points(True, None, None) == (sv.QUICK_ROWS, sv.QUICK_HEADS)
    assert sv.points(True, (5, 1), (12, 64, 12)) == ((1, 5), (12, 64))
    assert "serving" in bs.SECTIONS
    import vllm_kimi_dsa.__main__ as cli

    seen = {}
    monkeypatch.setattr(bs, "run", lambda args, error, extra=None: seen.update(args=args, extra=extra) or 0)
    assert cli.main(["bench", "--out", "/nonexistent-never-written", "--quick"]) == 0
    assert seen["extra"] == {"serving": (sv.points, sv.serving_section, sv.warm)} and seen["args"].quick
    assert "serving" in seen["args"].sections


def test_serving_table_marks_missing_cells() -> None:
    sec = {"records": [{"kernel": "triton/fp8", "dist": "full", "rows": 8, "heads": 4, "us": 10.0, "of_floor": 0.5,
                        "proportionality": 1.0}], "ratios": []}
    text = sv.serving_table(sec)
    assert "| 4 | 8 | triton/fp8 | 10.0 (1.00; 0.50) | - | - | - |" in text
    assert not math.isnan(1.0)
