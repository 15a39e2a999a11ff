"""Both Hopper decode kernels compile for SM90 with the installed Triton, on any machine (no GPU needed).

CI installs vLLM 0.33's Triton (3.8) while the H200 runs 3.6: this is where a Triton upgrade that breaks the
plain kernel's default configs or the Gluon kernel's API shows up before anyone runs them on a GPU. Checks what
the compiled code must hold: wgmma for the 64-head fp8 tile, no register spills in the Gluon kernel's partitions
beyond a small bound, and no wgmma serialization (ptxas C7514 / C7515, which would undo the kernel's overlap).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_kimi_dsa.kernels.common import gluon as glcommon

ROOT = Path(__file__).resolve().parents[1]


def _compile_env() -> dict[str, str]:
    """This process's environment without TRITON_INTERPRET (set by conftest on a CPU), PYTHONPATH on the repo."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.parametrize("scheduled", [False, True], ids=["static", "scheduled"])
def test_triton_kernel_default_configs_compile_for_sm90(scheduled: bool) -> None:
    """sass_report.py in a process of its own: the tests run `triton.jit` kernels in the interpreter, which cannot
    be compiled; the report compiles every default config (both formats; 128, 32 and 16 heads), static or in its
    scheduled form (the planner's items)."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sass_report.py")] + ["--scheduled"] * scheduled,
                       capture_output=True, text=True, env=_compile_env(), cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.startswith(("fp8-", "nvfp4_ds_mla-"))}
    assert set(rows) == {f"{f}-H{h}" for f in ("fp8", "nvfp4_ds_mla") for h in (128, 32, 16)}, r.stdout
    assert not any("FAILED" in line for line in rows.values()), r.stdout
    assert "QGMMA=" in rows["fp8-H128"], "the 64-head fp8 tile must run Q.K on fp8 wgmma"


# Triton 3.6 (the device image's; vLLM 0.33 pins 3.8) installed beside the venv's own, as the README's test command
# does: `pip install --no-deps --target .venv/triton-3.6 triton==3.6.0`
TRITON_36 = Path(sys.prefix) / "triton-3.6"


@pytest.mark.parametrize("triton_site", [
    None, pytest.param(TRITON_36, marks=pytest.mark.xfail(strict=True, reason=(
        "main's static Gluon forms do not compile on Triton 3.6 where num_splits is 1 (issue 58; the fix is the "
        "branch issue58-kernels)")))], ids=["installed", "3.6"])
def test_every_served_form_compiles_for_sm90(triton_site: Path | None) -> None:
    """Every form the Hopper dispatcher launches (tests/served_forms.py, enumerated from TritonDecode: heads 1..128,
    both cache formats, the LSE on and off, VLLM_KIMI_DSA_GLUON unset and 0, VLLM_KIMI_DSA_FP8_PV 0 and 1,
    VLLM_KIMI_DSA_SCHEDULE static and counts, every plan of 1..512 rows) compiles for sm_90a under the installed Triton and under Triton 3.6, specialized as Triton's
    JIT specializes it at that launch. The hand-written signatures below keep every int a runtime argument; the JIT
    makes an int of 1 a constant (num_splits of a whole-row launch), and such a form can fail where theirs compile,
    on one Triton and not the other."""
    env = _compile_env()
    if triton_site is not None:
        if not (triton_site / "triton" / "__init__.py").is_file():
            pytest.skip(f"no Triton 3.6 at {triton_site} (pip install --no-deps --target {triton_site} triton==3.6.0)")
        env["PYTHONPATH"] = str(triton_site) + os.pathsep + env["PYTHONPATH"]
    shards = max(1, min(4, os.cpu_count() or 1))
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "served_forms.py"), "--compile", "--shard",
                               f"{i}/{shards}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=ROOT) for i in range(shards)]
    lines, failed = [], []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        shard = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert shard and "forms" in shard[-1], err[-2000:]
        bad = [f"{d['kernel']} {d['first']}: {d['compiled']}" for d in shard[:-1] if d["compiled"] != "ok"]
        assert p.returncode == (1 if bad else 0), err[-2000:]
        lines += shard[:-1]
        failed += bad
    assert not failed, "\n".join(failed)
    assert len(lines) == shard[-1]["forms"]  # the shards together compiled every form
    assert triton_site is None or shard[-1]["triton"].startswith("3.6"), shard[-1]
    kernels = {d["kernel"] for d in lines}
    gluon = {"gluon_decode_kernel", "seesaw_decode_kernel", "few_heads_kernel"} if glcommon.gl is not None and \
        glcommon.triton_version_supported() else set()
    scheduled = {"schedule_kernel", "combine_scheduled_kernel"}
    assert kernels == {"decode_kernel", "combine_kernel"} | scheduled | gluon, kernels
    # the specialization a hand signature never makes: a whole-row launch's num_splits of 1 as a constant
    assert any("('constexpr', 1)" in d["specialization"] for d in lines if d["kernel"] == "decode_kernel")


_GLUON_COMPILE = """
import json, sys
sys.path.insert(0, "benchmarks")
import gluon_report
args = json.loads(sys.argv[1])
k = gluon_report.compile_gluon(args.pop("kernel", "gluon"), **args)
s = gluon_report.analyze(k)
print(json.dumps({key: s[key] for key in ("wgmma_serialized", "wgmma_injected", "shared", "spill_stores", "regs_launch")}
                 | {"kinds": sorted({lp["kind"] for lp in s["loops"]}),
                    "consumer_loops": sum(lp["kind"] == "consumer" for lp in s["loops"])}))
