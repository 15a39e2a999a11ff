"""The suite (vllm_kimi_dsa.bench), benchmarks/ and tools/: the suite's metrics, data and plain-torch baseline on a
CPU, the plots and README table from a synthetic bench_suite.json, the peer's scale mapping, the device runner's
steps (tools/device_run.sh: dry, and a real run of tiny steps for its time limits), and the developer benchmarks'
set-up.

CPU only, about 15 s (most of it matplotlib, one 3-row K=2048 reference, and the runner's torch import twice).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))

from vllm_kimi_dsa.bench import plot  # noqa: E402
from vllm_kimi_dsa.bench import suite as bs  # noqa: E402
from vllm_kimi_dsa.bench.peers import fa3 as peer_fa3  # noqa: E402

from vllm_kimi_dsa import planning  # noqa: E402
from vllm_kimi_dsa.formats import unpack_nvfp4  # noqa: E402
from vllm_kimi_dsa.kernels import common as kcommon  # noqa: E402
from vllm_kimi_dsa.reference import reference_decode  # noqa: E402

CEIL = {"copy_GBps": 4000.0, "bf16_TFLOPs": 800.0, "fp8_TFLOPs": 1600.0}


@pytest.fixture(scope="module")
def data():
    # 4096 base rows + 63 windows of 64: ~8k rows of each format on the CPU
    return bs.Data(torch.device("cpu"), base_rows=4096, shift=64, with_bf16=True)


# ---------------------------------------------------------------- suite pieces


def test_metrics_hand_computed():
    m = bs.metrics(2, 16, 10.0, "fp8", 1, "fp8", CEIL)
    flops = 2 * 2 * 16 * 2048 * 1088
    kv = 2 * 2048 * 576
    io = 2 * 16 * 576 * 1 + 2 * 16 * 512 * 2
    assert m["flops"] == flops and m["kv_bytes"] == kv
    assert m["tflops"] == pytest.approx(flops / 10e-6 / 1e12, abs=0.01)
    assert m["kv_GBps"] == pytest.approx(kv / 10e-6 / 1e9, abs=0.1)
    assert m["floor_bw_us"] == pytest.approx((kv + io) / 4000e9 * 1e6, abs=1e-3)
    assert m["floor_flops_us"] == pytest.approx(flops / 1600e12 * 1e6, abs=1e-3)
    assert m["floor_bound"] == "bandwidth" and m["floor_us"] == m["floor_bw_us"]
    assert m["of_floor"] == pytest.approx(m["floor_us"] / 10.0, abs=1e-3)
    # compute-bound at many heads with a slow matmul; a missing fp8 rate falls back to bf16
    m2 = bs.metrics(320, 128, 1000.0, "nvfp4_ds_mla", 1, "fp8", {**CEIL, "fp8_TFLOPs": None, "bf16_TFLOPs": 50.0})
    assert m2["floor_bound"] == "compute"
    assert m2["floor_us"] == pytest.approx(2 * 320 * 128 * 2048 * 1088 / 50e12 * 1e6, rel=1e-4)


def test_n_sets_exceed_l2():
    for rows in (1, 2, 5, 20, 80, 320):
        n = bs.n_sets(rows)
        assert 4 <= n <= bs.MAX_SETS * bs.MAX_POOLS
        assert n * rows * bs.K * 352 > 2 * bs.L2_BYTES  # rows 1 and 2 too: past 64 sets a second slot pool
    assert bs.n_sets(320) == 4


def test_request_slots_layout():
    g = torch.Generator().manual_seed(3)
    bt, slots = bs.request_slots(5, g, torch.device("cpu"), base_rows=64 * 400)
    assert slots.shape == (5, bs.K) and slots.dtype == torch.int32 and bt.shape == (5, 2 * bs.K // 64)
    assert len(set(bt.flatten().tolist())) == bt.numel()  # enough blocks: no request shares one
    for i in range(5):
        row = slots[i]
        assert row.unique().numel() == bs.K  # K distinct tokens of the request
        assert set((row // 64).tolist()) <= set(bt[i].tolist())
    assert int(slots.min()) >= 0 and int(slots.max()) < 64 * 400


def test_data_formats_agree(data):
    assert torch.equal(data.fp8.float() * bs.K_SCALE, data.bf16.float())  # exact BF16 copy for the peer
    x = data.bf16.float()
    y = unpack_nvfp4(data.nvfp4)
    assert float((y - x).norm() / x.norm()) < 0.15  # e2m1 with 16-value block scales: ~10% error
    w = data.window("fp8", 3)
    assert w.shape == (4096, 576) and w.data_ptr() == data.fp8[3 * 64].data_ptr()


def test_torch_baseline_and_peer_scales_match_reference(data):
    """The baseline's numerics, and the peer's scale mapping (sm_scale = scale*q_scale on k*k_scale values)."""
    inp = bs.error_inputs(3, 4, torch.device("cpu"), data.base_rows)
    counts = inp["counts"]
    assert int(counts[1]) == 1 and int(counts[0]) == bs.K
    sm, osc = bs.scales("fp8")
    ref, _ = reference_decode(inp["q8"], data.window("fp8", 0), inp["slots"], counts, fmt="fp8",
                              softmax_scale=sm, output_scale=osc)
    out = torch.full((3, 4, 512), float("nan"), dtype=torch.bfloat16)
    bs.torch_decode(inp["q16"], data.window("fp8", 0), inp["slots"], counts, out)
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < 2e-2, err  # BF16 logits and probabilities: ~3 significant digits
    peer_ref = peer_fa3.reference(inp["q16"], data.window("bf16", 0).double(), inp["slots"], counts.tolist(),
                                  bs.SCALE * bs.Q_SCALE)
    assert float((peer_ref - ref.double()).norm() / ref.norm()) < 1e-5  # same math, float64 vs float32


def test_summary_table_lists_kernels():
    recs = [{"section": "decode", "kernel": k, "rows": r, "heads": 128, "us": 10.0 * r, "tflops": 1.0}
            for k in ("triton/fp8", "fa3/bf16") for r in (1, 5)]
    text = bs.summary_table(recs)
    assert "H=128" in text and "triton/fp8" in text and "fa3/bf16" in text and "50.0" in text


# ---------------------------------------------------------------- plots / markdown


def synthetic_json() -> dict:
    recs = []
    for kernel, fmt, compute, qb, speed in (("triton/fp8", "fp8", "fp8", 1, 1.0), ("triton/nvfp4_ds_mla", "nvfp4_ds_mla",
                                             "fp8", 1, 0.8), ("fa3/bf16", "bf16", "bf16", 2, 1.3)):
        for heads in (128, 16, 12):
            for rows in (1, 5, 20, 80, 320):
                us = speed * (12.0 + 1.1 * rows * (heads / 128 + 0.2))
                recs.append({"section": "decode", "kernel": kernel, "fmt": fmt, "rows": rows, "heads": heads,
                             **bs.metrics(rows, heads, us, fmt, qb, compute, CEIL)})
    for rows in (1, 5, 20, 80, 320):  # the FP8_PV opt-in: > 32 heads only, speed 0.9
        us = 0.9 * (12.0 + 1.1 * rows * 1.2)
        recs.append({"section": "decode", "kernel": "triton-pv8/fp8", "fmt": "fp8", "rows": rows, "heads": 128,
                     **bs.metrics(rows, 128, us, "fp8", 1, "fp8", CEIL)})
    recs.append({"section": "convert", "kernel": "convert", "rows": 5, "us": 3.25, "copy_us": 2.5, "vs_copy": 1.3})
    recs.append({"section": "fused", "kernel": "convert+triton/fp8", "rows": 5, "heads": 128, "us": 20.0,
                 "decode_us": 17.5, "convert_overhead_us": 2.5, "tflops": 1.0})
    recs.append({"section": "torch", "kernel": "torch/fp8->bf16", "rows": 5, "heads": 128, "us": 250.0,
                 "tflops": 0.9})
    return {
        "info": {"gpu": "NVIDIA H200", "date": "2026-12-02T20:00:00+00:00", "torch": "2.11", "triton": "3.6",
                 "flashinfer": "flashinfer 0.7.2.post1", "ceilings": CEIL},
        "results": recs,
        "accuracy": [{"kernel": "triton/fp8", "rows": 5, "heads": 128, "rel_l2": 1.234e-3, "max_abs": 2e-3}],
        "failures": [{"kernel": "fa3/fp8", "rows": 5, "heads": 12, "error": "ValueError: heads"}],
    }


def test_plot_and_markdown(tmp_path):
    src = tmp_path / "bench_suite.json"
    data = synthetic_json()
    src.write_text(json.dumps(data))
    out = tmp_path / "res"
    assert plot.main([str(src), "--out-dir", str(out), "--rows", "1,5,320"]) == 0
    for name in ("bench_H128.png", "bench_H16_H12.png"):
        blob = (out / name).read_bytes()
        assert blob[:8] == b"\x89PNG\r\n\x1a\n" and len(blob) > 10_000, name
    md = (out / "bench_suite.md").read_text()
    assert "NVIDIA H200" in md and "copy 4000 GB/s" in md and "FP8 matmul 1600 TFLOP/s" in md
    for heads in (128, 16, 12):
        assert f"**H = {heads}**" in md
    assert "| kernel | 1 rows | 5 rows | 320 rows |" in md
    # one cell, recomputed from the record it came from
    rec = next(r for r in data["results"] if r.get("kernel") == "fa3/bf16" and r.get("heads") == 16
               and r.get("rows") == 320)
    assert f"{rec['us']:.1f} ({rec['tflops']:.0f}; {rec['of_floor']:.2f})" in md
    assert "| triton/fp8 | 5 | 128 | 1.23e-03 |" in md
    assert "| 5 | 3.25 | 2.50 | 1.30 |" in md and "| 5 | 128 | 20.00 | 17.50 | 2.50 |" in md
    assert "1 measurement(s) failed" in md
    # the targets' ratios: speeds 1.0 (fp8), 0.8 (nvfp4), 1.3 (fa3/bf16, the only peer) at every size
    assert "| fp8 / best peer (time) | 0.77 | 0.77 | 0.77 |" in md
    assert "| nvfp4 / fp8 (time) | 0.80 | 0.80 | 0.80 |" in md
    assert md.count("| fp8 P.V e4m3 / best peer (time) | 0.69 | 0.69 | 0.69 |") == 1  # H = 128 only
    # every decode row of the table has a cell per column
    table_rows = [ln for ln in md.splitlines() if ln.startswith("| triton/") or ln.startswith("| fa3/")]
    assert table_rows and all(ln.count("|") == 5 for ln in table_rows if "rows" not in ln and "e-0" not in ln)


def test_plot_rejects_other_json(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"tp": "1-8:triton"}))
    with pytest.raises(ValueError, match="results"):
        plot.load(p)


# ---------------------------------------------------------------- tools/device_run.sh


# the runner calls python3 (tools/gpu_gate.py, py steps): this Python's
RUNNER_PATH = f"{Path(sys.executable).parent}:/usr/bin:/bin"


def _device_run(tmp_path: Path, *args: str, dry: bool = True) -> subprocess.CompletedProcess:
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    env = {"PATH": RUNNER_PATH, "OUT": str(tmp_path), **({"DRY": "1"} if dry else {})}
    return subprocess.run(["bash", str(ROOT / "tools" / "device_run.sh"), *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=60)


def test_device_run_steps(tmp_path: Path) -> None:
    """The runner's steps, dry: each "+"-joined step becomes one command with its arguments; the GPU list's parts
    (tools/gpu_gate.py), a pytest and a record each, the suite without a carried peer, racecheck's tiny default case,
    ncu of profile_gluon."""
    import gpu_gate

    r = _device_run(tmp_path, "tests", "+", "tests", "tests/test_gluon_seesaw.py", "-k", "quick", "+", "suite",
                    "--quick", "+", "memcheck", "+", "racecheck", "+", "racecheck", "tools/racecheck_gluon.py",
                    "seesaw", "+", "ncu", "--kernel", "few", "+", "py", "-m", "vllm_kimi_dsa", "tune", "--out", "t.json",
                    "+", "tests", "part=gluon")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    parts = 2 * len(gpu_gate.PARTS)
    assert len(lines) == parts + 9, lines
    for i, (part, files) in enumerate(gpu_gate.PARTS.items()):
        test, record = lines[2 * i: 2 * i + 2]
        options = "".join(f" {o}" for o in gpu_gate.PART_OPTIONS.get(part, ()))
        assert test.endswith(f"--junitxml={tmp_path}/1-{part}_junit.xml{options} {' '.join(files)}"), test
        assert record == (f"python3 tools/gpu_gate.py record --out {tmp_path} --junit {tmp_path}/1-{part}_junit.xml "
                          f"--part {part} --rc $?")
    assert lines[-2].endswith(" ".join(gpu_gate.PARTS["gluon"])) and "--part gluon" in lines[-1]
    lines = lines[parts - 1:]  # the steps after the parts, as numbered from here on
    assert "tests/test_gluon_seesaw.py -k quick" in lines[1] and "2_junit" in lines[1]
    peer = "" if (ROOT / ".carry" / "fi" / "fi_site.tar.xz").is_file() else " --no-peer"  # a carried fa3 peer
    assert lines[2].endswith(f"-m vllm_kimi_dsa bench --out {tmp_path}{peer} --quick")
    assert "--tool memcheck" in lines[3] and lines[3].endswith("tools/sanitize_case.py")
    assert "--tool racecheck" in lines[4] and lines[4].endswith("tools/sanitize_case.py --tiny")
    assert lines[5].endswith("tools/racecheck_gluon.py seesaw")
    assert lines[6].endswith("tools/profile_gluon.py --kernel few")
    assert lines[7] == "python3 -m vllm_kimi_dsa tune --out t.json"


def test_device_run_step_caps(tmp_path: Path) -> None:
    """STEP@S caps a step at S seconds (the budget's rest when fewer), so the steps after a slow or hung one still
    run; a dry run makes no $OUT."""
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(ROOT / "tools" / "device_run.sh"), "--budget", "540", "tests@240",
                        "tests/test_schedule.py", "+", "suite", "--sections", "serving", "+", "py@9999", "x.py"],
                       capture_output=True, text=True, cwd=ROOT,
                       env={"PATH": "/usr/bin:/bin", "DRY": "1", "OUT": str(out)}, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("(at most 240s) python3 -m pytest") and lines[0].endswith("tests/test_schedule.py")
    assert "(at most" not in lines[1] and lines[1].endswith("--sections serving")
    assert lines[2] == "(at most 9999s) python3 x.py"  # (the dry run prints the cap asked for)
    assert not out.exists()
    r = _device_run(tmp_path, "tests@soon")
    assert r.returncode == 2 and "the cap must be whole seconds" in r.stdout
    r = _device_run(tmp_path, "tests", "part=few", "+", "py", "x.py")
    assert r.returncode == 2 and "no such part (smoke triton" in r.stdout and "x.py" not in r.stdout
    r = _device_run(tmp_path, "tests", "part=smoke", "-x")
    assert r.returncode == 2 and "no more arguments" in r.stdout


def test_device_run_time_limits(tmp_path: Path) -> None:
    """A real run of tiny steps (no GPU, no nvidia-smi needed): a step capped under 15 s runs to its cap and shows
    rc 124, a cap past the budget gets the budget's rest, the summary names each; a step reached with under 15 s of
    the budget left is skipped, and that fails the run."""
    script = tmp_path / "sleep.py"
    script.write_text("import sys, time\nprint('start', flush=True)\ntime.sleep(float(sys.argv[1]))\n"
                      "print('slept', sys.argv[1])\n")
    out = tmp_path / "out"
    r = _device_run(out, "--budget", "40", "py@1", str(script), "5", "+", "py@600", str(script), "0", dry=False)
    assert r.returncode == 1, r.stdout + r.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("== ") and "torch" in summary[0], summary
    assert re.fullmatch(r"== 1_py rc=124 at \+\d+s \(limit 1s\): start", summary[1]), summary
    limit = int(re.fullmatch(r"== 2_py rc=0 at \+\d+s \(limit (\d+)s\): slept 0", summary[2]).group(1))
    assert 15 <= limit <= 40, summary
    assert (out / "1_py.log").read_text().strip() == "start"
    out = tmp_path / "short"
    r = _device_run(out, "--budget", "14", "py", str(script), "0", dry=False)
    assert r.returncode == 1 and re.search(r"^== 1_py skipped: \d+s of the budget left$", r.stdout, re.M), r.stdout


def test_device_run_usage_and_bad_step(tmp_path: Path) -> None:
    r = _device_run(tmp_path)
    assert r.returncode == 2 and "tools/device_run.sh [--t38]" in r.stdout
    r = _device_run(tmp_path, "bogus")
    assert r.returncode == 2 and "unknown step 'bogus'" in r.stdout
    subprocess.run(["bash", "-n", str(ROOT / "tools" / "device_run.sh")], check=True)


# ---------------------------------------------------------------- the Gluon benchmarks (CPU: their set-up only)


def test_gluon_bench_variants_are_valid_params() -> None:
    """Every variant the Gluon benches time is a shape the kernels take (a bad one would cost device time)."""
    import bench_few_heads as bfh
    import bench_gluon as bg

    from vllm_kimi_dsa.kernels.gluon_decode import GluonParams
    from vllm_kimi_dsa.kernels.gluon_seesaw import SeesawParams

    for overrides in bg.GLUON_VARIANTS.values():
        GluonParams(**bg.kernel_params(overrides)[0])
    for name, overrides in bg.SEESAW_VARIANTS.items():  # shared memory, registers and rings checked at construction
        assert SeesawParams(**bg.kernel_params(overrides)[0]).nvfp4 == (bg._fmt(name) == "nvfp4_ds_mla"), name
    for name in bfh.VARIANTS:
        assert bfh._params(name).nvfp4 == (bfh._fmt(name) == "nvfp4_ds_mla"), name
    for name in bfh.NAMES:
        for heads in (12, 16, 32):
            assert bfh._config(name, heads).block_n in (32, 64)


def test_tail_split_call_runs_the_plan_on_row_slices() -> None:
    """bench_gluon.tail_split_call (the "-tail" variants): choose_plan's plan for the batch, as launches on row slices
    that cover every row once (a recording launch on CPU tensors; the interpreter's 4 'SMs')."""
    import bench_gluon as bg


    cfg = planning.Config(block_h=16, block_n=64, num_warps=12, num_stages=1, ctas_per_sm=1, split_tiles=2.0)
    rows, heads, width = 5, 16, 2048  # 4 whole rows (one wave), then one row split 4 ways
    plan = planning.choose_plan(rows, heads, width, cfg, kcommon.num_sms(torch.device("cpu")))
    assert plan == (4, 4), plan
    q = torch.zeros(rows, heads, 576)
    slots = torch.zeros(rows, width, dtype=torch.int32)
    counts = torch.arange(rows, dtype=torch.int32)
    out, lse = torch.zeros(rows, heads, 512), torch.zeros(rows, heads)
    seen = []

    def launch(query, kv_rows, slots_, counts_, out_, lse_, softmax_scale, output_scale, ws, splits):
        assert out_.data_ptr() == out[counts_[0]].data_ptr() and lse_.shape[0] == query.shape[0] == slots_.shape[0]
        seen.append((counts_.tolist(), splits))

    bg.tail_split_call(launch, cfg, q, None, slots, counts, out, lse, None)()
    assert seen == [(list(range(plan[0])), 1), (list(range(plan[0], rows)), plan[1])]


@pytest.mark.parametrize("name", ["triton-tail", "triton-tail-nvfp4"])
def test_tl_tail_variant_matches_the_reference(name: str) -> None:
    """bench_few_heads' "triton-tail*" runners (the plain kernel through choose_plan's plan) compute the decode: in the
    interpreter, 10 rows of 16 heads at width 256 (8 whole rows, then 2 split 4 ways on the interpreter's 4 'SMs' x 2
    CTAs), holes and a count-0 row, outputs poisoned; bound as test_triton_decode's fp8-wgmma-free path (bf16
    output)."""
    import bench_few_heads as bfh

    from vllm_kimi_dsa.formats import LATENT_DIM, quantize_rows

    g = torch.Generator().manual_seed(3)
    fmt, rows, heads, width = bfh._fmt(name), 10, 16, 256
    sms = kcommon.num_sms(torch.device("cpu"))
    assert planning.choose_plan(rows, heads, width, bfh._config(name, heads), sms) == (8, 4)
    kv = quantize_rows(torch.randn(300, 576, generator=g) * 8, fmt)
    q = (torch.randn(rows, heads, 576, generator=g) * 4).to(torch.float8_e4m3fn)
    slots = torch.randint(0, 300, (rows, width), generator=g, dtype=torch.int32)
    slots[torch.rand(rows, width, generator=g) < 0.1] = -1
    counts = torch.tensor([width, 0, 100, width - 1, 37, 1, width, 200, 0, 129], dtype=torch.int32)  # 0s at the seam
    out = torch.full((rows, heads, LATENT_DIM), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((rows, heads), float("nan"))
    ws = bfh._workspace(name, heads, rows, torch.device("cpu"))
    bfh._runner(name, q, kv, slots, counts, out, lse, ws)()
    ref, ref_lse = reference_decode(q, kv, slots, counts, fmt=fmt, softmax_scale=bfh.SSCALE, output_scale=bfh.OSCALE)
    assert torch.isfinite(out).all() and (out[[1, 8]] == 0).all() and torch.isneginf(lse[[1, 8]]).all()
    # bf16 output: 2**-8 relative a value; the norm of the error over the norm of the output well inside 1e-2
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and float((lse[fin] - ref_lse[fin]).abs().max()) < 1e-3


def test_gather_floor_kernel_xors_the_gathered_rows() -> None:
    """bench_gather_floor's kernel, in the interpreter: one word a program, the xor of its 16 rows."""
    import functools
    import operator

    import bench_gather_floor as bgf

    g = torch.Generator().manual_seed(0)
    kv = torch.randint(-1000, 1000, (100, 144), generator=g, dtype=torch.int32)
    slots = torch.randint(0, 100, (32,), generator=g, dtype=torch.int32)
    out = torch.full((2,), 7, dtype=torch.int32)
    bgf._gather_xor[(2,)](kv, slots, out, kv.stride(0), WORDS=144, WORDS_P2=256, BLOCK_N=16)
    want = [functools.reduce(operator.xor, kv[slots[i * 16:(i + 1) * 16].long()].flatten().tolist()) for i in range(2)]
    assert out.tolist() == want


def test_plot_gluon_draws_both_benches(tmp_path: Path) -> None:
    """plot_gluon draws a few_heads_bench.json and a gluon_bench.json of the shapes the two benches write."""
    pytest.importorskip("matplotlib")

    def times(us0: float) -> dict:
        return {"times": {str(r): {"us": us0 + 0.4 * r} for r in (1, 5, 20, 80, 320)}}

    few = tmp_path / "few_heads_bench.json"
    few.write_text(json.dumps({"device": "NVIDIA H200", "K": 2048, "ceilings": {"copy_GBps": 4000.0},
                               "results": {"triton/H16": times(10.0), "few-tail-regv/H16": times(8.0),
                                           "few-tail-nvfp4/H16": times(9.0)}}))
    gluon = tmp_path / "gluon_bench.json"
    gluon.write_text(json.dumps({"K": 2048, "heads": 128, "results": {"seesaw-tail": times(12.0)}}))
    png = tmp_path / "g.png"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_gluon.py"), "--few", str(few), "--gluon",
                        str(gluon), "--out", str(png)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert png.stat().st_size > 10_000


def test_time_rotated_builds_each_set_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_gluon.time_rotated (both Gluon benches' timer) on a CPU, the graph timer replaced by one eager call a
    set: every set gets its own query, slots, out and LSE of the asked shape, one workspace sized for the splits."""
    import bench_gluon as bg

    seen = []
    monkeypatch.setattr(bg, "cuda_graph_time_us", lambda calls: [c() for c in calls] and 1.5)

    def make_call(q, slots, counts, out, lse, ws):
        return lambda: seen.append((q.shape, slots.shape, counts.tolist(), out.shape, lse.shape, ws.capacity))

    g = torch.Generator().manual_seed(0)
    us, ws, outs, lses, sets = bg.time_rotated(make_call, 3, 12, 2, 576, torch.device("cpu"), g)
    assert us == 1.5 and len(seen) == sets == len(outs) == len(lses) >= 1
    assert seen[0] == ((3, 12, 576), (3, bg.K), [bg.K] * 3, (3, 12, 512), (3, 12), 3 * 2 * 12)
    assert ws.part_out.numel() == 3 * 2 * 12 * 512


def test_sass_reports_compile_the_shipped_partial_dtype() -> None:
    """gluon_report / sass_report compile the kernels with the split partials' pointer type TritonDecode's workspace
    passes (kernels.common.PARTIAL_DTYPE), so their SASS is the shipped epilogue's."""
    import gluon_report
    import sass_report


    want = {torch.float16: "*fp16", torch.float32: "*fp32"}[kcommon.PARTIAL_DTYPE]
    assert gluon_report._PARTIAL_SIG == want
    assert sass_report.SIGNATURE["part_out_ptr"] == want


def test_fit_plan_cost_reads_pairs_and_scores_picks(tmp_path: Path) -> None:
    """fit_plan_cost pairs the two forms' times by (heads, rows), per file's own variant names, and scores a set of
    picks by the µs they lose (a pick within 1% of the faster time is not a mispick)."""
    import fit_plan_cost as fit

    def times(d):
        return {"times": {str(r): {"us": us} for r, us in d.items()}}

    a = tmp_path / "a.json"
    a.write_text(json.dumps({"results": {"one/H16": times({5: 10.0, 80: 50.0}), "two/H16": times({5: 11.0, 80: 40.0}),
                                         "one/H12": times({320: 130.0})}}))
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"results": {"x/H32": times({160: 120.0}), "y/H32": times({160: 100.0})}}))
    pairs = fit.measured_pairs([str(a), f"{b}:x,y"], "one", "two")
    assert pairs == {(16, 5): (10.0, 11.0), (16, 80): (50.0, 40.0), (32, 160): (120.0, 100.0)}
    assert fit.score(pairs, {(16, 5): 1, (16, 80): 2, (32, 160): 2}) == (0.0, 0)
    assert fit.score(pairs, {(16, 5): 2, (16, 80): 1, (32, 160): 2}) == (11.0, 2)
    assert fit.score({(16, 8): (10.0, 10.05)}, {(16, 8): 2}) == pytest.approx((0.05, 0))
    chosen = fit.picks(pairs, {1: 1.7, 2: 1.5}, 2.0)
    assert set(chosen) == set(pairs) and set(chosen.values()) <= {1, 2}


def test_bench_host_guards_the_launch_queue_and_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_host's host_us counts only the host while the CUDA launch queue has room: too many layer-steps is an
    error before any work; without a GPU the script says what it needs."""
    import bench_host

    with pytest.raises(ValueError, match="layers x reps"):
        bench_host.measure(128, 5, layers=16, reps=16)
    if not torch.cuda.is_available():
        monkeypatch.setattr(sys, "argv", ["bench_host.py"])
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bench_host.main()


def test_gluon_benches_accuracy_case(capsys: pytest.CaptureFixture[str]) -> None:
    """bench_gluon.accuracy_case (both Gluon benches' accuracy batch) on a CPU: a count-0 row, -1 holes, each format's
    reference on its cache, the unquantized rows' answer, and each format's own error printed (nvfp4's larger)."""
    import bench_gluon as bg
    from vllm_kimi_dsa.formats import quantize_rows

    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, 576, generator=g) * 8
    caches = {fmt: quantize_rows(x, fmt) for fmt in ("fp8", "nvfp4_ds_mla")}
    q, slots, counts, refs, src = bg.accuracy_case(12, 128, caches, x, "cpu", g)
    assert q.shape == (5, 12, 576) and slots.shape == (5, 128) and counts.tolist()[:2] == [128, 0]
    assert (slots == -1).any() and set(refs) == {"fp8", "nvfp4_ds_mla"}
    assert torch.equal(src[1], torch.zeros_like(src[1])) and torch.isfinite(src).all()
    errs = [float(m) for m in re.findall(r"rel ([0-9.e+-]+)", capsys.readouterr().out)]
    assert len(errs) == 2 and 0 < errs[0] < errs[1] < 0.5, errs
