"""FlashInfer's trtllm-gen sparse MLA decode (trtllm_batch_decode_with_kv_cache_mla, sparse mode) as a DecodeKernel.

FP8 cache only; natural-log LSE; rows with no valid token come back as 0 / -inf (masked here, not by the kernel).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from vllm_kimi_dsa.backends.flashinfer.checks import check_setup, positive_scale
from vllm_kimi_dsa.backends.flashinfer.features import require_trtllm
from vllm_kimi_dsa.formats import HEAD_DIM, LATENT_DIM, ROPE_DIM
from vllm_kimi_dsa.heads import heads_refusal
from vllm_kimi_dsa.kernels.base import DecodeSetup

# vLLM 0.33's default trtllm-gen workspace (VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE,
# vllm/v1/attention/backends/mla/flashinfer_mla_sparse.py: _DEFAULT_WORKSPACE_BUFFER_SIZE).
TRTLLM_BASE_WORKSPACE_BYTES = 394 * 1024 * 1024

# Per-device buffers shared by every TrtllmDecode: layers run one after another on one stream,
# which FlashInfer allows ("Reuse is safe only for ordered, non-overlapping launches").
# A later kernel needing more gets a new, larger buffer; earlier kernels keep theirs (still
# alive, still large enough for them), so no captured address ever moves.
_TRTLLM_COUNTERS: dict[torch.device, torch.Tensor] = {}
_TRTLLM_WORKSPACES: dict[torch.device, torch.Tensor] = {}


def trtllm_lse_slab_bytes(rows: int, heads: int) -> int:
    """Workspace bytes trtllm-gen carves for softmax stats when LSE is requested (q_len 1).

    flashinfer/data/csrc/trtllm_fmha_kernel_launcher.cu: sizeof(float2) * heads * batch *
    round_up(max_q_len, 256) + 1 MiB guard.
    """
    return 8 * heads * rows * 256 + (1 << 20)


def _shared_zeros(cache: dict[torch.device, torch.Tensor], device: torch.device, nbytes: int) -> torch.Tensor:
    buf = cache.get(device)
    if buf is None or buf.numel() < nbytes:
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        cache[device] = buf
    return buf


class TrtllmDecode:
    """FlashInfer's trtllm-gen sparse MLA decode (`trtllm_batch_decode_with_kv_cache_mla`), fp8 only."""

    name: ClassVar[str] = "trtllm"

    def __init__(self, setup: DecodeSetup) -> None:
        check_setup(setup)
        if setup.fmt != "fp8":
            raise ValueError(
                f"fmt={setup.fmt!r}: the trtllm kernel reads only the fp8 cache; nvfp4_ds_mla runs on prims_ts"
            )
        h = setup.heads
        refusal = heads_refusal("trtllm", h)
        if refusal:
            raise ValueError(f"heads={h}: {refusal}")
        for w in setup.widths:
            if w % 4:
                raise ValueError(f"width {w}: trtllm-gen needs sparse_mla_top_k to be a multiple of 4")
        require_trtllm()
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla
        from flashinfer.utils import get_device_sm_count, get_trtllm_gen_multi_ctas_kv_counter_bytes

        self.setup = setup
        self.heads = h
        self._decode = trtllm_batch_decode_with_kv_cache_mla
        device = torch.device(setup.device)
        self.bmm1_scale = positive_scale(setup.softmax_scale, "softmax_scale")
        self.bmm2_scale = positive_scale(setup.output_scale, "output_scale")
        self.qk_nope_head_dim = int(getattr(setup.impl, "qk_nope_head_dim", 128))
        max_rows = setup.max_rows

        # FlashInfer allocates a fresh zeroed counter per call when given none (mla/_batch_mla/
        # _backends/trtllm_gen_backend.py forward()): pass one made here instead. The kernel
        # resets its semaphores at the end of every launch, so zeroing once is enough.
        sm_count = get_device_sm_count(device)
        self.counter = _shared_zeros(
            _TRTLLM_COUNTERS, device, get_trtllm_gen_multi_ctas_kv_counter_bytes(max_rows, h, sm_count)
        )

        need = TRTLLM_BASE_WORKSPACE_BYTES + (trtllm_lse_slab_bytes(max_rows, h) if setup.return_lse else 0)
        workspace = getattr(setup.impl, "_workspace_buffer", None)
        if workspace is None or workspace.numel() * workspace.element_size() < need:
            workspace = _shared_zeros(_TRTLLM_WORKSPACES, device, need)
        self.workspace = workspace

        # Count-0 rows: trtllm-gen leaves them unspecified (finite garbage LSE); fixed after the
        # call with in-place masked fills driven by this preallocated mask (no allocation per call).
        self._empty = torch.zeros(max_rows, dtype=torch.bool, device=device)

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
        page = math.gcd(int(rows_per_block_stride), int(block_size), 64)
        if page not in (32, 64):
            raise ValueError(
                f"trtllm-gen needs pages of 32 or 64 rows; gcd(rows_per_block_stride={rows_per_block_stride}, "
                f"block_size={block_size}, 64) = {page}"
            )
        if (lse is None) == self.setup.return_lse:
            raise ValueError(f"lse must be {'given' if self.setup.return_lse else 'None'} (setup.return_lse)")
        rows, width = slots.shape
        if slots.stride() != (width, 1):
            # The C++ launcher passes only block_tables' pointer and last size: rows must be dense.
            raise ValueError(f"slots must be a contiguous (rows, K) tensor for trtllm-gen, strides {slots.stride()}")
        # Flat row r is page r // page, offset r % page of this view: sparse mode reads the
        # block table entries as token ids into the pool (kernelParams.h: 2-D K, row stride 576).
        kv = kv_rows.view(-1, page, HEAD_DIM).unsqueeze(1)
        self._decode(
            query=query.unsqueeze(1),
            kv_cache=kv,
            workspace_buffer=self.workspace,
            qk_nope_head_dim=self.qk_nope_head_dim,
            kv_lora_rank=LATENT_DIM,
            qk_rope_head_dim=ROPE_DIM,
            block_tables=slots.unsqueeze(1),
            seq_lens=counts,
            max_seq_len=width,
            sparse_mla_top_k=width,
            out=out.unsqueeze(1),
            bmm1_scale=self.bmm1_scale,
            bmm2_scale=self.bmm2_scale,
            backend="trtllm-gen",
            lse=lse,
            return_lse=lse is not None,
            multi_ctas_kv_counter_buffer=self.counter,
            return_lse_base="basee",
        )
        empty = self._empty[:rows]
        torch.eq(counts, 0, out=empty)
        out.masked_fill_(empty.view(rows, 1, 1), 0.0)
        if lse is not None:
            lse.masked_fill_(empty.view(rows, 1), float("-inf"))


__all__ = ["TRTLLM_BASE_WORKSPACE_BYTES", "TrtllmDecode", "trtllm_lse_slab_bytes"]
