"""benchmarks/engine_check.py on a CPU: the per-step KL and the layer-0 error against hand-computed values, the
bootstrap interval, bounds set from the null pairs alone, and the verdicts on synthetic per-request statistics (this
backend passing on 95% of its requests, each planted fault caught with margin on 95%)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import engine_check as ec  # noqa: E402


def _logprobs(requests=6, steps=5, vocab=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(2.0 * torch.randn(requests, 1 + steps, vocab, generator=g), dim=-1)


def _near(base, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(base + scale * torch.randn(base.shape, generator=g), dim=-1)


# ---------------------------------------------------------------------------------------------------- per request


def test_step_kl_is_the_kl_of_the_decode_steps():
    ref, other = _logprobs(seed=1), _logprobs(seed=2)
    kl = ec.step_kl(ref, other)
    assert kl.shape == (6, 5) and kl.dtype == torch.float64
    p = ref[2, 3].double().exp()
    assert float(kl[2, 2]) == pytest.approx(float((p * (ref[2, 3].double() - other[2, 3].double())).sum()))
    assert (kl >= 0).all() and float(ec.step_kl(ref, ref).abs().max()) == 0.0
    other[1, 0] += 5.0  # step 0, the token after the prompt: not a decode step
    assert torch.equal(ec.step_kl(ref, other), kl)


def test_step_kl_marks_a_missing_step_and_request_means_count_it():
    ref, other = _logprobs(), _logprobs(seed=3)
    other[4, 2] = math.nan
    kl = ec.step_kl(ref, other)
    assert math.isnan(kl[4, 1]) and not torch.isnan(kl[4, 2:]).any()
    means, missing = ec.request_means(kl)
    assert missing == 1 and means[4] == pytest.approx(float(kl[4, [0, 2, 3, 4]].mean()))
    with pytest.raises(ValueError, match="reference"):
        ec.step_kl(ref, other[:, :3])


def test_layer0_errors_are_the_relative_l2_over_the_steps_both_recorded():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(3, 4, 16, generator=g)
    other = ref + 0.01 * torch.randn(3, 4, 16, generator=g)
    other[1, 2] = math.nan
    errors, missing = ec.layer0_errors(ref, other)
    keep = [0, 1, 3]
    expected = ((other[1, keep] - ref[1, keep]).norm() / ref[1, keep].norm()).item()
    assert missing == 1 and errors[1] == pytest.approx(expected, rel=1e-5)
    assert errors[0] == pytest.approx(((other[0] - ref[0]).norm() / ref[0].norm()).item(), rel=1e-5)


def test_layer0_rows_are_placed_by_position_and_a_later_row_replaces_an_earlier_one():
    """Prompts of 100 and 200 tokens, 3 decode steps: step t of a request sits at position len + t - 1. A padded row
    of a captured batch writes a position early; the step's own row, written later, replaces it."""
    rows = torch.arange(7 * 2 * 4, dtype=torch.float32).reshape(7, 2, 4)
    positions = torch.tensor([100, 99, 201, 102, 100, 200, 500])  # 99: the prompt's last token; 500: past the steps
    placed, dropped = ec.layer0_by_step(rows, positions, [200, 100], steps=3)
    assert placed.shape == (2, 3, 8) and dropped == 2
    assert torch.equal(placed[1, 0], rows[4].flatten())  # position 100 written twice: the later row
    assert torch.equal(placed[1, 2], rows[3].flatten()) and torch.equal(placed[0, 1], rows[2].flatten())
    assert torch.equal(placed[0, 0], rows[5].flatten()) and torch.isnan(placed[1, 1]).all()
    with pytest.raises(ValueError, match="collide"):
        ec.layer0_by_step(rows, positions, [100, 103], steps=3)


