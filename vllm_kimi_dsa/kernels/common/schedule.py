"""The device planner of scheduled launches: one small Triton kernel that divides a call's tiles among CTA items.

schedule_kernel reads the rows' counts and writes the item table the decode kernels read (grid head blocks x items),
the split-row table the combine reads, and what it picked; planning.schedule is its host twin (same integers).
ScheduleTables: the views of one int32 scratch a ScheduleShape's call uses; plan_schedule launches the planner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_kimi_dsa.host_math import next_pow2
from vllm_kimi_dsa.planning.schedule import COMBINE_DECI, DECI, U_CANDIDATES, ScheduleShape

ITEM_FIELDS = 4  # an item: row (-1 idle), first token, end token, partial slot (-1: the row is whole: out directly)
SPLIT_FIELDS = 4  # a split row: row, first partial slot, pieces, (unused)
META_FIELDS = 5  # items used, split rows, the U, P and L picked
COMBINE_PROGRAM_ROWS = 32  # the scheduled combine's programs a head: each walks split rows j, j + this, ...
_NO_COST = 2**31 - 1


@triton.jit
def schedule_kernel(
    counts_ptr, items_ptr, splits_ptr, meta_ptr,
    rows, width, tiles, head_blocks, slots, overhead, split, pieces_cap, items_cap, wave_rows, lead, static_u,
    static_p,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, SQ: tl.constexpr, NU: tl.constexpr,
    STEPS: tl.constexpr, BLOCK_G: tl.constexpr, DECI_C: tl.constexpr, COMBINE_C: tl.constexpr,
):
    """planning.schedule on the device, one program: the rows' tiles, their histogram, every candidate (U, P, L)'s
    estimate from the histogram (the rank search bisects the cost levels), the cheapest picked; then the rows sorted
    longest first and their items (first items, then the other pieces), partial slots and split rows written."""
    r = tl.arange(0, BLOCK_R)
    live = r < rows
    cnt = tl.load(counts_ptr + r, mask=live, other=0)
    cnt = tl.minimum(tl.maximum(cnt, 0), width)
    t = (cnt + BLOCK_N - 1) // BLOCK_N

    # histogram of the rows' tiles: h[j] rows of j + 1 tiles; h0 rows of none
    tv = tl.arange(0, BLOCK_T) + 1
    h = tl.sum(((t[:, None] == tv[None, :]) & live[:, None]).to(tl.int32), axis=0)
    h0 = tl.sum((live & (t == 0)).to(tl.int32), axis=0)
    above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0)  # rows of more tiles than tv

    # candidates: c = iu * 2 SQ + ip; row iu = 3 the lead candidates (U = 0, a first piece of `lead` tiles)
    c = tl.arange(0, NU * 2 * SQ)
    iu = c // (2 * SQ)
    ip = c % (2 * SQ)
    full = rows // wave_rows
    u = tl.where(iu == 1, (full - 1) * wave_rows, tl.where(iu == 2, full * wave_rows, 0))
    u = tl.where((u > 0) & (u < rows), u, 0)
    lc = tl.where(iu == 3, lead, 0)
    div = tl.maximum(ip - SQ + 1, 1)
    p = tl.where(ip < SQ, ip + 1, (tiles + div - 1) // div)
    p = tl.where(iu == 3, (tl.maximum(tiles - lead, 1) + ip) // (ip + 1), p)  # the lead row: cdiv(rest, 1 .. 2 SQ)
    T2 = tv[None, :]
    P2 = p[:, None]
    L2 = lc[:, None]
    H2 = h[None, :]
    thr = tl.where(L2 > 0, L2, P2)
    whole = tl.where(T2 <= thr, H2, tl.minimum(tl.maximum(u[:, None] - above[None, :], 0), H2))
    sp = H2 - whole
    rest = tl.maximum(T2 - L2, 1)
    n = (rest + P2 - 1) // P2
    per = (rest + n - 1) // n
    has_f = (L2 > 0).to(tl.int32)
    lam_w = T2 * DECI_C
    lam_s = per * DECI_C + split
    lam_f = L2 * DECI_C + split
    spn = sp * n
    spf = sp * has_f
    units = head_blocks * (h0 + tl.sum(whole + spn + spf, axis=1))
    work = head_blocks * (h0 * overhead + tl.sum(whole * (overhead + lam_w) + spn * (overhead + lam_s)
                                                 + spf * (overhead + lam_f), axis=1))
    pieces = tl.sum(spn + spf, axis=1)
    longest = overhead + tl.maximum(tl.maximum(tl.max(tl.where(whole > 0, lam_w, 0), axis=1),
                                               tl.max(tl.where(sp > 0, lam_s, 0), axis=1)),
                                    tl.max(tl.where(spf > 0, lam_f, 0), axis=1))
    waves = (units + slots - 1) // slots
    before = (waves - 1) * slots
    lo = tl.zeros_like(c)
    hi = tl.zeros_like(c) + (tiles * DECI_C + split + 1)
    for _ in tl.static_range(STEPS):  # the largest cost level with more CTAs at or above it than `before`
        mid = (lo + hi) // 2
        ge = head_blocks * (h0 * (mid <= 0).to(tl.int32)
                            + tl.sum(whole * (lam_w >= mid[:, None]).to(tl.int32)
                                     + spn * (lam_s >= mid[:, None]).to(tl.int32)
                                     + spf * (lam_f >= mid[:, None]).to(tl.int32), axis=1))
        ok = ge > before
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    cost = tl.maximum(longest * slots, work + (overhead + lo) * (slots - (units - before)))
    cost = cost + tl.where(pieces > 0, COMBINE_C * slots, 0)
    cost = tl.where(pieces <= pieces_cap, cost, 2147483647)
    best = tl.min(cost, axis=0)
    m1 = cost == best
    fewest = tl.min(tl.where(m1, pieces, 2147483647), axis=0)
    ci = tl.min(tl.where(m1 & (pieces == fewest), c, 2147483647), axis=0)
    U = tl.sum(tl.where(c == ci, u, 0), axis=0)
    P = tl.sum(tl.where(c == ci, p, 0), axis=0)
    L = tl.sum(tl.where(c == ci, lc, 0), axis=0)
    all_full = tl.sum((live & (t == tiles)).to(tl.int32), axis=0) == rows  # the static plan, as the static path
    U = tl.where(all_full, static_u, U)
    P = tl.where(all_full, static_p, P)
    L = tl.where(all_full, lead, L)

    # the rows longest first (ties: lower row first): the U longest (whole), the split rows, the short whole rows;
    # items: the U longest and the split rows' first pieces (L > 0) at their sorted index, the split rows' other
    # pieces, the short rows (planning.schedule.emit)
    key = tl.where(live, t * 65536 + (65535 - r), -1)
    sk = tl.sort(key, descending=True)
    slive = sk >= 0
    sr = tl.where(slive, 65535 - (sk & 65535), 0)
    st = tl.where(slive, sk >> 16, 0)
    scnt = tl.minimum(tl.maximum(tl.load(counts_ptr + sr, mask=slive, other=0), 0), width)
    is_split = slive & (r >= U) & (st > tl.where(L > 0, L, P))
    rest_r = tl.maximum(st - L, 1)
    n_rest = (rest_r + P - 1) // P
    per_r = (rest_r + n_rest - 1) // n_rest
    hf = (L > 0).to(tl.int32)
    nr = tl.where(is_split, n_rest + hf, tl.where(slive, 1, 0))
    g2 = tl.where(is_split, nr - hf, 0)  # a split row's pieces in the second run
    off2 = tl.cumsum(g2, axis=0) - g2
    sn = tl.where(is_split, nr, 0)
    pbase = tl.cumsum(sn, axis=0) - sn
    si = is_split.to(tl.int32)
    sidx = tl.cumsum(si, axis=0) - si
    n_items = tl.sum(nr, axis=0)
    n_split = tl.sum(si, axis=0)
    base2 = U + n_split * hf
    base3 = base2 + tl.sum(g2, axis=0)
    maxn = tl.max(nr, axis=0)
    for k in range(0, maxn):
        m = slive & (k < nr)
        idx = tl.where(is_split, tl.where(k < hf, r, base2 + off2 + k - hf), tl.where(r < U, r, base3 + r - U - n_split))
        at = items_ptr + idx * 4
        # piece k: the first (L tiles) when L > 0, else pieces of per_r tiles after it
        j = k - hf
        s_t = tl.where(j < 0, 0, hf * L + j * per_r)
        e_t = tl.where(j < 0, L, hf * L + (j + 1) * per_r)
        s0 = tl.where(is_split, s_t * BLOCK_N, 0)
        e0 = tl.where(is_split, tl.minimum(e_t * BLOCK_N, scnt), scnt)
        tl.store(at, sr, mask=m)
        tl.store(at + 1, s0, mask=m)
        tl.store(at + 2, e0, mask=m)
        tl.store(at + 3, tl.where(is_split, pbase + k, -1), mask=m)
    sm = slive & is_split
    tl.store(splits_ptr + sidx * 4, sr, mask=sm)
    tl.store(splits_ptr + sidx * 4 + 1, pbase, mask=sm)
    tl.store(splits_ptr + sidx * 4 + 2, nr, mask=sm)
    for g0 in range(0, items_cap, BLOCK_G):  # the items past this call's: idle
        g = g0 + tl.arange(0, BLOCK_G)
        tl.store(items_ptr + g * 4, tl.zeros_like(g) - 1, mask=(g >= n_items) & (g < items_cap))
    mo = tl.arange(0, 4)
    tl.store(meta_ptr + mo, tl.where(mo == 0, n_items, tl.where(mo == 1, n_split, tl.where(mo == 2, U, P))))
    tl.store(meta_ptr + 4, L)


@dataclass(frozen=True)
class ScheduleTables:
    """One ScheduleShape's views of a workspace's int32 schedule scratch: items (items, 4), splits (split_rows, 4),
    meta (5,) = (items used, split rows, U, P, L)."""

    shape: ScheduleShape
    items: torch.Tensor
    splits: torch.Tensor
    meta: torch.Tensor


def table_ints(shape: ScheduleShape) -> int:
    """int32 entries of a shape's tables in the scratch."""
    return shape.items * ITEM_FIELDS + max(shape.split_rows, 1) * SPLIT_FIELDS + META_FIELDS


