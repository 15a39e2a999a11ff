"""The Hopper peer vLLM runs by default: FlashMLA's SM90 sparse FP8 decode (FLASHMLA_SPARSE) on 656 B fp8_ds_mla rows.

Two sources, the first that is here:
- vLLM 0.33's own build (SOURCE_VLLM, the default): its `_flashmla_C` from the vLLM pack (tools/device_run.sh --vllm
  .carry/vllm_flashmla), called through vLLM's Python wrappers (`vllm_ops`: vllm.v1.attention.ops.flashmla's
  get_mla_metadata / flash_mla_with_kvcache / flash_mla_sparse_fwd; where that module cannot import here -- its
  platform needs vLLM's _C_stable_libtorch, which the small pack leaves out -- the very functions it re-exports, from
  vllm.third_party.flashmla.flash_mla_interface);
- the old harness (/work/shared/device/flashmla-sm90, built on the device from FlashMLA's sources; --flashmla,
  $FLASHMLA_PEER_DIR or .carry/flashmla_bench): a fallback.

Called as vLLM 0.33's FlashMLASparseImpl calls the kernel (vllm/v1/attention/backends/mla/flashmla_sparse.py), by
`vllm_shape(heads, rows)`:
- >= 32 heads a rank (MIN_HEADS_FOR_BF16_PREFILL): a decode batch goes through `_forward_fp8_kv_separate_prefill_decode`
  -> `_fp8_flash_mla_kernel` with q (rows, 1, H, 576), indices (rows, 1, K), cache_seqlens / block_table of rows;
- below 32 heads: every batch is a "mixed batch" (`_forward_fp8_kv_mixed_batch`): q.unsqueeze(0) (1, T, H, 576),
  indices (1, T, K), cache_seqlens / block_table of one;
- `_fp8_flash_mla_kernel` pads the query to 64 or 128 heads (`_compute_fp8_decode_padded_heads`) per call with a
  fresh `q.new_zeros` and a copy of the real heads, and slices the output back (a view); the scheduler metadata is
  a fresh `get_mla_metadata()` object a step, filled by the first call (here: made once a batch shape, outside the
  timed graph; in vLLM one layer of a step pays for it).

The fp8_ds_mla row (656 B): 512 e4m3 latent values in 4 tiles of 128, each with an fp32 power-of-two scale (vLLM's
writer, deepseek_v32's fused_norm_rope: 2^ceil(log2(max(amax / 448, 1e-4)))), then the 4 fp32 scales, then the 64
RoPE values as BF16. `quantize_fp8_ds_mla` packs rows so.

`python -m vllm_kimi_dsa.bench.peers.flashmla --build auto|vllm|DIR [--probe-heads 8,64,128]` finds (or builds) the
kernel, checks small cases (padding and both call shapes) against a float64 reference of the packed rows, and prints
one JSON line per step, the first with the source: the suite runs it in the background so a failure cannot crash it.
"""

from __future__ import annotations

import argparse
import importlib.util
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
SOURCE_VLLM = "vllm-0.33"  # vLLM's own _flashmla_C through its Python wrappers
SOURCE_HARNESS = "flashmla-harness"  # the harness's extension built on the device
MIN_HEADS_FOR_BF16_PREFILL = 32  # vLLM's: below it every batch runs FlashMLA's FP8 decode kernel as one mixed batch
MAX_MODEL_LEN = 163840  # the cache_seqlens vLLM passes (max_model_len; ignored by the sparse kernel)


def vllm_available() -> tuple[bool, str]:
    """(True, where) when vLLM and its compiled _flashmla_C are importable here (nothing imported beyond vllm's
    package); else (False, why)."""
    try:
        if importlib.util.find_spec("vllm") is None:
            return False, "vLLM is not importable here (bash tools/device_run.sh --vllm .carry/vllm_flashmla ...)"
        if importlib.util.find_spec("vllm._flashmla_C") is None:
            return False, ("vLLM here has no _flashmla_C (carry a pack with its compiled libraries: SO=flashmla "
                           "FROM=.carry/vllm bash tools/pack_vllm.sh .carry/vllm_flashmla)")
    except (ImportError, ValueError) as err:
        return False, f"vLLM does not import here: {type(err).__name__}: {err}"[:300]
    import vllm

    return True, f"vLLM {getattr(vllm, '__version__', '?')} ({Path(vllm.__file__).parent})"


