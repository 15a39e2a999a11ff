"""The process-wide registry of FlashInfer prims_ts sparse MLA plans (`PLANS`), their capacities and qo_indptr.

One plan per (device, plan rows, heads, lse, format, width), all on one shared workspace per device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

from vllm_kimi_dsa.arguments import positive_int
from vllm_kimi_dsa.formats import HEAD_DIM, LATENT_DIM, CacheFormat, normalize_format
from vllm_kimi_dsa.heads import heads_refusal

# FlashInfer's kv_cache_format for each cache format (flashinfer/attention/prims_ts/mla_decode.py,
# plan docstring and kernels/mla_decode/helpers/nvfp4_kv.py: cache_record_size): "native" reads
# 576 e4m3 values a row with the q dtype; "nvfp4.fp8rope" reads the 352-byte nvfp4_ds_mla row.
PRIMS_TS_FORMAT: dict[str, str] = {"fp8": "native", "nvfp4_ds_mla": "nvfp4.fp8rope"}

# Round the shared workspace up so small plan additions rarely force a re-plan.
_WORKSPACE_ROUND = 1 << 20


class PlanKey(NamedTuple):
    """One prims_ts plan: `plan_rows` one-token rows of `heads` heads over top-k `width`."""

    device: torch.device
    plan_rows: int
    heads: int
    lse: bool
    format: CacheFormat
    width: int


def plan_arguments(key: PlanKey) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) for both `BatchSparseMLADecodePagedTSWrapper.plan` and the workspace size.

    Packed one-token rows: batch_size = plan rows, max_q_len = 1, so the schedule is the decode
    one (FlashInfer's policy keys many choices on `query_length <= 8`) and `run` takes any
    rows <= plan rows with qo_indptr of plan_rows + 1 entries (see `_offsets`).
    """
    return (key.device, key.plan_rows, key.heads), dict(
        max_topk=key.width,
        max_q_len=1,
        packed_query=True,
        q_dtype=torch.float8_e4m3fn,
        qk_rope_head_dim=HEAD_DIM - LATENT_DIM,
        kv_cache_format=PRIMS_TS_FORMAT[key.format],
        return_lse=key.lse,
    )


