"""vLLM 0.33's DeepSeek-V3.2 attention layer (DeepseekV32Attention.forward) with this backend, on a CPU.

The same layer, batch and checks as tests/test_vllm_gpu.py (tests/vllm_layer.py), at 16 heads, in Triton's
interpreter: vLLM's EngineArgs config, constructor, metadata builder, cache writer (fused_norm_rope), FP8 query
(fused_q), top-k conversion and forward_mqa all run. What a CPU lacks is stood in for, and only that: vLLM's platform
is CudaPlatform at compute capability 9.0 (as vLLM's own selector tests mock it), the builder's pinned host buffers
are plain, and the index group's CUDA side stream and events run in program order.
"""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def cpu_layer(tmp_path_factory):
    import vllm.engine.arg_utils as arg_utils
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
        vh.init_vllm_cpu()
        layer = rig.LayerRig(tmp_path_factory.mktemp("cpu_layer"), heads=16, device="cpu", num_blocks=80,
                             max_num_seqs=4, max_num_batched_tokens=512)
        group = layer.impl.index_group
        group.side_stream = _InOrderStream()
        group.logical_topk_ready = group.physical_topk_ready = _InOrderEvent()
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