def tables(scratch: torch.Tensor, shape: ScheduleShape) -> ScheduleTables:
    """A shape's tables as views of `scratch` (int32, at least table_ints(shape) entries): made once, at binding."""
    if scratch.dtype != torch.int32 or scratch.numel() < table_ints(shape):
        raise ValueError(f"the schedule scratch must be int32 of >= {table_ints(shape)} entries, got "
                         f"{scratch.numel()} {scratch.dtype}")
    ni = shape.items * ITEM_FIELDS
    ns = max(shape.split_rows, 1) * SPLIT_FIELDS
    return ScheduleTables(shape=shape, items=scratch[:ni].view(shape.items, ITEM_FIELDS),
                          splits=scratch[ni:ni + ns].view(-1, SPLIT_FIELDS), meta=scratch[ni + ns:ni + ns + META_FIELDS])


def plan_schedule(counts: torch.Tensor, width: int, tabs: ScheduleTables) -> None:
    """Launch the planner for one call: counts (rows,) int32 on the tables' device; no allocation, no sync."""
    s = tabs.shape
    schedule_kernel[(1,)](
        counts, tabs.items, tabs.splits, tabs.meta,
        s.rows, width, s.tiles, s.head_blocks, s.slots, s.overhead, s.split, s.pieces, s.items, s.wave_rows, s.lead,
        s.static[0], s.static[1],
        BLOCK_N=s.block_n, BLOCK_R=next_pow2(max(s.rows, 2)), BLOCK_T=next_pow2(max(s.tiles, 2)), SQ=s.sqrt_tiles,
        NU=U_CANDIDATES, STEPS=s.bisect_steps, BLOCK_G=min(1024, next_pow2(max(s.items, 2))), DECI_C=DECI,
        COMBINE_C=COMBINE_DECI, num_warps=8 if s.rows > 64 else 4,
    )


__all__ = ["COMBINE_PROGRAM_ROWS", "ITEM_FIELDS", "META_FIELDS", "SPLIT_FIELDS", "ScheduleTables", "plan_schedule",
           "schedule_kernel", "table_ints", "tables"]
