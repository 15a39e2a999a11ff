"""benchmarks/bench_engine.py and engine_worker.py on a CPU: the workloads, the engine's arguments through vLLM's own
EngineArgs (at a mocked SM 9.0), the recorder, the instruments' pure parts, the check's and the timing's runs with
stand-in engines, and the driver's and the worker's smaller behaviours (serve's environment, the query's rounding,
a window's purity, a batch's token count). The engines run on a GPU (tests/test_vllm_engine_gpu.py); the worker's instruments run on vLLM's own layer in
tests/test_vllm_layer_cpu.py; the statistics are tests/test_engine_check.py's."""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_engine as be  # noqa: E402
import engine_check as ec  # noqa: E402
import engine_timing as et  # noqa: E402
import engine_worker as ew  # noqa: E402


# ---------------------------------------------------------------------------------------------------- workloads


def test_check_workload_spaces_its_prompts_and_forces_every_trace():
    prompts, traces = be.check_workload(ec.CALIBRATION_SEED)
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) == len(traces) == be.CHECK_REQUESTS >= 64
    assert be.TOPK < be.CHECK_CONTEXT[0] <= lengths[0] and lengths[-1] <= be.CHECK_CONTEXT[1]
    assert min(b - a for a, b in zip(lengths, lengths[1:])) >= be.CHECK_STEPS + 2  # a position names its request
    assert {len(t) for t in traces} == {1 + be.CHECK_STEPS} and be.CHECK_STEPS >= 64
    assert all(2 <= x < be.VOCAB for p in prompts + traces for x in p)
    assert be.check_workload(ec.CALIBRATION_SEED) == (prompts, traces)  # every engine gets the same
    other = be.check_workload(ec.VALIDATION_SEED)
    assert other[0] != prompts and other[1] != traces
    assert max(lengths) + 1 + be.CHECK_STEPS <= ew.MAX_MODEL_LEN
    with pytest.raises(ValueError, match="requests"):
        be.check_workload(1, requests=200)


def test_context_mixes():
    assert be.context_lengths("uniform-4096", 8, seed=1) == [4096] * 8
    ragged = be.context_lengths("ragged-100-8000", 128, seed=1)
    assert min(ragged) == 100 and max(ragged) == 8000 and ragged == be.context_lengths("ragged-100-8000", 128, 1)
    assert sum(n < 2048 for n in ragged) > 32 and sum(n > 2048 for n in ragged) > 16  # both sides of index_topk
    with pytest.raises(ValueError, match="context mix"):
        be.context_lengths("lognormal", 8, seed=1)


def test_model_is_deepseek_v32_attention_as_released(tmp_path):
    written = json.loads((be.write_model(tmp_path, 16, layers=1) / "config.json").read_text())
    assert written["num_hidden_layers"] == written["first_k_dense_replace"] == 1
    config = be.model_config(128, 4)
    assert (config["q_lora_rank"], config["kv_lora_rank"], config["qk_rope_head_dim"]) == (1536, 512, 64)
    assert (config["index_topk"], config["index_n_heads"], config["index_head_dim"]) == (2048, 64, 128)
    assert config["first_k_dense_replace"] == config["num_hidden_layers"]  # dense MLP in every layer


# ---------------------------------------------------------------------------------------------------- the engine


def test_flash_attention_present_with_fa3_alone_keeps_force_mqa_off(monkeypatch):
    """An SM90 vLLM wheel may carry FA3 without FA2: FlashAttention is there, vLLM's dense-MHA prefill runs, and the
    engines must not force every prefill through the sparse path."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: real("json") if name == "vllm._vllm_fa3_C"
                        else None if "_vllm_fa" in name else real(name, *a))
    assert ew.flash_attention_present()
    args = argparse.Namespace(shims=False, capture_sizes=[1, 2], gpu_memory_utilization=0.3)
    assert not be.engine_spec(Path("/nowhere"), "x", Path("/model"), be.OURS, 16, args)["force_mqa"]


@pytest.mark.parametrize("flash_attention", [False, True])
def test_force_mqa_only_where_flash_attention_is_absent(monkeypatch, flash_attention):
    """The device has no FlashAttention (tools/pack_vllm.sh carries none), so vLLM's dense-MHA prefill of short prompts
    cannot run there: every prefill goes through the sparse backends instead, and every row says so. A user's vLLM
    has FlashAttention, and the flag stays off."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (real("json") if flash_attention else None) if "_vllm_fa" in name
                        else real(name, *a))
    assert ew.flash_attention_present() is flash_attention
    args = argparse.Namespace(shims=False, capture_sizes=[1, 2], gpu_memory_utilization=0.3)
    spec = be.engine_spec(Path("/nowhere"), "x", Path("/model"), be.OURS, 16, args)
    assert spec["force_mqa"] is not flash_attention
    kwargs = ew.engine_kwargs("/model", be.OURS, force_mqa=spec["force_mqa"])
    assert kwargs["attention_config"].get("sparse_mla_force_mqa", False) is not flash_attention
    assert ("sparse_mla_force_mqa" in ew.prefill_path(spec["force_mqa"])) is not flash_attention


