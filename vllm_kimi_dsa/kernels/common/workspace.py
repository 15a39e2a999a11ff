"""The split-KV scratch every decode kernel writes its partials (and a scheduled launch its tables) into, and the
per-call checks and slices of it.

PARTIAL_DTYPE, Workspace, make_workspace / shared_workspace (one per device and head count), check_inputs,
scratch, one_off_scratch, check_lead, num_sms, run_plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_kimi_dsa.formats import LATENT_DIM, CacheFormat, cache_dtype, normalize_format, row_bytes
from vllm_kimi_dsa.kernels.base import check_query
from vllm_kimi_dsa.kernels.common.schedule import table_ints
from vllm_kimi_dsa.planning import Config, choose_splits, default_config, plan_table, split_entries
from vllm_kimi_dsa.planning.schedule import ScheduleShape


def num_sms(device: torch.device) -> int:
    """SMs of a CUDA device; 4 for the interpreter (a few splits, so the combine path runs on a CPU too)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


# The split partials' dtype: fp16 halves what the splits write and the combine reads. A partial is a convex mix of
# the cache's values (|o| <= 6 x 448), inside fp16's range; its rounding, 2^-11 of the largest |v|, is below the bf16
# output's 2^-8.
PARTIAL_DTYPE = torch.float16


@dataclass
class Workspace:
    """Split-KV scratch: part_out (capacity*512,) fp32 or fp16 (make_workspace's partial_dtype), part_lse
    (capacity,) fp32, a dummy lse (rows*H,), and the scheduled launches' tables (sched, int32; common.schedule)."""

    part_out: torch.Tensor
    part_lse: torch.Tensor
    dummy_lse: torch.Tensor
    capacity: int  # rows * splits * heads entries the scratch holds
    max_rows: int
    heads: int
    sched: torch.Tensor | None = None  # int32 entries for the largest ScheduleShape's tables (None: none planned)


def make_workspace(
    device: torch.device | str,
    *,
    heads: int,
    max_rows: int,
    widths: tuple[int, ...] | list[int] = (2048,),
    fmt: CacheFormat = "fp8",
    config: Config | None = None,
    plans: dict[tuple[int, int], tuple[int, int]] | None = None,
    min_entries: int = 0,
    schedules: tuple[ScheduleShape, ...] | list[ScheduleShape] = (),
    min_sched_ints: int = 0,
) -> Workspace:
    """Scratch for every call with rows <= max_rows, these heads and any of `widths`; plans: plan_table's for
    them when the caller has it already (else made here); min_entries: at least this many partial entries (a larger
    shared scratch); schedules: the scheduled launches' shapes (their partial slots and tables; min_sched_ints: at
    least this many table entries). Partials are PARTIAL_DTYPE (the combine reads them in fp32). A normalized partial is a convex mix of the cache's values before the output scale (applied in the combine): |o|
    <= 448 for e4m3 rows, <= 6 x 448 for nvfp4_ds_mla, inside fp16's range, rounded to 2^-11 of the largest."""
    device = torch.device(device)
    if heads < 1:
        raise ValueError(f"heads must be >= 1, got {heads}")
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    if plans is None:
        cfg = config or default_config(heads, normalize_format(fmt))
        plans = plan_table(max_rows, heads, widths, cfg, num_sms(device))
    need = max(min_entries, split_entries(plans, heads), *(s.pieces * heads for s in schedules))
    ints = max([min_sched_ints] + [table_ints(s) for s in schedules])
    return Workspace(
        part_out=torch.empty(need * LATENT_DIM, dtype=PARTIAL_DTYPE, device=device),
        part_lse=torch.empty(need, dtype=torch.float32, device=device),
        dummy_lse=torch.empty(max_rows * heads, dtype=torch.float32, device=device),
        capacity=need,
        max_rows=max_rows,
        heads=heads,
        sched=torch.empty(ints, dtype=torch.int32, device=device) if ints else None,
    )


