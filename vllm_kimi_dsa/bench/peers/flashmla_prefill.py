"""The Hopper prefill peer: FlashMLA's SM90 sparse prefill (`flash_mla_sparse_fwd`) as vLLM 0.33 runs it for a
prefill chunk on an FP8 cache (FLASHMLA_SPARSE's separate prefill / decode path, >= 32 heads a rank).

What vLLM does per prefill chunk (vllm/v1/attention/backends/mla/flashmla_sparse.py,
`_forward_fp8_kv_separate_prefill_decode`): `ops.cp_gather_and_upconvert_fp8_kv_cache` gathers every chunk
request's whole context (context + query tokens) from the fp8_ds_mla cache into a BF16 workspace (rows, 576);
the top-k ids become workspace offsets (`triton_convert_req_index_to_global_index`, HAS_PREFILL_WORKSPACE, -1 kept,
valid counts returned); `_bf16_flash_mla_kernel` pads the BF16 query to a multiple of 64 heads (a workspace slice,
its extra heads zeroed) and calls `flash_mla_sparse_fwd(q, workspace (rows, 1, 576), indices (tokens, 1, K),
softmax_scale, topk_length=counts, out=padded_out)`; the first H heads are then copied into the compact output.
`PrefillPeer.run` is that last part (pad, kernel, copy); the gather is timed apart by the suite (a torch stand-in).

Below 32 heads a rank (MIN_HEADS_FOR_BF16_PREFILL) vLLM does not run this kernel: the whole batch goes through
FlashMLA's FP8 sparse decode kernel ("mixed batch"); the suite still times this one there, padded to 64 heads.

Builds of the kernel, the first that is here:
- vLLM 0.33's own `_flashmla_C` from the vLLM pack (tools/device_run.sh --vllm .carry/vllm_flashmla), called through
  vLLM's `flash_mla_sparse_fwd` wrapper (peers.flashmla.vllm_ops), `out=` given as vLLM gives it: the default;
  nothing is built then;
- FlashMLA 9241ae3 compiled here (benchmarks/peers/flashmla_prefill/prepare.sh: sm_90a objects + the API generated
  from FlashMLA's sparse_fwd.h into .carry/flashmla_prefill/, with its build_ext.py), linked against the running
  torch by that build_ext.py (run as a child);
- vLLM 0.33's own `_flashmla_C.abi3.so` (torch's stable ABI, so it may load on another torch), copied beside them
  by prepare.sh: exactly the kernel vLLM runs, where it loads.

    python -m vllm_kimi_dsa.bench.peers.flashmla_prefill --build [HARNESS_DIR] [--build-dir B]
        builds, loads, checks small cases; JSON lines on stdout
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from vllm_kimi_dsa.bench.peers import CARRY, flashmla as decode_peer, load_extension, run_build_script

D_QK, D_V = 576, 512
HEAD_PAD = 64  # vLLM's FlashMLASparseImpl.prefill_padding: the BF16 prefill kernel takes 64 or 128 heads
ENV_DIR = "FLASHMLA_PREFILL_DIR"  # the harness folder (objs/, api_prefill.cpp; FlashMLA's tree beside it)
ENV_SO = "FLASHMLA_PREFILL_SO"  # an extension built earlier (skips the build)
CARRY_DIR = CARRY / "flashmla_prefill"
EXT_NAME = "flash_mla_sm90_sparse_prefill"
VLLM_SO = "vllm_flashmla_C.abi3.so"
SOURCE_VLLM = "vllm-0.33"  # vLLM's _flashmla_C: from the vLLM pack (route given) or copied beside the harness


def vllm_fwd() -> tuple[Callable[..., Any], str]:
    """vLLM's flash_mla_sparse_fwd as `fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out)` and the
    module it came from (peers.flashmla.vllm_ops); fwd.takes_out: vLLM hands the kernel its padded output buffer."""
    ops, route = decode_peer.vllm_ops()

    def fwd(q, kv, idx, sm, dv, sink, lens, out=None):
        return ops.flash_mla_sparse_fwd(q, kv, idx, sm, d_v=dv, attn_sink=sink, topk_length=lens, out=out)

    fwd.takes_out = True  # type: ignore[attr-defined]
    return fwd, route


def harness_dir(given: str | os.PathLike[str] | None = None) -> Path | None:
    """`given`, else $FLASHMLA_PREFILL_DIR, else .carry/flashmla_prefill (CARRY_DIR): the first that holds the
    generated API; None where none does."""
    for cand in (given, os.environ.get(ENV_DIR), CARRY_DIR):
        if cand and (Path(cand) / "api_prefill.cpp").is_file():
            return Path(cand).resolve()
    return None


def available(given: str | os.PathLike[str] | None = None) -> tuple[bool, str]:
    """(True, the harness folder) when objects, API and FlashMLA's headers are there; else (False, why)."""
    if os.environ.get(ENV_SO) and Path(os.environ[ENV_SO]).is_file():
        return True, os.environ[ENV_SO]
    d = harness_dir(given)
    if d is None:
        return False, (f"no prefill peer harness (${ENV_DIR} or {CARRY_DIR}; "
                       "bash benchmarks/peers/flashmla_prefill/prepare.sh)")
    missing = [str(p) for p in (d / "objs" / "phase1_k576_topklen.o", d / "objs" / "phase1_k576.o",
                                d / "build_ext.py", d.parent / "flashmla" / "csrc") if not p.exists()]
    if missing:
        return False, f"harness {d} incomplete: missing {missing}"
    return True, str(d)


