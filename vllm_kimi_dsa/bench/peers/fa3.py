"""The Hopper peer: FlashInfer's SM90 MLA kernel (BatchMLAPagedAttentionWrapper, backend "fa3") as a sparse decode.

Used as vLLM's FLASHINFER_MLA_SPARSE_SM90 uses it: page_size=1, each row's selected flat cache rows are its page table.

Recipe: /work/shared/device/flashinfer-sm90/bench_fa3.py (tested on an H200 with flashinfer-python 0.7.2.post1).
- one wrapper with use_cuda_graph=True and reserved qo_indptr / kv_indptr / kv_indices / kv_len buffers, a shared
  128 MiB workspace; `plan` takes host indptr / lengths (it syncs: plan outside timing), `run` is graph-capturable;
- the query must be BF16 (q_nope = q[..., :512], q_pe = q[..., 512:] views); the cache is [N, 1, 576] viewed
  as ckv = [..., :512], kpe = [..., 512:];
- kv_data_type float8_e4m3fn needs per-tensor `ckv_scale` and `kpe_scale` in `run`: the kernel reads k = raw * scale
  and v = raw * ckv_scale (as the recipe's float64 reference check shows);
- FlashInfer 0.7 wants packed CSR offsets: kv_indptr = cumsum(lengths), kv_indices the valid prefixes back to back.

`python -m vllm_kimi_dsa.bench.peers.fa3 --build bf16 [--probe-heads 12]` JIT-builds one module (to FLASHINFER_WORKSPACE_BASE)
and checks small cases against a float64 reference, printing one JSON line per case: the suite runs it in the
background so the build overlaps the Triton measurements and an unsupported head count cannot crash the suite.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import torch

CKV, KPE = 512, 64
D = CKV + KPE
WORKSPACE_BYTES = 128 * 1024 * 1024
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}

_workspaces: dict[torch.device, torch.Tensor] = {}


def available() -> tuple[bool, str]:
    """(True, version) when FlashInfer's MLA wrapper imports here; else (False, why)."""
    try:
        import flashinfer
        from flashinfer.mla import BatchMLAPagedAttentionWrapper  # noqa: F401
    except Exception as err:  # ImportError, or a broken install / missing tvm_ffi
        return False, f"{type(err).__name__}: {err}"[:300]
    return True, str(getattr(flashinfer, "__version__", "?"))


def build_module(kv: str) -> float:
    """JIT-build and load the fa3 MLA module for a KV dtype ("bf16" / "fp8"); returns seconds (0 when cached)."""
    from flashinfer.mla._batch_mla._backends._fa_common import get_batch_mla_module

    t = time.perf_counter()
    get_batch_mla_module("fa3", torch.bfloat16, KV_DTYPES[kv], torch.bfloat16, torch.int32, CKV, KPE, False)
    return time.perf_counter() - t


def _workspace(device: torch.device) -> torch.Tensor:
    # All peers run one after another on one stream, so one float workspace serves them all.
    if device not in _workspaces:
        _workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[device]