# (device, heads, partial dtype) -> the largest workspace made for it: every layer's kernel runs on one stream, one
# after another, so all of them share one scratch, as FlashInfer's plans share one workspace.
_SHARED_WORKSPACES: dict[tuple[str, int, torch.dtype], Workspace] = {}


def shared_workspace(
    device: torch.device | str,
    *,
    heads: int,
    max_rows: int,
    widths: tuple[int, ...] | list[int],
    fmt: CacheFormat,
    config: Config,
    plans: dict[tuple[int, int], tuple[int, int]],
    schedules: tuple[ScheduleShape, ...] | list[ScheduleShape] = (),
) -> Workspace:
    """make_workspace's scratch, shared by every caller of this device and head count that it is large enough for.

    A caller needing more gets a new, larger one, which later callers then share; callers already holding the
    smaller one keep it (it still fits them).
    """
    device = torch.device(device)
    key = (str(device), int(heads), PARTIAL_DTYPE)
    need = max([split_entries(plans, heads)] + [s.pieces * heads for s in schedules])
    ints = max([0] + [table_ints(s) for s in schedules])
    held = _SHARED_WORKSPACES.get(key)
    held_ints = 0 if held is None or held.sched is None else held.sched.numel()
    if held is not None and held.capacity >= need and held.max_rows >= max_rows and held_ints >= ints:
        return held
    made = make_workspace(device, heads=heads, max_rows=max(max_rows, held.max_rows if held else 0), widths=widths,
                          fmt=fmt, config=config, plans=plans, min_entries=max(need, held.capacity if held else 0),
                          schedules=schedules, min_sched_ints=max(ints, held_ints))
    _SHARED_WORKSPACES[key] = made
    return made


def check_inputs(query, kv_rows, slots, counts, fmt, out, lse) -> None:
    """Every argument of a one-off decode call against its contract (kernels/base.py DecodeKernel), naming the
    argument: the query (kernels.base.check_query), then the rest (check_operands)."""
    check_query(query)
    check_operands(query, kv_rows, slots, counts, fmt, out, lse)


def check_operands(query, kv_rows, slots, counts, fmt, out, lse) -> None:
    """Every argument but the query itself (checked once, by the core or check_inputs) against its contract, rows and
    heads read from the query's shape, naming the argument."""
    rows, heads = query.shape[0], query.shape[1]
    if kv_rows.dtype != cache_dtype(fmt):
        raise TypeError(f"kv_rows must be {cache_dtype(fmt)} for {fmt}, got {kv_rows.dtype}")
    if kv_rows.dim() != 2 or kv_rows.shape[1] != row_bytes(fmt) or kv_rows.stride(1) != 1:
        raise ValueError(f"kv_rows must be (num_rows, {row_bytes(fmt)}) with unit last stride, got {tuple(kv_rows.shape)}")
    if slots.dtype != torch.int32 or slots.dim() != 2 or slots.shape[0] != rows or slots.stride(1) != 1:
        raise ValueError(f"slots must be (rows={rows}, K) int32 with unit last stride, got {tuple(slots.shape)} {slots.dtype}")
    if counts.dtype != torch.int32 or counts.shape != (rows,) or not counts.is_contiguous():
        raise ValueError(f"counts must be contiguous ({rows},) int32, got {tuple(counts.shape)} {counts.dtype}")
    if out.dtype != torch.bfloat16 or out.shape != (rows, heads, LATENT_DIM) or out.stride(-1) != 1:
        raise ValueError(f"out must be ({rows}, {heads}, {LATENT_DIM}) bf16 with unit last stride, got {tuple(out.shape)} {out.dtype}")
    if lse is not None and (lse.dtype != torch.float32 or lse.shape != (rows, heads) or lse.stride(-1) != 1):
        raise ValueError(f"lse must be ({rows}, {heads}) float32 with unit last stride, got {tuple(lse.shape)} {lse.dtype}")