def test_the_bootstrap_interval_is_seeded_and_brackets_the_ratio():
    g = torch.Generator().manual_seed(4)
    den = (1.0 + torch.rand(64, generator=g)).tolist()
    num = [1.3 * d * (1 + 0.05 * float(torch.randn(1, generator=g))) for d in den]
    a = ec.ratio_interval(num, den, seed=11)
    assert a == ec.ratio_interval(num, den, seed=11) and a != ec.ratio_interval(num, den, seed=12)
    assert a["low"] < a["ratio"] < a["high"] and 1.25 < a["ratio"] < 1.35 and a["high"] - a["low"] < 0.1
    assert ec.ratio_interval([1.0, math.nan], [1.0, 2.0], seed=0)["requests"] == 1
    with pytest.raises(ValueError, match="resamples"):
        ec.ratio_interval(num, den, seed=0, resamples=0)


# ---------------------------------------------------------------------------------------------------- bounds, verdicts


def _stats(ratio_kl, ratio_l2=None):
    out = {"kl_ratio": list(ratio_kl)}
    if ratio_l2 is not None:
        out["layer0_ratio"] = list(ratio_l2)
    return out


def test_the_bounds_come_from_the_null_pairs_alone():
    stats = {ec.FLASHINFER_SM90: _stats([0.4, 0.5], [0.6, 0.7]), ec.KEYS_REVERSED: _stats([1.01, 1.04], [1.02, 1.1]),
             ec.OURS: _stats([5.0, 6.0], [9.0, 9.0]), "fault:half_topk": _stats([50.0, 60.0], [30.0, 30.0])}
    bounds = ec.set_bounds(stats)
    assert bounds == {"kl": ec.round_up(1.5 * 1.04), "layer0": ec.round_up(1.5 * 1.1)} == {"kl": 1.6, "layer0": 1.7}
    stats[ec.OURS] = _stats([0.1, 0.1], [0.1, 0.1])
    del stats["fault:half_topk"]
    assert ec.set_bounds(stats) == bounds
    stats[ec.FLASHINFER_SM90] = _stats([1.2, 1.3], [0.6, 0.7])  # now the BF16-query pair sets the KL bound
    assert ec.set_bounds(stats) == {"kl": 2.0, "layer0": 1.7}
    with pytest.raises(ValueError, match="null pairs"):
        ec.set_bounds({ec.OURS: _stats([1.0])})


def test_round_up_to_two_digits():
    assert ec.round_up(0.1218) == 0.13 and ec.round_up(1.56) == 1.6 and ec.round_up(1.5) == 1.5
    assert ec.round_up(2.731) == 2.8
    with pytest.raises(ValueError, match="value"):
        ec.round_up(0.0)


def test_this_backend_passes_on_95_percent_of_its_requests_and_no_fewer():
    bounds = {"kl": 1.5, "layer0": 1.6}
    ratios = [1.1] * 95 + [2.0] * 5
    assert ec.judge_engine(_stats(ratios, [1.0] * 100), bounds, fault=False)["passes"]
    ratios = [1.1] * 94 + [2.0] * 6
    assert not ec.judge_engine(_stats(ratios, [1.0] * 100), bounds, fault=False)["passes"]
    layer0 = [1.0] * 94 + [1.7] * 6  # within on KL, past on layer 0: the request fails
    assert not ec.judge_engine(_stats([1.1] * 100, layer0), bounds, fault=False)["passes"]
    assert not ec.judge_engine(_stats([1.1] * 100, [1.0] * 100), bounds, fault=False, missing_steps=1)["passes"]


def test_a_fault_is_caught_with_margin_on_95_percent_of_its_requests():
    bounds = {"kl": 1.5}
    over = ec.CAUGHT_MARGIN * 1.5
    assert ec.judge_engine(_stats([over * 1.01] * 95 + [1.0] * 5), bounds, fault=True)["passes"]
    assert not ec.judge_engine(_stats([over * 1.01] * 94 + [1.0] * 6), bounds, fault=True)["passes"]
    just_past = ec.judge_engine(_stats([1.6] * 100), bounds, fault=True)  # past the bound, inside the margin
    assert not just_past["passes"] and just_past["caught_fraction"] == 0.0 and just_past["within_fraction"] == 0.0
    either = ec.judge_engine(_stats([1.0] * 100, [5.0] * 100), {"kl": 1.5, "layer0": 1.5}, fault=True)
    assert either["passes"]  # layer 0 alone catches it


