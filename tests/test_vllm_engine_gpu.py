"""vLLM's engine on a CUDA GPU: `LLM(...)` generates through FLASHINFER_MLA_SPARSE (this package) and agrees with
FLASHMLA_SPARSE (vLLM's Hopper default) on the same small DeepSeek-V3.2, same weights, same prompts.

benchmarks/bench_engine.py runs each engine in a child process (vLLM's real indexer, the model runner's own batches
and CUDA graph capture); this test runs it at 16 heads (DeepSeek-V3.2's TP8 share) with no throughput batches and
reads its report:

- every engine started and generated (the exact error otherwise);
- the backend's startup line is in the engine's log, naming the heads it runs;
- ours against FLASHMLA_SPARSE: the tokens agree up to a near tie and the log-probabilities of every step, the first
  decode step included, stay within bench_engine.LOGPROB_BOUND (its docstring derives it);
- the same engine with a 5% softmax-scale error fails that comparison;
- n-gram speculative decoding (2 draft tokens) gives the plain engine's tokens.

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


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("engine")
    shims = ["--shims"] if (ROOT / "tools" / "vllm_device_shims.py").exists() else []
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "run", "--out", str(out), "--heads",
           str(HEADS), "--batches", "", "--check-requests", "4", "--check-tokens", "10", "--spec", "2", *shims]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=os.environ.copy())
    path = out / "engine_report.json"
    assert path.exists(), f"bench_engine wrote no report (rc {done.returncode}):\n{done.stdout[-3000:]}"
    data = json.loads(path.read_text())["heads"][str(HEADS)]
    if os.environ.get("KIMI_DSA_ENGINE_REPORT"):
        Path(os.environ["KIMI_DSA_ENGINE_REPORT"]).write_text(json.dumps(data, indent=1))
    return data


@pytest.mark.parametrize("engine", ["FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE", "wrong_scale", "ngram"])
def test_engine_starts_and_generates(report, engine):
    run = report[engine]
    assert run["rc"] == 0 and run["stage"] == "done", f"{engine}: {run['error']}"


def test_startup_line_names_the_heads(report):
    line = report["FLASHINFER_MLA_SPARSE"]["startup_line"]
    assert line and "serves FLASHINFER_MLA_SPARSE" in line and f"{HEADS} query heads" in line, line


def test_logits_and_tokens_agree_with_flashmla(report):
    result = report["ours_vs_flashmla"]
    assert result["ok"], result


def test_a_five_percent_softmax_scale_error_fails_the_comparison(report):
    result = report["wrong_vs_flashmla"]
    assert result is not None and not result["ok"], result
    assert result["max_logprob_diff"] > report["ours_vs_flashmla"]["max_logprob_diff"]


def test_ngram_speculation_gives_the_plain_engines_tokens(report):
    result = report["ngram_vs_ours"]
    assert result is not None and result["ok"], result