def vllm_ops() -> tuple[Any, str]:
    """vLLM's FlashMLA wrappers (get_mla_metadata, flash_mla_with_kvcache, flash_mla_sparse_fwd) and the module they
    came from: vllm.v1.attention.ops.flashmla, as FLASHMLA_SPARSE imports them, where that module imports with its
    library available; else vllm.third_party.flashmla.flash_mla_interface, the module whose functions it re-exports
    (its platform check needs vllm._C_stable_libtorch, which the small pack leaves out). ImportError if neither."""
    note = ""
    try:
        from vllm.v1.attention.ops import flashmla as ops

        ok, why = ops.is_flashmla_sparse_supported()
        if ok:
            return ops, ops.__name__
        note = str(why)
    except Exception as err:  # noqa: BLE001 - the platform import fails where _C_stable_libtorch does not load
        note = f"{type(err).__name__}: {err}"
    from vllm.third_party.flashmla import flash_mla_interface as ops

    return ops, f"{ops.__name__} (what vllm.v1.attention.ops.flashmla re-exports; that module here: {note[:200]})"


def vllm_shape(heads: int, rows: int) -> dict[str, Any]:
    """How vLLM 0.33's FlashMLASparseImpl hands `rows` query rows of `heads` heads to the FP8 decode kernel:
    {"mixed": below 32 heads (one batch of rows query tokens), "q": the query's shape before padding, "padded":
    the kernel's heads, "batch": cache_seqlens / block_table rows}."""
    padded = padded_heads(heads)
    if heads < MIN_HEADS_FOR_BF16_PREFILL:
        return {"mixed": True, "q": (1, rows, heads, D_QK), "padded": padded, "batch": 1,
                "path": "_forward_fp8_kv_mixed_batch"}
    return {"mixed": False, "q": (rows, 1, heads, D_QK), "padded": padded, "batch": rows,
            "path": "_forward_fp8_kv_separate_prefill_decode"}


def harness_dir(given: str | os.PathLike[str] | None = None) -> Path | None:
    """The flashmla_bench folder (build_ext.py, api_sm90.cpp, objs/; FlashMLA's tree beside it as ../flashmla):
    `given` (only it, when given), else $FLASHMLA_PEER_DIR, else .carry/flashmla_bench; None where the
    folder asked for is not one."""
    for cand in ((given,) if given else (os.environ.get(ENV_DIR), CARRY_DIR)):
        if cand and (Path(cand) / "build_ext.py").is_file():
            return Path(cand).resolve()
    return None


def available(given: str | os.PathLike[str] | None = None) -> tuple[bool, str]:
    """(True, SOURCE_VLLM or the harness folder) where a FlashMLA is here: vLLM's own (unless `given` names a
    harness), else the harness with FlashMLA's sources; else (False, why)."""
    if not given:
        ok, why_vllm = vllm_available()
        if ok:
            return True, SOURCE_VLLM
    else:
        why_vllm = "a harness folder was given"
    ok, why = harness_available(given)
    return (True, why) if ok else (False, f"{why_vllm}; {why}")


