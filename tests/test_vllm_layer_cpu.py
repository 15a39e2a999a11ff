"""vLLM 0.33's DeepSeek-V3.2 attention layer (DeepseekV32Attention.forward) with this backend, on a CPU.

The same layer, batch and checks as tests/test_vllm_gpu.py (tests/vllm_layer.py), at 16 heads, in Triton's
interpreter: vLLM's EngineArgs config, constructor, metadata builder, cache writer (fused_norm_rope), FP8 query
(fused_q), top-k conversion and forward_mqa all run. What a CPU lacks is stood in for, and only that: vLLM's platform
is CudaPlatform at compute capability 9.0 (as vLLM's own selector tests mock it), the builder's pinned host buffers
are plain, and the index group's CUDA side stream and events run in program order.
"""

from __future__ import annotations

import contextlib
from unittest.mock import patch

import pytest
import torch

pytest.importorskip("vllm.models.deepseek_v32.attention", reason="needs vLLM 0.33")
if torch.cuda.is_available():
    pytest.skip("the GPU runs tests/test_vllm_gpu.py instead", allow_module_level=True)

import vllm_harness as vh  # noqa: E402
import vllm_layer as rig  # noqa: E402

from vllm_kimi_dsa import vllm_glue  # noqa: E402


class _InOrderStream:
    """A CPU's stand-in for the index group's side stream: work runs in program order, so waits are no-ops."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class _InOrderEvent:
    def record(self, stream=None) -> None:
        pass


def _prefill_stand_in() -> type:
    """vLLM's MLAPrefillBackend named FLASH_ATTN, what vLLM selects on SM90 for the dense-MHA prefill where
    FlashAttention imports (it does not on a CPU). Its kernels never run here: the split test records forward_mha."""
    from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend

    class FlashAttnStandIn(MLAPrefillBackend):
        @staticmethod
        def get_name() -> str:
            return "FLASH_ATTN"

        def run_prefill_new_tokens(self, *args, **kwargs):
            raise AssertionError("the stand-in's prefill kernel never runs")

        def run_prefill_context_chunk(self, *args, **kwargs):
            raise AssertionError("the stand-in's prefill kernel never runs")

    return FlashAttnStandIn


def _no_prefill_backend(vllm_config):
    raise ValueError("no MLA prefill backend imports on this machine (FlashAttention needs a GPU)")


def _static_fp8_quant(input, scale=None, *args, output=None, **kwargs):
    """vLLM's ops.scaled_fp8_quant with a per-tensor static scale, in torch (x / scale to e4m3, saturated)."""
    assert scale is not None and scale.numel() == 1, "the stand-in does the static per-tensor case only"
    q = (input.float() / scale.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    if output is None:
        return q, scale
    output.copy_(q)
    return output, scale


@contextlib.contextmanager
def _cpu_rig(directory, *, dense_prefill: bool = False, **scales):
    import vllm.engine.arg_utils as arg_utils
    import vllm.model_executor.layers.attention.mla_attention as mla_attention
    import vllm.model_executor.layers.attention.sparse_mla_attention as sparse_mla
    import vllm.v1.attention.backends.mla.index_group as index_group

    vllm_glue.register()
    with (
        pytest.MonkeyPatch.context() as env,
        vh.gpu_capability(9),
        patch.object(arg_utils, "current_platform", vh.cuda_platform_class()()),
        patch.object(sparse_mla, "PIN_MEMORY", False),
        patch.object(index_group, "current_stream", _InOrderStream),
    ):
        # create_engine_config turns VLLM_USE_BREAKABLE_CUDAGRAPH on for DeepSeek-V3.2 in os.environ: undone after
        env.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")
        env.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH")
        # vLLM's MLA prefill backend as this rig's machine has it (vLLM caches its own pick per process, whatever
        # capability an earlier test mocked): SM90's FlashAttention stood in, or none, as on a CPU
        if dense_prefill:
            stand_in = _prefill_stand_in()
            env.setattr(mla_attention, "get_mla_prefill_backend", lambda vllm_config: stand_in)
            # the chunked-context fields' host buffers, and the capture check a CPU's torch cannot answer
            import vllm.utils.torch_utils as torch_utils

            env.setattr(mla_attention, "PIN_MEMORY", False)
            env.setattr(torch_utils, "PIN_MEMORY", False)
            env.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
            # the dense path's decode query goes through vLLM's compiled static FP8 quant (a CUDA op): torch's here
            import vllm._custom_ops as custom_ops

            env.setattr(custom_ops, "scaled_fp8_quant", _static_fp8_quant)
        else:
            env.setattr(mla_attention, "get_mla_prefill_backend", _no_prefill_backend)
        vh.init_vllm_cpu()
        layer = rig.LayerRig(directory, heads=16, device="cpu", num_blocks=80, max_num_seqs=4,
                             max_num_batched_tokens=512, **scales)
        assert (layer.layer.prefill_backend is not None) == dense_prefill
        group = layer.impl.index_group
        group.side_stream = _InOrderStream()
        group.logical_topk_ready = group.physical_topk_ready = _InOrderEvent()
        yield layer


@pytest.fixture(scope="module")
def cpu_layer(tmp_path_factory):
    """The layer as a CPU builds it: no FlashAttention imports, so no dense-MHA prefill (every token to the backend)."""
    with _cpu_rig(tmp_path_factory.mktemp("cpu_layer")) as layer:
        yield layer


@pytest.fixture(scope="module")
def unit_scale_layer(tmp_path_factory):
    """The layer with q / k scales of 1.0 (an unquantized checkpoint, the usual serving case: the writer skips them)."""
    with _cpu_rig(tmp_path_factory.mktemp("unit_layer"), q_scale=1.0, k_scale=1.0) as layer:
        yield layer


@pytest.fixture(scope="module")
def sm90_layer(tmp_path_factory):
    """The layer as an H100 with vLLM's wheel builds it: FlashAttention the dense-MHA prefill backend."""
    with _cpu_rig(tmp_path_factory.mktemp("sm90_layer"), dense_prefill=True) as layer:
        yield layer


def test_decode_step_through_vllms_layer(cpu_layer):
    """An odd decode batch (contexts below and above index_topk), -1 holes, a token with nothing selected."""
    r = cpu_layer
    batch = r.batch([rig.Request(1, 1), rig.Request(2500, 1), rig.Request(40, 1)], empty_rows=(2,))
    r.impl._step.buffers.latent.fill_(float("nan"))  # poison: everything returned must be written
    out = r.forward(batch)
    assert r.impl._step_scales == (r.q_scale, r.k_scale), "the step must replan at the layer's new scales"
    found = rig.check_step(r, batch, out)
    assert found["is_decode"] is True


def test_decode_step_at_unit_scales(unit_scale_layer):
    """q / k scales of 1.0: vLLM's skip-scale cache writer and an unscaled step, checked as the calibrated one."""
    r = unit_scale_layer
    batch = r.batch([rig.Request(1, 1), rig.Request(2500, 1), rig.Request(40, 1)], empty_rows=(2,))
    out = r.forward(batch)
    assert r.impl._step_scales == (1.0, 1.0)
    assert rig.check_step(r, batch, out)["is_decode"] is True


@pytest.mark.parametrize("fault", sorted(rig.FAULTS))
def test_check_step_catches_a_planted_fault(cpu_layer, fault):
    """The checks' negative controls, in the interpreter: each fault planted in the backend (a dropped slot, a
    softmax scale 5% high, an output scale 10% high) or in vLLM's cache writer (its k scale 5% high) makes check_step
    fail, with the message of the check that is to catch it. (The flipped LSE base is the DCP merge's control:
    test_vllm_backend's DCP test and test_vllm_gpu's.)"""
    r = cpu_layer
    batch = r.batch([rig.Request(1, 1), rig.Request(300, 1), rig.Request(40, 1)], empty_rows=(2,))
    with rig.planted(r, fault):
        out = r.forward(batch)
        with pytest.raises(AssertionError, match=rig.FAULTS[fault]):
            rig.check_step(r, batch, out)
    clean = r.forward(batch)  # the same batch once the fault is gone passes
    rig.check_step(r, batch, clean)


# ---------------------------------------------------------------- which tokens vLLM sends to the backend


def _route(r, batch) -> dict:
    """vLLM's forward of `batch` with the two attention paths recorded instead of run: how many tokens reach the
    backend (_forward_mqa_kernel, through forward_mqa) and how many vLLM's dense-MHA prefill takes (forward_mha).
    Both write zeros, so a prefill of thousands of tokens costs no interpreter time; everything else is vLLM's."""
    seen = {"backend": [], "dense_mha": []}
    impl = r.impl

    def kernel(q, kv_cache, topk_indices, seq_lens, **kw):
        seen["backend"].append(int(q.shape[0]))
        out = torch.zeros((q.shape[0], r.heads, 512), dtype=torch.bfloat16)
        return out, None

    def forward_mha(q, kv_c_normed, k_pe, kv_cache, attn_metadata, k_scale, output, output_scale=None):
        seen["dense_mha"].append(int(q.shape[0]))
        output.zero_()

    with patch.object(impl, "_forward_mqa_kernel", kernel), patch.object(impl, "forward_mha", forward_mha):
        r.forward(batch)
    metadata = r.metadata(batch)
    return {"backend": sum(seen["backend"]), "dense_mha": sum(seen["dense_mha"]),
            "decode_tokens": metadata.num_decode_tokens, "threshold": r.builder.reorder_batch_threshold}


@pytest.mark.parametrize(
    "requests, backend, dense",
    [
        ([(40, 1), (2500, 1), (7, 1)], 3, 0),  # decodes
        ([(3000, 100)], 100, 0),  # an extend of <= 128 tokens (16 heads' threshold): counted as a decode
        ([(40, 1), (0, 200)], 1, 200),  # a fresh 200-token prefill: seq_len 200 <= index_topk 2048
        ([(40, 1), (1800, 200)], 1, 200),  # a chunk over context, seq_len 2000 <= 2048: dense MHA too
        ([(40, 1), (1900, 200)], 201, 0),  # seq_len 2100 > 2048: through the backend
        ([(0, 200), (2000, 150)], 350, 0),  # the batch's longest prefill decides for every prefill of it
    ],
    ids=["decodes", "short-extend", "fresh-prefill", "chunk-within-topk", "chunk-past-topk", "mixed-prefills"],
)
def test_which_tokens_reach_the_backend(sm90_layer, requests, backend, dense):
    """vLLM 0.33's split, driven through its builder and DeepseekV32Attention.forward (SM90, FP8 cache, 16 heads a
    rank): decode tokens, and extends no longer than the builder's reorder threshold, always reach the backend; the
    prefills of a batch go to dense MHA (FlashAttention on SM90) when the longest one's seq_len (context + chunk) is at
    most index_topk, else through the backend with the decodes (README: "Which batches reach the backend")."""
    r = sm90_layer
    batch = r.batch([rig.Request(c, q) for c, q in requests])
    found = _route(r, batch)
    assert found["threshold"] == 128
    assert (found["backend"], found["dense_mha"]) == (backend, dense), found
    assert found["backend"] + found["dense_mha"] == batch.tokens


def test_masked_mha_never_takes_a_cache_the_core_reads():
    """On SM100 vLLM has a third path, masked MHA, for some TP sizes; it refuses quantized caches, so the fp8 and
    nvfp4_ds_mla layers the core serves take the same split on Blackwell as on Hopper."""
    import vllm.model_executor.layers.attention.sparse_mla_attention as sparse_mla
    from vllm.model_executor.layers.attention.mla_attention import _MASKED_MHA_THRESHOLDS

    assert {dims: sorted(by.get("FLASHINFER_MLA_SPARSE", {})) for dims, by in _MASKED_MHA_THRESHOLDS.items()} == {
        (192, 128): [8], (256, 256): [4, 8]}
    with (
        vh.gpu_capability(10),
        patch.object(sparse_mla, "current_platform", vh.cuda_platform_class()()),
        patch.object(sparse_mla, "get_flash_attn_version", lambda **kw: 4),
    ):
        for fmt in ("fp8", "fp8_e4m3", "nvfp4_ds_mla"):
            assert not sparse_mla._is_masked_mha_available(128, 512, 128, 64, 128, fmt), fmt
        assert sparse_mla._is_masked_mha_available(128, 512, 128, 64, 128, "auto")  # the check can say yes


# ---------------------------------------------------------------- the engine benchmark's instruments on vLLM's layer


@pytest.fixture(scope="module")
def engine_worker():
    """benchmarks/engine_worker.py (the engine benchmark's worker side), every patch it makes undone after."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "engine_worker.py"
    spec = importlib.util.spec_from_file_location("engine_worker", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["engine_worker"] = module
    spec.loader.exec_module(module)
    yield module
    module.restore()


def test_seeded_loader_on_vllms_attention_layer(tmp_path, engine_worker):
    """The engine's seeded weights on vLLM's own DeepseekV32Attention. Its 0-d FP8 scales (_k_scale, _q_scale, ...,
    1.0 as built) are drawn like weights by vLLM's dummy loader (+-1e-3): vLLM's cache writer and fused_q then quantize
    by them while the decode reads _k_scale_float = 1.0, a cache of saturated, sign-flipped e4m3. The seeded loader
    puts every 0-d scale back as an unquantized checkpoint leaves it (1.0; a KV-cache scale parameter, where a
    quantization config makes one, to its "not loaded" -1, from which vLLM's post-load hook sets 1.0); an earlier
    loader that drew normal_(0, shape[-1] ** -0.5) for them died with IndexError (H100, 2026-12-07). Matrices are
    N(0, 1/fan_in), q_b_proj QUERY_GAIN times that."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.layers.quantization.kv_cache import KVCacheScaleParameter
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    with _cpu_rig(tmp_path) as r:
        scalars = lambda: {n: float(t) for n, t in r.layer.state_dict(keep_vars=True).items() if t.dim() == 0}
        assert {"_k_scale", "_v_scale", "_q_scale", "_prob_scale"} <= set(scalars())
        DummyModelLoader(LoadConfig(load_format="dummy")).load_weights(r.layer, r.config.model_config)
        assert all(abs(v) <= 1e-3 for v in scalars().values()), scalars()  # what vLLM's dummy loader leaves
        engine_worker.register_seeded_loader()(LoadConfig(load_format="dsa_seeded")).load_weights(
            r.layer, r.config.model_config)
        assert set(scalars().values()) == {1.0}, scalars()
        state = r.layer.state_dict(keep_vars=True)
        q_b = next(t for n, t in state.items() if n.endswith("q_b_proj.weight"))
        other = next(t for n, t in state.items() if n.endswith("o_proj.weight"))
        assert q_b.float().std().item() == pytest.approx(engine_worker.QUERY_GAIN * q_b.shape[-1] ** -0.5, rel=0.05)
        assert other.float().std().item() == pytest.approx(other.shape[-1] ** -0.5, rel=0.05)
    param = KVCacheScaleParameter()
    param.data.fill_(5e-4)  # a dummy draw vLLM's post-load hook would take for a real k_scale
    engine_worker.seeded_value("model.layers.0.self_attn.attn.k_scale", param, None)
    assert float(param) == engine_worker.SCALE_NOT_LOADED


def test_engine_faults_counters_probe_and_layer0_record_on_vllms_layer(tmp_path, engine_worker):
    """The engine benchmark's instruments through vLLM's layer in the interpreter, on a batch of two decodes and a
    130-token prefill chunk: every planted fault moves the decode rows far past their rounding and leaves the prefill
    rows bit for bit as they were (decode only); with none the layer is as unfaulted; the device counters count this
    backend's forward_mqa and core calls and their rows; the logit probe samples the eager calls; layer 0's recorder
    holds each decode row's latent at its position, and only those."""
    ew = engine_worker
    ew.Faults.install("softmax_scale")  # before the layer is built: its weights-loaded hook plans the high-scale step
    ew.Coverage.install(device="cpu")
    ew.LogitProbe.install()
    ew.LayerZeroRecord.install(8, heads=16, device="cpu")
    try:
        with _cpu_rig(tmp_path) as r:
            assert r.impl._fault_step.core.softmax_scale == pytest.approx(
                ew.SCALE_FAULT * r.impl._step.core.softmax_scale)
            batch = r.batch([rig.Request(2500, 1), rig.Request(2200, 1), rig.Request(0, 130)])
            ew.Faults.mode = "none"
            clean = r.forward(batch).float()
            latent = r.captured[-1]["pieces"][0]["out"]
            recorded = ew.LayerZeroRecord.read()
            assert recorded["positions"].tolist() == [2500, 2200] and recorded["overflow"] == 0
            assert torch.equal(recorded["rows"], latent[:2, :16].to(torch.bfloat16))
            for mode in ew.FAULTS:
                ew.Faults.mode = mode
                out = r.forward(batch).float()
                moved = (out[:2] - clean[:2]).norm() / clean[:2].norm()
                assert moved > 2.0**-5, (mode, float(moved))
                assert torch.equal(out[2:], clean[2:]), mode
            ew.Faults.mode = "none"
            assert torch.equal(r.forward(batch).float(), clean)
            counts = ew.Coverage.read()
            assert counts["KimiDSAFlashInferMLASparseImpl.forward_mqa"] == {"calls": 6, "rows": 6 * 132}, counts
            assert counts["FlashInferCore.decode"]["calls"] >= 6, counts
            assert counts["FlashMLASparseImpl.forward_mqa"]["calls"] == 0, counts
            probe = ew.LogitProbe.summary()
            assert probe["rows"] > 0 and probe["logit_std_median"] > 0 and 0 < probe["top_probability_median"] <= 1
            assert ew.LayerZeroRecord.read()["overflow"] == 6 * 2 - 8  # past the capacity: counted, not written
    finally:
        ew.restore()