def test_the_engines_sampler_never_asks_flashinfer(monkeypatch):
    """vLLM's sampler asks FlashInfer whether it can sample (an import of FlashInfer's backend, which the device lacks:
    the H100's engines stopped there, 2026-12-07) unless VLLM_USE_FLASHINFER_SAMPLER is 0, which ENGINE_ENV sets."""
    pytest.importorskip("vllm")
    import vllm.v1.sample.ops.topk_topp_sampler as sampler
    import vllm_harness as vh

    monkeypatch.setattr(sampler, "current_platform", vh.cuda_platform_class()())
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.flashinfer", None)  # FlashInfer absent
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    with pytest.raises(ImportError):
        sampler.flashinfer_sampler_supported()
    for name, value in ew.ENGINE_ENV.items():
        monkeypatch.setenv(name, value)
    assert sampler.flashinfer_sampler_supported() is False


@pytest.mark.parametrize("backend", [be.OURS, be.FLASHMLA])
def test_vllm_builds_the_engine_config_at_sm90(tmp_path, backend, monkeypatch):
    """vLLM's own EngineArgs takes what every engine of the run is given: breakable CUDA graphs (compilation mode
    NONE, as vLLM turns them on for DeepSeek-V3.2) at the run's capture sizes, Model Runner V2 (trace replay needs
    it), trace replay on, the recorder as a custom logits processor, force-MQA, index_topk 2048."""
    pytest.importorskip("vllm")
    import vllm_harness as vh
    from unittest.mock import patch
    from vllm.engine import arg_utils
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "")
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH")
    model = be.write_model(tmp_path / "model", 16, be.CHECK_LAYERS)
    kwargs = ew.engine_kwargs(str(model), backend, force_mqa=True, capture_sizes=list(be.CAPTURE_SIZES))
    with vh.gpu_capability(9, 0), patch.object(arg_utils, "current_platform", vh.cuda_platform_class()()):
        config = EngineArgs(**kwargs).create_engine_config()
    assert config.attention_config.backend.name == backend and config.attention_config.sparse_mla_force_mqa
    assert config.cache_config.cache_dtype == "fp8" and int(config.compilation_config.mode) == 0
    assert list(config.compilation_config.cudagraph_capture_sizes) == list(be.CAPTURE_SIZES)
    assert config.use_v2_model_runner and config.model_config.enable_trace_replay
    assert config.model_config.logits_processors == [ew.RecordLogits]
    assert config.model_config.hf_text_config.index_topk == 2048
    assert config.model_config.get_num_attention_heads(config.parallel_config) == 16


def test_recorder_is_a_v2_logits_processor_and_records_by_output_step():
    """RecordLogits through vLLM's V2 loader; rows of a recorded request land at step pos + 1 - prompt_len (a chunk
    short of the prompt's end records nothing), the logits pass through unchanged, other requests are declined."""
    pytest.importorskip("vllm")
    from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_by_fqcns

    assert _load_v2_logitsprocs_by_fqcns([ew.RecordLogits]) == [ew.RecordLogits]
    ew.RecordLogits.instances.clear()
    rec = ew.RecordLogits(None, None)
    params = lambda extra: SimpleNamespace(extra_args=extra)  # noqa: E731
    assert rec.add_request(3, params({"record_key": 0, "prompt_len": 10}))
    assert rec.add_request(5, params({"record_key": 1, "prompt_len": 4}))
    assert not rec.add_request(6, params(None))
    logits = torch.randn(4, 16)
    ctx = SimpleNamespace(expanded_idx_mapping=torch.tensor([3, 5, 6, 3]), pos=torch.tensor([6, 3, 9, 9]))
    out = rec.apply(logits.clone(), ctx)
    assert torch.equal(out, logits)
    got = ew.RecordLogits.collect([0, 1], steps=2)
    assert torch.allclose(got[0, 0], torch.log_softmax(logits[3], -1))  # pos 9 of a 10-token prompt: step 0
    assert torch.allclose(got[1, 0], torch.log_softmax(logits[1], -1))  # pos 3 of 4: step 0
    assert torch.isnan(got[0, 1]).all() and torch.isnan(got[1, 1]).all()
    ew.RecordLogits.instances.clear()




class _EnvReportingServer:
    """Stands in for engine_worker.EngineServer in a child process: its info is the ENGINE_ENV variables as that
    process sees them."""

    def __init__(self, spec):
        self.spec = spec

    def info(self):
        return {name: os.environ.get(name) for name in ew.ENGINE_ENV}

    def close(self):
        pass


def _serve_with_stand_in(conn, spec):
    ew.EngineServer = _EnvReportingServer
    ew.serve(conn, spec)


def test_serve_sets_engine_env_in_the_engines_own_process(tmp_path, monkeypatch):
    """A real child process (spawned as EngineProcess spawns it) runs engine_worker.serve; the parent lacks the
    variables, so the child has them only if serve set them there."""
    for name in ew.ENGINE_ENV:
        monkeypatch.delenv(name, raising=False)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_serve_with_stand_in, args=(child, {"log": str(tmp_path / "engine.log")}))
    process.start()
    try:
        assert parent.poll(120), "the engine process did not answer"
        assert parent.recv() == ("ok", dict(ew.ENGINE_ENV))
        parent.send(("stop", {}))
        assert parent.recv() == ("ok", "stopped")
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
    assert all(name not in os.environ for name in ew.ENGINE_ENV)


def test_a_timed_engine_has_no_recorder_and_no_trace_replay():
    kwargs = ew.engine_kwargs("/model", be.OURS, force_mqa=True, record=False)
    assert "logits_processors" not in kwargs and "enable_trace_replay" not in kwargs
    checked = ew.engine_kwargs("/model", be.OURS, force_mqa=True)
    assert checked["logits_processors"] == [ew.RecordLogits] and checked["enable_trace_replay"]