def harness_available(given: str | os.PathLike[str] | None = None) -> tuple[bool, str]:
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
    """(N, 576) float rows -> (N, 656) uint8 fp8_ds_mla rows as vLLM writes them: per 128-value latent tile an fp32
    power-of-two scale (tile_scales) and the tile's values e4m3(x / scale); the 64 RoPE values as BF16."""
    n = rows.shape[0]
    x = rows.float()
    lat = x[:, :D_V].reshape(n, D_V // TILE, TILE)
    scale = tile_scales(x[:, :D_V])  # (N, 4) fp32
    q8 = (lat / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).reshape(n, D_V)
    out = torch.empty((n, ROW_BYTES), dtype=torch.uint8, device=rows.device)
    out[:, :D_V] = q8.view(torch.uint8)
    out[:, D_V:D_V + 16] = scale.contiguous().view(torch.uint8)
    out[:, D_V + 16:] = x[:, D_V:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


def tile_scales(latent: torch.Tensor) -> torch.Tensor:
    """(N, 4) fp32 scales of (N, 512) latent values as vLLM's fp8_ds_mla writer makes them (deepseek_v32's
    fused_norm_rope, MLA_CACHE_DS_MLA): per 128-value tile 2^ceil(log2(max(amax / 448, 1e-4)))."""
    amax = latent.float().reshape(latent.shape[0], D_V // TILE, TILE).abs().amax(dim=-1)
    return torch.exp2(torch.ceil(torch.log2((amax / 448.0).clamp_min(1e-4))))


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
    scheduler metadata for this batch shape; later calls reuse it (capturable in a CUDA graph), or (fresh_metadata)
    every call makes its own, in its time.
    """

    def __init__(self, ext: Any, heads: int, rows: int, width: int, *, sm_scale: float,
                 fresh_metadata: bool = False) -> None:
        self.ext, self.heads, self.rows, self.width = ext, int(heads), int(rows), int(width)
        self.padded = padded_heads(self.heads)
        self.sm_scale = float(sm_scale)
        self.fresh_metadata = bool(fresh_metadata)
        self.meta: Any = None
        self.nsplits: Any = None

    def plan(self, q: torch.Tensor, kv_rows: torch.Tensor, slots: torch.Tensor) -> None:
        """One eager call: makes the scheduler metadata (not capturable, as vLLM makes it before the graph)."""
        self.run(q, kv_rows, slots)

    def run(self, q: torch.Tensor, kv_rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """q (rows, H, 576) bf16; kv_rows (N, 656) uint8, N a multiple of 64; slots (rows, K) int32 flat rows (-1:
        none). Returns out (rows, H, 512) bf16, a view of the padded call's output (as vLLM slices it). Shapes as
        vllm_shape: (1, rows, H) below 32 heads, else (rows, 1, H)."""
        shape = vllm_shape(self.heads, q.shape[0])
        q4 = q.view(shape["q"])
        idx = slots.view(shape["q"][0], shape["q"][1], -1)
        if self.padded != self.heads:  # vLLM: q.new_zeros(padded) and the real heads copied in
            qp = q4.new_zeros((q4.shape[0], q4.shape[1], self.padded, D_QK))
            qp[:, :, : self.heads] = q4
        else:
            qp = q4
        kv = kv_rows.view(kv_rows.shape[0] // PAGE, PAGE, 1, ROW_BYTES)
        meta, nsplits = (None, None) if self.fresh_metadata else (self.meta, self.nsplits)
        out, _lse, meta, nsplits = self.ext.sparse_decode_fwd(
            qp, kv, idx, None, None, meta, nsplits, None, None, None, D_V, self.sm_scale)
        self.meta, self.nsplits = meta, nsplits
        return out[:, :, : self.heads].reshape(q.shape[0], self.heads, D_V)


class VllmFlashMLA:
    """FlashMLA's sparse FP8 decode as vLLM 0.33's FlashMLASparseImpl runs it, through vLLM's own wrappers.

    ops: vllm_ops()'s module. heads: the rank's query heads; rows: query tokens a call (a decode batch, or a
    prefill chunk's tokens below 32 heads); sm_scale: logits = sm_scale * q . k (k the dequantized row).
    The first call (plan) fills the step's scheduler metadata (vLLM: a fresh get_mla_metadata() a step); later calls
    reuse it (graph-capturable), or (fresh_metadata) every call takes a fresh get_mla_metadata(), filled in that call
    (its scheduler kernel then runs in the call's time, as in a step's first layer). Each call pads the query as vLLM
    does (q.new_zeros + copy, inside the call).
    """

    def __init__(self, ops: Any, heads: int, rows: int, *, sm_scale: float, device: torch.device | str,
                 fresh_metadata: bool = False) -> None:
        self.ops, self.heads, self.rows, self.sm_scale = ops, int(heads), int(rows), float(sm_scale)
        self.fresh_metadata = bool(fresh_metadata)
        self.shape = vllm_shape(self.heads, self.rows)
        self.padded = self.shape["padded"]
        batch = self.shape["batch"]
        # the builder's buffers, sliced as the impl slices them (max_num_seqs rows; here the batch's)
        self.dummy_block_table = torch.empty((batch, 1), dtype=torch.int32, device=device)
        self.cache_lens = torch.full((batch,), MAX_MODEL_LEN, dtype=torch.int32, device=device)
        self.sched = ops.get_mla_metadata()[0]

    def describe(self) -> str:
        b, s, h, _ = self.shape["q"]
        return (f"vLLM {self.shape['path']}: q ({b}, {s}, {h} -> {self.padded}, 576), indices ({b}, {s}, K); "
                f"query padded per call (q.new_zeros + copy)" if self.padded != self.heads else
                f"vLLM {self.shape['path']}: q ({b}, {s}, {h}, 576), indices ({b}, {s}, K)")

    def plan(self, q: torch.Tensor, kv_rows: torch.Tensor, slots: torch.Tensor) -> None:
        """One eager call: fills the scheduler metadata (not capturable, as vLLM fills it before replaying)."""
        self.run(q, kv_rows, slots)

    def run(self, q: torch.Tensor, kv_rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """q (rows, H, 576) bf16; kv_rows (N, 656) uint8 fp8_ds_mla rows, N a multiple of 64; slots (rows, K) int32
        flat rows (-1: none). Returns out (rows, H, 512) bf16: a view of the kernel's padded output, as vLLM."""
        b, s, h, d = self.shape["q"]
        q4 = q.view(b, s, h, d)  # mixed: q.unsqueeze(0); decode: reshape_query_for_spec_decode
        idx = slots.view(b, s, -1)
        if h < self.padded:  # _fp8_flash_mla_kernel
            q_padded = q4.new_zeros((q4.size(0), q4.size(1), self.padded, q4.size(3)))
            q_padded[:, :, :h, :] = q4
            q4 = q_padded
        out, _lse = self.ops.flash_mla_with_kvcache(
            q=q4, k_cache=kv_rows.view(-1, PAGE, ROW_BYTES).view(torch.uint8).unsqueeze(-2),
            block_table=self.dummy_block_table, head_dim_v=D_V, cache_seqlens=self.cache_lens,
            tile_scheduler_metadata=self.ops.get_mla_metadata()[0] if self.fresh_metadata else self.sched,
            is_fp8_kvcache=True, indices=idx, softmax_scale=self.sm_scale)
        if h < self.padded:
            out = out[:, :, :h, :]
        return out.squeeze(0) if self.shape["mixed"] else out.view(b * s, h, D_V)


def reference(q: torch.Tensor, kv_values: torch.Tensor, slots: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """float64 reference: q (rows, H, 576), kv_values (N, 576) the rows' values, slots (rows, K) (-1 ignored)."""
    outs = []
    for i in range(slots.shape[0]):
        ids = slots[i][slots[i] >= 0].long()
        k = kv_values[ids].double()
        p = torch.softmax((q[i].double() @ k.T) * sm_scale, dim=-1)
        outs.append(p @ k[:, :D_V])
    return torch.stack(outs)


def open_source(record: dict[str, Any]) -> tuple[str, Any]:
    """(source, handle) of a build child's first record: (SOURCE_VLLM, vllm_ops()'s module) or (SOURCE_HARNESS, the
    loaded extension)."""
    if record.get("source") == SOURCE_VLLM:
        return SOURCE_VLLM, vllm_ops()[0]
    return SOURCE_HARNESS, load(record["so"])


def make_peer(source: tuple[str, Any], heads: int, rows: int, width: int, *, sm_scale: float,
              device: torch.device | str, fresh_metadata: bool = False) -> VllmFlashMLA | FlashMLAPeer:
    """The decode of `source` (open_source's) for a batch of `rows` rows of `heads` heads over `width` selections;
    fresh_metadata: the scheduler metadata made in every call (as the first layer of each vLLM step makes it)."""
    kind, handle = source
    if kind == SOURCE_VLLM:
        return VllmFlashMLA(handle, heads, rows, sm_scale=sm_scale, device=device, fresh_metadata=fresh_metadata)
    return FlashMLAPeer(handle, heads, rows, width, sm_scale=sm_scale, fresh_metadata=fresh_metadata)


def probe(source: tuple[str, Any], heads: int, rows: int = 3, width: int = 256,
          num_rows: int = 4096) -> dict[str, Any]:
    """A small case (holes, a short row) through make_peer's decode against the float64 reference of its packed
    rows (the call shape vLLM uses at this head count)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(heads * 7 + rows)
    kv = quantize_fp8_ds_mla(torch.randn(num_rows, D_QK, device=dev, generator=g))
    slots = torch.randint(0, num_rows, (rows, width), dtype=torch.int32, device=dev, generator=g)
    slots[1, width // 3:] = -1
    slots[2, ::5] = -1
    q = torch.randn(rows, heads, D_QK, device=dev, generator=g).to(torch.bfloat16)
    sm = 1.0 / math.sqrt(192.0)
    peer = make_peer(source, heads, rows, width, sm_scale=sm, device=dev)
    out = peer.run(q, kv, slots)
    torch.cuda.synchronize()
    ref = reference(q, dequantize_fp8_ds_mla(kv), slots, sm)
    err = float((out.double() - ref).norm() / ref.norm())
    return {"kind": "flashmla", "source": source[0], "heads": heads, "padded": peer.padded,
            "shape": list(vllm_shape(heads, rows)["q"]), "rel_l2_err": err,
            "ok": bool(math.isfinite(err) and err < 2e-2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", required=True, help="'auto' (vLLM's own where here, else the harness), 'vllm' "
                    "(vLLM's only), or the flashmla_bench folder")
    ap.add_argument("--build-dir", default="/tmp/fmla_build", help="where torch's extension build goes (harness)")
    ap.add_argument("--probe-heads", default="128,64,8", help="head counts to check on small cases")
    args = ap.parse_args(argv)
    if args.build == "vllm":
        ok, why = vllm_available()
        why = SOURCE_VLLM if ok else why
    else:
        ok, why = available(None if args.build in ("", "auto") else args.build)
    if not ok:
        print(json.dumps({"kind": "flashmla", "available": False, "why": why}), flush=True)
        return 3
    t = time.perf_counter()
    try:
        if why == SOURCE_VLLM:
            ops, route = vllm_ops()
            source: tuple[str, Any] = (SOURCE_VLLM, ops)
            first = {"kind": "flashmla", "available": True, "source": SOURCE_VLLM, "route": route,
                     "where": vllm_available()[1]}
        else:
            so = build(Path(why), args.build_dir)
            source = (SOURCE_HARNESS, load(so))
            first = {"kind": "flashmla", "available": True, "source": SOURCE_HARNESS, "so": so}
    except Exception as err:  # noqa: BLE001 - reported to the suite, which goes on without the peer
        print(json.dumps({"kind": "flashmla", "available": True, "build_error": repr(err)[-1500:]}), flush=True)
        return 4
    print(json.dumps({**first, "build_s": round(time.perf_counter() - t, 1)}), flush=True)
    for h in [int(x) for x in args.probe_heads.split(",") if x]:
        try:
            rec = probe(source, h)
        except Exception as err:  # noqa: BLE001
            rec = {"kind": "flashmla", "heads": h, "ok": False, "error": repr(err)[-800:]}
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
