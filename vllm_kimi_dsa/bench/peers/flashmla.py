"""The Hopper peer vLLM runs by default: FlashMLA's SM90 sparse FP8 decode (FLASHMLA_SPARSE) on 656 B fp8_ds_mla rows.

As vLLM 0.33's FlashMLASparseImpl._fp8_flash_mla_kernel runs it (vllm/v1/attention/backends/mla/flashmla_sparse.py):
the kernel takes 64 or 128 query heads (`_compute_fp8_decode_padded_heads`: 64 if H <= 64 else 128), so a BF16
query of fewer heads is padded with a fresh zeroed tensor (`q.new_zeros`, then the real heads copied in) before the
call, and the output sliced back to H heads (a view); the scheduler metadata is made once per batch shape (outside
the timed graph here, as vLLM's metadata builder makes it). A `-1` index is masked by the kernel; a row whose every
index is -1 is undefined there (vLLM zero-fills it), so the suite's inputs keep counts >= 1.

The harness is /work/shared/device/flashmla-sm90 (a benchmark harness, never part of the package): its prepare.sh
unpacks FlashMLA's sources into `.carry/flashmla` and the reduced SM90 API with prebuilt objects into
`.carry/flashmla_bench` (its build_ext.py builds the extension against this torch in ~45 s, exposing
`sparse_decode_fwd` with flash_mla's own signature). This module finds it through --flashmla / $FLASHMLA_PEER_DIR,
else `.carry/flashmla_bench` under the current directory (peers.CARRY).

The fp8_ds_mla row (656 B): 512 e4m3 latent values in 4 tiles of 128, each with an fp32 scale (amax / 448, as vLLM's
cache writer makes it), then the 4 fp32 scales, then the 64 RoPE values as BF16. `quantize_fp8_ds_mla` packs the
suite's exact BF16 rows so.

`python -m vllm_kimi_dsa.bench.peers.flashmla --build DIR --build-dir B [--probe-heads 8,64,128]` builds and loads the
extension, checks small cases (padding included) against a float64 reference of the packed rows, and prints one
JSON line per step, the first with the built .so's path: the suite runs it in the background so the build overlaps
its Triton measurements and a failure cannot crash the suite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

from vllm_kimi_dsa.bench.peers import CARRY, load_extension, run_build_script

D_QK, D_V, D_ROPE = 576, 512, 64
ROW_BYTES = 656  # 512 e4m3 + 4 fp32 scales + 64 bf16
TILE = 128  # latent values a scale
PAGE = 64  # tokens a cache block, as vLLM's FLASHMLA_SPARSE pages the cache
ENV_DIR = "FLASHMLA_PEER_DIR"
CARRY_DIR = CARRY / "flashmla_bench"
EXT_NAME = "flash_mla_sm90_sparse"


def harness_dir(given: str | os.PathLike[str] | None = None) -> Path | None:
    """The flashmla_bench folder (build_ext.py, api_sm90.cpp, objs/; FlashMLA's tree beside it as ../flashmla):
    `given` (only it, when given), else $FLASHMLA_PEER_DIR, else .carry/flashmla_bench; None where the
    folder asked for is not one."""
    for cand in ((given,) if given else (os.environ.get(ENV_DIR), CARRY_DIR)):
        if cand and (Path(cand) / "build_ext.py").is_file():
            return Path(cand).resolve()
    return None


def available(given: str | os.PathLike[str] | None = None) -> tuple[bool, str]:
    """(True, the harness folder) when the harness and FlashMLA's sources are here; else (False, why)."""
    d = harness_dir(given)
    if d is None:
        return False, (f"no FlashMLA harness (--flashmla, ${ENV_DIR} or {CARRY_DIR}; "
                       "bash /work/shared/device/flashmla-sm90/prepare.sh .carry)")
    if not (d.parent / "flashmla" / "csrc").is_dir():
        return False, f"{d.parent / 'flashmla'} (FlashMLA's sources, prepare.sh's other folder) is missing"
    if not (d / "objs").is_dir():
        return False, f"{d / 'objs'} (the prebuilt sm_90a objects) is missing"
    return True, str(d)


def build(d: Path, build_dir: str | os.PathLike[str]) -> str:
    """Build (or find built) the extension from the harness's prebuilt objects with the harness's build_ext.py (a
    child process: `build_ext.py OBJS BUILD_DIR` builds, smoke-tests and prints "built+loaded SO in ..."); returns
    its .so path."""
    out = run_build_script(d / "build_ext.py", str(d / "objs"), str(build_dir))
    found = re.findall(r"built\+loaded (\S+) in ", out)
    if not found:
        raise RuntimeError(f"{d / 'build_ext.py'} did not name the extension it built: {out[-800:]}")
    return found[-1]


def load(so_path: str | os.PathLike[str]) -> Any:
    """The built extension (a module with sparse_decode_fwd), loaded from its .so."""
    return load_extension(EXT_NAME, so_path)


# ---------------------------------------------------------------- the fp8_ds_mla rows


def quantize_fp8_ds_mla(rows: torch.Tensor) -> torch.Tensor:
    """(N, 576) float rows -> (N, 656) uint8 fp8_ds_mla rows: per 128-value latent tile an fp32 scale amax / 448 (at
    least 1e-4 / 448) and the tile's values e4m3(x / scale); the 64 RoPE values as BF16."""
    n = rows.shape[0]
    x = rows.float()
    lat = x[:, :D_V].reshape(n, D_V // TILE, TILE)
    scale = lat.abs().amax(dim=-1).clamp_min(1e-4) / 448.0  # (N, 4) fp32
    q8 = (lat / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).reshape(n, D_V)
    out = torch.empty((n, ROW_BYTES), dtype=torch.uint8, device=rows.device)
    out[:, :D_V] = q8.view(torch.uint8)
    out[:, D_V:D_V + 16] = scale.contiguous().view(torch.uint8)
    out[:, D_V + 16:] = x[:, D_V:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


def dequantize_fp8_ds_mla(rows: torch.Tensor) -> torch.Tensor:
    """(N, 656) uint8 fp8_ds_mla rows -> (N, 576) float32: the values the kernel computes with."""
    n = rows.shape[0]
    lat = rows[:, :D_V].contiguous().view(torch.float8_e4m3fn).float().reshape(n, D_V // TILE, TILE)
    scale = rows[:, D_V:D_V + 16].contiguous().view(torch.float32)
    rope = rows[:, D_V + 16:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(lat * scale.unsqueeze(-1)).reshape(n, D_V), rope], dim=-1)


def padded_heads(heads: int) -> int:
    """vLLM 0.33's FlashMLASparseImpl._compute_fp8_decode_padded_heads: the kernel takes 64 or 128 heads."""
    if not 1 <= heads <= 128:
        raise ValueError(f"heads must be in 1..128 for FlashMLA's sparse decode, got {heads}")
    return 64 if heads <= 64 else 128


class FlashMLAPeer:
    """One fp8_ds_mla sparse decode of `rows` rows x `heads` heads over `width` selected rows each, as vLLM runs it.

    ext: load()'s module. sm_scale: logits = sm_scale * q . k (k the dequantized row). The first call (plan) makes the
    scheduler metadata for this batch shape; later calls reuse it (capturable in a CUDA graph).
    """

    def __init__(self, ext: Any, heads: int, rows: int, width: int, *, sm_scale: float) -> None:
        self.ext, self.heads, self.rows, self.width = ext, int(heads), int(rows), int(width)
        self.padded = padded_heads(self.heads)
        self.sm_scale = float(sm_scale)
        self.meta: Any = None
        self.nsplits: Any = None

    def plan(self, q: torch.Tensor, kv_rows: torch.Tensor, slots: torch.Tensor) -> None:
        """One eager call: makes the scheduler metadata (not capturable, as vLLM makes it before the graph)."""
        self.run(q, kv_rows, slots)

    def run(self, q: torch.Tensor, kv_rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """q (rows, H, 576) bf16; kv_rows (N, 656) uint8, N a multiple of 64; slots (rows, K) int32 flat rows (-1:
        none). Returns out (rows, H, 512) bf16, a view of the padded call's output (as vLLM slices it)."""
        if self.padded != self.heads:  # vLLM: q.new_zeros(padded) and the real heads copied in
            qp = q.new_zeros((q.shape[0], 1, self.padded, D_QK))
            qp[:, 0, : self.heads] = q
        else:
            qp = q.unsqueeze(1)
        kv = kv_rows.view(kv_rows.shape[0] // PAGE, PAGE, 1, ROW_BYTES)
        out, _lse, meta, nsplits = self.ext.sparse_decode_fwd(
            qp, kv, slots.unsqueeze(1), None, None, self.meta, self.nsplits, None, None, None, D_V, self.sm_scale)
        self.meta, self.nsplits = meta, nsplits
        return out[:, 0, : self.heads]


def reference(q: torch.Tensor, kv_values: torch.Tensor, slots: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """float64 reference: q (rows, H, 576), kv_values (N, 576) the rows' values, slots (rows, K) (-1 ignored)."""
    outs = []
    for i in range(slots.shape[0]):
        ids = slots[i][slots[i] >= 0].long()
        k = kv_values[ids].double()
        p = torch.softmax((q[i].double() @ k.T) * sm_scale, dim=-1)
        outs.append(p @ k[:, :D_V])
    return torch.stack(outs)


def probe(ext: Any, heads: int, rows: int = 3, width: int = 256, num_rows: int = 4096) -> dict[str, Any]:
    """A small case (holes, a short row) through FlashMLAPeer against the float64 reference of its packed rows."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(heads * 7 + rows)
    kv = quantize_fp8_ds_mla(torch.randn(num_rows, D_QK, device=dev, generator=g))
    slots = torch.randint(0, num_rows, (rows, width), dtype=torch.int32, device=dev, generator=g)
    slots[1, width // 3:] = -1
    slots[2, ::5] = -1
    q = torch.randn(rows, heads, D_QK, device=dev, generator=g).to(torch.bfloat16)
    sm = 1.0 / math.sqrt(192.0)
    peer = FlashMLAPeer(ext, heads, rows, width, sm_scale=sm)
    out = peer.run(q, kv, slots)
    torch.cuda.synchronize()
    ref = reference(q, dequantize_fp8_ds_mla(kv), slots, sm)
    err = float((out.double() - ref).norm() / ref.norm())
    return {"kind": "flashmla", "heads": heads, "padded": peer.padded, "rel_l2_err": err,
            "ok": bool(math.isfinite(err) and err < 2e-2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", required=True, help="the flashmla_bench folder ('' / 'auto': find it)")
    ap.add_argument("--build-dir", default="/tmp/fmla_build", help="where torch's extension build goes")
    ap.add_argument("--probe-heads", default="128,64,8", help="head counts to check on small cases")
    args = ap.parse_args(argv)
    ok, why = available(None if args.build in ("", "auto") else args.build)
    if not ok:
        print(json.dumps({"kind": "flashmla", "available": False, "why": why}), flush=True)
        return 3
    t = time.perf_counter()
    try:
        so = build(Path(why), args.build_dir)
        ext = load(so)
    except Exception as err:  # noqa: BLE001 - reported to the suite, which goes on without the peer
        print(json.dumps({"kind": "flashmla", "available": True, "build_error": repr(err)[-1500:]}), flush=True)
        return 4
    print(json.dumps({"kind": "flashmla", "available": True, "so": so, "build_s": round(time.perf_counter() - t, 1)}),
          flush=True)
    for h in [int(x) for x in args.probe_heads.split(",") if x]:
        try:
            rec = probe(ext, h)
        except Exception as err:  # noqa: BLE001
            rec = {"kind": "flashmla", "heads": h, "ok": False, "error": repr(err)[-800:]}
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
