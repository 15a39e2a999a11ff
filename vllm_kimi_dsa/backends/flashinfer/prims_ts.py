"""FlashInfer's prims_ts sparse MLA decode (BatchSparseMLADecodePagedTSWrapper, 0.7.4+) as a DecodeKernel.

Planned at construction from the shared PLANS registry; `__call__` only runs (no allocation, no sync).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from vllm_kimi_dsa.backends.flashinfer.checks import check_setup, positive_scale
from vllm_kimi_dsa.backends.flashinfer.features import require_prims_ts
from vllm_kimi_dsa.backends.flashinfer.plans import PLANS, PlanKey, plan_rows_for, qo_offsets
from vllm_kimi_dsa.formats import row_bytes
from vllm_kimi_dsa.heads import heads_refusal
from vllm_kimi_dsa.kernels.base import DecodeSetup


class PrimsTsDecode:
    """FlashInfer 0.7.4's BatchSparseMLADecodePagedTSWrapper, planned per (plan rows, width).

    Every batch of `rows` runs the plan of `plan_rows_for(rows, capacities)` = C rows as a
    packed query of `rows` rows (query/indices/lengths/out/lse all have `rows` rows, never C):
    FlashInfer's packed mode takes any rows <= C and only checks qo_indptr has C + 1 entries;
    the launch itself sees `rows` (mla_decode.py run(): query.view(rows, 1, H, D)).
    """

    name: ClassVar[str] = "prims_ts"

    def __init__(self, setup: DecodeSetup) -> None:
        require_prims_ts()
        check_setup(setup)
        refusal = heads_refusal("prims_ts", setup.heads)
        if refusal:
            raise ValueError(f"heads={setup.heads}: {refusal}")
        self.setup = setup
        self.fmt = setup.fmt
        self.heads = setup.heads
        self.row_bytes = row_bytes(setup.fmt)
        self.kv_dtype = torch.float8_e4m3fn if setup.fmt == "fp8" else torch.uint8
        # FlashInfer rounds host scales to fp32 and rejects non-positive ones at run(): fail here instead.
        self.softmax_scale = positive_scale(setup.softmax_scale, "softmax_scale")
        self.output_scale = positive_scale(setup.output_scale, "output_scale")
        device = torch.device(setup.device)
        capacities = setup.capacities or None
        plan_rows = {r: plan_rows_for(r, capacities) for r in setup.row_counts}
        keys = {
            (r, w): PlanKey(device, plan_rows[r], setup.heads, setup.return_lse, setup.fmt, w)
            for r in setup.row_counts
            for w in setup.widths
        }
        PLANS.plan(keys.values())
        self._wrappers = {rw: PLANS.get(k) for rw, k in keys.items()}
        self._qo_indptr = {r: qo_offsets(c, r, device) for r, c in plan_rows.items()}
        self.plan_rows = plan_rows

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
        rows, width = query.shape[0], slots.shape[1]
        wrapper = self._wrappers.get((rows, width))
        if wrapper is None:
            raise ValueError(
                f"prims_ts has no plan for rows={rows}, width={width}; planned rows "
                f"{sorted(self.plan_rows)}, widths {self.setup.widths}"
            )
        if (lse is None) == self.setup.return_lse:
            raise ValueError(f"lse must be {'given' if self.setup.return_lse else 'None'} (setup.return_lse)")
        if kv_rows.dtype != self.kv_dtype:
            kv_rows = kv_rows.view(self.kv_dtype)
        # kv_rows (num_rows, row_bytes): FlashInfer's _pool() reads a 2-d cache as [rows, 1, row_bytes].
        wrapper.run(
            query,
            kv_rows,
            slots,
            counts,
            qo_indptr=self._qo_indptr[rows],
            softmax_scale=self.softmax_scale,
            output_scale=self.output_scale,
            out=out,
            lse=lse,
            validate=False,
        )


__all__ = ["PrimsTsDecode"]
