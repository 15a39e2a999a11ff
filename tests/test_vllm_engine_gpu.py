"""vLLM's engine on a CUDA GPU: benchmarks/bench_engine.py's check at one layer, 16 heads (DeepSeek-V3.2's TP8 share):
FLASHMLA_SPARSE, this backend, vLLM's FLASHINFER_MLA_SPARSE_SM90 three ways and one CUDA-graph engine per planted
fault the run chose (all four, or a share of them where a call holds fewer), every request forced down one token
trace, on the calibration and the validation seed.

The report is a check run made earlier in the same device call ($KIMI_DSA_ENGINE_RUN, its --out folder), else one
made here (FlashInfer from $KIMI_DSA_FI_SITE: tools/device_run.sh --fi). What it holds:

- every engine started; the backend's startup line names the heads; every fault engine runs CUDA graphs;
- every engine followed the trace, recorded every decode step's log-probabilities and layer 0's output at every
  decode step, and ran its own backend (the device counters);
- the statistics of this backend, every fault and both null pairs on both seeds (benchmarks/engine_check.py);
- at engine_check's bounds, once they are set, this backend passes and every fault is caught on each seed (until
  then that test skips, naming the command that gives the bounds from this run).

Skipped (with the reason) without an SM90+ GPU or vLLM's Python tree.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HEADS = 16

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("needs an SM90+ CUDA GPU (vLLM's engine on the device)", allow_module_level=True)
if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vLLM 0.33's Python tree (tools/device_run.sh --vllm)", allow_module_level=True)

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_engine as be  # noqa: E402
import engine_check as ec  # noqa: E402

SEEDS = (ec.CALIBRATION_SEED, ec.VALIDATION_SEED)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    given = os.environ.get("KIMI_DSA_ENGINE_RUN")
    out = Path(given) if given else tmp_path_factory.mktemp("engine")
    if not given:
        shims = ["--shims"] if (ROOT / "tools" / "vllm_device_shims.py").exists() else []
        cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "check", "--out", str(out), "--heads",
               str(HEADS), "--layers", str(be.CHECK_LAYERS), *shims]
        subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=os.environ.copy())
    path = out / "engine_check.json"
    assert path.exists(), f"bench_engine wrote no check report in {out}"
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def heads(run) -> dict:
    assert run["kind"] == "check" and run["layers"] == be.CHECK_LAYERS
    return run["heads"][str(HEADS)]


def test_every_engine_started(heads, run):
    for name, engine in heads["engines"].items():
        assert not engine.get("error"), f"{name}: {engine.get('error')}\n{engine.get('log_tail', '')[-2000:]}"
    assert not heads.get("errors"), heads.get("errors")
    assert {"flashmla", "fi_sm90", "ours", *(f"fault_{f}" for f in run["faults"])} <= set(heads["engines"])


def test_startup_line_names_the_heads(heads):
    line = heads["engines"]["ours"]["startup_line"]
    assert line and "serves FLASHINFER_MLA_SPARSE" in line and f"{HEADS} query heads" in line, line


def test_the_faults_run_in_cuda_graph_engines(heads, run):
    assert run["faults"], "a check with no planted fault"
    for fault in run["faults"]:
        engine = heads["engines"][f"fault_{fault}"]
        assert engine["fault"] == fault and not engine["eager"] and engine["config"]["cudagraph_mode"] != "NONE"
    keys = ("cudagraph_mode", "capture_sizes", "max_num_seqs", "compilation_mode")
    for fault in run["faults"]:
        config = heads["engines"][f"fault_{fault}"]["config"]
        assert {k: config[k] for k in keys} == {k: heads["engines"]["ours"]["config"][k] for k in keys}, fault


@pytest.mark.parametrize("seed", SEEDS)
def test_every_engine_recorded_every_step_through_its_own_backend(heads, run, seed):
    measured = heads["seeds"][str(seed)]["measured"]
    steps = run["requests"] * run["steps"]
    assert run["context"][0] > 2048 and run["steps"] >= 64 and run["requests"] >= 64
    for name, m in measured.items():
        assert m["tokens_follow_trace"] and m["missing_steps"] == 0, name
        assert m["layer0_rows"]["overflow"] == 0, name
        if name != be.FLASHMLA:
            assert m["layer0_missing_steps"] == 0, name  # layer 0 at every decode step of both engines
    own = {be.OURS: "FlashInferCore.decode", be.FLASHMLA: "FlashMLASparseImpl.forward_mqa",
           ec.SAME_INPUTS: "FlashInferMLASparseSM90Impl.forward_mqa"}
    for name, counter in own.items():
        assert measured[name]["coverage"][counter]["rows"] >= steps, (name, measured[name]["coverage"])
    assert measured[be.FLASHMLA]["coverage"]["FlashInferCore.decode"]["calls"] == 0
    probe = measured[be.OURS]["probe"]
    assert probe["rows"] > 0 and 2.5 <= probe["logit_std_median"] <= 5.0, probe


@pytest.mark.parametrize("seed", SEEDS)
def test_the_statistics_of_every_engine(heads, run, seed):
    stats = heads["seeds"][str(seed)]["statistics"]
    assert set(stats) >= {be.OURS, *ec.NULL_PAIRS, *(ec.FAULT_PREFIX + f for f in run["faults"])}
    for name, s in stats.items():
        assert "layer0_interval" in s, name


@pytest.mark.parametrize("seed", SEEDS)
def test_verdicts_at_the_module_bounds(heads, run, seed):
    if ec.module_bounds() is None:
        pytest.skip("engine_check's bounds are not set: `python benchmarks/bench_engine.py bounds "
                    "<out>/engine_check.json` gives them from this run's calibration seed, validated on the other")
    verdicts = heads["seeds"][str(seed)]["verdicts"]
    assert verdicts["ok"], verdicts