def test_a_timed_engine_gets_no_instruments_but_the_step_events(monkeypatch):
    """install_instruments with instruments off installs only StepEvents; on, a fault engine of this backend gets the
    fault first (so the counters and the recorder see the faulted calls) and every instrument after."""
    calls = []
    for name in ("Faults", "QueryRounding", "KeyOrder", "LogitProbe", "Coverage", "LayerZeroRecord", "StepEvents"):
        monkeypatch.setattr(getattr(ew, name), "install",
                            classmethod(lambda cls, *a, _n=name, **k: calls.append(_n)))
    assert ew.install_instruments({"backend": be.OURS, "instruments": False, "heads": 16}) == []
    assert calls == ["StepEvents"]
    calls.clear()
    spec = {"backend": be.OURS, "instruments": True, "fault": "half_topk", "record_rows": 8, "heads": 16}
    ew.install_instruments(spec)
    assert calls == ["Faults", "LogitProbe", "Coverage", "LayerZeroRecord", "StepEvents"]
    calls.clear()
    ew.install_instruments({"backend": be.FLASHINFER_SM90, "instruments": True, "record_rows": 8, "heads": 16})
    assert calls == ["QueryRounding", "KeyOrder", "Coverage", "LayerZeroRecord", "StepEvents"]


def test_query_rounding_rounds_to_e4m3(monkeypatch):
    """FlashInfer SM90 fed this backend's query: each value rounded to e4m3 at the layer's q scale, as vLLM's fused_q
    rounds it (1.125 stays, e5m2 would give 1.0; 500 saturates at e4m3's 448, e5m2 keeps 512)."""
    pytest.importorskip("vllm")
    import vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 as fi_sm90

    seen = []
    monkeypatch.setattr(fi_sm90.FlashInferMLASparseSM90Impl, "forward_mqa",
                        lambda self, q, kv, md, layer: seen.append(q))
    try:
        ew.QueryRounding.install()
        ew.QueryRounding.on = True
        nope = torch.tensor([[1.125, 500.0, 0.30078125, -3.25]], dtype=torch.bfloat16)
        rope = torch.tensor([[0.0625, 7.5]], dtype=torch.bfloat16)
        fi_sm90.FlashInferMLASparseSM90Impl.forward_mqa(None, (nope, rope), None, None,
                                                       SimpleNamespace(_q_scale_float=1.0))
        got_nope, got_rope = seen[-1]
        assert got_nope.float().tolist() == [[1.125, 448.0, 0.3125, -3.25]]
        assert got_rope.float().tolist() == [[0.0625, 7.5]] and got_nope.dtype == torch.bfloat16
        ew.QueryRounding.on = False
        fi_sm90.FlashInferMLASparseSM90Impl.forward_mqa(None, (nope, rope), None, None,
                                                       SimpleNamespace(_q_scale_float=1.0))
        assert torch.equal(seen[-1][0], nope)
    finally:
        ew.restore()


def test_key_order_reverses_each_rows_valid_prefix_only(monkeypatch):
    pytest.importorskip("vllm")
    import vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 as fi_sm90

    slots = torch.tensor([[5, 6, 7, -1, -1], [9, -1, -1, -1, -1], [1, 2, 3, 4, 8]], dtype=torch.int32)
    counts = torch.tensor([3, 1, 5], dtype=torch.int32)
    monkeypatch.setattr(fi_sm90, "triton_convert_req_index_to_global_index", lambda *a, **k: (slots, counts))
    try:
        ew.KeyOrder.install()
        assert fi_sm90.triton_convert_req_index_to_global_index()[0] is slots  # off: as vLLM gave them
        ew.KeyOrder.on = True
        got, got_counts = fi_sm90.triton_convert_req_index_to_global_index()
        assert got.tolist() == [[7, 6, 5, -1, -1], [9, -1, -1, -1, -1], [8, 4, 3, 2, 1]] and got_counts is counts
    finally:
        ew.restore()


def test_faults_are_chosen_from_the_four_at_install():
    with pytest.raises(ValueError, match="mode"):
        ew.Faults.install("none")
    assert set(ew.FAULTS) == {"softmax_scale", "slot_off_by_one", "half_topk", "topk_ignored"}


def test_seeded_weights_are_the_same_in_two_processes(tmp_path):
    """Two engines of a run are two processes: the seeded loader must draw the same weights in each (a generator
    seeded by the tensor's name, never Python's per-process hash)."""
    pytest.importorskip("vllm")
    code = (
        "import sys, hashlib, torch; sys.path.insert(0, {bench!r}); import engine_worker as ew\n"
        "from vllm.config.load import LoadConfig\n"
        "m = torch.nn.Module(); m.q_b_proj = torch.nn.Linear(64, 96); m.embed_tokens = torch.nn.Embedding(32, 64)\n"
        "ew.register_seeded_loader()(LoadConfig(load_format='dsa_seeded')).load_weights(m, None)\n"
        "print(hashlib.sha256(b''.join(t.detach().numpy().tobytes() for t in m.state_dict().values())).hexdigest())\n"
    ).format(bench=str(ROOT / "benchmarks"))
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                              env={"PYTHONHASHSEED": str(seed), "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""},
                              ).stdout.strip().splitlines()[-1] for seed in (1, 2)}
    assert len(digests) == 1 and len(next(iter(digests))) == 64, digests




