"""The suite's comparison (issue 48): kernels timed in turn at every point with repeats and their spread, ratios
with each side's fraction of its own floor, input sets past 2x L2 at every batch size (slot pools), and the accuracy
section on BF16 source data, each kernel on its own quantization, with tolerances and the FP8 P.V rule.

CPU: our kernel in Triton's interpreter at K = 128, FlashMLA as a stand-in of vLLM's ops module (checking
FlashMLA's argument rules, computing the float64 reference), timings by the host clock (plumbing, not measurement).
"""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from vllm_kimi_dsa import timing
from vllm_kimi_dsa.bench import suite as bs
from vllm_kimi_dsa.bench.peers import flashmla as pf
from test_peer_flashmla import _StandInOps

CEIL = {"copy_GBps": 3000.0, "bf16_TFLOPs": 780.0, "fp8_TFLOPs": 1400.0}


class _Timer:
    def __init__(self, name, log, value):
        self.name, self.log, self.value, self.closed = name, log, value, False

    def time_us(self, **kw):
        self.log.append(self.name)
        return self.value + len(self.log) * 0.01

    def close(self):
        self.closed = True


def test_interleaved_rounds_take_every_kernel_in_turn():
    log: list[str] = []
    timers = {n: _Timer(n, log, v) for n, v in (("ours", 10.0), ("fa3", 12.0), ("flashmla", 14.0))}
    out = timing.interleaved_us(timers, 3)
    assert log == ["ours", "fa3", "flashmla", "fa3", "flashmla", "ours", "flashmla", "ours", "fa3"]
    assert all(len(v) == 3 for v in out.values())
    with pytest.raises(ValueError):
        timing.interleaved_us(timers, 0)


def test_spread_of_repeats():
    st = timing.spread([10.0, 12.0, 11.0])
    assert st["us"] == 11.0 and st["us_min"] == 10.0 and st["us_max"] == 12.0
    assert st["spread"] == pytest.approx(2 / 11, abs=1e-4) and st["us_repeats"] == [10.0, 12.0, 11.0]
    assert st["us_iqr"] == pytest.approx(1.0)


@pytest.mark.parametrize("l2", [50 * 2**20, 60 * 2**20, 128 * 2**20])
def test_every_batch_size_reads_past_twice_the_l2(l2):
    """Rows 1 and 2 included (the old cap of 64 sets left them under 2x L2): sets x the smallest row format's bytes
    exceed 2x L2, past 64 sets from more slot pools, and no two sets share both their pool and their window."""
    for rows in sorted(set(bs.FULL_ROWS) | {1, 2}):
        n = bs.n_sets(rows, l2)
        assert n >= 4 and n * rows * bs.K * 352 > 2 * l2, (rows, n)
        pairs = {bs.pool_of(s) for s in range(n)}
        assert len(pairs) == n and max(p for p, _ in pairs) < bs.MAX_POOLS and max(w for _, w in pairs) < bs.MAX_SETS
    assert bs.n_sets(1, 60 * 2**20) > bs.MAX_SETS  # the second pool is needed there
    assert timing.l2_bytes(torch.device("cpu")) == timing.L2_BYTES


def test_published_ratio_is_the_median_of_the_rounds_ratios():
    """Each round times ours then the peer back to back, so a round's ratio cancels what drifted between rounds (clock,
    heat, a neighbour): the published ratio is the median of those ratios, not the ratio of the two medians. Rounds
    where the two differ (0.5, 0.75, 0.7): median 0.70; ratio of medians 10 / 20 = 0.50. Each side's fraction of its
    own floor beside it; the suite's table and the plot's print them."""
    from vllm_kimi_dsa.bench import plot

    ours = {"rows": 5, "heads": 128, "kernel": "triton/fp8", "us": 10.0, "us_repeats": [10.0, 9.0, 14.0],
            "of_floor": 0.5, "spread": 0.5}
    peer = {"rows": 5, "heads": 128, "kernel": bs.FLASHMLA_KIND, "us": 20.0, "us_repeats": [20.0, 12.0, 20.0],
            "of_floor": 0.45, "spread": 0.4}
    r = bs.pair_ratio(ours, peer)
    assert r["ratio"] == 0.7 and r["ratio_min"] == 0.5 and r["ratio_max"] == 0.75
    assert r["ours_us"] / r["peer_us"] == 0.5  # the medians' ratio, kept beside it, is not what is published
    assert r["ours_of_floor"] == 0.5 and r["peer_of_floor"] == 0.45
    text = bs.ratio_table([r])
    assert "H=128 triton/fp8 / flashmla/fp8_ds_mla" in text and "5: 0.70 [0.50-0.75] (0.50 vs 0.45)" in text
    assert "| 0.70 [0.50-0.75] (0.50 / 0.45) |" in "\n".join(plot.measured_ratio_rows([r], 128, [5]))


