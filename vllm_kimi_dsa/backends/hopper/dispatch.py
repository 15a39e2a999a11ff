"""TritonDecode, the core's "triton" DecodeKernel: the plain kernel everywhere, the Gluon kernels on Hopper.

At construction it picks the kernels (variants.gluon_choice), plans every (rows, width) -- static plans, or
(VLLM_KIMI_DSA_SCHEDULE=counts) the fixed shape of a scheduled launch whose planner divides each call's tiles from its
counts on the device -- binds each plan's launches and sizes the shared workspace; a call checks its inputs and runs
the bound launch.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vllm_kimi_dsa import envs
from vllm_kimi_dsa.backends.hopper.variants import GluonChoice, gluon_choice, seesaw_takes
from vllm_kimi_dsa.formats import normalize_format
from vllm_kimi_dsa.heads import FEW_HEADS_MAX, heads_refusal
from vllm_kimi_dsa.kernels import triton_decode
from vllm_kimi_dsa.kernels.base import DecodeSetup
from vllm_kimi_dsa.kernels.common import check_operands, num_sms, run_plan, shared_workspace
from vllm_kimi_dsa.kernels.common.gluon import gluon_available
from vllm_kimi_dsa.kernels.common.schedule import tables
from vllm_kimi_dsa.logs import init_logger
from vllm_kimi_dsa.planning import choose_lead, choose_plan, default_config, plan_cost, plan_table
from vllm_kimi_dsa.planning.schedule import ScheduleShape, schedule_shape
from vllm_kimi_dsa.widths import check_width

logger = init_logger(__name__)

# (params, the kernel module's launch): params None is the plain kernel
Kernel = tuple[Any, Any]


class TritonDecode:
    """DecodeKernel "triton": kernels by (heads, fmt), plans by (rows, K), launches bound and scratch made here.

    config: the plan Config of the batch's plans; gluon: the Gluon params bound (None: the plain kernel);
    gluon_large: the per-plan alternatives (few heads fp8: reg_v at one and two CTAs an SM; nvfp4 17..32 heads and
    > 32 heads fp8: the seesaw kernel); plan_params[rows, width]: (the first launch's params, the split rows'
    launch's); plan_leads[rows, width]: the one-launch plan's lead (choose_lead), 0 if none. scheduled
    (VLLM_KIMI_DSA_SCHEDULE=counts): every call one scheduled launch; schedules[rows, width]: its ScheduleShape (the
    static plans are still made: their kernel choices pick the scheduled launch's).
    """

    name: ClassVar[str] = "triton"

    def __init__(self, setup: DecodeSetup) -> None:
        self.setup = setup
        self.fmt = normalize_format(setup.fmt)
        _check_setup(setup)
        choice = _available_choice(self.fmt, setup)
        self.gluon: Any = choice.params if choice else None
        self.gluon_large: tuple[Any, ...] = choice.large if choice else ()
        self.config = choice.config if choice else default_config(setup.heads, self.fmt)
        sms = num_sms(torch.device(setup.device))
        self._plans = plan_table(setup.max_rows, setup.heads, setup.widths, self.config, sms)
        self._launches: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.plan_params: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.plan_leads: dict[tuple[int, int], int] = {}
        self.scheduled = envs.schedule() == "counts"
        self.schedules: dict[tuple[int, int], ScheduleShape] = {}
        self._bind(choice, sms)
        kernels = self._bind_scheduled(choice, sms) if self.scheduled else {}
        self.workspace = shared_workspace(setup.device, heads=setup.heads, max_rows=setup.max_rows,
                                          widths=setup.widths, fmt=self.fmt, config=self.config, plans=self._plans,
                                          schedules=tuple(self.schedules.values()))
        self._scheduled_launches = {key: self._scheduled_call(kernel, self.schedules[key])
                                    for key, kernel in kernels.items()}

    def _bind(self, choice: GluonChoice | None, sms: int) -> None:
        """Each plan's launches, bound once (the call path does not branch on them): few heads fp8, the occupancy the
        model costs least, for both launches (its plan re-made for it); nvfp4 17..32 heads, the seesaw kernel's nvfp4
        form for both launches of plans of large_from_rows rows or more (re-made the same way); > 32 heads, the seesaw
        kernel for the launches seesaw_takes, gluon_decode's for a split tail after whole rows; a one-launch plan's
        lead bound into its launch."""
        heads = self.setup.heads
        small: Kernel = (self.gluon, choice.launch if choice else None)
        large: list[Kernel] = [(p, choice.large_launch) for p in self.gluon_large]
        large_configs = [p.config(heads) for p in self.gluon_large]
        seesaw = large[0] if choice is not None and choice.seesaw and large else None
        bound: dict[tuple[int, Any, int], Any] = {}  # one launch callable per (params, module launch, lead)
        for (rows, width), (whole, splits) in self._plans.items():
            first = tail = small
            plan_config = self.config
            pick = None  # the `large` alternative running both launches of this plan, its plan re-made for it
            if choice is not None and choice.large_from_rows:
                pick = 0 if rows >= choice.large_from_rows else None
            elif seesaw is None and large:
                costs = [plan_cost(rows, heads, width, c, sms) for c in large_configs]
                pick = costs.index(min(costs))
            if pick is not None:
                plan_config = large_configs[pick]
                self._plans[rows, width] = choose_plan(rows, heads, width, plan_config, sms)
                first = tail = large[pick]
            elif seesaw is not None:
                first = seesaw if seesaw_takes(width, 1 if whole else splits, alone=not whole) else small
                tail = seesaw if seesaw_takes(width, splits) else small
                if not whole:  # no second launch: bound as the first, for the record (plan_params)
                    tail = first
            lead = choose_lead(rows, heads, width, plan_config, sms) if self.gluon is not None else 0
            self._launches[rows, width] = (self._bound(bound, first, lead), self._bound(bound, tail, 0))
            self.plan_params[rows, width] = (first[0], tail[0])
            self.plan_leads[rows, width] = lead

    def _bind_scheduled(self, choice: GluonChoice | None, sms: int) -> dict[tuple[int, int], Kernel]:
        """Each (rows, width)'s scheduled launch: the kernel (> 32 heads fp8: the seesaw kernel, or the P.V-on-e4m3
        form when asked for; otherwise the static plan's first launch's: the few-heads occupancy the model costs
        least for full rows) and its ScheduleShape (that kernel's Config). plan_params records it for both launches."""
        heads = self.setup.heads
        seesaw = choice.large[0] if choice is not None and choice.seesaw and choice.large else None
        kernels: dict[tuple[int, int], Kernel] = {}
        for rows, width in self._plans:
            first, _ = self.plan_params[rows, width]
            params = seesaw if seesaw is not None else first
            if params is None or choice is None:
                kernels[rows, width], cfg = (None, None), self.config
            else:
                module = choice.launch if params is choice.params else choice.large_launch
                kernels[rows, width], cfg = (params, module), params.config(heads)
            self.schedules[rows, width] = schedule_shape(rows, width, heads, cfg, sms)
            self.plan_params[rows, width] = (params, params)
            self.plan_leads[rows, width] = 0
        return kernels

    def _scheduled_call(self, kernel: Kernel, shape: ScheduleShape) -> Any:
        """The scheduled launch of one (rows, width): its tables made once, as views of the workspace's scratch."""
        tabs = tables(self.workspace.sched, shape)
        params, module_launch = kernel
        setup, ws = self.setup, self.workspace
        if params is None:
            fmt, cfg = self.fmt, self.config

            def launch(query, kv_rows, slots, counts, out, lse) -> None:
                triton_decode.launch_scheduled(query, kv_rows, slots, counts, out, lse, fmt, setup.softmax_scale,
                                               setup.output_scale, ws, cfg, tabs)
            return launch

        def gluon_launch(query, kv_rows, slots, counts, out, lse) -> None:
            module_launch(query, kv_rows, slots, counts, out, lse, setup.softmax_scale, setup.output_scale, ws, 1,
                          params, 0, tabs)
        return gluon_launch

    def __call__(
        self,
        query: torch.Tensor,
        kv_rows: torch.Tensor,
        slots: torch.Tensor,
        counts: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        *,
        block_size: int,
        rows_per_block_stride: int,
    ) -> None:
        # the query was checked by the core (kernels.base.check_query), once a decode; the rest here
        check_operands(query, kv_rows, slots, counts, self.fmt, out, lse)
        rows, heads = query.shape[0], query.shape[1]
        if heads != self.setup.heads:
            raise ValueError(f"query has {heads} heads, the kernel was set up for {self.setup.heads}")
        key = (rows, slots.shape[1])
        if key not in self._plans:
            raise ValueError(
                f"rows={rows}, width={slots.shape[1]} not planned (max_rows {self.setup.max_rows}, widths {self.setup.widths})"
            )
        if rows == 0:
            return
        if self.scheduled:
            self._scheduled_launches[key](query, kv_rows, slots, counts, out, lse)
            return
        launch, split_launch = self._launches[key]
        run_plan(launch, self._plans[key], query, kv_rows, slots, counts, out, lse, split_launch=split_launch)

    def _launch_tl(self, query, kv_rows, slots, counts, out, lse, splits: int) -> None:
        triton_decode.launch(query, kv_rows, slots, counts, out, lse, self.fmt, self.setup.softmax_scale,
                             self.setup.output_scale, self.workspace, self.config, splits)

    def _bound(self, cache: dict[tuple[int, Any, int], Any], kernel: Kernel, lead_tiles: int) -> Any:
        """The launch run_plan calls for (params, module launch) with this lead, made once per distinct triple."""
        params, module_launch = kernel
        key = (id(params), module_launch, lead_tiles)
        if key not in cache:
            cache[key] = self._launch_tl if params is None else self._gluon_call(params, module_launch, lead_tiles)
        return cache[key]

    def _gluon_call(self, params: Any, module_launch: Any, lead_tiles: int) -> Any:
        """A Gluon kernel module's launch with these params and lead, as run_plan calls it."""

        def launch(query, kv_rows, slots, counts, out, lse, splits: int) -> None:
            module_launch(query, kv_rows, slots, counts, out, lse, self.setup.softmax_scale,
                          self.setup.output_scale, self.workspace, splits, params, lead_tiles)
        return launch


def _check_setup(setup: DecodeSetup) -> None:
    refusal = heads_refusal(TritonDecode.name, setup.heads)
    if refusal:
        raise ValueError(f"heads={setup.heads}: {refusal}")
    if not setup.widths:
        raise ValueError("setup.widths must not be empty")
    for w in setup.widths:
        check_width(w, "setup.widths")


def _available_choice(fmt: str, setup: DecodeSetup) -> GluonChoice | None:
    """gluon_choice's kernels where this device runs Gluon and (unless VLLM_KIMI_DSA_GLUON=1) they were verified on
    this Triton; None: the plain kernel."""
    want = envs.gluon_choice()
    fp8_pv = envs.fp8_pv()
    choice = gluon_choice(fmt, setup.heads, want, fp8_pv)
    if fp8_pv and want != "0" and fmt == "fp8" and setup.heads > FEW_HEADS_MAX and not getattr(choice and choice.params, "pv_fp8", False):
        logger.warning("%s=1: P.V on e4m3 is not verified on this Triton, the default kernels run (%s=1 forces it)",
                       envs.FP8_PV, envs.GLUON)
    if choice is None or not gluon_available(setup.device) or not (want == "1" or choice.verified):
        return None
    return choice
