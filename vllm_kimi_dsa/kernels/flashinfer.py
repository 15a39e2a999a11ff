"""FlashInfer's Blackwell sparse MLA decode kernels as DecodeKernels: prims_ts and trtllm-gen.

FlashInfer is imported lazily; `flashinfer_features` says what the installed version offers.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm_kimi_dsa.formats import HEAD_DIM, LATENT_DIM, ROPE_DIM, row_bytes
from vllm_kimi_dsa.kernels.base import DecodeSetup
from vllm_kimi_dsa.plans import PLANS, PlanKey, _offsets

PRIMS_TS_INSTALL = "pip install --no-deps flashinfer-python==0.7.4"

# vLLM 0.33's default trtllm-gen workspace (VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE,
# vllm/v1/attention/backends/mla/flashinfer_mla_sparse.py: _DEFAULT_WORKSPACE_BUFFER_SIZE).
TRTLLM_BASE_WORKSPACE_BYTES = 394 * 1024 * 1024


@dataclass(frozen=True)
class FlashInferFeatures:
    """What the installed FlashInfer offers (version None: not installed)."""

    version: str | None
    prims_ts: bool
    trtllm_mla: bool


@functools.cache
def flashinfer_features() -> FlashInferFeatures:
    """Probe the installed FlashInfer once; never raises."""
    try:
        import flashinfer
    except Exception:  # noqa: BLE001 - a broken install is as good as none here
        return FlashInferFeatures(None, False, False)
    version = getattr(flashinfer, "__version__", None)
    try:
        from flashinfer.attention.prims_ts import BatchSparseMLADecodePagedTSWrapper  # noqa: F401

        prims_ts = True
    except Exception:  # noqa: BLE001
        prims_ts = False
    try:
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla  # noqa: F401

        trtllm = True
    except Exception:  # noqa: BLE001
        trtllm = False
    return FlashInferFeatures(None if version is None else str(version), prims_ts, trtllm)


def device_runs_blackwell(device: torch.device | str | int) -> bool:
    """True for a CUDA device of compute capability major 10 (SM100 / SM103)."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] == 10


def require_prims_ts() -> None:
    """Raise ImportError saying what to install when prims_ts is missing."""
    features = flashinfer_features()
    if not features.prims_ts:
        found = "no flashinfer" if features.version is None else f"flashinfer-python {features.version}"
        raise ImportError(
            "the prims_ts kernel needs flashinfer.attention.prims_ts.BatchSparseMLADecodePagedTSWrapper "
            f"(flashinfer-python >= 0.7.4); found {found}. vLLM 0.33 pins 0.7.2.post1, so install over it: "
            f"{PRIMS_TS_INSTALL}"
        )


def _require_trtllm() -> None:
    features = flashinfer_features()
    if not features.trtllm_mla:
        raise ImportError(
            "the trtllm kernel needs flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla; "
            f"found flashinfer {features.version!r}. Install flashinfer-python (vLLM 0.33 pins 0.7.2.post1)"
        )


def _check_scale(value: float, name: str) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return value


def _check_setup(setup: DecodeSetup) -> None:
    if not setup.row_counts or not setup.widths:
        raise ValueError("setup.row_counts and setup.widths must not be empty")
    for w in setup.widths:
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"setup.widths must be positive ints, got {setup.widths}")


# ---------------------------------------------------------------- prims_ts


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
        from vllm_kimi_dsa.dispatch import plan_rows_for

        _check_setup(setup)
        if not 1 <= setup.heads <= 128:
            raise ValueError(f"heads={setup.heads}: prims_ts takes 1 to 128 query heads")
        self.setup = setup
        self.fmt = setup.fmt
        self.heads = setup.heads
        self.row_bytes = row_bytes(setup.fmt)
        self.kv_dtype = torch.float8_e4m3fn if setup.fmt == "fp8" else torch.uint8
        # FlashInfer rounds host scales to fp32 and rejects non-positive ones at run(): fail here instead.
        self.softmax_scale = _check_scale(setup.softmax_scale, "softmax_scale")
        self.output_scale = _check_scale(setup.output_scale, "output_scale")
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
        self._qo_indptr = {r: _offsets(r, c, device) for r, c in plan_rows.items()}
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


# ---------------------------------------------------------------- trtllm-gen

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
        _check_setup(setup)
        if setup.fmt != "fp8":
            raise ValueError(
                f"fmt={setup.fmt!r}: the trtllm kernel reads only the fp8 cache; nvfp4_ds_mla runs on prims_ts"
            )
        h = setup.heads
        if not (1 <= h <= 64 or h == 128):
            raise ValueError(f"heads={h}: trtllm-gen MLA decode takes 1 to 64 heads or exactly 128")
        for w in setup.widths:
            if w % 4:
                raise ValueError(f"width {w}: trtllm-gen needs sparse_mla_top_k to be a multiple of 4")
        _require_trtllm()
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla
        from flashinfer.utils import get_device_sm_count, get_trtllm_gen_multi_ctas_kv_counter_bytes

        self.setup = setup
        self.heads = h
        self._decode = trtllm_batch_decode_with_kv_cache_mla
        device = torch.device(setup.device)
        self.bmm1_scale = _check_scale(setup.softmax_scale, "softmax_scale")
        self.bmm2_scale = _check_scale(setup.output_scale, "output_scale")
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


__all__ = [
    "FlashInferFeatures",
    "PRIMS_TS_INSTALL",
    "PrimsTsDecode",
    "TrtllmDecode",
    "device_runs_blackwell",
    "flashinfer_features",
    "require_prims_ts",
    "trtllm_lse_slab_bytes",
]
