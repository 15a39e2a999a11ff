"""The engine check's statistics, bounds and verdicts: per request the mean KL divergence from FLASHMLA_SPARSE and
layer 0's attention error, each as a ratio to a correct kernel's on the same inputs, judged at bounds set in advance.

**The statistic.** For an engine X and request i, kl_i(X) is the mean over the decode steps of KL(p_ref || p_X) over
the full vocabulary, p_ref being FLASHMLA_SPARSE's distribution (vLLM's Hopper default; step 0, the token after the
prompt, is not a decode step). The ratio r_i(X) = kl_i(X) / kl_i(D), where D is vLLM's FLASHINFER_MLA_SPARSE_SM90 fed
this backend's FP8 query (SAME_INPUTS: the same 576 B cache bytes and query values), says how much farther from the
reference X is than a correct kernel on X's own inputs. The ratio of the sums over requests gets a percentile
bootstrap interval over requests (`ratio_interval`, seeded). Layer 0's attention output (forward_mqa's latent,
recorded in every engine into a fixed buffer) gives a second ratio the same way: the relative L2 error of X's against
FLASHMLA_SPARSE's over request i's decode steps, divided by D's; under a forced trace layer 0's inputs are the same
in every engine, so no earlier layer's rounding enters it.

**The bounds, and how they are set** (`set_bounds`; the constants KL_BOUND and LAYER0_BOUND):
- Only pairs without this backend set them (NULL_PAIRS): FLASHINFER_MLA_SPARSE_SM90 on its own BF16 query, and
  FLASHINFER_MLA_SPARSE_SM90 on this backend's query with every row's selected keys read in reverse order
  (KEYS_REVERSED: the same attention, another summation order). Each is a correct engine; its r_i is what a
  correct kernel shows.
- A bound is BOUND_FACTOR x the largest r_i of those pairs over the requests of the calibration seed
  (CALIBRATION_SEED's workload), rounded up to two significant digits.
- It is validated on VALIDATION_SEED's workload, which never sets it (`validate`): every null pair within the bounds on
  at least PASS_FRACTION of the requests, every planted fault caught with margin on at least PASS_FRACTION.
- A bound is set once, from one device run (or the calls of one session, their reference and denominator the same
  bytes), with its reports committed and named in CALIBRATION_REPORTS; tests/test_bench_engine.py holds the
  constants to what those reports give (`bench_engine.py bounds`). A bound never moves to make a run pass. If the
  validation fails, the check does not separate and the constants stay unset.
- KL_BOUND and LAYER0_BOUND are None: no device run has recorded the KL or the layer-0 outputs yet (the committed
  H100 / H200 reports hold per-step largest |log-probability differences| only), so they wait for the next device
  run (docs/vllm-on-device.md gives its commands). Until then `verdicts` reports the bounds the run's own null pairs
  would give and judges nothing.

**The verdicts** (`verdicts`): a request passes when both its ratios are within the bounds; this backend passes when at
least PASS_FRACTION of its requests pass and no decode step is missing. A request of a planted fault is caught when
either ratio exceeds CAUGHT_MARGIN x its bound; a fault is caught when at least PASS_FRACTION of its requests are.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
import torch

OURS, FLASHMLA, FLASHINFER_SM90 = "FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM90"
SAME_INPUTS = f"{FLASHINFER_SM90}+fp8q"  # the denominator D: vLLM's FlashInfer SM90 on this backend's rounded query
KEYS_REVERSED = f"{SAME_INPUTS}+reversed"  # the same, every row's selected keys summed in reverse order
NULL_PAIRS = (FLASHINFER_SM90, KEYS_REVERSED)
FAULT_PREFIX = "fault:"

BOUND_FACTOR = 1.5
PASS_FRACTION = 0.95
CAUGHT_MARGIN = 1.25
RESAMPLES = 2000
LEVEL = 0.95
CALIBRATION_SEED, VALIDATION_SEED = 7, 8
KL_BOUND: float | None = None
LAYER0_BOUND: float | None = None
CALIBRATION_REPORTS: tuple[str, ...] = ()  # the committed engine_check.json files they came from (from the root)


def module_bounds() -> dict[str, float] | None:
    """{"kl": KL_BOUND, "layer0": LAYER0_BOUND} once both are set from a device run, else None."""
    if KL_BOUND is None or LAYER0_BOUND is None:
        return None
    return {"kl": KL_BOUND, "layer0": LAYER0_BOUND}


# ---------------------------------------------------------------------------------------------------- per request


def step_kl(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(p_ref || p) over the vocabulary at each decode step.

    reference, other: (requests, 1 + steps, vocab) float32 log-probabilities (step 0: the token after the prompt;
    NaN: not recorded). Returns (requests, steps) float64, NaN where either engine missed the step.
    """
    if reference.shape != other.shape or reference.dim() != 3:
        raise ValueError(f"reference {tuple(reference.shape)} and other {tuple(other.shape)} must be one "
                         "(requests, 1 + steps, vocab) shape")
    ref, oth = reference[:, 1:].double(), other[:, 1:].double()
    missing = torch.isnan(ref).any(-1) | torch.isnan(oth).any(-1)
    kl = (ref.exp() * (ref - oth)).nan_to_num(nan=0.0).sum(-1)
    return kl.masked_fill(missing, math.nan)