class Fa3Peer:
    """One planned fa3 sparse MLA decode of `rows` rows x `heads` heads over up to `width` selected rows each.

    kv: "bf16" (cache rows (N, 576) bfloat16) or "fp8" (rows (N, 576) float8_e4m3fn, per-tensor kv_scale).
    sm_scale: logits = sm_scale * q . k with k = the cache row times kv_scale (kv_scale only for fp8).
    Output: out (rows, heads, 512) bf16 = sum_j p_j v_j, v_j = row[:512] * kv_scale.
    """

    def __init__(self, kv: str, heads: int, rows: int, width: int, *, sm_scale: float, kv_scale: float = 1.0,
                 device: torch.device | str = "cuda") -> None:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        if kv not in KV_DTYPES:
            raise ValueError(f"kv must be one of {sorted(KV_DTYPES)}, got {kv!r}")
        if kv == "bf16" and kv_scale != 1.0:
            raise ValueError("kv_scale applies to the fp8 cache only; scale a bf16 cache's values instead")
        if rows < 1 or width < 1 or heads < 1:
            raise ValueError(f"rows, width and heads must be >= 1, got {rows}, {width}, {heads}")
        self.kv, self.kv_dtype = kv, KV_DTYPES[kv]
        self.heads, self.rows, self.width = int(heads), int(rows), int(width)
        self.sm_scale, self.kv_scale = float(sm_scale), float(kv_scale)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # tensors report cuda:N; a bare "cuda" would never compare equal to them
            self.device = torch.device("cuda", torch.cuda.current_device())
        dev = self.device
        # Reserved (capture-stable) buffers, as vLLM's _SM90State: plan() refreshes them in place.
        self.kv_indices = torch.zeros(rows * width, dtype=torch.int32, device=dev)
        self.kv_len = torch.full((rows,), width, dtype=torch.int32, device=dev)
        self.kv_indptr = torch.zeros(rows + 1, dtype=torch.int32, device=dev)
        self.qo_indptr = torch.zeros(rows + 1, dtype=torch.int32, device=dev)
        self.wrapper = BatchMLAPagedAttentionWrapper(
            _workspace(dev), use_cuda_graph=True, qo_indptr=self.qo_indptr, kv_indptr=self.kv_indptr,
            kv_indices=self.kv_indices, kv_len_arr=self.kv_len, backend="fa3")
        self._scale_kwargs: dict[str, float] = (
            {"ckv_scale": self.kv_scale, "kpe_scale": self.kv_scale} if kv == "fp8" else {}
        )
        self.planned = False

    def plan(self, slots: torch.Tensor, counts: torch.Tensor | list[int]) -> None:
        """slots (rows, >= max count) int32 flat rows on the device; counts (rows,) host or device ints, >= 1.

        Packs each row's valid prefix into the reserved kv_indices and plans (host sync; not capturable).
        """
        counts_cpu = torch.as_tensor(counts, dtype=torch.int32).cpu()
        if counts_cpu.shape != (self.rows,):
            raise ValueError(f"counts must be ({self.rows},), got {tuple(counts_cpu.shape)}")
        if slots.dim() != 2 or slots.shape[0] != self.rows or slots.device != self.device:
            raise ValueError(f"slots must be ({self.rows}, K) on {self.device}, got {tuple(slots.shape)} "
                             f"on {slots.device}")
        if int(counts_cpu.min()) < 1 or int(counts_cpu.max()) > min(self.width, slots.shape[1]):
            raise ValueError(f"counts must be in [1, {min(self.width, slots.shape[1])}]")
        total = int(counts_cpu.sum())
        if total == self.rows * slots.shape[1]:
            packed = slots.reshape(-1)
        else:
            live = torch.arange(slots.shape[1], device=self.device) < counts_cpu.to(self.device).unsqueeze(1)
            packed = slots[live]
        self.kv_indices[:total].copy_(packed.to(torch.int32))
        qo_cpu = torch.arange(self.rows + 1, dtype=torch.int32)
        kv_cpu = torch.zeros(self.rows + 1, dtype=torch.int32)
        torch.cumsum(counts_cpu, 0, out=kv_cpu[1:])
        self.wrapper.plan(qo_cpu, kv_cpu, self.kv_indices[:total], counts_cpu, self.heads, CKV, KPE, 1, False,
                          self.sm_scale, q_data_type=torch.bfloat16, kv_data_type=self.kv_dtype)
        self.planned = True

    def run(self, q: torch.Tensor, kv_rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """q (rows, heads, 576) bf16; kv_rows (N, 576) of the peer's KV dtype; out (rows, heads, 512) bf16."""
        if not self.planned:
            raise RuntimeError("plan() before run()")
        c = kv_rows.view(kv_rows.shape[0], 1, D)
        return self.wrapper.run(q[..., :CKV], q[..., CKV:], c[..., :CKV], c[..., CKV:], out=out,
                                **self._scale_kwargs)


def make_peer(kv_dtype: str, heads: int, rows: int, width: int, **kwargs: Any) -> Fa3Peer:
    """A Fa3Peer (see its docstring); kwargs: sm_scale (required), kv_scale, device."""
    return Fa3Peer(kv_dtype, heads, rows, width, **kwargs)


def reference(q: torch.Tensor, kv_f64: torch.Tensor, slots: torch.Tensor, counts: list[int],
              sm_scale: float) -> torch.Tensor:
    """float64 reference: q (rows, H, 576), kv_f64 (N, 576) the rows as the peer reads them -> (rows, H, 512)."""
    outs = []
    for i, n in enumerate(counts):
        k = kv_f64[slots[i, :n].long()]
        p = torch.softmax((q[i].double() @ k.T) * sm_scale, dim=-1)
        outs.append(p @ k[:, :CKV])
    return torch.stack(outs)


def probe(kv: str, heads: int, rows: int = 3, width: int = 256, num_rows: int = 4096) -> dict[str, Any]:
    """Plan and run a small case (odd counts) and compare with the float64 reference."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(heads * 7 + rows)
    x = torch.randn(num_rows, D, device=dev, generator=g)
    scale = 0.125
    if kv == "fp8":
        cache = (x / scale).to(torch.float8_e4m3fn)
        kv_f64 = cache.double() * scale
    else:
        cache = x.to(torch.bfloat16)
        kv_f64 = cache.double()
    slots = torch.randint(0, num_rows, (rows, width), dtype=torch.int32, device=dev, generator=g)
    counts = [width, max(1, width // 3), 17][:rows] + [width] * max(0, rows - 3)
    q = torch.randn(rows, heads, D, device=dev, generator=g).to(torch.bfloat16)
    sm = 1.0 / math.sqrt(192.0)
    peer = Fa3Peer(kv, heads, rows, width, sm_scale=sm, kv_scale=scale if kv == "fp8" else 1.0)
    peer.plan(slots, counts)
    out = torch.full((rows, heads, CKV), float("nan"), dtype=torch.bfloat16, device=dev)
    peer.run(q, cache, out)
    torch.cuda.synchronize()
    ref = reference(q, kv_f64, slots, counts, sm)
    err = float((out.double() - ref).norm() / ref.norm())
    return {"kv": kv, "heads": heads, "rel_l2_err": err, "ok": bool(math.isfinite(err) and err < 2e-2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", required=True, help="KV dtype whose module to build and check: bf16 or fp8")
    ap.add_argument("--probe-heads", default="128,16", help="head counts to check on small cases")
    args = ap.parse_args(argv)
    ok, why = available()
    if not ok:
        print(json.dumps({"kv": args.build, "available": False, "why": why}), flush=True)
        return 3
    try:
        dt = build_module(args.build)
        print(json.dumps({"kv": args.build, "available": True, "build_s": round(dt, 1)}), flush=True)
    except Exception as err:
        print(json.dumps({"kv": args.build, "available": True, "build_error": repr(err)[-1500:]}), flush=True)
        return 4
    for h in [int(x) for x in args.probe_heads.split(",") if x]:
        # Each head count on its own: a rejected one raises here (a device fault would end this process only).
        try:
            rec = probe(args.build, h)
        except Exception as err:
            rec = {"kv": args.build, "heads": h, "ok": False, "error": repr(err)[-800:]}
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
