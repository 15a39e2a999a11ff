"""The scheduled (count-following) split-KV division of one decode: its fixed shape and the host twin of the planner.

ScheduleShape (made at construction: grid, partial slots, cost constants), the candidates the planner weighs, its
cost estimate and `schedule`, the tables the device planner (kernels/common/schedule.py) writes from each call's counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_kimi_dsa.host_math import cdiv, next_pow2
from vllm_kimi_dsa.planning.cost import OVERHEAD, Config, plan_and_cost

# the plan model's costs in tenths of a tile, so that the device planner and this twin pick with the same integers
DECI = 10
COMBINE_DECI = 5  # the combine's launch, as the even plans' 0.5 tile (cost.split_cost)
SPLIT_WAVES = 2  # partial slots: this many waves of split pieces (each row's items of one head block a slot)
# candidate rows: U = 0 and the two whole-wave marks below the batch, then the lead row (U = 0, a first piece of
# `lead` tiles); a power of 2
U_CANDIDATES = 4


@dataclass(frozen=True)
class ScheduleShape:
    """What a scheduled launch fixes at construction for `rows` rows of `tiles` tiles at most.

    head_blocks x items CTAs (items = rows + pieces: every whole row one item, a split row n >= 2 of them, at most
    `pieces` split pieces in all); `pieces` partial slots (each of `heads` entries); split_rows: rows the combine
    visits at most; overhead / split: a CTA's fixed cost and a split piece's partial (write + combine read), in tenths
    of a tile; slots: CTAs a wave; wave_rows: rows whose head blocks fill one wave; static: the static plan for full
    rows (planning.cost.plan_and_cost) as a candidate (U, P, L), taken whenever every row is full; lead: its L (0:
    none), also the lead candidates' first piece."""

    rows: int
    tiles: int
    block_n: int
    head_blocks: int
    slots: int
    overhead: int
    split: int
    pieces: int
    static: tuple[int, int, int] = (0, 1, 0)

    @property
    def lead(self) -> int:
        return self.static[2]

    @property
    def items(self) -> int:
        return self.rows + self.pieces

    @property
    def split_rows(self) -> int:
        return min(self.rows, self.pieces // 2)

    @property
    def wave_rows(self) -> int:
        return max(1, self.slots // self.head_blocks)

    @property
    def sqrt_tiles(self) -> int:
        """P candidates: 1..this, then cdiv(tiles, 1..this) (every distinct cdiv(tiles, s) among them)."""
        return next_pow2(max(1, math.isqrt(self.tiles - 1) + 1))

    @property
    def bisect_steps(self) -> int:
        """Steps of the rank search over the longest piece's cost (0 .. tiles + split)."""
        return max(1, (self.tiles * DECI + self.split + 1).bit_length())


def schedule_shape(rows: int, width: int, heads: int, cfg: Config, sms: int) -> ScheduleShape:
    """The ScheduleShape of a kernel config (its tile, head block, occupancy and split cost) at (rows, width)."""
    if rows < 1 or width < 1:
        raise ValueError(f"rows and width must be >= 1, got {rows}, {width}")
    head_blocks = cdiv(heads, cfg.block_h)
    slots = sms * cfg.ctas_per_sm
    tiles = cdiv(width, cfg.block_n)
    (whole, splits), _, lead = plan_and_cost(rows, heads, width, cfg, sms)
    if lead:  # a first piece of `lead` tiles, then splits - 1 even pieces
        static = (0, cdiv(tiles - lead, max(splits - 1, 1)), lead)
    else:  # the first `whole` rows whole, the others `splits` even pieces
        static = (whole, cdiv(tiles, splits), 0)
    static_pieces = (rows - whole) * splits if splits > 1 else 0
    return ScheduleShape(rows=rows, tiles=tiles, block_n=cfg.block_n, head_blocks=head_blocks, slots=slots,
                         overhead=round(OVERHEAD * DECI), split=round(cfg.split_tiles * DECI),
                         pieces=max(SPLIT_WAVES * cdiv(slots, head_blocks), static_pieces), static=static)


def candidates(shape: ScheduleShape) -> list[tuple[int, int, int]]:
    """(U, P, L) in the planner's order: the U longest rows whole, and the others past their threshold (L if L else
    P tiles) split -- a first piece of L tiles (L > 0), then pieces of at most P tiles. Rows U: 0 and the two
    whole-wave marks below the batch (a mark outside 0 < U < rows is 0), with L = 0, P in 1..sqrt_tiles then
    cdiv(tiles, 1..sqrt_tiles); then U = 0 with L = shape.lead, P = cdiv(tiles - L, 1..2 sqrt_tiles) (the static lead
    plan's pieces among them)."""
    w = shape.wave_rows
    full = shape.rows // w
    rows_ul = [(0, 0)] + [(k * w if 0 < k * w < shape.rows else 0, 0) for k in (full - 1, full)] + [(0, shape.lead)]
    sq = shape.sqrt_tiles
    ps = [j + 1 for j in range(sq)] + [cdiv(shape.tiles, j + 1) for j in range(sq)]
    lead_ps = [cdiv(max(shape.tiles - shape.lead, 1), j + 1) for j in range(2 * sq)]
    return [(u, p, lead) for k, (u, lead) in enumerate(rows_ul) for p in (lead_ps if k == 3 else ps)]


def row_tiles(counts: list[int], width: int, block_n: int) -> list[int]:
    """Each row's tiles: its count clamped to [0, width], in tiles."""
    return [cdiv(min(max(int(c), 0), width), block_n) for c in counts]


def pieces_of(t: int, top: bool, p: int, lead: int) -> list[int]:
    """The tiles of each piece of a row of t tiles (the last of the pieces after the first may be shorter than
    listed: the cost model takes them all at `per`): whole (one piece) when it is among the U longest (`top`) or at
    most its threshold (lead if lead else p), else [lead] (if lead) and n pieces of per = cdiv(rest, n), n = cdiv(rest,
    p), rest = t - lead."""
    if top or t <= (lead if lead else p):
        return [t]
    rest = t - lead
    n = cdiv(rest, p)
    return ([lead] if lead else []) + [cdiv(rest, n)] * n


def estimate(shape: ScheduleShape, tiles: list[int], u: int, p: int, lead: int = 0) -> tuple[int, int] | None:
    """(cost x slots in tenths of a tile, split pieces) of candidate (u, p, lead) on rows of `tiles`, None when its
    pieces outgrow the partial slots. The cost: every CTA (each row's pieces, head_blocks each) costs overhead + its
    tiles (+ split if its row is split); taken longest first, the waves before the last cost their mean and the last
    its longest CTA: max(longest, (sum of all but the last wave's + longest of the last x its slots left) / slots)."""
    order = sorted(range(len(tiles)), key=lambda r: (-tiles[r], r))
    hb, s = shape.head_blocks, shape.slots
    costs: list[tuple[int, int]] = []  # (cost of one CTA, CTAs)
    pieces = 0
    for rank, r in enumerate(order):
        parts = pieces_of(tiles[r], rank < u, p, lead)
        split = len(parts) > 1
        pieces += len(parts) if split else 0
        costs += [(t * DECI + (shape.split if split else 0), hb) for t in parts]
    if pieces > shape.pieces:
        return None
    units = sum(c for _, c in costs)
    work = sum((shape.overhead + lam) * c for lam, c in costs)
    waves = cdiv(units, s)
    before = (waves - 1) * s  # CTAs before the last wave
    lam_x, seen = 0, 0  # the cost of the CTA at rank `before`, longest first
    for lam, c in sorted(costs, reverse=True):
        seen += c
        if seen > before:
            lam_x = lam
            break
    longest = shape.overhead + max(lam for lam, _ in costs)
    cost = max(longest * s, work + (shape.overhead + lam_x) * (s - (units - before)))
    return cost + (COMBINE_DECI * s if pieces else 0), pieces


@dataclass(frozen=True)
class Schedule:
    """One call's division: items[i] = (row, start, end, partial slot or -1) for every CTA item (row -1: idle),
    splits[j] = (row, first partial slot, pieces) of each split row, the (U, P, L) picked and its estimate."""

    items: list[tuple[int, int, int, int]]
    splits: list[tuple[int, int, int]]
    choice: tuple[int, int, int]
    cost: int


def pick(shape: ScheduleShape, tiles: list[int]) -> tuple[tuple[int, int, int], int]:
    """((U, P, L), cost) of the cheapest candidate (ties: fewer split pieces, then the earlier candidate); when every
    row is full, the static plan (shape.static: what the static path runs, in one launch)."""
    if tiles and all(t == shape.tiles for t in tiles):
        est = estimate(shape, tiles, *shape.static)
        return shape.static, est[0] if est else 0
    best = None
    for i, cand in enumerate(candidates(shape)):
        est = estimate(shape, tiles, *cand)
        if est is not None and (best is None or (est[0], est[1], i) < best[0]):
            best = ((est[0], est[1], i), cand)
    if best is None:  # U = 0, P = tiles (every row whole) always fits: pieces 0
        raise AssertionError("no feasible candidate")
    return best[1], best[0][0]


def emit(shape: ScheduleShape, counts: list[int], cand: tuple[int, int, int]) -> tuple[list, list]:
    """(items, splits) of candidate (U, P, L) on counts already clamped to the width. Rows longest first (ties by
    index) fall in three runs: the U longest (whole), the split rows, the short whole rows; the items go, in dispatch
    order (about longest first): the U longest rows and the split rows' first pieces (L > 0), the split rows' other
    pieces (each row's together), the short rows. A piece covers its tiles clamped to the row's count; a split row's
    partial slots are consecutive, rows in that order."""
    u, p, lead = cand
    tiles = [cdiv(c, shape.block_n) for c in counts]
    order = sorted(range(len(counts)), key=lambda r: (-tiles[r], r))
    groups: tuple[list, list, list] = ([], [], [])
    splits: list[tuple[int, int, int]] = []
    slot = 0
    bn = shape.block_n
    for rank, r in enumerate(order):
        parts = pieces_of(tiles[r], rank < u, p, lead)
        if len(parts) == 1:
            groups[0 if rank < u else 2].append((r, 0, counts[r], -1))
            continue
        splits.append((r, slot, len(parts)))
        start = 0
        for k, t in enumerate(parts):
            groups[0 if lead and k == 0 else 1].append((r, start * bn, min((start + t) * bn, counts[r]), slot + k))
            start += t
        slot += len(parts)
    items = groups[0] + groups[1] + groups[2]
    return items + [(-1, 0, 0, -1)] * (shape.items - len(items)), splits


def schedule(shape: ScheduleShape, counts: list[int], width: int) -> Schedule:
    """The tables the device planner writes for these counts: the cheapest candidate (pick), emitted (emit)."""
    if len(counts) != shape.rows:
        raise ValueError(f"counts must have {shape.rows} entries, got {len(counts)}")
    clamped = [min(max(int(c), 0), width) for c in counts]
    choice, cost = pick(shape, row_tiles(clamped, width, shape.block_n))
    items, splits = emit(shape, clamped, choice)
    return Schedule(items=items, splits=splits, choice=choice, cost=cost)


__all__ = ["COMBINE_DECI", "DECI", "SPLIT_WAVES", "Schedule", "ScheduleShape", "U_CANDIDATES", "candidates",
           "emit", "estimate", "pick", "pieces_of", "row_tiles", "schedule", "schedule_shape"]