def test_verdicts_judge_nothing_without_bounds_and_everything_with_them():
    stats = {ec.FLASHINFER_SM90: _stats([0.5] * 20), ec.KEYS_REVERSED: _stats([1.0] * 20), ec.OURS: _stats([1.2] * 20),
             "fault:softmax_scale": _stats([3.0] * 20)}
    unset = ec.verdicts(stats, None)
    assert unset["ok"] is None and "not set" in unset["judged"] and unset["bounds_from_null_pairs"] == {"kl": 1.5}
    judged = ec.verdicts(stats, {"kl": 1.5})
    assert judged["ok"] and set(judged["engines"]) == set(stats)
    stats["fault:softmax_scale"] = _stats([1.7] * 20)
    assert not ec.verdicts(stats, {"kl": 1.5})["ok"]


def test_validate_reads_the_null_pairs_and_the_faults_not_this_backend():
    stats = {ec.FLASHINFER_SM90: _stats([0.5] * 20), ec.KEYS_REVERSED: _stats([1.0] * 20), ec.OURS: _stats([9.0] * 20),
             **{f"fault:{f}": _stats([3.0] * 20) for f in ("softmax_scale", "half_topk")}}
    assert ec.validate(stats, {"kl": 1.5}, ["softmax_scale", "half_topk"])["valid"]
    result = ec.validate(stats, {"kl": 1.5}, ["softmax_scale", "half_topk", "topk_ignored"])
    assert not result["valid"] and result["absent"] == ["fault:topk_ignored"]
    stats[ec.KEYS_REVERSED] = _stats([1.0] * 18 + [2.0] * 2)
    assert not ec.validate(stats, {"kl": 1.5}, ["softmax_scale"])["valid"]


def test_the_statistics_of_engines_that_differ_as_the_engines_do():
    """Log-probabilities made to differ as the engines do (the reference, D off it, a key-order twin of D, this
    backend a little off D, a fault far off D): the ratios order them, the bounds from the twin pass this backend,
    and the fault is caught."""
    ref = _logprobs(requests=40, steps=16, vocab=64, seed=5)
    d = _near(ref, 0.10, 6)
    twin = _near(d, 0.01, 7)
    ours = _near(d, 0.03, 8)
    fault = _near(d, 0.12, 9)
    kl = {name: ec.request_means(ec.step_kl(ref, x))[0]
          for name, x in ((ec.SAME_INPUTS, d), (ec.KEYS_REVERSED, twin), (ec.OURS, ours), ("fault:x", fault),
                          (ec.FLASHINFER_SM90, _near(ref, 0.05, 10)))}
    stats = ec.engine_statistics({name: {"kl": v} for name, v in kl.items()}, seed=0)
    assert ec.OURS in stats and ec.SAME_INPUTS not in stats
    ours_ratio = stats[ec.OURS]["kl_interval"]
    assert 1.0 < ours_ratio["low"] < ours_ratio["ratio"] < ours_ratio["high"] < 1.5
    assert stats["fault:x"]["kl_interval"]["low"] > 2.0
    bounds = ec.set_bounds(stats)
    judged = ec.verdicts(stats, bounds)
    assert judged["ok"], judged
    with pytest.raises(ValueError, match="denominator"):
        ec.engine_statistics({ec.OURS: {"kl": [1.0]}}, seed=0)


def test_no_bound_is_set_before_a_device_run_records_the_kl():
    """The committed device reports hold per-step largest |log-probability differences| only: the KL bounds wait
    for the next device run, and nothing is judged until then."""
    assert ec.KL_BOUND is None and ec.LAYER0_BOUND is None and ec.module_bounds() is None
