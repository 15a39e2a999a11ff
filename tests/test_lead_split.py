"""Uneven one-launch splits ("lead" plans, planning.choose_lead): the model, the binding, and every kernel's
split ranges against the float32 reference.

A lead plan splits each row of a one-launch plan into a first piece of `lead_tiles` tiles and num_splits - 1 even
pieces of the rest, on a split-major grid (every first piece dispatched before any later one). CPU: the makespan
model against a brute-force dispatch, the plan picks, TritonDecode's binding (kernels stubbed) and bad lead_tiles.
GPU (Hopper, Gluon): the seesaw, 64-head and few-heads kernels at leads
that cut rows at every place. Tolerance: test_triton_decode's check (the same arithmetic as even splits: a partial
per piece, merged by the combine).
"""

from __future__ import annotations

import dataclasses
import heapq
import random

import pytest
import torch

from conftest import GLUON_GPU
from test_triton_decode import DEVICE, _case, _check
from vllm_kimi_dsa.formats import LATENT_DIM
from vllm_kimi_dsa.kernels.base import DecodeSetup
from vllm_kimi_dsa.kernels.gluon_decode import gluon_sparse_mla_decode
from vllm_kimi_dsa.planning import gluon_config
from vllm_kimi_dsa.kernels.gluon_few_heads import reg_v_params
from vllm_kimi_dsa.backends.hopper import TritonDecode
from vllm_kimi_dsa.planning.cost import lead_makespan as _lead_makespan
from vllm_kimi_dsa.planning import choose_lead, choose_plan, plan_cost
from vllm_kimi_dsa import planning
from vllm_kimi_dsa.backends.hopper import dispatch as hopper_dispatch

SMS = 132  # the H200's


def _dispatch(busy: int, free: int, big: float, small: float, pieces: int) -> float:
    """Brute force of what _lead_makespan computes: list scheduling of the pieces onto the earliest-free slot."""
    slots = [big] * busy + [0.0] * free
    heapq.heapify(slots)
    end = big if busy else 0.0
    for _ in range(pieces):
        t = heapq.heappop(slots) + small
        end = max(end, t)
        heapq.heappush(slots, t)
    return end


def test_makespan_matches_list_scheduling() -> None:
    rnd = random.Random(5)
    for _ in range(2000):
        busy, free = rnd.randint(1, 200), rnd.randint(0, 200)
        big, small = rnd.uniform(1, 40), rnd.uniform(0.5, 30)
        pieces = rnd.randint(0, 1200)
        assert _lead_makespan(busy, free, big, small, pieces) == pytest.approx(
            _dispatch(busy, free, big, small, pieces), rel=1e-9), (busy, free, big, small, pieces)


