"""tune: spec-string merge, fastest-kernel choice, the table file round trip into kernel_for, the CLI.

CPU only, well under 10 s: timings are injected (a fake measure) or taken through the real core with
the conftest's reference kernel standing in for the decode kernels, at 1-2 rows, width 128.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import vllm_kimi_dsa.selection.specs as d
from vllm_kimi_dsa.selection import FI_KERNEL, kernel_for, kernel_from_spec, load_kernel_table, parse_kernel_spec
from vllm_kimi_dsa.tune import fastest, main, merge_spec, rotation_sets, tune

ROWS = (1, 2, 3, 4, 8, 16, 32, 64, 320)


@pytest.fixture(autouse=True)
def _no_env_table(monkeypatch):
    monkeypatch.delenv(d.KERNEL_TABLE_ENV, raising=False)
    d.reset_kernel_table_cache()
    yield
    d.reset_kernel_table_cache()


def fake_measure(kernel: str, rows: int, config) -> float:
    """trtllm wins below 4 rows, prims_ts above; the tie at 4 goes to prims_ts (named first). FI_KERNEL says trtllm to 32."""
    base = {"trtllm": 10.0 + 3.0 * rows, "prims_ts": 20.0 + 0.5 * rows, "triton": 100.0 + 10.0 * rows}
    return base[kernel]


def expected_choice(rows: int) -> str:
    return "trtllm" if 10.0 + 3.0 * rows < 20.0 + 0.5 * rows else "prims_ts"


# ---------------------------------------------------------------- merge / fastest


def test_merge_spec_runs_and_gaps():
    assert merge_spec({1: "trtllm", 2: "trtllm", 8: "trtllm", 16: "prims_ts", 320: "prims_ts"}) == (
        "1-8:trtllm,9-320:prims_ts"
    )
    assert merge_spec({5: "triton"}) == "1-5:triton"
    assert merge_spec({1: "triton"}) == "1:triton"
    # alternating choices are not merged, and the dict's order does not matter
    assert merge_spec({3: "prims_ts", 1: "prims_ts", 2: "trtllm"}) == (
        "1:prims_ts,2:trtllm,3:prims_ts"
    )
    assert merge_spec({16: "prims_ts", 1: "trtllm"}) == "1:trtllm,2-16:prims_ts"


@pytest.mark.parametrize("bad", [{}, {0: "triton"}, {-3: "triton"}, {True: "triton"}])
def test_merge_spec_rejects(bad):
    with pytest.raises(ValueError, match="choices"):
        merge_spec(bad)


def test_merge_spec_parses_back_to_every_choice():
    g = torch.Generator().manual_seed(7)
    names = ("prims_ts", "trtllm", "triton")
    for _ in range(20):
        sizes = sorted(set(torch.randint(1, 400, (9,), generator=g).tolist()))
        choices = {r: names[int(torch.randint(0, 3, (1,), generator=g))] for r in sizes}
        spec = merge_spec(choices)
        parse_kernel_spec(spec)  # well formed for dispatch
        # every batch up to the largest measured size maps to the choice of the next measured size
        for b in range(1, sizes[-1] + 1):
            nxt = min(r for r in sizes if r >= b)
            assert kernel_from_spec(spec, b) == choices[nxt], (spec, b)
        assert kernel_from_spec(spec, sizes[-1] + 1) is None


def test_fastest_ignores_missing_and_nan():
    us = {"prims_ts": {1: 5.0, 2: float("nan"), 3: 9.0}, "trtllm": {1: 4.0, 3: 9.0}, "triton": {2: 7.0}}
    assert fastest(us, (1, 2, 3, 4)) == {1: "trtllm", 2: "triton", 3: "prims_ts"}  # tie -> first named


def test_rotation_sets_bounds():
    assert rotation_sets(1) == 32
    assert rotation_sets(10**10) == 2
    n = rotation_sets(2**20)
    assert n * 2**20 > 2 * 60 * 2**20 or n == 32


# ---------------------------------------------------------------- file round trip


def test_tune_writes_table_kernel_for_follows(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    res = tune(ROWS, heads=64, kv_cache_dtype="fp8", width=2048, out=path, kernels=("prims_ts", "trtllm", "triton"),
               measure=fake_measure, allow_cpu=True, progress=False)
    want = {r: expected_choice(r) for r in ROWS}
    assert res["choices"] == want
    assert res["spec"] == "1-3:trtllm,4-320:prims_ts"
    assert res["topology"] == "tp" and res["path"] == str(path)
    data = json.loads(path.read_text())
    assert data["tp"] == res["spec"] and "dcp" not in data
    meta = data["meta"]["tp"]
    assert meta["us"]["triton"]["320"] == pytest.approx(3300.0)
    assert meta["config"]["heads"] == 64 and meta["choices"]["8"] == "prims_ts"
    assert load_kernel_table(path)["tp"] == res["spec"]

    # Without the env var kernel_for uses the prior (trtllm up to 32); with it, the file.
    offered = ("prims_ts", "trtllm")
    assert kernel_for(16, 1, offered, 64) == "trtllm"
    monkeypatch.setenv(d.KERNEL_TABLE_ENV, str(path))
    d.reset_kernel_table_cache()
    for r in (1, 3, 4, 5, 8, 16, 100, 320):
        nxt = min(x for x in ROWS if x >= r)
        assert kernel_for(r, 1, offered, 64) == want[nxt], r
    # the dcp topology was not tuned: it keeps the prior
    assert kernel_for(2, 2, offered, 64) == kernel_from_spec(FI_KERNEL["dcp"], 2)


def test_tune_dcp_keeps_tp_in_the_same_file(tmp_path):
    path = tmp_path / "table.json"
    tp = tune(ROWS, heads=64, out=path, kernels=("prims_ts", "trtllm"), measure=fake_measure, allow_cpu=True,
              progress=False)

    def dcp_measure(kernel, rows, config):
        assert config.dcp == 4 and config.topology == "dcp"
        return {"prims_ts": 1.0, "trtllm": 2.0}[kernel]

    res = tune((1, 64), heads=64, dcp=4, out=path, kernels=("prims_ts", "trtllm"), measure=dcp_measure,
               allow_cpu=True, progress=False)
    assert res["spec"] == "1-64:prims_ts"
    data = json.loads(path.read_text())
    assert data["tp"] == tp["spec"] and data["dcp"] == "1-64:prims_ts"
    assert set(data["meta"]) == {"tp", "dcp"}


def test_tune_records_a_failing_kernel_and_picks_another(tmp_path):
    def measure(kernel, rows, config):
        if kernel == "trtllm" and rows == 2:
            raise RuntimeError("boom at two rows")
        return fake_measure(kernel, rows, config)

    res = tune((1, 2, 3), heads=64, out=None, kernels=("prims_ts", "trtllm"), measure=measure, allow_cpu=True,
               progress=False)
    assert res["choices"] == {1: "trtllm", 2: "prims_ts", 3: "trtllm"}
    assert "boom" in res["errors"]["trtllm"][2]
    assert res["path"] is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rows=()), "rows"),
        (dict(rows=(0, 2)), "rows"),
        (dict(width=100), "width"),
        (dict(dcp=0), "dcp"),
        (dict(kernels=("flashmla",)), "kernels"),
        (dict(kv_cache_dtype="bf16"), "kv_cache_dtype|bf16"),
    ],
)
def test_tune_bad_input(kwargs, match):
    args = dict(rows=(1, 2), out=None, kernels=("triton",), measure=fake_measure, allow_cpu=True, progress=False)
    args.update(kwargs)
    rows = args.pop("rows")
    with pytest.raises(ValueError, match=match):
        tune(rows, **args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_tune_refuses_cpu_without_allow_cpu(tmp_path):
    with pytest.raises(ValueError, match="allow_cpu"):
        tune((1,), out=None, kernels=("triton",), measure=fake_measure, progress=False)
    with pytest.raises(SystemExit) as exit_info:  # a usage error, as argparse reports one
        main(["--rows", "1", "--out", str(tmp_path / "t.json")])
    assert exit_info.value.code == 2
    assert not (tmp_path / "t.json").exists()


# ---------------------------------------------------------------- through the real core


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU plumbing check; on a GPU the suite times for real")
def test_core_timer_runs_the_core(tmp_path, reference_kernels, capsys):
    """The default measure builds a FlashInferCore per kernel and times its decode (reference kernel inside)."""
    path = tmp_path / "t.json"
    rc = main(["--rows", "1,2", "--heads", "16", "--width", "128", "--kernels", "triton", "--allow-cpu",
               "--out", str(path), "--no-progress"])
    assert rc == 0
    data = json.loads(path.read_text())
    assert data["tp"] == "1-2:triton"
    us = data["meta"]["tp"]["us"]["triton"]
    assert set(us) == {"1", "2"} and all(math.isfinite(t) and t > 0 for t in us.values())
    (kernel,) = reference_kernels.instances  # one core, one kernel object for both batch sizes
    assert kernel.setup.row_counts == (1, 2) and kernel.setup.heads == 16 and kernel.setup.widths == (128,)
    assert {c["rows"] for c in kernel.calls} == {1, 2}
    assert all(c["width"] == 128 and c["block_size"] == 64 for c in kernel.calls)
    assert "VLLM_KIMI_DSA_KERNEL_TABLE" in capsys.readouterr().out