def qo_offsets(capacity: int, rows: int, device: torch.device | str) -> torch.Tensor:
    """qo_indptr (capacity + 1,) int32 = [0, 1, ..., rows, rows, ..., rows] for `rows` one-token rows."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"rows must be a non-negative int, got {rows!r}")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    if rows > capacity:
        raise ValueError(f"rows={rows} exceeds the plan capacity={capacity}")
    return torch.arange(capacity + 1, dtype=torch.int32, device=device).clamp_(max=rows)


# The seed's documented name (SPEC 10): _offsets(capacity, rows, device).
_offsets = qo_offsets


def plan_rows_for(rows: int, capacities: Sequence[int] | None = None) -> int:
    """The prims_ts plan batch size for `rows` rows: the smallest capacity >= rows (rows when none given).

    capacities: ascending positive ints without repeats, or None / empty.
    """
    positive_int(rows, "rows")
    if not capacities:
        return rows
    caps = tuple(capacities)
    for c in caps:
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"capacities must be positive ints, got {caps}")
    if any(a >= b for a, b in zip(caps, caps[1:])):
        raise ValueError(f"capacities must be sorted ascending without repeats, got {caps}")
    for c in caps:
        if c >= rows:
            return c
    raise ValueError(f"rows={rows} exceeds every plan capacity in capacities={caps}")


def _check_key(key: PlanKey) -> PlanKey:
    if not isinstance(key, PlanKey):
        raise TypeError(f"plan keys must be PlanKey, got {type(key).__name__}")
    fmt = normalize_format(key.format)
    for name in ("plan_rows", "heads", "width"):
        value = getattr(key, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"PlanKey.{name} must be a positive int, got {value!r}")
    refusal = heads_refusal("prims_ts", key.heads)
    if refusal:
        raise ValueError(f"PlanKey.heads={key.heads}: {refusal}")
    device = torch.device(key.device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())  # "cuda" and "cuda:0" are one plan
    return key._replace(device=device, format=fmt, lse=bool(key.lse))


class _Plans:
    """Planned prims_ts wrappers by PlanKey, sharing one workspace per device.

    Sharing is safe because the plans never run concurrently: every layer runs on one stream,
    one after another (FlashInfer: "A wrapper/workspace permits one in-flight run"). The
    workspace is the max of `get_prims_ts_sparse_mla_decode_workspace_size` over every plan on the
    device. When a new plan needs more, a larger workspace is allocated and the existing wrappers
    are re-planned onto it in place (same objects). So: make every plan before any CUDA graph
    capture; `plan` refuses to plan during capture.
    """

    def __init__(self) -> None:
        self._wrappers: dict[PlanKey, Any] = {}
        self._sizes: dict[PlanKey, int] = {}
        self._workspaces: dict[torch.device, torch.Tensor] = {}
        self.plan_calls = 0  # wrapper.plan invocations, re-plans included (tests read it)

    def plan(
        self,
        keys: Iterable[PlanKey] | torch.device | str,
        shapes: Iterable[tuple[int, int, bool]] | None = None,
        fmt: str | None = None,
        topk: int | Iterable[int] | None = None,
    ) -> None:
        """Make every missing plan in one go; plans already made are untouched.

        plan(keys): PlanKeys. plan(device, shapes, fmt, topk) (SPEC 10): shapes of (plan rows, heads, lse), each
        planned for the cache format `fmt` and every top-k width in `topk` (an int or several).
        """
        if shapes is not None or fmt is not None or topk is not None:
            if shapes is None or fmt is None or topk is None:
                raise TypeError("plan(device, shapes, fmt, topk) needs all four arguments")
            widths = (topk,) if isinstance(topk, int) else tuple(topk)
            keys = [PlanKey(torch.device(keys), r, h, lse, fmt, w) for r, h, lse in shapes for w in widths]  # type: ignore[arg-type]
        elif isinstance(keys, (torch.device, str)):
            raise TypeError("plan(device, shapes, fmt, topk) needs all four arguments")
        wanted = list(dict.fromkeys(_check_key(k) for k in keys))  # type: ignore[union-attr]
        missing = [k for k in wanted if k not in self._wrappers]
        if not missing:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "prims_ts plans must all be made before CUDA graph capture (their workspace and "
                f"metadata addresses are baked into the graph); missing {missing}"
            )
        from vllm_kimi_dsa.backends.flashinfer.features import require_prims_ts

        require_prims_ts()
        from flashinfer.attention.prims_ts import (
            BatchSparseMLADecodePagedTSWrapper,
            get_prims_ts_sparse_mla_decode_workspace_size,
        )

        for key in missing:
            args, kwargs = plan_arguments(key)
            self._sizes[key] = int(get_prims_ts_sparse_mla_decode_workspace_size(*args, **kwargs))

        for device in dict.fromkeys(k.device for k in missing):
            on_device = [k for k in self._sizes if k.device == device]
            need = max(self._sizes[k] for k in on_device)
            workspace = self._workspaces.get(device)
            if workspace is None or workspace.numel() < need:
                size = -(-need // _WORKSPACE_ROUND) * _WORKSPACE_ROUND
                workspace = torch.zeros(size, dtype=torch.uint8, device=device)
                self._workspaces[device] = workspace
                # The wrapper keeps views of its workspace in its plan state: re-plan onto the new one.
                for key in on_device:
                    wrapper = self._wrappers.get(key)
                    if wrapper is not None:
                        wrapper._workspace_buffer = workspace
                        self._plan_one(wrapper, key)
            for key in (k for k in missing if k.device == device):
                wrapper = BatchSparseMLADecodePagedTSWrapper(workspace)
                self._plan_one(wrapper, key)
                self._wrappers[key] = wrapper

    def _plan_one(self, wrapper: Any, key: PlanKey) -> None:
        args, kwargs = plan_arguments(key)
        wrapper.plan(*args, **kwargs)
        self.plan_calls += 1

    def get(self, key: PlanKey | torch.device | str, *shape: Any) -> Any:
        """The planned BatchSparseMLADecodePagedTSWrapper of `key`, or of get(device, rows, heads, lse, fmt, topk)."""
        if shape:
            if len(shape) != 5:
                raise TypeError("get(device, rows, heads, lse, fmt, topk) takes six arguments")
            rows, heads, lse, fmt, topk = shape
            key = PlanKey(torch.device(key), rows, heads, lse, fmt, topk)  # type: ignore[arg-type]
        if not isinstance(key, PlanKey):
            raise TypeError(f"get takes a PlanKey or (device, rows, heads, lse, fmt, topk), got {type(key).__name__}")
        try:
            return self._wrappers[_check_key(key)]
        except KeyError:
            raise ValueError(
                f"no prims_ts plan for rows={key.plan_rows}, width={key.width}, heads={key.heads}, "
                f"lse={key.lse}, format={key.format} on {key.device}; every (rows, width) must be "
                "planned at construction"
            ) from None

    def keys(self) -> tuple[PlanKey, ...]:
        return tuple(self._wrappers)

    def workspace(self, device: torch.device | str) -> torch.Tensor | None:
        """The shared workspace of `device` (uint8, contiguous), or None before any plan there."""
        return self._workspaces.get(torch.device(device))

    def workspace_size(self, key: PlanKey) -> int:
        """Bytes FlashInfer asked for plan `key` (get_prims_ts_sparse_mla_decode_workspace_size)."""
        return self._sizes[_check_key(key)]

    def clear(self) -> None:
        """Forget every plan and workspace (tests)."""
        self._wrappers.clear()
        self._sizes.clear()
        self._workspaces.clear()
        self.plan_calls = 0


PLANS = _Plans()

__all__ = ["PLANS", "PRIMS_TS_FORMAT", "PlanKey", "plan_arguments", "plan_rows_for", "qo_offsets"]