"""


# the Gluon compile checks: Gluon imports and Triton is a version its kernels are written for
_NEEDS_GLUON = pytest.mark.skipif(glcommon.gl is None or not glcommon.triton_version_supported(),
                                  reason=glcommon.gluon_unavailable_reason() or "Gluon unavailable")


@_NEEDS_GLUON
@pytest.mark.parametrize("overrides", [{}, {"scheduled": True}, {"block_n": 32, "k_stages": 4, "v_slots": 4},
                                       {"kernel": "few", "nvfp4": True, "reg_v": False, "k_stages": 3},
                                       {"kernel": "few", "nvfp4": True, "reg_v": False, "k_stages": 3, "heads": 32},
                                       {"kernel": "few", "heads": 32},
                                       {"kernel": "few", "reg_v": True, "k_stages": 3},
                                       {"kernel": "few", "reg_v": True, "k_stages": 2, "pv_in_flight": 2,
                                        "ctas_per_sm": 2, "producer_regs": 56},
                                       {"kernel": "few", "reg_v": True, "k_stages": 2, "pv_in_flight": 2,
                                        "ctas_per_sm": 2, "producer_regs": 56, "pv_early": True},
                                       {"kernel": "seesaw"}, {"kernel": "seesaw", "pv_in_flight": 1, "k_stages": 3},
                                       {"kernel": "seesaw", "nvfp4": True, "k_stages": 3},
                                       {"kernel": "few", "reg_v": True, "k_stages": 3, "block_h": 8, "heads": 8},
                                       {"kernel": "few", "reg_v": True, "k_stages": 2, "pv_in_flight": 2,
                                        "ctas_per_sm": 2, "producer_regs": 56, "pv_early": True, "block_h": 8,
                                        "heads": 8},
                                       {"kernel": "seesaw", "scheduled": True},
                                       {"kernel": "few", "reg_v": True, "k_stages": 2, "pv_in_flight": 2,
                                        "ctas_per_sm": 2, "producer_regs": 56, "pv_early": True, "scheduled": True},
                                       {"kernel": "few", "nvfp4": True, "reg_v": False, "k_stages": 3, "heads": 32,
                                        "scheduled": True}],
                         ids=["default", "scheduled", "block_n_32", "few_heads_nvfp4", "few_heads_nvfp4_32", "few_heads_32",
                              "few_heads_reg_v",
                              "few_heads_reg_v_two_ctas", "few_heads_reg_v_two_ctas_pv_early", "seesaw",
                              "seesaw_pv1_ks3", "seesaw_nvfp4", "few_heads_8", "few_heads_8_two_ctas", "seesaw_scheduled",
                              "few_heads_two_ctas_scheduled", "few_heads_nvfp4_32_scheduled"])
def test_gluon_kernel_compiles_for_sm90a(overrides: dict) -> None:
    """The 64-head kernel (64- and 32-token tiles); the few-heads kernel (reg_v at one and two CTAs an SM, nvfp4);
    the seesaw kernel. In a process of its own too: Triton's own `tl`
    helpers that Gluon calls (gl.max, ...) are interpreted functions once the tests set TRITON_INTERPRET, and
    Gluon cannot compile those."""
    r = subprocess.run([sys.executable, "-c", _GLUON_COMPILE, json.dumps(overrides)], capture_output=True,
                       text=True, env=_compile_env(), cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert not s["wgmma_serialized"], "ptxas serialized the wgmmas (C7510-C7515)"
    # the seesaw kernel: ptxas injects a warpgroup arrive at its first P.V (a zero accumulator) and a wait at one
    # rescale (C7517 / C7519; 3 sites in its default form on Triton 3.6 and 3.8); the other kernels have none
    assert s["wgmma_injected"] <= (6 if overrides.get("kernel") == "seesaw" else 0), s
    assert s["shared"] <= 227 * 1024
    assert s["spill_stores"] is not None and s["spill_stores"] <= 256, f"{s['spill_stores']} bytes of spill stores"
    assert {"consumer", "producer"} <= set(s["kinds"]), f"expected a consumer and a producer tile loop: {s['kinds']}"
    if overrides.get("kernel") == "few" and overrides.get("nvfp4"):  # the e4m3 converter feeds the fp8 consumer
        assert "converter" in s["kinds"], f"expected the converter warpgroup's loop: {s['kinds']}"
        assert s["consumer_loops"] == 1, f"consumer loops: {s['consumer_loops']}"
        assert s["spill_stores"] == 0, f"{s['spill_stores']} bytes of spill stores"
    if overrides.get("ctas_per_sm") == 2:  # two CTAs fit an SM: half its registers and shared memory each
        assert s["regs_launch"] <= 128 and s["shared"] + 1024 <= 114 * 1024 and s["spill_stores"] == 0, s


@_NEEDS_GLUON
@pytest.mark.parametrize("block_n,cvt_rows", [(64, 32), (64, 16), (32, 8)])
def test_producer_layouts_are_bank_conflict_free(block_n: int, cvt_rows: int) -> None:
    """Every shared-memory access of the gathers and conversions (both kernels, both formats) takes the ideal
    number of wavefronts by Gluon's own count (bank_conflicts: excess accesses a wavefront). The few-heads kernel
    runs out of shared-memory bandwidth first (ncu, NOTES v12): a layout change that brings conflicts back costs
    it speed without failing any numeric test. The layouts it replaced must count as conflicting here."""
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bank_conflicts.py"), str(block_n), str(cvt_rows)],
                       capture_output=True, text=True, env=_compile_env(), cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = {w[1]: int(w[2]) for w in (line.split() for line in r.stdout.splitlines()) if w[:1] == ["RESULT"]}
    assert len(got) == 10, r.stdout
    assert got.pop("old_lat_gather") > 0 and got.pop("old_nvfp4_cvt_load") > 0, "the check does not see conflicts"
    assert got == dict.fromkeys(got, 0), got


def _sectors_written_in_part(reg_bases, lane_bases, elem_bytes: int) -> bool:
    """Whether every store instruction of a [dims, heads] linear layout (Triton's vectors: the leading register bases
    along dims, at most 16 bytes) writes only whole 32-byte sectors of each head's row."""
    vec = 0
    while vec < len(reg_bases) and reg_bases[vec] == [1 << vec, 0] and (2 << vec) * elem_bytes <= 16:
        vec += 1
    rest = reg_bases[vec:]
    for instr in range(1 << len(rest)):
        written: dict[int, set[int]] = {}
        for lane in range(1 << len(lane_bases)):
            d = h = 0
            for i, (bd, bh) in enumerate(rest):
                if instr >> i & 1:
                    d, h = d ^ bd, h ^ bh
            for i, (bd, bh) in enumerate(lane_bases):
                if lane >> i & 1:
                    d, h = d ^ bd, h ^ bh
            written.setdefault(h, set()).update(range(d * elem_bytes, (d + (1 << vec)) * elem_bytes))
        for row in written.values():
            if any(not set(range(s - s % 32, s - s % 32 + 32)) <= row for s in row):
                return True
    return False


