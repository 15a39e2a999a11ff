"""Which shared-memory hand-offs `compute-sanitizer --tool racecheck` can follow in a Gluon warp-specialized kernel.

Two consumer-like partitions (the default warpgroup and one worker warpgroup) swap 128 fp32 values a step through
shared memory, double-buffered by step parity, the way gluon_decode's consumers swap their row maxima. MODE picks
the hand-off:

  0  no hand-off: warp_specialize alone (what Triton's own partition state costs racecheck)
  1  store, one thread's mbarrier.arrive (count 1, Triton puts a partition bar.sync before it), the other waits:
     gluon_decode's row-max exchange today
  2  store, every thread's cp.async.mbarrier.arrive.noinc (count 128), the other waits
  3  store, a named barrier of both warpgroups (inline `bar.sync 15, 256`), load

    python3 tools/racecheck_probe.py MODE [--compile-only]

prints whether the swapped values are right; run it under racecheck to see which modes it reports. With
--compile-only it compiles all modes for sm_90a (no GPU) and prints each kernel's named barriers."""

from __future__ import annotations

import re
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

N = 128
STEPS = 6
_ONE_EACH = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))  # 128 values, one a thread of a warpgroup


@gluon.jit
def _side(x_s, x_ready, out_ptr, steps, HALF: gl.constexpr, MODE: gl.constexpr):
    offs = gl.arange(0, 128, _ONE_EACH)
    acc = gl.zeros([128], gl.float32, _ONE_EACH)
    for it in range(steps):
        xb = it % 2
        v = (offs + it * 7 + HALF * 1000).to(gl.float32)
        if MODE == 0:
            w = v
        else:
            x_s.index(xb * 2 + HALF).store(v)
            if MODE == 1:
                mbarrier.arrive(x_ready.index(HALF))
                mbarrier.wait(x_ready.index(1 - HALF), it & 1)
            elif MODE == 2:
                async_copy.mbarrier_arrive(x_ready.index(HALF), increment_count=False)
                mbarrier.wait(x_ready.index(1 - HALF), it & 1)
            else:
                gl.inline_asm_elementwise("bar.sync 15, 256;\n\tmov.u32 $0, 0;", "=r,r", [offs], dtype=gl.int32,
                                          is_pure=False, pack=1)
            w = x_s.index(xb * 2 + 1 - HALF).load(_ONE_EACH)
        acc += w
    gl.store(out_ptr + HALF * 128 + offs, acc)


@gluon.jit
def probe_kernel(out_ptr, steps, MODE: gl.constexpr):
    x_s = gl.allocate_shared_memory(gl.float32, [4, 128], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    x_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        if MODE == 2:
            mbarrier.init(x_ready.index(i), count=128)
        else:
            mbarrier.init(x_ready.index(i), count=1)
    gl.warp_specialize(
        [
            (_side, (x_s, x_ready, out_ptr, steps, 0, MODE)),
            (_side, (x_s, x_ready, out_ptr, steps, 1, MODE)),
        ],
        [4],
        [128],
    )


def expected(mode: int) -> torch.Tensor:
    offs = torch.arange(N, dtype=torch.float64)
    halves = []
    for half in (0, 1):
        src = half if mode == 0 else 1 - half
        halves.append(sum(offs + 7 * it + 1000 * src for it in range(STEPS)))
    return torch.cat(halves).float()


def compile_only() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    for mode in range(4):
        src = GluonASTSource(fn=probe_kernel, signature={"out_ptr": "*fp32", "steps": "i32", "MODE": "constexpr"},
                             constexprs={"MODE": mode})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        bars = sorted(set(re.findall(r"\b(?:bar|barrier)\.\w+(?:\.\w+)*\s+[^;]*;", k.asm["ptx"])))
        print(f"mode {mode}: named barriers {bars}")


def main() -> int:
    if "--compile-only" in sys.argv:
        compile_only()
        return 0
    mode = int(sys.argv[1])
    out = torch.full((2 * N,), float("nan"), device="cuda")
    probe_kernel[(1,)](out, STEPS, MODE=mode, num_warps=4)
    torch.cuda.synchronize()
    ok = torch.equal(out.cpu(), expected(mode))
    print(f"mode {mode}: triton {triton.__version__}, values {'right' if ok else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