def build(d: Path, build_dir: str | os.PathLike[str]) -> str:
    """Link the extension from the harness's objects against this torch with the harness's build_ext.py (a child
    process: `build_ext.py HARNESS BUILD_DIR` prints the built .so's path last); returns that path."""
    lines = run_build_script(d / "build_ext.py", str(d), str(build_dir)).strip().splitlines()
    if not lines or not lines[-1].endswith(".so"):
        raise RuntimeError(f"{d / 'build_ext.py'} did not print the extension it built: {lines[-5:]}")
    return lines[-1]


def load(so_path: str | os.PathLike[str]) -> Callable[..., Any]:
    """FlashMLA's `sparse_prefill_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length) -> [out, max_logits,
    lse]` from a built .so: the reduced extension (EXT_NAME) or vLLM's _flashmla_C (its op, out_=None)."""
    so_path = str(so_path)
    if Path(so_path).name == VLLM_SO or "_flashmla_C" in Path(so_path).name:
        torch.ops.load_library(so_path)
        op = torch.ops._flashmla_C.sparse_prefill_fwd
        return lambda q, kv, idx, sm, dv, sink, lens: op(q, kv, idx, sm, dv, sink, lens, None)
    return load_extension(EXT_NAME, so_path).sparse_prefill_fwd


