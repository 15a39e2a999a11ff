"""This package's own decode kernels, as leaves: the plain Triton kernel (triton_decode) and the Hopper Gluon kernels
(gluon_decode, gluon_seesaw, gluon_few_heads), what they share (common), and the contract every decode kernel of the
core keeps (base: DecodeSetup, DecodeKernel, check_query).

FlashInfer's kernels and the dispatcher that binds these leaves are backends (vllm_kimi_dsa.backends); which class
runs each kernel name is backends.registry's.
"""

from __future__ import annotations

from vllm_kimi_dsa.kernels.base import DecodeKernel, DecodeSetup, check_query

__all__ = ["DecodeKernel", "DecodeSetup", "check_query"]