def scratch(ws: Workspace, rows: int, heads: int, splits: int, lse: torch.Tensor | None) -> tuple[int, torch.Tensor]:
    """(splits the workspace holds, the LSE buffer to write: `lse` or the workspace's dummy) for one call."""
    if rows > ws.max_rows or heads != ws.heads:
        raise ValueError(f"workspace was made for rows <= {ws.max_rows}, heads {ws.heads}; got rows {rows}, heads {heads}")
    if splits > 1 and rows * splits * heads > ws.capacity:
        splits = max(1, ws.capacity // (rows * heads))
    return splits, (lse if lse is not None else ws.dummy_lse[: rows * heads].view(rows, heads))


def scheduled_scratch(ws: Workspace, tabs: Any, heads: int, lse: torch.Tensor | None) -> torch.Tensor:
    """The LSE buffer a scheduled launch writes (`lse` or the workspace's dummy), once the workspace holds its
    shape's partial slots and tables (tabs: common.schedule.ScheduleTables, made from this workspace)."""
    shape = tabs.shape
    if heads != ws.heads or shape.rows > ws.max_rows or shape.pieces * heads > ws.capacity:
        raise ValueError(f"workspace (rows <= {ws.max_rows}, heads {ws.heads}, {ws.capacity} partial entries) does "
                         f"not hold a scheduled launch of {shape.rows} rows, {heads} heads, {shape.pieces} pieces")
    rows = shape.rows
    return lse if lse is not None else ws.dummy_lse[: rows * heads].view(rows, heads)


def one_off_scratch(query: torch.Tensor, slots: torch.Tensor, fmt: str, config: Config,
                    workspace: Workspace | None, splits: int | None) -> tuple[Workspace, int]:
    """The workspace and split count of a single call (tests, benchmarks): `splits` as given, else as choose_splits
    picks; with no workspace, one sized for exactly this call and split count (one launch, every row split alike).
    Not for the hot path (it allocates). A given workspace too small for `splits` lowers them (scratch)."""
    rows, heads, width = query.shape[0], query.shape[1], slots.shape[1]
    if splits is None:
        splits = choose_splits(rows, heads, width, config, num_sms(query.device))
    elif isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits must be an int >= 1 (or None: choose_splits), got {splits!r}")
    if workspace is None:
        workspace = make_workspace(query.device, heads=heads, max_rows=rows, widths=(width,), fmt=fmt,
                                   config=config, plans={(rows, width): (0, splits)})
    return workspace, splits


def check_lead(lead_tiles: int) -> int:
    """A one-off call's lead_tiles (choose_lead's form: 0 for even splits), checked."""
    if isinstance(lead_tiles, bool) or not isinstance(lead_tiles, int) or lead_tiles < 0:
        raise ValueError(f"lead_tiles must be an int >= 0 (0: even splits), got {lead_tiles!r}")
    return lead_tiles


def run_plan(launch: Any, plan: tuple[int, int], query, kv_rows, slots, counts, out, lse, *args: Any,
             split_launch: Any = None) -> None:
    """launch(query, kv_rows, slots, counts, out, lse, *args, splits) over a choose_plan plan: the whole rows unsplit,
    then the rest (row slices: views, nothing allocated) through split_launch (default: launch). A one-launch plan
    runs on launch."""
    whole, splits = plan
    if not whole:  # one launch over the batch (no slicing: the common plan, kept cheap on the host)
        launch(query, kv_rows, slots, counts, out, lse, *args, splits)
        return
    launch(query[:whole], kv_rows, slots[:whole], counts[:whole], out[:whole],
           None if lse is None else lse[:whole], *args, 1)
    if whole < query.shape[0]:  # choose_plan keeps whole < rows; a caller's plan may not
        (split_launch or launch)(query[whole:], kv_rows, slots[whole:], counts[whole:], out[whole:],
                                 None if lse is None else lse[whole:], *args, splits)
