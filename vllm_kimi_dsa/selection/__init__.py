"""Kernel selection: which kernel runs each batch size (kernel_for, fi_kernels) and the tables behind it.

`specs` parses and stores kernel tables; `choice` applies the head rules and the table to what this machine runs.
"""

from __future__ import annotations

from vllm_kimi_dsa.backends.flashinfer.plans import plan_rows_for
from vllm_kimi_dsa.selection.choice import fi_kernels, kernel_for, triton_runs
from vllm_kimi_dsa.selection.specs import (
    FI_KERNEL,
    KERNEL_TABLE_ENV,
    KERNELS,
    SPEC_KERNELS,
    TOPOLOGIES,
    active_kernel_table,
    kernel_from_spec,
    load_kernel_table,
    parse_kernel_spec,
    reset_kernel_table_cache,
    save_kernel_table,
)

__all__ = [
    "FI_KERNEL",
    "KERNELS",
    "KERNEL_TABLE_ENV",
    "SPEC_KERNELS",
    "TOPOLOGIES",
    "active_kernel_table",
    "fi_kernels",
    "kernel_for",
    "kernel_from_spec",
    "load_kernel_table",
    "parse_kernel_spec",
    "plan_rows_for",
    "reset_kernel_table_cache",
    "save_kernel_table",
    "triton_runs",
]
