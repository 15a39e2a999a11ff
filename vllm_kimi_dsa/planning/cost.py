"""The split-KV plan model: host integer math, no torch or Triton.

Config (a kernel's tile and occupancy as the model sees it), the split cost model, even / tail-split / lead plans,
plan tables, the partial entries a plan needs, and the split ranges the kernels compute (their host twin).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from vllm_kimi_dsa.host_math import cdiv


@dataclass(frozen=True)
class Config:
    """A kernel's tile and launch shape as the plan model and the plain kernel's launch see it (fixed: graph capture
    must not autotune)."""

    block_h: int  # heads a program (the MMA M dim; padded heads are masked)
    block_n: int  # KV rows a tile
    num_warps: int
    num_stages: int
    ctas_per_sm: int  # occupancy assumed by the split heuristic
    prefetch: bool = False  # gather the next tile into registers while this one computes
    lazy: bool = False  # rescale the accumulator only when the running max grows by > 2**8
    swap: bool = False  # transposed dots (tokens and dims as the MMA's M, heads as N): for few heads
    split_tiles: float = 0.0  # split heuristic: tiles' worth a CTA's partial costs (its write + the combine's read)
    # a tile's time at this config's occupancy, in tiles of the same kernel run one CTA an SM: what plan_cost weighs a
    # plan's model cost by to choose between one kernel's occupancies (configs.TWO_CTA_TILE_COST)
    tile_cost: float = 1.0
    # one-launch plans may split each row unevenly (choose_lead): the first piece of every row lead tiles, dispatched
    # first, the rest in smaller pieces on the SMs the first pieces leave idle (the Gluon kernels only)
    lead_split: bool = False
    # ... taken only when the model costs it this fraction below every even plan (the model overstates the gain at
    # few heads)
    lead_min_gain: float = 0.05


OVERHEAD = 1.5  # tiles' worth a CTA costs beyond its tiles: Q load, epilogue, the combine's extra pass
LAUNCH_GAP = 1.0  # tiles' worth a second launch costs: its start and the first launch's tail


def split_cost(rows: int, head_blocks: int, tiles: int, splits: int, cfg: Config, slots_per_wave: int) -> tuple[float, int]:
    """(cost in tiles' worth, splits that get work) of one launch over `rows` rows, each split `splits` ways."""
    per = cdiv(tiles, splits)
    used = cdiv(tiles, per)  # splits that get work
    waves = cdiv(rows * head_blocks * used, slots_per_wave)
    split = used > 1  # a split CTA also writes a partial the combine reads back
    return waves * (per + OVERHEAD + split * cfg.split_tiles) + split * 0.5, used


# Plans are pure functions of small integers and a frozen Config; every layer's kernel object asks for the same ones
# (and choose_plan asks best_splits again for each wave count), so they are worked out once a process.
@functools.lru_cache(maxsize=1 << 16)
def best_splits(rows: int, head_blocks: int, tiles: int, cfg: Config, slots_per_wave: int) -> tuple[int, float]:
    """(splits, cost) of the cheapest even split of every row, up to one tile a split (the combine takes any count:
    kernels.common.combine walks more than 64 splits in chunks)."""
    best, best_cost = 1, float("inf")
    for splits in range(1, tiles + 1):
        cost, used = split_cost(rows, head_blocks, tiles, splits, cfg, slots_per_wave)
        if cost < best_cost - 1e-9:
            best, best_cost = used, cost
    return best, best_cost


def lead_makespan(busy: int, free: int, big: float, small: float, pieces: int) -> float:
    """Greedy dispatch of a split-major grid: `busy` slots run a first piece of cost `big` from t = 0, `free` slots
    are idle; `pieces` later pieces of cost `small` each start on the earliest-free slot. Returns when the last piece
    (or first piece) ends. The pieces start in order of the times {k small (free times each), big + j small (busy
    times each)}: before `big` only the free slots' (`before` of them), after it each period of `small` holds the
    busy slots' start at big + j small, then the free slots' `phase` later."""
    if pieces == 0:
        return big
    rounds_before = math.ceil(big / small - 1e-9)  # the free slots' starts before big
    before = free * rounds_before
    if pieces <= before:
        last_start = (math.ceil(pieces / free) - 1) * small
    else:
        period, index = divmod(pieces - before - 1, busy + free)
        phase = rounds_before * small - big  # the free slots' start after big + j small, within [0, small)
        last_start = big + period * small + (phase if index >= busy else 0.0)
    return max(big, last_start + small)


@functools.lru_cache(maxsize=1 << 16)
def best_lead(rows: int, head_blocks: int, tiles: int, cfg: Config, slots_per_wave: int) -> tuple[int, int, float]:
    """(splits, lead, cost in tiles' worth) of the best uneven one-launch plan (lead 0: none). Only a batch whose
    first pieces leave slots idle (rows x head blocks < slots) gains: those slots take the rows' other pieces."""
    units = rows * head_blocks
    best = (1, 0, float("inf"))
    if not cfg.lead_split or units >= slots_per_wave or tiles < 2:
        return best
    piece_cost = OVERHEAD + cfg.split_tiles  # every piece of a split row writes a partial
    for splits in range(2, min(tiles, 8) + 1):
        for lead in range(1, tiles - splits + 2):
            rest = tiles - lead
            used = cdiv(rest, cdiv(rest, splits - 1))  # pieces after the first that get work
            per = cdiv(rest, used)  # as the kernels split the rest over used pieces
            cost = lead_makespan(units, slots_per_wave - units, lead + piece_cost, per + piece_cost,
                                  units * used) + 0.5
            if cost < best[2] - 1e-9:
                best = (used + 1, lead, cost)
    return best


def choose_splits(rows: int, heads: int, width: int, cfg: Config, sms: int) -> int:
    """KV splits per row: minimize (waves x tiles a split + fixed cost) over the chip's slots."""
    tiles = max(1, cdiv(width, cfg.block_n))
    return best_splits(rows, cdiv(heads, cfg.block_h), tiles, cfg, sms * cfg.ctas_per_sm)[0]


def choose_lead(rows: int, heads: int, width: int, cfg: Config, sms: int) -> int:
    """Tiles of each row's first piece in choose_plan's plan (0: its splits are even). Non-zero only for a one-launch
    plan of a cfg.lead_split config whose uneven form the model costs cfg.lead_min_gain below every even plan: e.g. H =
    128 at 40 rows, 64-token tiles of width 2048: 23 tiles, then 9 (80 first pieces on 132 SMs; the other 52 run the
    9-tile pieces in two rounds meanwhile) instead of every row split 3 ways (240 CTAs: two waves)."""
    return plan_and_cost(rows, heads, width, cfg, sms)[2]


def choose_plan(rows: int, heads: int, width: int, cfg: Config, sms: int) -> tuple[int, int]:
    """(whole_rows, splits): the first whole_rows rows run unsplit in one launch, the others split `splits` ways in
    a second (whole_rows 0: one launch, as choose_splits). whole_rows may fill k full waves of the chip, so that only the last partial wave's rows pay for split partials and the combine: at 80 rows of
    64-head tiles on 132 SMs, 66 whole rows then 14 rows split 4 ways (40 tiles on the critical path, partials for
    28 CTA pairs) instead of every row split twice (48 tiles, partials for all 160)."""
    return plan_and_cost(rows, heads, width, cfg, sms)[0]


def plan_cost(rows: int, heads: int, width: int, cfg: Config, sms: int) -> float:
    """choose_plan's model cost of its plan in tiles of the kernel run one CTA an SM (cfg.tile_cost a tile): comparable
    across occupancies of one kernel."""
    return plan_and_cost(rows, heads, width, cfg, sms)[1] * cfg.tile_cost


@functools.lru_cache(maxsize=1 << 16)
def plan_and_cost(rows: int, heads: int, width: int, cfg: Config, sms: int) -> tuple[tuple[int, int], float, int]:
    """(plan, its model cost, its lead): choose_plan's, plan_cost's (before tile_cost) and choose_lead's answers."""
    head_blocks = cdiv(heads, cfg.block_h)
    tiles = max(1, cdiv(width, cfg.block_n))
    slots_per_wave = sms * cfg.ctas_per_sm
    plan, cost = even_plan_and_cost(rows, head_blocks, tiles, cfg, slots_per_wave)
    lead_splits, lead, lead_cost = best_lead(rows, head_blocks, tiles, cfg, slots_per_wave)
    if lead and lead_cost < cost * (1 - cfg.lead_min_gain) - 1e-9:
        return (0, lead_splits), lead_cost, lead
    return plan, cost, 0


def even_plan_and_cost(rows: int, head_blocks: int, tiles: int, cfg: Config,
                        slots_per_wave: int) -> tuple[tuple[int, int], float]:
    splits, best_cost = best_splits(rows, head_blocks, tiles, cfg, slots_per_wave)
    best = (0, splits)
    for waves in range(1, rows * head_blocks // slots_per_wave + 1):
        whole = waves * slots_per_wave // head_blocks  # rows whose head blocks fill `waves` waves, unsplit
        if not 0 < whole < rows:
            continue
        whole_cost, _ = split_cost(whole, head_blocks, tiles, 1, cfg, slots_per_wave)
        tail_splits, tail_cost = best_splits(rows - whole, head_blocks, tiles, cfg, slots_per_wave)
        cost = whole_cost + tail_cost + LAUNCH_GAP
        if cost < best_cost - 1e-9:
            best, best_cost = (whole, tail_splits), cost
    return best, best_cost


def plan_table(max_rows: int, heads: int, widths, cfg: Config, sms: int) -> dict[tuple[int, int], tuple[int, int]]:
    """choose_plan for every (rows, width) with 1 <= rows <= max_rows: what a kernel object plans at construction."""
    return {(r, w): choose_plan(r, heads, w, cfg, sms) for r in range(1, max_rows + 1) for w in widths}


def split_entries(plans: dict[tuple[int, int], tuple[int, int]], heads: int) -> int:
    """Partial entries (row x split x head) the largest split launch of these plans writes (at least 1)."""
    return max([1] + [(r - whole) * s * heads for (r, _), (whole, s) in plans.items() if s > 1])


def split_range(count: int, split: int, num_splits: int, lead_tiles: int, block_n: int) -> tuple[int, int]:
    """[start, end) tokens of piece `split` of a row of `count` tokens, as every kernel computes it: num_splits even
    pieces of its tiles, or (lead_tiles > 0) a first piece of lead_tiles tiles and num_splits - 1 even pieces of
    the rest. A piece past the row is empty (start >= end)."""
    tiles = cdiv(count, block_n)
    if lead_tiles > 0:
        first = min(tiles, lead_tiles)
        per = cdiv(tiles - first, max(num_splits - 1, 1))
        t0, t1 = (0, first) if split == 0 else (first + (split - 1) * per, first + split * per)
    else:
        per = cdiv(tiles, num_splits)
        t0, t1 = split * per, split * per + per
    return t0 * block_n, min(t1 * block_n, count)