def test_flashmla_floor_counts_the_padded_heads():
    plain = bs.metrics(4, 8, 10.0, "fp8_ds_mla", 2, "bf16", CEIL)
    padded = bs.metrics(4, 8, 10.0, "fp8_ds_mla", 2, "bf16", CEIL, heads_run=64)
    assert padded["tflops"] == plain["tflops"]  # the useful work
    assert padded["floor_flops_us"] == pytest.approx(plain["floor_flops_us"] * 8, rel=1e-3)
    io = 4 * 64 * (576 * 2 + 512 * 2)
    assert padded["floor_bw_us"] == pytest.approx((4 * 2048 * 656 + io) / 3000e9 * 1e6, abs=1e-3)
    assert padded["heads_run"] == 64 and plain["heads_run"] == 8


@pytest.fixture()
def small_suite(tmp_path, monkeypatch):
    """K = 128, 2 sets a pool, a tiny L2: a point has 5 sets in 3 pools; FlashMLA a stand-in of vLLM's ops."""
    monkeypatch.setattr(bs, "K", 128)
    monkeypatch.setattr(bs, "MAX_SETS", 2)
    ops = _StandInOps()
    monkeypatch.setattr(bs, "flashmla_source", lambda build: (pf.SOURCE_VLLM, ops))
    args = argparse.Namespace(out=str(tmp_path), reps_time=0.001, repeats=3, quick=True)
    suite = bs.Suite(args, device="cpu")
    suite.l2 = 4 * 128 * 352 // 2 + 1  # 2x L2 just past 4 sets of one row: 5 sets
    data = bs.Data(torch.device("cpu"), base_rows=4096, shift=64, with_bf16=False,
                   fp8_ds_mla=pf.quantize_fp8_ds_mla)
    peer = {bs.FLASHMLA_KIND: {"usable_heads": {8: True, 64: True}, "records": [{"source": pf.SOURCE_VLLM}]}}
    return suite, data, peer, ops


def test_decode_point_interleaves_ours_and_flashmla(small_suite):
    suite, data, peer, ops = small_suite
    bs.decode_section(suite, data, CEIL, (1,), (8,), ["triton/fp8", bs.FLASHMLA_KIND], peer)
    assert not suite.failures, suite.failures
    recs = {r["kernel"]: r for r in suite.results}
    assert set(recs) == {"triton/fp8", bs.FLASHMLA_KIND}
    for r in recs.values():
        assert r["repeats"] == 3 and len(r["us_repeats"]) == 3 and r["us_min"] <= r["us"] <= r["us_max"]
        assert r["sets"] == 5 and r["pools"] == 3 and r["replay_bytes"] > 2 * suite.l2
    fm = recs[bs.FLASHMLA_KIND]
    assert fm["padded_heads"] == 64 and fm["call_shape"] == [1, 1, 64] and fm["heads_run"] == 64
    assert fm["vllm_path"] == "_forward_fp8_kv_mixed_batch" and fm["source"] == pf.SOURCE_VLLM
    # every call of the stand-in: (1, T, 64) with the real heads first, zeros after; one metadata object reused
    assert all(c["q"].shape == (1, 1, 64, 576) and not c["q"][0, :, 8:].any() for c in ops.calls)
    assert ops.calls[0]["meta"] == {"initialized": False} and all(c["meta"]["initialized"] for c in ops.calls[1:])
    (ratio,) = suite.ratios
    assert ratio["ours"] == "triton/fp8" and ratio["peer"] == bs.FLASHMLA_KIND
    assert ratio["ours_of_floor"] == recs["triton/fp8"]["of_floor"]
    assert ratio["peer_of_floor"] == fm["of_floor"]
    suite.dump()
    saved = json.loads((suite.out_dir / "bench_suite.json").read_text())
    assert saved["ratios"] == suite.ratios and len(saved["results"]) == 2


def test_accuracy_on_bf16_source_each_kernel_its_own_quantization(small_suite, monkeypatch):
    suite, _, peer, _ = small_suite
    monkeypatch.setattr(bs, "ACCURACY_ROWS", 4096)
    bs.accuracy_section(suite, ((3, 8),), ["triton/fp8", "triton/nvfp4_ds_mla", bs.FLASHMLA_KIND], peer)
    assert not suite.failures, suite.failures
    acc = {a["kernel"]: a for a in suite.accuracy}
    assert set(acc) == {"triton/fp8", "triton/nvfp4_ds_mla", bs.FLASHMLA_KIND}
    for a in acc.values():
        assert a["against"] == "float32 on the BF16 source values" and a["nonfinite"] == 0
        assert a["within_tolerance"], a
        assert a["rel_l2_own"] < a["rel_l2"]  # the kernel's own arithmetic is a small part of its error
    for a in acc.values():  # the prediction from the measured rounding is within 2x of what the kernel does
        assert a["tolerance"] == pytest.approx(2 * a["predicted"], abs=3e-5)
        assert a["predicted"] / 2 < a["rel_l2"] < a["predicted"] * 1.5, a
        assert a["rounding"]["values_rel_l2"] > 0 and "tolerance 2x" in a["tolerance_why"]
    # the quantization shows: e4m3 rows and query vs BF16 query + tile-scaled rows vs e2m1
    assert 5e-3 < acc[bs.FLASHMLA_KIND]["rel_l2"] < acc["triton/fp8"]["rel_l2"] * 1.5
    assert acc["triton/nvfp4_ds_mla"]["rel_l2"] > acc["triton/fp8"]["rel_l2"]
    assert suite.info["fp8_pv_default"]["verdict"] == "not measured"