@_NEEDS_GLUON
@pytest.mark.parametrize("dims,heads,thread_dims,elem_bytes", [(256, 64, 8, 4), (256, 64, 8, 2), (512, 16, 16, 4),
                                                               (512, 16, 16, 2)])
def test_latent_store_layout_writes_whole_sectors(dims: int, heads: int, thread_dims: int, elem_bytes: int) -> None:
    """The seesaw and reg_v epilogues store O (bf16 out, fp16 split partials) from common.gluon.latent_store_layout:
    each instruction must write whole 32-byte sectors (the half-sector form cost the seesaw kernel's split launches
    4-5 µs and the two-CTA few-heads kernel 2.5-3.7 µs at 5-8 rows, NOTES v18), and the layout must keep each warp's
    dims (warp bases of the thread-native layout: shuffles, no shared memory). The thread-native layout itself (a
    thread's thread_dims contiguous dims) must fail the check wherever it is wider than 16 bytes."""
    new = glcommon.latent_store_layout(dims, heads, thread_dims, elem_bytes)
    assert sorted(map(tuple, new.reg_bases + new.lane_bases + new.warp_bases)) == sorted(
        [(1 << i, 0) for i in range(dims.bit_length() - 1)] + [(0, 1 << i) for i in range(heads.bit_length() - 1)])
    assert new.warp_bases == [[8 * thread_dims, 0], [16 * thread_dims, 0]]
    assert not _sectors_written_in_part(new.reg_bases, new.lane_bases, elem_bytes)
    native = glcommon.latent_store_layout(dims, heads, thread_dims, 16 // thread_dims)  # vec = thread_dims
    assert _sectors_written_in_part(native.reg_bases, native.lane_bases, elem_bytes) == (thread_dims * elem_bytes > 16)


@_NEEDS_GLUON
def test_wgmma_store_layout_writes_whole_sectors() -> None:
    """fp16 split partials from the 64-head kernel's wgmma accumulator go through common.gluon.wgmma_store_layout:
    whole 32-byte sectors an instruction, each warp keeping the accumulator's rows; the accumulator's own layout (2
    fp16 a lane along the dims) fails the check."""
    new = glcommon.wgmma_store_layout()
    # [64 heads (M), 256 dims (N)] seen as [dims, heads]
    acc_reg, acc_lane, warp = ([[1, 0], [0, 8], [8, 0], [16, 0], [32, 0], [64, 0], [128, 0]],
                               [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]], [[0, 16], [0, 32]])
    assert new.warp_bases == warp
    assert sorted(map(tuple, new.reg_bases + new.lane_bases)) == sorted(map(tuple, acc_reg + acc_lane))
    assert not _sectors_written_in_part(new.reg_bases, new.lane_bases, 2)
    assert _sectors_written_in_part(acc_reg, acc_lane, 2)


