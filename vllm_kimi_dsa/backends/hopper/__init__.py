"""The Hopper dispatcher of the "triton" kernel (TritonDecode) and its table of Gluon variants.

dispatch: TritonDecode; variants: which Gluon kernels bind for (format, heads) and the Triton versions they were
verified on.
"""

from __future__ import annotations

from vllm_kimi_dsa.backends.hopper.dispatch import TritonDecode
from vllm_kimi_dsa.backends.hopper.variants import VERIFIED_TRITON, gluon_choice, seesaw_takes, verified

__all__ = ["VERIFIED_TRITON", "TritonDecode", "gluon_choice", "seesaw_takes", "verified"]