def test_accuracy_tolerance_of_the_fp8_pv_kernel_counts_ps_rounding(small_suite, monkeypatch):
    """At 128 heads (the FP8 P.V opt-in runs only above 32 heads: at 8 the suite records no triton-pv8 row) the
    tolerance of triton-pv8/fp8 adds P's e4m3 rounding (2^-4 / sqrt(3) rms) in quadrature to the same logit, value
    and output terms as triton/fp8, whose P is fp16; on a CPU both run the plain kernel (the same answer), so the
    difference is the tolerance's alone."""
    suite, _, peer, _ = small_suite
    monkeypatch.setattr(bs, "ACCURACY_ROWS", 4096)
    bs.accuracy_section(suite, ((2, 128),), ["triton/fp8", "triton-pv8/fp8"], peer)
    assert not suite.failures, suite.failures
    acc = {a["kernel"]: a for a in suite.accuracy}
    assert set(acc) == {"triton/fp8", "triton-pv8/fp8"} and all(a["heads"] == 128 for a in acc.values())
    fp16_p, pv8 = acc["triton/fp8"], acc["triton-pv8/fp8"]
    assert pv8["rounding"]["p_rms"] == pytest.approx(2.0**-4 / math.sqrt(3), rel=1e-3)
    assert fp16_p["rounding"]["p_rms"] == pytest.approx(2.0**-11 / math.sqrt(3), rel=1e-3)
    for a in acc.values():  # the prediction is the quadrature sum of its terms (and the BF16 output's)
        terms = a["rounding"]["logits_rms"] ** 2 + a["rounding"]["values_rel_l2"] ** 2 + a["rounding"]["p_rms"] ** 2
        assert a["predicted"] == pytest.approx(math.sqrt(terms + 2.0**-16 / 3), abs=2e-5)
        assert a["tolerance"] == pytest.approx(2 * a["predicted"], abs=3e-5) and a["within_tolerance"]
    assert pv8["rounding"]["logits_rms"] == fp16_p["rounding"]["logits_rms"]
    assert pv8["tolerance"] ** 2 - fp16_p["tolerance"] ** 2 == pytest.approx(4 * (2.0**-8 - 2.0**-22) / 3, rel=1e-2)
    assert "P rounded to e4m3" in pv8["tolerance_why"]


def test_accuracy_inputs_sit_on_no_quantized_grid():
    src = bs.accuracy_inputs(3, 4, torch.device("cpu"), num_rows=2048)
    assert src["kv"].dtype == torch.bfloat16 and src["q"].dtype == torch.bfloat16
    kv = src["kv"].float()
    k_scale = float(kv.abs().amax()) / 448
    on_grid = ((kv / k_scale).to(torch.float8_e4m3fn).float() * k_scale == kv).float().mean()
    assert on_grid < 0.05
    counts, slots = src["counts"], src["slots"]
    assert int(counts[0]) == bs.K and int(counts[1]) == 1
    assert bool((slots[torch.arange(bs.K) >= counts.unsqueeze(1)] == -1).all())
    assert bool((slots[0] == -1).any())  # holes inside a full row


def test_fp8_pv_rule():
    acc = [{"kernel": "triton/fp8", "rows": 5, "heads": 128, "rel_l2": 0.040},
           {"kernel": "triton-pv8/fp8", "rows": 5, "heads": 128, "rel_l2": 0.041},
           {"kernel": "triton/fp8", "rows": 320, "heads": 128, "rel_l2": 0.040},
           {"kernel": "triton-pv8/fp8", "rows": 320, "heads": 128, "rel_l2": 0.0419}]
    d = bs.fp8_pv_decision(acc)
    assert d["default_ok"] and d["verdict"] == "may be the default" and len(d["shapes"]) == 2
    acc[-1]["rel_l2"] = 0.0421  # 5.25% over at one size: opt-in
    d = bs.fp8_pv_decision(acc)
    assert not d["default_ok"] and d["verdict"] == "stays opt-in"
    assert not [s for s in d["shapes"] if s["rows"] == 320][0]["ok"]