# ---------------------------------------------------------------------------------------------------- the check's run

VOCAB, WIDTH = 48, 8


def _noise(seed: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


class _StandInEngine:
    """An engine process answering as engine_worker.serve does, with recordings made here: FlashMLA's the reference;
    FlashInfer's (each query and key order) and this backend's off it by seeded noise of the sizes below; a fault's
    off this backend's by FAULTS[mode]. Layer 0's rows likewise, at the positions the trace gives."""

    sigma = {be.FLASHINFER_SM90: 0.05, ec.SAME_INPUTS: 0.10, ec.KEYS_REVERSED: 0.10, be.OURS: 0.10}
    extra = {ec.KEYS_REVERSED: 0.01, be.OURS: 0.03}
    faults: dict[str, float] = {}
    started: list[str] = []

    def __init__(self, spec: dict) -> None:
        self.spec, self.error = spec, None
        self.rounding = self.reversed = False
        self.info = {"backend": spec["backend"], "heads": spec["heads"], "gpu": "stand-in",
                     "prefill_path": ew.prefill_path(spec["force_mqa"]),
                     "config": {"max_num_seqs": 128, "capture_sizes": [1, 2], "cudagraph_mode": "FULL",
                                "compilation_mode": "0", "async_scheduling": True, "num_hidden_layers": 1}}
        _StandInEngine.started.append(spec["backend"] + ":" + spec.get("fault", "none"))

    def name(self) -> str:
        backend, fault = self.spec["backend"], self.spec.get("fault", "none")
        if backend == be.FLASHINFER_SM90:
            return ec.KEYS_REVERSED if self.reversed else ec.SAME_INPUTS if self.rounding else be.FLASHINFER_SM90
        return backend if fault == "none" else ec.FAULT_PREFIX + fault

    def _values(self, kind: int, seed: int, shape) -> torch.Tensor:
        name = self.name()
        base = _noise(seed * 10 + kind, shape) * (3.0 if kind == 0 else 1.0)
        if name == be.FLASHMLA:
            return base
        root = be.FLASHINFER_SM90 if name == be.FLASHINFER_SM90 else ec.SAME_INPUTS
        value = base + self.sigma[root] * _noise(seed * 10 + kind + 1, shape)
        if name in self.extra:
            value = value + self.extra[name] * _noise(seed * 10 + kind + 2, shape)
        if name.startswith(ec.FAULT_PREFIX):
            value = value + self.faults[name[len(ec.FAULT_PREFIX):]] * _noise(seed * 10 + kind + 3, shape)
        return value

    def call(self, command: str, **kw):
        if command == "set_query_rounding":
            self.rounding = kw["on"]
            return self.rounding
        if command == "set_key_order":
            self.reversed = kw["reversed_"]
            return self.reversed
        if command == "check":
            prompts, traces = kw["prompts"], kw["traces"]
            requests, steps = len(prompts), len(traces[0]) - 1
            seed = len(prompts[0])
            logprobs = torch.log_softmax(self._values(0, seed, (requests, 1 + steps, VOCAB)), dim=-1)
            rows = self._values(1, seed, (requests, steps, 1, WIDTH))
            positions = torch.tensor([[len(p) + t for t in range(steps)] for p in prompts])
            layer0 = {"rows": rows.reshape(-1, 1, WIDTH), "positions": positions.reshape(-1), "overflow": 0}
            own = {be.OURS: "FlashInferCore.decode", be.FLASHMLA: "FlashMLASparseImpl.forward_mqa",
                   be.FLASHINFER_SM90: "FlashInferMLASparseSM90Impl.forward_mqa"}[self.spec["backend"]]
            coverage = {own: {"calls": 1, "rows": requests * steps}}
            if self.spec["backend"] == be.OURS:
                coverage["KimiDSAFlashInferMLASparseImpl.forward_mqa"] = {"calls": 1, "rows": requests * steps}
            return {"logprobs": logprobs, "layer0": layer0, "coverage": coverage, "probe": {}, "seconds": 0.0,
                    "tokens_follow_trace": True}
        raise AssertionError(command)

    def startup_line(self):
        return "vllm_kimi_dsa serves" if self.spec["backend"] == be.OURS else None

    def stop(self):
        pass


def _check(tmp_path, monkeypatch, faults, *extra: str, bounds=None) -> tuple[int, dict]:
    monkeypatch.setattr(be, "EngineProcess", _StandInEngine)
    monkeypatch.setattr(_StandInEngine, "faults", faults)
    monkeypatch.setattr(_StandInEngine, "started", [])
    monkeypatch.setattr(ec, "KL_BOUND", None if bounds is None else bounds["kl"])
    monkeypatch.setattr(ec, "LAYER0_BOUND", None if bounds is None else bounds["layer0"])
    out = tmp_path / "check"
    rc = be.main(["check", "--out", str(out), "--heads", "16", "--check-requests", "24", "--check-steps", "6",
                  "--faults", ",".join(faults), "--fi-site", "/fi", *extra])
    return rc, json.loads((out / "engine_check.json").read_text())


GROSS = {"softmax_scale": 0.3, "slot_off_by_one": 1.0, "half_topk": 1.0, "topk_ignored": 1.0}


def test_a_check_without_bounds_judges_nothing_and_reports_the_bounds_its_null_pairs_give(tmp_path, monkeypatch):
    rc, report = _check(tmp_path, monkeypatch, GROSS)
    assert rc == 0 and report["kind"] == "check" and report["bounds"] is None
    assert _StandInEngine.started[:3] == [f"{be.FLASHMLA}:none", f"{be.FLASHINFER_SM90}:none", f"{be.OURS}:none"]
    for seed in (ec.CALIBRATION_SEED, ec.VALIDATION_SEED):
        data = report["heads"]["16"]["seeds"][str(seed)]
        assert data["verdicts"]["ok"] is None and "not set" in data["verdicts"]["judged"]
        assert set(data["statistics"]) == {be.FLASHINFER_SM90, ec.KEYS_REVERSED, be.OURS,
                                           *(ec.FAULT_PREFIX + f for f in GROSS)}
        ours = data["statistics"][be.OURS]
        assert 1.0 < ours["kl_interval"]["ratio"] < 1.5 and 1.0 < ours["layer0_interval"]["ratio"] < 1.5
        measured = data["measured"][be.OURS]
        assert measured["missing_steps"] == 0 and measured["layer0_rows"]["off_step"] == 0
        assert len(measured["kl"]) == 24 and len(measured["layer0_same_inputs"]) == 24
    found = be.bounds_from_reports([report])
    assert found["validation"]["valid"] and 1.5 <= found["bounds"]["kl"] <= 1.8
    assert found["bounds"] == ec.set_bounds(report["heads"]["16"]["seeds"][str(ec.CALIBRATION_SEED)]["statistics"])


def test_a_check_at_bounds_passes_this_backend_and_catches_every_fault(tmp_path, monkeypatch):
    rc, report = _check(tmp_path, monkeypatch, GROSS, bounds={"kl": 1.5, "layer0": 1.5})
    verdicts = report["heads"]["16"]["seeds"][str(ec.CALIBRATION_SEED)]["verdicts"]
    assert rc == 0 and verdicts["ok"], verdicts
    assert verdicts["engines"][be.OURS]["within_fraction"] >= ec.PASS_FRACTION
    assert all(verdicts["engines"][ec.FAULT_PREFIX + f]["caught_fraction"] >= ec.PASS_FRACTION for f in GROSS)


def test_the_bounds_of_two_calls_merge_only_over_the_same_reference(tmp_path, monkeypatch):
    """The faults split over two device calls: each call's statistics join the other's only where both ran on the same
    FLASHMLA_SPARSE and denominator bytes."""
    _, first = _check(tmp_path / "a", monkeypatch, {"softmax_scale": 0.3, "half_topk": 1.0})
    _, second = _check(tmp_path / "b", monkeypatch, {"slot_off_by_one": 1.0, "topk_ignored": 1.0})
    found = be.bounds_from_reports([first, second])
    assert found["faults"] == sorted(GROSS) and found["validation"]["valid"] and not found["validation"]["absent"]
    seed = second["heads"]["16"]["seeds"][str(ec.VALIDATION_SEED)]
    seed["measured"][be.FLASHMLA]["logprobs_sha256"] = "0" * 64
    with pytest.raises(ValueError, match="differs"):
        be.bounds_from_reports([first, second])


def test_the_module_bounds_are_what_the_committed_calibration_runs_give():
    """engine_check's bounds come with the check reports they were set from; none is set without them."""
    if not ec.CALIBRATION_REPORTS:
        assert ec.module_bounds() is None
        return
    import gzip

    paths = [ROOT / p for p in ec.CALIBRATION_REPORTS]
    reports = [json.loads(gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_text()) for p in paths]
    found = be.bounds_from_reports(reports)
    assert found["bounds"] == ec.module_bounds() and found["validation"]["valid"], found


def test_a_check_fails_when_a_fault_stays_inside_the_bound(tmp_path, monkeypatch):
    faults = {**GROSS, "half_topk": 0.0}
    rc, report = _check(tmp_path, monkeypatch, faults, bounds={"kl": 1.5, "layer0": 1.5})
    verdicts = report["heads"]["16"]["seeds"][str(ec.CALIBRATION_SEED)]["verdicts"]
    assert rc == 1 and not verdicts["engines"]["fault:half_topk"]["passes"]
    assert not be.bounds_from_reports([report])["validation"]["valid"]


def test_a_check_without_flashinfer_judges_nothing_and_fails(tmp_path, monkeypatch):
    """Without FlashInfer's pairs there is no denominator and no null pair: no other pair (FlashMLA's alone) may
    stand in for them and judge the faults."""
    monkeypatch.setattr(be, "EngineProcess", _StandInEngine)
    monkeypatch.setattr(_StandInEngine, "faults", GROSS)
    monkeypatch.setattr(ec, "KL_BOUND", 1.5)
    monkeypatch.setattr(ec, "LAYER0_BOUND", 1.5)
    out = tmp_path / "check"
    rc = be.main(["check", "--out", str(out), "--heads", "16", "--check-requests", "24", "--check-steps", "6",
                  "--faults", "all", "--fi-site", ""])
    report = json.loads((out / "engine_check.json").read_text())
    verdicts = report["heads"]["16"]["seeds"][str(ec.CALIBRATION_SEED)]["verdicts"]
    assert rc == 1 and verdicts["ok"] is False and "FlashInfer" in verdicts["judged"]
    assert "statistics" not in report["heads"]["16"]["seeds"][str(ec.CALIBRATION_SEED)]


def test_four_layers_are_a_smoke_test(tmp_path, monkeypatch):
    rc, report = _check(tmp_path, monkeypatch, {}, "--layers", "4", bounds={"kl": 1.5, "layer0": 1.5})
    verdicts = report["heads"]["16"]["seeds"][str(ec.CALIBRATION_SEED)]["verdicts"]
    assert rc == 0 and report["kind"] == "smoke" and verdicts["kind"] == "smoke" and verdicts["ok"]
    assert all(v["own_backend_counted"] for v in verdicts["engines"].values())
    with pytest.raises(ValueError, match="smoke"):
        be.bounds_from_reports([report])


# ---------------------------------------------------------------------------------------------------- the timing


def _step(requests: int, **changes) -> dict:
    return {"tokens": requests, "requests": requests, "new": 0, "prefilling": 0, "multi_token": 0, **changes}


class _StandInTimed:
    """A timed engine's answers: windows of `steps` pure-decode steps (the batch shrinking from window `shrink_at`
    on, if set), CUDA-event spans, clocks, and a profile of this backend's or FlashMLA's kernels."""

    shrink_at: int | None = None

    def __init__(self, backend: str, requests: int) -> None:
        self.spec = {"backend": backend}
        self.info = {"gpu": "stand-in", "prefill_path": "sparse"}
        self.requests, self.windows = requests, 0

    def call(self, command: str, **kw):
        if command in ("start_batch", "end_batch"):
            return {"prefill_s": 0.1}
        steps = kw["steps"]
        self.windows += 1
        batch = self.requests - (1 if self.shrink_at is not None and self.windows > self.shrink_at else 0)
        us = 1000.0 if self.spec["backend"] == be.OURS else 1200.0
        out = {"steps": steps, "scheduled": [_step(batch) for _ in range(steps)], "step_gpu_span_us": [us - 50] * steps,
               "window_gpu_span_us": (us - 50) * steps, "clocks": {"gpus": [{"clocks.sm": "1980"}]},
               "seconds": us * steps * 1e-6}
        if kw.get("profile"):
            decode = "few_heads_kernel" if self.spec["backend"] == be.OURS else \
                "void legacy::sm90::decode::sparse::flash_fwd_splitkv_mla_fp8_sparse_kernel<x>"
            out["kernels_us"] = {decode: 100.0 * steps, "_fused_q_kernel": 50.0 * steps, "nvjet_x": 500.0 * steps}
        return out


def test_timing_rows_carry_the_spans_the_kernels_and_the_full_batch_check(monkeypatch):
    args = argparse.Namespace(windows=10, steps=64)
    engines = {n: _StandInTimed(n, 8) for n in (be.OURS, be.FLASHMLA)}
    rows = be.time_point(engines, 16, 40, 8, "ragged-100-8000", args, copy_gbps=3000.0)
    ours, flashmla = rows
    for row in rows:
        assert {"backend", "heads", "layers", "requests", "context_mix", "decode_step_us", "gpu_span_us", "kernel_us",
                "attention_us", "tokens_per_s", "gpu", "prefill_path", "kernels", "full_batch",
                "sm_clock_mhz"} <= set(row)
        assert row["full_batch"] and len(row["decode_step_us_windows"]) == 10 and row["attention_floor_us"] > 0
        assert row["attention_us"] == pytest.approx(100.0) and row["kernel_us"] == pytest.approx(650.0)
        assert {k["kernel"] for k in row["kernels"]} >= {"_fused_q_kernel", "nvjet_x"}  # the full table
    assert (ours["decode_step_us"], flashmla["decode_step_us"], ours["gpu_span_us"]) == (1000.0, 1200.0, 950.0)
    assert ours["tokens_per_s"] == pytest.approx(8000.0) and ours["sm_clock_mhz"] == [1980, 1980]
    assert "| 16 | 40 | 8 | ragged-100-8000 | 1000 / 1200 | 950 / 1150 | 650 / 650 | 100 (" in et.table(rows)


def test_a_window_whose_batch_shrank_fails_the_full_batch_check(monkeypatch):
    monkeypatch.setattr(_StandInTimed, "shrink_at", 9)
    args = argparse.Namespace(windows=10, steps=64)
    engines = {n: _StandInTimed(n, 32) for n in (be.OURS, be.FLASHMLA)}
    rows = be.time_point(engines, 16, 1, 32, "uniform-4096", args, copy_gbps=3000.0)
    assert not any(r["full_batch"] for r in rows) and rows[0]["request_counts"] == [31, 32]
    assert "| no |" in et.table(rows)


def test_a_floor_fraction_past_one_fails_the_full_batch_check():
    windows = [{"steps": 2, "scheduled": [_step(4), _step(4)]}]
    assert et.window_checks(windows, 4, 0.9)["full_batch"]
    assert not et.window_checks(windows, 4, 1.42)["full_batch"]
    assert not et.window_checks([{"steps": 3, "scheduled": [_step(4), _step(4)]}], 4, 0.9)["full_batch"]


def test_batch_tokens_of_one_request_cover_every_window_and_the_profiled_one():
    """One request of 4,096 tokens, 10 timed windows and a profiled one of 64 steps: the token after the prompt, 4
    warm-up steps, 11 x 64 window steps, a step in flight after each window and the warm-up (12), the prefill's 2
    steps and 16 spare: 739. Without the profiled window it would be 674, and the last window would outlast it."""
    assert et.batch_tokens([4096], 10, 64, be.WARMUP, ew.MAX_NUM_BATCHED_TOKENS) == 1 + 4 + 11 * 64 + 12 + 2 + 16
    assert et.batch_tokens([4096], 3, 16, be.WARMUP, ew.MAX_NUM_BATCHED_TOKENS) == 1 + 4 + 4 * 16 + 5 + 2 + 16


def test_a_point_past_max_model_len_is_refused():
    with pytest.raises(ValueError, match="max_model_len"):
        be.point_tokens(8, "ragged-100-8000", 30, 64)
    lengths, tokens = be.point_tokens(128, "ragged-100-8000", 10, 64)
    assert max(lengths) + tokens <= ew.MAX_MODEL_LEN


def test_the_model_takes_as_many_layers_as_the_card_holds_for_both_engines():
    """At 128 requests of 4,096 tokens (the largest point): 61 layers on an H200's 141 GB at 16 heads; fewer on an
    H100's 80 GB, each engine within its share."""
    tokens = 128 * (4096 + be.point_tokens(128, "uniform-4096", 10, 64)[1])
    h200 = et.fit_layers(be.model_config(16, 1), 141 << 30, tokens)
    assert h200["layers"] == 61 and h200["fits"] and h200["gpu_memory_utilization"] == 0.45
    h100 = et.fit_layers(be.model_config(128, 1), 80 << 30, tokens)
    assert 20 < h100["layers"] < 61 and max(h100["engine_bytes"].values()) <= h100["share_bytes"]
    assert et.engine_bytes(be.model_config(128, 1), h100["layers"] + 1, tokens, be.FLASHMLA) > h100["share_bytes"]
    # one 128-head layer: down-projection 4.33 M, q_b 37.7 M, kv_b and its absorbed copy 33.6 M, o 33.6 M, indexer
    # 13.0 M, dense MLP 25.2 M parameters, in BF16
    assert et.layer_weight_bytes(be.model_config(128, 1)) == 2 * 147_331_328


def test_every_timing_call_at_a_head_count_times_the_same_model():
    """Calls holding the small points and calls holding the large ones size the model alike (for the largest point
    of the whole set), so their rows compare."""
    def args(requests):
        return argparse.Namespace(requests=requests, mixes=["uniform-4096"], windows=10, steps=64, layers="auto",
                                  gpu_memory_utilization=0.3)

    small, large = (be.timing_layers(args(r), 128, 80 << 30) for r in ([1, 8], [32, 128]))
    assert small == large and small["layers"] < 61
    assert be.timing_layers(argparse.Namespace(**{**vars(args([1])), "layers": 12}), 128, None)["layers"] == 12


def test_attention_is_counted_alike_from_each_backends_named_kernels():
    """The names both sides' kernels had in the H100's profiles (2026-12-07): FlashMLA's query concatenation counts
    as its attention, the shared RoPE / indexer query kernel counts on neither side, vLLM's top-k conversion on
    both; FlashMLA's head padding only where it pads (fewer than 64 heads)."""
    flashmla = {
        "void legacy::sm90::decode::sparse::flash_fwd_splitkv_mla_fp8_sparse_kernel<legacy::sm90::decode": "decode",
        "void smxx::decode::flash_fwd_mla_combine_kernel<cutlass::bfloat16_t, 512, 8, 32, 256, false>": "combine",
        "void smxx::decode::get_mla_metadata_kernel<false, false, false>(GetDecodeSchedMetaParams)": "metadata",
        "void vllm::ConcatMLAQKernel<c10::BFloat16, 512>(c10::BFloat16*, c10::BFloat16 const*, ...)": "query",
        "sparse_mla_index_remap_kernel": "topk_convert", "_fused_q_kernel": "other", "_fused_norm_rope_kernel": "other",
        "void deep_gemm::sm90_fp8_paged_mqa_logits<1u, 64u, 128u>": "other",
        "void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<c10::BFloat16>, x>": "query_padding",
    }
    assert {n: et.kernel_class(be.FLASHMLA, 16, n) for n in flashmla} == flashmla
    assert et.kernel_class(be.FLASHMLA, 128, "vectorized_elementwise_kernel<8, FillFunctor<c10::BFloat16>>") == "other"
    ours = {"few_heads_kernel": "decode", "seesaw_decode_kernel": "decode", "combine_kernel": "combine",
            "sparse_mla_index_remap_kernel": "topk_convert", "_fused_q_kernel": "other",
            "void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctorOnSelf_add<long>>": "other"}
    assert {n: et.kernel_class(be.OURS, 16, n) for n in ours} == ours
    a = et.classify({"few_heads_kernel": 400.0, "_fused_q_kernel": 80.0, "nvjet_x": 1000.0, "extra": 40.0}, 4,
                    be.OURS, 16)
    b = et.classify({"flash_fwd_splitkv_mla_fp8_sparse_kernel": 800.0, "_fused_q_kernel": 80.0, "nvjet_x": 1000.0},
                    4, be.FLASHMLA, 16)
    assert a["attention_us"] == 100.0 and a["kernel_us"] == 380.0 and b["attention_us"] == 200.0
    assert et.unmatched_other(a["kernels"], b["kernels"]) == [{"kernel": "extra", "us_per_step": [10.0, 0.0]}]


# ---------------------------------------------------------------------------------------------------- the worker


def _scheduler_output(cached: dict[str, tuple[int, int]], new: int = 0):
    """vLLM's own SchedulerOutput: `cached` maps a request id to (tokens scheduled, tokens computed before)."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    out = SchedulerOutput.make_empty()
    data = CachedRequestData.make_empty()
    data.req_ids = list(cached)
    data.num_computed_tokens = [c for _, c in cached.values()]
    data.num_output_tokens = [0] * len(cached)
    out.scheduled_cached_reqs = data
    out.num_scheduled_tokens = {rid: n for rid, (n, _) in cached.items()}
    out.total_num_scheduled_tokens = sum(n for n, _ in cached.values())
    out.scheduled_new_reqs = [object()] * new
    return out


def test_scheduled_step_sees_a_prefill_chunk_of_one_token():
    """Three requests one token each, one of them the last token of its 100-token prompt: in counts a decode step,
    but it holds a prefill chunk."""
    pytest.importorskip("vllm")
    lens = {"a": 100, "b": 100, "c": 100}
    decode = ew.scheduled_step(_scheduler_output({"a": (1, 100), "b": (1, 120), "c": (1, 101)}), lens)
    assert decode == _step(3) and et.step_is_decode(decode, 3)
    chunk = ew.scheduled_step(_scheduler_output({"a": (1, 100), "b": (1, 120), "c": (1, 99)}), lens)
    assert chunk["prefilling"] == 1 and not et.step_is_decode(chunk, 3)
    big = ew.scheduled_step(_scheduler_output({"a": (2, 100), "b": (1, 120)}), lens)
    assert big["multi_token"] == 1 and not et.step_is_decode(big, 3)


def test_decode_window_does_not_count_a_step_with_a_prefill_chunk_as_pure_decode(monkeypatch):
    """EngineServer.decode_window over scheduler steps recorded by its own hook's function: a window in which one
    step carried a request's last prompt token is not pure decode."""
    pytest.importorskip("vllm")
    lens = {"a": 100, "b": 100}
    plain = [_scheduler_output({"a": (1, 100 + i), "b": (1, 101 + i)}) for i in range(3)]
    chunked = [*plain[:2], _scheduler_output({"a": (1, 102), "b": (1, 99)})]
    server = object.__new__(ew.EngineServer)
    for outputs, pure in ((plain, True), (chunked, False)):
        server.batch_ids, server.prompt_lens, server.produced = ["a", "b"], lens, {"a": 10, "b": 10}

        def step_until(target, outputs=outputs):
            for out in outputs:
                server.scheduled.append(ew.scheduled_step(out, server.prompt_lens))
            server.produced = {k: target for k in server.produced}

        monkeypatch.setattr(server, "_step_until", step_until, raising=False)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
        monkeypatch.setattr(ew.StepEvents, "arm", classmethod(lambda cls, steps: None))
        monkeypatch.setattr(ew.StepEvents, "disarm", classmethod(lambda cls: {"step_gpu_span_us": []}))
        monkeypatch.setattr(ew, "gpu_clocks", lambda: {})
        window = server.decode_window(3)
        assert window["pure_decode"] is pure and len(window["scheduled"]) == 3


def test_step_events_pair_each_steps_start_with_its_sampling(monkeypatch):
    """A step's span runs from Model Runner V2's execute_model to the end of its sample_tokens; a dummy run records
    nothing, and a step that sampled nothing leaves no start behind to pair with the next step's end."""
    pytest.importorskip("vllm")
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    clock = iter(range(100))

    class _Event:
        def record(self):
            self.t = next(clock)

        def elapsed_time(self, other):
            return (other.t - self.t) / 1e3  # ms

    monkeypatch.setattr(GPUModelRunner, "execute_model", lambda self, *a, **k: None)
    monkeypatch.setattr(GPUModelRunner, "sample_tokens", lambda self, *a, **k: None)
    try:
        ew.StepEvents.install()
        ew.StepEvents.pool = [_Event() for _ in range(8)]
        runner = object.__new__(GPUModelRunner)
        runner.execute_model(None, dummy_run=True)  # not a step
        runner.execute_model(None)  # t=0, never sampled
        runner.execute_model(None)  # t=1
        runner.sample_tokens(None)  # t=2
        runner.execute_model(None)  # t=3
        runner.sample_tokens(None)  # t=4
        spans = ew.StepEvents.disarm()
        assert spans == {"step_gpu_span_us": [1.0, 1.0], "window_gpu_span_us": 3.0}
    finally:
        ew.restore()


def test_each_check_reports_its_own_probe():
    """LogitProbe's samples belong to the check that made them: a second engine's (or a second check's) summary does
    not hold the first one's."""
    server = object.__new__(ew.EngineServer)

    class _LLM:
        def generate(self, prompts, params, use_tqdm):
            ew.LogitProbe.samples.append((3.5, 0.3))
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(p.trace_decode_token_ids))])
                    for p in params]

    server.llm = _LLM()
    try:
        ew.LogitProbe.samples.extend([(1.0, 0.1)] * 5)  # what an earlier check left
        got = server.check(prompts=[[5, 6, 7]], traces=[[8, 9]])
        assert got["probe"]["rows"] == 1 and got["probe"]["logit_std_median"] == 3.5 and got["tokens_follow_trace"]
    finally:
        ew.restore()