def request_means(values: torch.Tensor) -> tuple[list[float], int]:
    """(requests, steps) per-step values -> each request's mean over its recorded steps (NaN: none recorded) and the
    number of missing steps."""
    if values.dim() != 2:
        raise ValueError(f"values must be (requests, steps), got {tuple(values.shape)}")
    recorded = ~torch.isnan(values)
    sums = values.nan_to_num(nan=0.0).sum(-1)
    counts = recorded.sum(-1)
    means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.full_like(sums, math.nan))
    return [float(v) for v in means], int((~recorded).sum())


def layer0_by_step(rows: torch.Tensor, positions: torch.Tensor, prompt_lens: Sequence[int],
                   steps: int) -> tuple[torch.Tensor, int]:
    """Recorded layer-0 rows placed by request and decode step.

    rows: (n, heads, 512) in the order written; positions: (n,) each row's token position. A request with a prompt
    of L tokens computes decode step t (1..steps) at position L + t - 1; prompt lengths must keep those positions
    apart (check_workload spaces them). A position written twice keeps its last row (a padded row of a captured
    batch can write a position before its request reaches it). Returns (requests, steps, heads * 512) float32, NaN
    where nothing was recorded, and the number of rows that fell on no decode step.
    """
    if rows.shape[0] != positions.shape[0]:
        raise ValueError(f"rows has {rows.shape[0]} rows, positions {positions.shape[0]}")
    starts = sorted((length, i) for i, length in enumerate(prompt_lens))
    for (a, _), (b, _) in zip(starts, starts[1:]):
        if b - a < steps + 1:
            raise ValueError(f"prompt_lens {a} and {b} are closer than steps + 1 = {steps + 1}: positions collide")
    lengths = torch.tensor([length for length, _ in starts], dtype=torch.int64)
    owners = torch.tensor([i for _, i in starts], dtype=torch.int64)
    width = rows[0].numel() if rows.shape[0] else 0
    out = torch.full((len(prompt_lens), steps, width), math.nan)
    if not rows.shape[0]:
        return out, 0
    where = torch.searchsorted(lengths, positions.long(), right=True) - 1
    step = positions.long() - lengths[where.clamp(min=0)] + 1
    valid = (where >= 0) & (step >= 1) & (step <= steps)
    flat = rows.reshape(rows.shape[0], -1).float()
    for j in torch.nonzero(valid).flatten().tolist():  # in write order: a later row replaces an earlier one
        out[owners[where[j]], step[j] - 1] = flat[j]
    return out, int((~valid).sum())


def layer0_errors(reference: torch.Tensor, other: torch.Tensor) -> tuple[list[float], int]:
    """Per request, the relative L2 error of `other`'s layer-0 attention outputs against `reference`'s over the
    decode steps both recorded: sqrt(sum ||o - r||^2 / sum ||r||^2).

    reference, other: (requests, steps, width) float tensors, NaN rows where a step was not recorded. Returns the
    errors (NaN for a request with no step in common) and the number of steps either engine missed.
    """
    if reference.shape != other.shape or reference.dim() != 3:
        raise ValueError(f"reference {tuple(reference.shape)} and other {tuple(other.shape)} must be one "
                         "(requests, steps, width) shape")
    ref, oth = reference.float(), other.float()
    both = ~(torch.isnan(ref).any(-1) | torch.isnan(oth).any(-1))
    diff = ((oth - ref).nan_to_num(nan=0.0).pow(2).sum(-1) * both).sum(-1)
    norm = (ref.nan_to_num(nan=0.0).pow(2).sum(-1) * both).sum(-1)
    errors = torch.where(norm > 0, (diff / norm.clamp(min=1e-30)).sqrt(), torch.full_like(norm, math.nan))
    return [float(v) for v in errors], int((~both).sum())


def ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Request by request numerator / denominator (NaN where either is NaN or the denominator is not positive)."""
    if len(numerator) != len(denominator):
        raise ValueError(f"numerator has {len(numerator)} requests, denominator {len(denominator)}")
    return [n / d if d > 0 and not (math.isnan(n) or math.isnan(d)) else math.nan
            for n, d in zip(numerator, denominator)]


def ratio_interval(numerator: Sequence[float], denominator: Sequence[float], *, seed: int,
                   resamples: int = RESAMPLES, level: float = LEVEL) -> dict[str, float]:
    """The ratio of the sums over requests and its percentile bootstrap interval, requests drawn with replacement
    (numpy's generator seeded by `seed`); requests with a NaN on either side are left out."""
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    num, den = np.asarray(numerator, dtype=np.float64), np.asarray(denominator, dtype=np.float64)
    if num.shape != den.shape:
        raise ValueError(f"numerator has {num.shape} requests, denominator {den.shape}")
    keep = ~(np.isnan(num) | np.isnan(den))
    num, den = num[keep], den[keep]
    if not len(num) or den.sum() <= 0:
        return {"ratio": math.nan, "low": math.nan, "high": math.nan, "requests": int(len(num))}
    draws = np.random.default_rng(seed).integers(0, len(num), size=(resamples, len(num)))
    sampled = num[draws].sum(1) / np.maximum(den[draws].sum(1), 1e-300)
    tail = (1 - level) / 2 * 100
    return {"ratio": float(num.sum() / den.sum()), "low": float(np.percentile(sampled, tail)),
            "high": float(np.percentile(sampled, 100 - tail)), "requests": int(len(num))}


def engine_statistics(measured: Mapping[str, Mapping[str, Any]], *, seed: int) -> dict[str, dict[str, Any]]:
    """Each engine's ratios to SAME_INPUTS.

    measured: engine name -> {"kl": per-request mean KL from FLASHMLA_SPARSE, "layer0": per-request layer-0 relative
    L2 against FLASHMLA_SPARSE (absent where not recorded)}; SAME_INPUTS must be among them. Returns, for every other
    engine, {"kl_ratio": per request, "kl_interval": ratio_interval's, and "layer0_ratio" / "layer0_interval" where
    both engines recorded layer 0}.
    """
    if SAME_INPUTS not in measured:
        raise ValueError(f"measured must hold {SAME_INPUTS}, the denominator; it has {sorted(measured)}")
    den = measured[SAME_INPUTS]
    out: dict[str, dict[str, Any]] = {}
    for name, m in measured.items():
        if name == SAME_INPUTS:
            continue
        stats: dict[str, Any] = {"kl_ratio": ratios(m["kl"], den["kl"]),
                                 "kl_interval": ratio_interval(m["kl"], den["kl"], seed=seed)}
        if m.get("layer0") is not None and den.get("layer0") is not None:
            stats["layer0_ratio"] = ratios(m["layer0"], den["layer0"])
            stats["layer0_interval"] = ratio_interval(m["layer0"], den["layer0"], seed=seed)
        out[name] = stats
    return out


# ---------------------------------------------------------------------------------------------------- bounds


def round_up(value: float) -> float:
    """`value` rounded up to two significant digits (float32 sums' last bits never push it a whole step)."""
    if not value > 0 or math.isinf(value):
        raise ValueError(f"value must be positive and finite, got {value}")
    value = float(f"{value:.4g}")
    step = 10 ** (math.floor(math.log10(value)) - 1)
    return round(math.ceil(value / step) * step, 10)


def set_bounds(statistics: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """The bounds the null pairs of one seed give (engine_statistics' output): for each ratio, BOUND_FACTOR x its
    largest value over the NULL_PAIRS' requests, rounded up. No other engine is read."""
    missing = [name for name in NULL_PAIRS if name not in statistics]
    if missing:
        raise ValueError(f"statistics lack the null pairs {missing}: the bounds come from them alone")
    out = {}
    for key in ("kl", "layer0"):
        values = [v for name in NULL_PAIRS for v in statistics[name].get(f"{key}_ratio", []) if not math.isnan(v)]
        if values:
            out[key] = round_up(BOUND_FACTOR * max(values))
    if "kl" not in out:
        raise ValueError("the null pairs hold no KL ratio")
    return out


def _fraction(flags: Sequence[bool]) -> float:
    return sum(flags) / len(flags) if flags else 0.0


def judge_engine(stats: Mapping[str, Any], bounds: Mapping[str, float], *, fault: bool,
                 missing_steps: int = 0) -> dict[str, Any]:
    """One engine's requests at `bounds`. A correct engine (fault False) passes when at least PASS_FRACTION of its
    requests have every ratio within its bound and no step is missing; a fault is caught when at least PASS_FRACTION
    of its requests have a ratio past CAUGHT_MARGIN x its bound. `passes` is the verdict either way."""
    keys = [k for k in ("kl", "layer0") if k in bounds and f"{k}_ratio" in stats]
    if "kl" not in keys:
        raise ValueError(f"bounds {dict(bounds)} and stats {sorted(stats)} must both hold the KL ratio")
    per_request = list(zip(*(stats[f"{k}_ratio"] for k in keys)))
    within = [all(v <= bounds[k] for k, v in zip(keys, row)) for row in per_request]
    caught = [any(v > CAUGHT_MARGIN * bounds[k] for k, v in zip(keys, row)) for row in per_request]
    out = {"judged_on": keys, "bounds": {k: bounds[k] for k in keys}, "requests": len(per_request),
           "within_fraction": _fraction(within), "caught_fraction": _fraction(caught),
           "missing_steps": missing_steps, "fault": fault}
    if fault:
        out["passes"] = out["caught_fraction"] >= PASS_FRACTION
    else:
        out["passes"] = out["within_fraction"] >= PASS_FRACTION and missing_steps == 0
    return out


def verdicts(statistics: Mapping[str, Mapping[str, Any]], bounds: Mapping[str, float] | None,
             missing: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Every engine of one seed judged at `bounds` (None: unset, nothing judged): this backend and the null pairs as
    correct engines, the planted faults (FAULT_PREFIX) as faults. `ok` is whether all pass; `bounds_from_null_pairs`
    is what set_bounds would give on this seed, reported always."""
    proposed = set_bounds(statistics) if all(n in statistics for n in NULL_PAIRS) else None
    out: dict[str, Any] = {"bounds": None if bounds is None else dict(bounds), "bounds_from_null_pairs": proposed}
    if bounds is None:
        out.update(ok=None, judged="nothing: the bounds are not set (engine_check's docstring says how they are)")
        return out
    missing = missing or {}
    judged = {name: judge_engine(s, bounds, fault=name.startswith(FAULT_PREFIX), missing_steps=missing.get(name, 0))
              for name, s in statistics.items() if name != FLASHMLA}
    out["engines"] = judged
    out["ok"] = OURS in judged and all(v["passes"] for v in judged.values())
    return out


def validate(statistics: Mapping[str, Mapping[str, Any]], bounds: Mapping[str, float],
             faults: Sequence[str]) -> dict[str, Any]:
    """Whether `bounds` hold on another seed's statistics: every null pair passes as a correct engine and every
    fault in `faults` (names without FAULT_PREFIX) is caught. This backend is not read."""
    judged = {name: judge_engine(statistics[name], bounds, fault=False) for name in NULL_PAIRS if name in statistics}
    for fault in faults:
        name = FAULT_PREFIX + fault
        if name in statistics:
            judged[name] = judge_engine(statistics[name], bounds, fault=True)
    absent = [n for n in (*NULL_PAIRS, *(FAULT_PREFIX + f for f in faults)) if n not in judged]
    return {"bounds": dict(bounds), "engines": judged, "absent": absent,
            "valid": not absent and all(v["passes"] for v in judged.values())}


__all__ = ["BOUND_FACTOR", "CALIBRATION_REPORTS", "CALIBRATION_SEED", "CAUGHT_MARGIN", "FAULT_PREFIX",
           "KEYS_REVERSED", "KL_BOUND", "LAYER0_BOUND", "NULL_PAIRS", "PASS_FRACTION", "SAME_INPUTS",
           "VALIDATION_SEED", "engine_statistics", "judge_engine", "layer0_by_step", "layer0_errors", "module_bounds",
           "ratio_interval", "ratios", "request_means", "round_up", "set_bounds", "step_kl", "validate", "verdicts"]