def padded_heads(heads: int) -> int:
    """vLLM's `_bf16_flash_mla_kernel`: the query padded to a multiple of 64 heads (16 -> 64, 96 -> 128)."""
    if not 1 <= heads <= 128:
        raise ValueError(f"heads must be in 1..128 for FlashMLA's sparse prefill, got {heads}")
    return -(-heads // HEAD_PAD) * HEAD_PAD


class PrefillPeer:
    """One prefill chunk through flash_mla_sparse_fwd as vLLM's `_bf16_flash_mla_kernel` runs it (out= given).

    fwd: load()'s function. heads: the model's heads a rank (the query's). sm_scale: logits = sm_scale * q . k.
    tokens: query tokens of the chunk (the padded-query and output buffers are sized here, as vLLM's workspace).
    """

    def __init__(self, fwd: Callable[..., Any], heads: int, tokens: int, *, sm_scale: float,
                 device: torch.device | str) -> None:
        self.fwd, self.heads, self.tokens, self.sm_scale = fwd, int(heads), int(tokens), float(sm_scale)
        self.padded = padded_heads(self.heads)
        self.q_padded = (torch.empty((tokens, self.padded, D_QK), dtype=torch.bfloat16, device=device)
                         if self.padded != self.heads else None)
        self.out = torch.empty((tokens, self.heads, D_V), dtype=torch.bfloat16, device=device)  # compact_out
        # vLLM's padded_out workspace: the kernel writes into it (out=) where the function takes it
        self.padded_out = (torch.empty((tokens, self.padded, D_V), dtype=torch.bfloat16, device=device)
                           if getattr(fwd, "takes_out", False) else None)

    def run(self, q: torch.Tensor, workspace: torch.Tensor, indices: torch.Tensor,
            counts: torch.Tensor) -> torch.Tensor:
        """q (tokens, H, 576) bf16; workspace (rows, 576) bf16 (the chunk's gathered, upconverted context);
        indices (tokens, K) int32 workspace offsets (-1: none); counts (tokens,) int32 valid entries of each.
        Returns the compact output (tokens, H, 512) bf16 (this object's buffer)."""
        if self.q_padded is not None:  # vLLM: q_padded[:, H:].zero_(); q_padded[:, :H] = q
            self.q_padded[:, self.heads:].zero_()
            self.q_padded[:, : self.heads] = q
            q = self.q_padded
        args = (q, workspace.view(-1, 1, D_QK), indices.view(indices.shape[0], 1, -1), self.sm_scale, D_V, None, counts)
        if self.padded_out is not None:
            out, _max_logits, _lse = self.fwd(*args, out=self.padded_out)
        else:
            out, _max_logits, _lse = self.fwd(*args)
        self.out.copy_(out[:, : self.heads])  # attn_out[chunk.tokens_slice].copy_(chunk_out)
        return self.out


def reference(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, counts: torch.Tensor,
              sm_scale: float) -> torch.Tensor:
    """float64: q (tokens, H, 576), kv (rows, 576), indices (tokens, K) (-1 and entries past counts ignored)."""
    outs = []
    for i in range(indices.shape[0]):
        ids = indices[i, : int(counts[i])]
        k = kv[ids[ids >= 0].long()].double()
        p = torch.softmax((q[i].double() @ k.T) * sm_scale, dim=-1)
        outs.append(p @ k[:, :D_V])
    return torch.stack(outs)


def probe(fwd: Callable[..., Any], heads: int, tokens: int = 5, width: int = 256, rows: int = 3000) -> dict[str, Any]:
    """A small case (holes past short counts, a -1 inside one) through PrefillPeer vs the float64 reference."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(heads * 7 + tokens)
    kv = torch.randn(rows, D_QK, device=dev, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(rows, device=dev, generator=g)[:width] for _ in range(tokens)]).int()
    counts = torch.full((tokens,), width, dtype=torch.int32, device=dev)
    counts[1] = width // 3
    idx[1, width // 3:] = -1
    idx[2, 7] = -1
    q = torch.randn(tokens, heads, D_QK, device=dev, generator=g).to(torch.bfloat16)
    sm = 1.0 / math.sqrt(192.0)
    peer = PrefillPeer(fwd, heads, tokens, sm_scale=sm, device=dev)
    out = peer.run(q, kv, idx, counts)
    torch.cuda.synchronize()
    ref = reference(q, kv, idx, counts, sm)
    err = float((out.double() - ref).norm() / ref.norm())
    return {"step": "probe", "heads": heads, "padded": peer.padded, "rel_l2": err,
            "ok": bool(math.isfinite(err) and err < 1e-2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", nargs="?", const="", default=None, help="build the extension from HARNESS_DIR "
                    f"(default ${ENV_DIR}, else {CARRY_DIR}) and check it")
    ap.add_argument("--build-dir", default="/tmp/fmla_prefill_build", help="torch's extension build folder")
    ap.add_argument("--probe-heads", default="128,16", help="head counts to check on small cases")
    args = ap.parse_args(argv)
    if args.build is None:
        ap.error("nothing to do: pass --build [HARNESS_DIR]")
    heads = [int(h) for h in args.probe_heads.split(",") if h]
    emit = lambda rec: print(json.dumps(rec), flush=True)  # noqa: E731
    rc = 1
    # 0) vLLM's own, from the vLLM pack: nothing to build, the kernel vLLM runs
    if not args.build and decode_peer.vllm_available()[0]:
        try:
            fwd, route = vllm_fwd()
            emit({"step": "build", "ok": True, "source": SOURCE_VLLM, "route": route, "wall_s": 0.0})
            for h in heads:
                rec = probe(fwd, h)
                emit({**rec, "source": SOURCE_VLLM, "route": route})
                rc = 0 if rec["ok"] and rc != 2 else 2
            return rc
        except Exception as err:  # noqa: BLE001 - the harness may still be here
            emit({"step": "probe", "ok": False, "source": SOURCE_VLLM, "why": f"{type(err).__name__}: {err}"[-800:]})
    # 1) the build of FlashMLA's sources
    ok, where = available(args.build or None)
    if not ok:
        emit({"step": "build", "ok": False, "why": where})
    else:
        t0 = time.perf_counter()
        try:
            so = where if where.endswith(".so") else build(Path(where), args.build_dir)
            fwd = load(so)
            emit({"step": "build", "ok": True, "so": so, "source": "flashmla-9241ae3",
                  "wall_s": round(time.perf_counter() - t0, 1)})
            for h in heads:
                rec = probe(fwd, h)
                emit({**rec, "source": "flashmla-9241ae3", "so": so})
                rc = 0 if rec["ok"] and rc != 2 else 2
        except Exception as err:  # the suite reads why from the JSON line
            emit({"step": "build", "ok": False, "why": f"{type(err).__name__}: {err}"[-1500:],
                  "wall_s": round(time.perf_counter() - t0, 1)})
    # 2) vLLM's own build, where it loads on this torch
    d = harness_dir(args.build or None)
    vso = d / VLLM_SO if d is not None else None
    if vso is not None and vso.is_file():
        try:
            fwd = load(vso)
            for h in heads:
                emit({**probe(fwd, h), "source": "vllm-0.33", "so": str(vso)})
        except Exception as err:
            emit({"step": "probe", "ok": False, "source": "vllm-0.33", "so": str(vso),
                  "why": f"{type(err).__name__}: {err}"[-800:]})
    return rc


if __name__ == "__main__":
    sys.exit(main())