def test_lead_plans_are_one_launch_partial_waves() -> None:
    """A lead plan only where the first pieces leave slots idle, only for lead_split configs, always a one-launch
    plan of >= 2 splits whose first piece is shorter than the row, and only cfg.lead_min_gain below every even plan."""
    for cfg, heads in ((gluon_config(), 128), (reg_v_params(2).config(16), 16)):
        even_cfg = dataclasses.replace(cfg, lead_split=False)
        tiles = 2048 // cfg.block_n
        seen = 0
        for rows in range(1, 400):
            lead = choose_lead(rows, heads, 2048, cfg, SMS)
            whole, splits = choose_plan(rows, heads, 2048, cfg, SMS)
            assert choose_lead(rows, heads, 2048, even_cfg, SMS) == 0
            if not lead:
                assert (whole, splits) == choose_plan(rows, heads, 2048, even_cfg, SMS)
                continue
            seen += 1
            assert whole == 0 and splits >= 2 and 0 < lead < tiles
            assert rows * -(-heads // cfg.block_h) < SMS * cfg.ctas_per_sm
            assert plan_cost(rows, heads, 2048, cfg, SMS) < (1 - cfg.lead_min_gain) * plan_cost(rows, heads, 2048,
                                                                                                 even_cfg, SMS)
        assert seen, "the model never takes a lead plan: the measured wins (NOTES v21) are not reproduced"


# One launch, µs on the H200 (results/h200-2026-12-04/lead-split, one run; NOTES v21): the shipped even plan and lead
# plans (splits, lead) around the balance point. The model's pick must be a lead plan here, and one near the best.
MEASURED_LEAD_US = {
    # (config, heads, rows): (even plan's µs, {(splits, lead): µs})
    ("seesaw", 128, 36): (63.8, {(2, 20): 66.7, (2, 22): 58.8, (2, 24): 61.5, (2, 26): 64.9}),
    ("seesaw", 128, 40): (64.6, {(2, 20): 67.1, (2, 22): 59.2, (2, 24): 61.8, (2, 26): 66.2}),
    ("seesaw", 128, 44): (66.3, {(2, 20): 68.5, (2, 22): 60.9, (2, 24): 62.2, (2, 26): 66.3}),
    # results/h200-2026-12-04/lead-split/bench_lead.json (benchmarks/bench_lead.py, the shipped lead_tiles argument)
    ("seesaw", 128, 46): (71.5, {(2, 24): 73.8, (2, 25): 67.5, (2, 26): 66.5, (2, 27): 67.9, (2, 28): 70.0,
                                 (2, 29): 72.1}),
    ("seesaw", 128, 48): (71.7, {(2, 24): 73.5, (2, 25): 68.1, (2, 26): 66.3, (2, 27): 68.1, (2, 28): 70.1,
                                 (2, 29): 71.7}),
    ("few2", 16, 160): (66.8, {(2, 20): 66.6, (2, 22): 62.8, (2, 24): 65.9, (2, 26): 69.3}),
    ("few2", 16, 180): (75.0, {(2, 20): 79.3, (2, 22): 77.0, (2, 24): 72.5, (2, 26): 71.6}),
}


@pytest.mark.parametrize("key", list(MEASURED_LEAD_US))
def test_picked_lead_is_near_the_measured_best(key) -> None:
    """The model's lead sits between the measured leads that bracket the best one (the cost is V-shaped in the
    lead: too short leaves the later pieces two rounds, too long holds the first)."""
    kind, heads, rows = key
    cfg = gluon_config() if kind == "seesaw" else reg_v_params(2).config(heads)
    even_us, times = MEASURED_LEAD_US[key]
    lead = choose_lead(rows, heads, 2048, cfg, SMS)
    splits = choose_plan(rows, heads, 2048, cfg, SMS)[1]
    assert lead and splits == 2
    best = min(times, key=times.get)
    leads = sorted(lead for _, lead in times)
    i = leads.index(best[1])
    assert leads[max(i - 1, 0)] <= lead <= leads[min(i + 1, len(leads) - 1)], (lead, best)
    assert times[best] < even_us


# The shipped kernel objects (TritonDecode, H200's 132 SMs) with and without lead plans in one run (bench_suite --even;
# results/h200-2026-12-04/lead-split/ab128, abfew, ab46), µs: (heads, rows): (with, without)
MEASURED_AB_US = {
    (128, 34): (59.1, 62.2), (128, 36): (59.6, 63.0), (128, 40): (59.9, 64.1), (128, 44): (59.9, 65.6),
    # lead-split/ab46 (after the 64-head configs' lead_min_gain went to 0: lead 27 at 46-48 rows)
    (128, 46): (67.9, 71.7), (128, 48): (68.4, 71.4), (64, 80): (61.8, 66.7),
    (16, 140): (61.1, 62.8), (16, 150): (62.4, 64.4), (16, 160): (64.0, 66.4), (16, 170): (65.8, 69.6),
    (16, 180): (71.1, 73.1), (16, 190): (72.5, 73.3), (12, 140): (60.2, 61.5), (12, 160): (62.7, 65.1),
    (12, 180): (69.9, 72.7), (32, 72): (55.5, 58.0), (32, 84): (57.4, 60.1), (32, 96): (63.6, 71.7),
}


@pytest.mark.parametrize("heads,rows", list(MEASURED_AB_US))
def test_measured_lead_plans_were_faster(heads: int, rows: int) -> None:
    """Each batch the model gives a lead plan (H = 128: the 64-head config; <= 32 heads: the two-CTA reg_v form,
    which plan_cost picks at these sizes) ran faster with it than planned evenly on the H200."""
    cfg = gluon_config() if heads > 32 else reg_v_params(2).config(heads)
    assert choose_lead(rows, heads, 2048, cfg, SMS)
    with_lead, even = MEASURED_AB_US[heads, rows]
    assert with_lead < even


@pytest.mark.parametrize("lead", [-1, 2.0, True, "3"])
def test_bad_lead_names_the_argument(lead) -> None:
    q, kv, slots, counts, ss, os_ = _case(2, 16, 128, "fp8", seed=3)
    out = torch.empty((2, 16, LATENT_DIM), dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="lead_tiles"):
        gluon_sparse_mla_decode(q, kv, slots, counts, softmax_scale=ss, output_scale=os_, out=out, splits=2,
                                lead_tiles=lead)


def test_kernel_class_binds_each_plans_lead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs on a CPU (the binding, kernels stubbed): TritonDecode at 128 and 16 heads, fp8, bound as on the H200's
    132 SMs, passes each one-launch plan's choose_lead to the kernel it binds, and 0 to every other launch."""
    from vllm_kimi_dsa.kernels import gluon_decode, gluon_few_heads, gluon_seesaw

    calls: list[tuple[str, int, int, int]] = []

    def stub(name):
        def launch(query, kv_rows, slots, counts, out, lse, ss, os_, ws, splits, params, lead_tiles=0):
            calls.append((name, query.shape[0], splits, lead_tiles))
        return launch

    monkeypatch.setenv("VLLM_KIMI_DSA_GLUON", "1")
    monkeypatch.setattr(hopper_dispatch, "gluon_available", lambda device=None: True)
    monkeypatch.setattr(hopper_dispatch, "num_sms", lambda device: SMS)
    for mod, name in ((gluon_decode, "gluon"), (gluon_seesaw, "seesaw"), (gluon_few_heads, "few")):
        monkeypatch.setattr(mod, "launch", stub(name))
    for heads, rows_list in ((128, (5, 40, 64, 80)), (16, (8, 160, 180, 200))):
        setup = DecodeSetup(device=DEVICE, fmt="fp8", heads=heads, row_counts=(256,), capacities=(), widths=(2048,),
                            return_lse=True, softmax_scale=0.04, output_scale=1.0)
        k = TritonDecode(setup)
        leads = {rows: k.plan_leads[rows, 2048] for rows in rows_list}
        assert all(lead for rows, lead in leads.items() if rows in (40, 160, 180)), leads
        assert not any(lead for rows, lead in leads.items() if rows in (5, 80, 8, 200)), leads
        for rows in rows_list:
            calls.clear()
            whole, splits = k._plans[rows, 2048]
            q = torch.zeros((rows, heads, 576), dtype=torch.float8_e4m3fn)
            k(q, torch.zeros((8, 576), dtype=torch.float8_e4m3fn), torch.zeros((rows, 2048), dtype=torch.int32),
              torch.zeros(rows, dtype=torch.int32), torch.empty((rows, heads, LATENT_DIM), dtype=torch.bfloat16),
              torch.empty((rows, heads)), block_size=64, rows_per_block_stride=1)
            assert [c[3] for c in calls] == ([leads[rows]] if not whole else [0, 0]), (rows, calls)
            if leads[rows]:
                assert calls[0][2] == splits >= 2


# --------------------------------------------------------------------------- GPU (Hopper, Gluon kernels)

# (kernel, rows, heads, width, splits, lead): 64-token tiles; leads from 1 tile to past the row, odd rows
GLUON_CASES = [
    ("seesaw", 7, 128, 2048, 2, 23),
    ("seesaw", 9, 96, 1024, 3, 5),
    ("seesaw", 5, 128, 2048, 2, 40),  # the lead is past every row: the second pieces are empty
    ("gluon", 7, 128, 2048, 2, 23),
    ("gluon", 6, 64, 512, 3, 1),
    ("few", 9, 16, 2048, 2, 22),
    ("few", 11, 12, 2048, 3, 26),
    ("few", 6, 32, 1024, 2, 9),
    ("few2", 13, 16, 2048, 2, 23),
    ("few2", 6, 32, 2048, 3, 20),
]


@GLUON_GPU
@pytest.mark.parametrize("kind,rows,heads,width,splits,lead", GLUON_CASES)
def test_gluon_kernels_lead_splits_match_reference(kind, rows, heads, width, splits, lead) -> None:
    from test_gluon_decode import _case as fp8_case
    from vllm_kimi_dsa.kernels import gluon_few_heads as fh
    from vllm_kimi_dsa.kernels.gluon_decode import gluon_sparse_mla_decode
    from vllm_kimi_dsa.kernels.gluon_seesaw import seesaw_sparse_mla_decode

    q, kv, slots, counts, ss, os_ = fp8_case(rows, heads, width, seed=rows * 13 + heads + lead)
    out = torch.full((rows, heads, LATENT_DIM), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((rows, heads), float("nan"), device="cuda")
    kw = dict(softmax_scale=ss, output_scale=os_, out=out, lse=lse, splits=splits, lead_tiles=lead)
    if kind == "seesaw":
        seesaw_sparse_mla_decode(q, kv, slots, counts, **kw)
    elif kind == "gluon":
        gluon_sparse_mla_decode(q, kv, slots, counts, **kw)
    else:
        fh.few_heads_sparse_mla_decode(q, kv, slots, counts, params=fh.reg_v_params(2 if kind == "few2" else 1), **kw)
    torch.cuda.synchronize()
    config = gluon_config() if kind in ("seesaw", "gluon") else planning.few_heads_config()
    _check(out, lse, q, kv, slots, counts, "fp8", ss, os_, config=config, wgmma=True)


@pytest.mark.parametrize("block_n", [32, 64])
def test_split_ranges_tile_each_row(block_n: int) -> None:
    """planning.split_range (the host twin of every kernel's split range): for even and lead plans the pieces of a
    row are disjoint, in order, whole tiles but the last, and cover exactly its count tokens (a piece past the row,
    or past a short row's lead, is empty)."""
    from vllm_kimi_dsa.planning import split_range

    for count in (0, 1, block_n - 1, block_n, 5 * block_n + 3, 32 * block_n):
        for splits in (1, 2, 3, 7):
            for lead in (0, 1, 3, 40) if splits > 1 else (0,):
                pieces = [split_range(count, s, splits, lead, block_n) for s in range(splits)]
                covered = [t for start, end in pieces for t in range(start, end)]
                assert covered == list(range(count)), (count, splits, lead, pieces)
                assert all(start % block_n == 0 for start, end in pieces if start < end)
                if lead and count:
                    assert pieces[0] == (0, min(lead * block_n, count))