_COMBINE_COMPILE = """
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_kimi_dsa.kernels import common as kcommon
out = {}
for fn, pieces, extra in ((kcommon.combine_kernel, "SPLITS", dict(num_splits="i32")),):
    for dtype in (kcommon.PARTIAL_DTYPE,):
        ws = kcommon.Workspace(part_out=torch.empty(512, dtype=dtype), part_lse=torch.empty(1), dummy_lse=torch.empty(1),
                          capacity=1, max_rows=1, heads=1)
        name = "fp16" if dtype == torch.float16 else "fp32"
        sig = dict(part_out_ptr="*" + name, part_lse_ptr="*fp32", out_ptr="*bf16", lse_ptr="*fp32", H="i32",
                   **extra, stride_o_row="i32", stride_o_head="i32", stride_lse_row="i32", out_scale="fp32")
        sig.update({pieces: "constexpr", "D": "constexpr"})
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
                 for n in ("part_out_ptr", "part_lse_ptr", "out_ptr", "lse_ptr", "stride_o_row", "stride_o_head")}
        for splits in (2, 8, 32):
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs={pieces: splits, "D": 512}, attrs=attrs),
                               target=GPUTarget("cuda", 90, 32), options={"num_warps": kcommon.combine_warps(ws)})
            out[f"{fn.__name__}-{name}-{splits}"] = {"shared": k.metadata.shared,
                                                     "ld_v4": k.asm["ptx"].count("ld.global.v4")}
print(json.dumps(out))
"""


def test_combine_keeps_the_split_sum_in_each_thread() -> None:
    """The combine at common.combine_warps: for fp16 partials and 2 / 8 / 32 splits, no shared memory (each thread holds the same dims of every split, so the sum down
    the splits never leaves it; with 4 warps on fp16 partials Triton spread the splits over 2 warps: 2-4x the time,
    NOTES v19) and 16-byte partial loads."""
    r = subprocess.run([sys.executable, "-c", _COMBINE_COMPILE], capture_output=True, text=True, env=_compile_env(),
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(res) == {f"combine_kernel-fp16-{s}" for s in (2, 8, 32)}
    for key, v in res.items():
        assert v["shared"] == 0, f"{key}: the combine went through shared memory ({v})"
        assert v["ld_v4"] >= int(key.split("-")[2]), f"{key}: partial loads narrower than 16 bytes ({v})"
