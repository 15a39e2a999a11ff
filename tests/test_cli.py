"""`python -m vllm_kimi_dsa`: bad values are usage errors (usage, a message naming the option, exit 2, no traceback),
`--help` of every command works, `bench` refuses a machine without a CUDA GPU the same way, one small demo runs.

Every case runs the CLI in a subprocess as on a CPU (CUDA_VISIBLE_DEVICES="", Triton's interpreter). Each process
spends about 2 s importing torch, so the cases run a few at a time, once for the module.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (argv, what the message must name): the values the CLI must refuse before running anything
BAD: list[tuple[tuple[str, ...], str]] = [
    ((), "required"),
    (("frob",), "invalid choice: 'frob'"),
    (("demo", "--rows", "0"), "--rows"),
    (("demo", "--layers", "0"), "--layers"),
    (("demo", "--heads", "129"), "--heads"),  # 1..128 heads a rank
    (("demo", "--width", "100"), "--width"),
    (("demo", "--width", "0"), "--width"),
    (("demo", "--kernel", "foo"), "--kernel"),
    (("demo", "--kernel", "trtllm"), "--kernel"),  # a kernel name, but not one a CPU runs
    (("tune",), "--allow-cpu"),  # no GPU and no --allow-cpu
    (("tune", "--allow-cpu", "--rows", "0"), "--rows"),
    (("tune", "--allow-cpu", "--heads", "0"), "--heads"),
    (("tune", "--allow-cpu", "--width", "0"), "--width"),
    (("tune", "--allow-cpu", "--dcp", "0"), "--dcp"),
    (("tune", "--allow-cpu", "--kernels", "foo"), "--kernels"),
    (("tune", "--allow-cpu", "--kernels", "trtllm"), "--kernels"),
    (("bench",), "--out"),
    (("bench", "--out", "unused", "--rows", "0"), "--rows"),
    (("bench", "--out", "unused", "--heads", "8,129"), "--heads"),
]
HELP: list[tuple[str, ...]] = [("--help",), ("demo", "--help"), ("tune", "--help"), ("bench", "--help")]
Finished = subprocess.CompletedProcess  # one case's process, its output as text
DEMO: tuple[str, ...] = ("demo", "--layers", "1", "--rows", "1")
BENCH_OUT = "bench-out"  # relative to the cases' working directory: it must not be created
BENCH_CPU: tuple[str, ...] = ("bench", "--out", BENCH_OUT)


def _env() -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    # the checkout's package, whether or not it is installed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[tuple[str, ...], Finished], Path]:
    """Every case's finished process, by argv, and the directory they ran in."""
    cwd = tmp_path_factory.mktemp("cli")
    cases = [argv for argv, _ in BAD] + HELP + [DEMO, BENCH_CPU]

    def run(argv: tuple[str, ...]) -> Finished:
        return subprocess.run([sys.executable, "-m", "vllm_kimi_dsa", *argv], cwd=cwd, env=_env(),
                              capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        return dict(zip(cases, pool.map(run, cases))), cwd


@pytest.mark.parametrize("argv,names", BAD, ids=[" ".join(a) or "(none)" for a, _ in BAD])
def test_bad_value_is_a_usage_error(cli, argv: tuple[str, ...], names: str) -> None:
    proc = cli[0][argv]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "usage:" in proc.stderr and "error:" in proc.stderr
    assert names in proc.stderr.splitlines()[-1]  # argparse's one-line message names the option
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "OK" not in proc.stdout  # refused before anything ran


@pytest.mark.parametrize("argv", HELP, ids=" ".join)
def test_help(cli, argv: tuple[str, ...]) -> None:
    proc = cli[0][argv]
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m vllm_kimi_dsa")
    if argv == ("--help",):
        for command in ("demo", "tune", "bench"):
            assert f"    {command} " in proc.stdout  # listed with its one-line help


def test_bench_without_gpu_is_a_usage_error(cli) -> None:
    results, cwd = cli
    proc = results[BENCH_CPU]
    assert proc.returncode == 2
    assert "usage: python -m vllm_kimi_dsa bench" in proc.stderr
    assert "error: needs a CUDA GPU" in proc.stderr.splitlines()[-1]
    assert "Traceback" not in proc.stderr
    assert not (cwd / BENCH_OUT).exists()  # nothing written before the refusal


def test_demo_runs_the_rows_it_was_given(cli) -> None:
    proc = cli[0][DEMO]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "shapes: rows=1 " in proc.stdout and "layers=1" in proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("OK: rows=1 layers=1,"), proc.stdout


def test_tune_module_refuses_bad_values_as_the_cli_does(capsys) -> None:
    """`python -m vllm_kimi_dsa.tune` and the CLI's `tune` share one parser (tune.add_arguments)."""
    from vllm_kimi_dsa import tune

    with pytest.raises(SystemExit) as exit_info:
        tune.main(["--allow-cpu", "--width", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "--width" in err
