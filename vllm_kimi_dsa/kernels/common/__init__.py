"""What every decode kernel of this package shares: the split-KV workspace, the combine, the nvfp4 decode, and
(common.gluon) the Gluon kernels' imports and jit pieces.

Kernel leaves import from here; nothing here imports a leaf.
"""

from __future__ import annotations

from vllm_kimi_dsa.kernels.common.combine import (
    CHUNK_SPLITS, INLINE_SPLITS, LN2, LOG2E, combine, combine_chunks_kernel, combine_kernel, combine_warps,
)
from vllm_kimi_dsa.kernels.common.workspace import (
    PARTIAL_DTYPE,
    Workspace,
    check_inputs,
    check_lead,
    check_operands,
    make_workspace,
    num_sms,
    one_off_scratch,
    run_plan,
    scratch,
    shared_workspace,
)

__all__ = ["CHUNK_SPLITS", "INLINE_SPLITS", "LN2", "LOG2E", "PARTIAL_DTYPE", "Workspace", "check_inputs", "check_lead",
           "check_operands", "combine", "combine_chunks_kernel", "combine_kernel", "combine_warps", "make_workspace", "num_sms", "one_off_scratch", "run_plan", "scratch", "shared_workspace"]