def test_markdown_shows_ratios_spreads_and_tolerances(tmp_path):
    from vllm_kimi_dsa.bench import plot

    recs = []
    for kernel, fmt, qb, compute, us in (("triton/fp8", "fp8", 1, "fp8qk", 10.0),
                                         (bs.FLASHMLA_KIND, "fp8_ds_mla", 2, "bf16", 14.0)):
        st = timing.spread([us, us * 1.02, us * 0.99])
        recs.append({"section": "decode", "kernel": kernel, "fmt": fmt, "rows": 5, "heads": 128, "repeats": 3,
                     **bs.metrics(5, 128, st["us"], fmt, qb, compute, CEIL), **st})
    ratio = bs.pair_ratio(recs[0], recs[1])
    acc = [{"kernel": "triton/fp8", "rows": 5, "heads": 128, "rel_l2": 0.04, "tolerance": 0.09, "predicted": 0.045,
            "within_tolerance": True, "rel_l2_own": 0.003, "holds": "e4m3 rows + e4m3 query"},
           {"kernel": bs.FLASHMLA_KIND, "rows": 5, "heads": 128, "rel_l2": 0.03, "tolerance": 0.07,
            "predicted": 0.035, "within_tolerance": True, "holds": "fp8_ds_mla rows + BF16 query"}]
    data = {"info": {"gpu": "NVIDIA H100", "ceilings": CEIL, "fp8_pv_default": bs.fp8_pv_decision(acc)},
            "results": recs, "ratios": [ratio], "accuracy": acc, "failures": []}
    md = plot.markdown(data, (5,))
    assert f"| triton/fp8 / {bs.FLASHMLA_KIND}, in turn (time [range]; each of its own floor) | " in md
    assert f"{ratio['ratio']:.2f} [{ratio['ratio_min']:.2f}-{ratio['ratio_max']:.2f}] " in md
    assert "±" in md  # the spread beside each time
    assert "| triton/fp8 | 5 | 128 | 4.00e-02 | 9.00e-02 | yes | 3.00e-03 | e4m3 rows + e4m3 query |" in md
    assert "FP8 P.V" in md and "not measured" in md


def test_compacted_selection_for_a_page_table_peer():
    slots = torch.tensor([[5, -1, 7, 9, 3], [4, -1, -1, 8, 2]], dtype=torch.int32)
    counts = torch.tensor([4, 2], dtype=torch.int32)
    packed, n = bs.compacted(slots, counts)
    assert n.tolist() == [3, 1]
    assert packed.tolist() == [[5, 7, 9, -1, -1], [4, -1, -1, -1, -1]]


class _StandInFa3:
    """fa3's contract as the suite uses it: plan(slots, counts) with no -1 inside a count (a page table), run(q bf16,
    rows, out) writing out; computes the float32 reference of what it was given."""

    def __init__(self, kv, heads, rows, width, *, sm_scale, kv_scale=1.0, device="cpu"):
        self.kv, self.sm, self.kv_scale = kv, sm_scale, kv_scale

    def plan(self, slots, counts):
        counts = torch.as_tensor(counts)
        live = torch.arange(slots.shape[1]) < counts.unsqueeze(1)
        assert bool((slots[live] >= 0).all()), "a -1 inside a count reaches the page table"
        self.slots, self.counts = slots, counts

    def run(self, q, rows, out):
        from vllm_kimi_dsa.reference import source_reference_decode

        assert q.dtype == torch.bfloat16
        vals = rows.float() * self.kv_scale
        ref, _ = source_reference_decode(q.float(), vals, self.slots, self.counts, softmax_scale=self.sm,
                                         output_scale=1.0)
        return out.copy_(ref.to(torch.bfloat16))


def test_accuracy_runs_fa3_on_compacted_selections(small_suite, monkeypatch):
    suite, _, _, _ = small_suite
    monkeypatch.setattr(bs, "ACCURACY_ROWS", 4096)
    monkeypatch.setattr(bs.fa3, "make_peer", _StandInFa3)
    peer = {"fa3/bf16": {"usable_heads": {8: True}}, "fa3/fp8": {"usable_heads": {8: True}}}
    bs.accuracy_section(suite, ((3, 8),), ["fa3/bf16", "fa3/fp8"], peer)
    assert not suite.failures, suite.failures
    acc = {a["kernel"]: a for a in suite.accuracy}
    assert acc["fa3/bf16"]["rel_l2"] < 2e-2 and acc["fa3/bf16"]["within_tolerance"]
    assert acc["fa3/fp8"]["within_tolerance"] and acc["fa3/fp8"]["rel_l2"] > acc["fa3/bf16"]["rel_l2"]
