"""The vLLM backend and plugin against vLLM 0.33's real classes, on a CPU.

vLLM's plugin loader, env validation, attention selector (CudaPlatform with a mocked compute capability, as vLLM's
own selector tests do), MLAAttention's constructor (which builds the impl), SparseMLACommonImpl.forward_mqa (vLLM's
own top-k conversion, TP and DCP) and vLLM's DCP combine; the decode runs the plain Triton kernel in Triton's
interpreter at small shapes and is checked against the float32 reference (tests/decode_checks.py's bounds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm.v1.attention.backends.mla.flashinfer_mla_sparse", reason="needs vLLM 0.33")

import vllm_harness as vh  # noqa: E402
from decode_checks import check_decode  # noqa: E402
from dcp_cases import make_case  # noqa: E402

from vllm_kimi_dsa import envs, vllm_glue  # noqa: E402
from vllm_kimi_dsa.convert import convert_topk_reference  # noqa: E402
from vllm_kimi_dsa.formats import flat_kv_row_view  # noqa: E402
from vllm_kimi_dsa.vllm_backend import KimiDSAFlashInferMLASparseBackend, KimiDSAFlashInferMLASparseImpl  # noqa: E402
from vllm_kimi_dsa.vllm_glue import BACKEND_CLASS, dsa_on_flashinfer  # noqa: E402

FORMATS = ("fp8", "nvfp4_ds_mla")
# The GPU each format's impl is built for: FP8 on Hopper; nvfp4_ds_mla on Blackwell, the only GPU vLLM 0.33 writes
# its rows on (on a CPU the core still runs the Triton kernel in the interpreter either way).
CAPABILITY = {"fp8": 9, "nvfp4_ds_mla": 10}
WIDTH, BLOCK = 128, 64
Q_SCALE, K_SCALE = 0.3, 0.5  # peaked enough that the ranks' LSEs differ: a merge in the wrong base shows


@pytest.fixture(autouse=True)
def plugin(monkeypatch):
    """The plugin registered, as vLLM's loader leaves it; vLLM's overrides restored after each test."""
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES

    saved = dict(_ATTN_OVERRIDES)
    monkeypatch.delenv(envs.BACKEND, raising=False)
    monkeypatch.delenv(envs.KERNEL_TABLE, raising=False)
    vllm_glue.register()
    yield
    _ATTN_OVERRIDES.clear()
    _ATTN_OVERRIDES.update(saved)


def _config(tmp_path: Path, arch: str = vh.DSV32, **kw):
    return vh.vllm_config(tmp_path / f"{arch}-{kw.get('kv_cache_dtype', 'fp8')}", arch, **kw)


# ---------------------------------------------------------------- the plugin, as vLLM loads it


def test_plugin_loads_through_vllms_loader_twice(monkeypatch):
    import vllm.plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    member = AttentionBackendEnum.FLASHINFER_MLA_SPARSE
    member.clear_override()
    monkeypatch.setenv("VLLM_PLUGINS", "kimi_k3_dsa")
    for _ in range(2):  # vLLM loads general plugins in every process, sometimes more than once: idempotent
        monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
        vllm.plugins.load_general_plugins()
        assert member.get_path() == BACKEND_CLASS
    assert member.get_class() is KimiDSAFlashInferMLASparseBackend


def test_env_variables_pass_vllms_strict_validation(monkeypatch):
    from vllm import envs as vllm_envs
    from vllm.platforms.interface import Platform

    monkeypatch.setenv(envs.KERNEL_TABLE, "")
    monkeypatch.setenv(envs.GLUON, "1")
    Platform.validate_environ(hard_fail=True)  # registered: neither warns nor raises
    for name in envs.ENVIRONMENT_VARIABLES:
        monkeypatch.delitem(vllm_envs.environment_variables, name)
    with pytest.raises(ValueError, match="Unknown vLLM environment variable"):  # the check itself can fail
        Platform.validate_environ(hard_fail=True)


def test_logs_go_through_vllms_logger_tree():
    from vllm_kimi_dsa import vllm_backend

    assert vllm_backend.logger.name.startswith("vllm.") and hasattr(vllm_backend.logger, "info_once")


def test_switch_off_gives_vllms_own_class_back(monkeypatch, tmp_path):
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import FlashInferMLASparseTRTLLMBackend

    config = _config(tmp_path)
    monkeypatch.setenv(envs.BACKEND, "0")
    vllm_glue.register()
    with vh.gpu_capability(10):
        assert vh.select_backend(config, "fp8") is FlashInferMLASparseTRTLLMBackend
    with vh.gpu_capability(9), pytest.raises(ValueError, match="compute capability not supported"):
        vh.select_backend(config, "fp8")
    monkeypatch.setenv(envs.BACKEND, "1")
    vllm_glue.register()
    with vh.gpu_capability(9):
        assert vh.select_backend(config, "fp8") is KimiDSAFlashInferMLASparseBackend


@pytest.mark.parametrize("name, value", [(envs.BACKEND, "yes"), (envs.GLUON, "2")])
def test_bad_switch_values_stop_startup_naming_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        vllm_glue.register()


def test_a_kernel_table_that_does_not_load_stops_startup(monkeypatch, tmp_path):
    bad = tmp_path / "table.json"
    bad.write_text(json.dumps({"tp": "1-8:warp_drive"}))
    monkeypatch.setenv(envs.KERNEL_TABLE, str(bad))
    with pytest.raises(ValueError, match=envs.KERNEL_TABLE):
        vllm_glue.register()


# ---------------------------------------------------------------- vLLM's selector


@pytest.mark.parametrize("capability, kv_cache_dtype", [(9, "fp8"), (10, "fp8"), (10, "nvfp4_ds_mla")])
@pytest.mark.parametrize("arch", [vh.DSV32, vh.GLM_DSA])
def test_selector_resolves_flashinfer_mla_sparse_to_this_backend(tmp_path, arch, kv_cache_dtype, capability):
    config = _config(tmp_path, arch, kv_cache_dtype=kv_cache_dtype)
    with vh.gpu_capability(capability):
        assert vh.select_backend(config, kv_cache_dtype) is KimiDSAFlashInferMLASparseBackend


@pytest.mark.parametrize("arch", [vh.DSV32, vh.GLM_DSA])
def test_nvfp4_on_hopper_is_refused_because_vllm_cannot_write_it(tmp_path, arch):
    """The core reads nvfp4_ds_mla rows on SM90, but vLLM 0.33 cannot write them there: refused at selection."""

    config = _config(tmp_path, arch, kv_cache_dtype="nvfp4_ds_mla")
    with vh.gpu_capability(9), pytest.raises(ValueError, match="writes nvfp4_ds_mla rows only on SM100"):
        vh.select_backend(config, "nvfp4_ds_mla")


def test_sm90_cannot_assemble_vllms_nvfp4_conversion(tmp_path):
    """The fact behind that refusal, checked with Triton's own ptxas (no GPU; outside the interpreter this process
    runs): should SM90 ever assemble vLLM's e2m1 conversion, this fails and the refusal is to be revisited.
    TMPDIR: Triton keeps the PTX that ptxas refused in a temporary file; it goes to this test's folder."""
    probe = Path(__file__).resolve().parents[1] / "tools" / "e2m1_cvt_probe.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("sm_")]
    assert lines[0].startswith("sm_90: does not assemble") and "e2m1x2" in lines[0], done.stdout + done.stderr[-800:]
    assert lines[1] == "sm_100: assembles", done.stdout


@pytest.mark.parametrize(
    "capability, config_kw, kv_cache_dtype, match",
    [
        (9, dict(kv_cache_dtype="auto"), "auto", "kv_cache_dtype 'auto'"),
        (9, dict(heads=256), "fp8", "256 query heads a rank: the sparse kernels take 1 to 128; use TP >= 2"),
        (9, dict(block_size=16), "fp8", "block_size not supported"),
        (8, dict(), "fp8", "compute capability not supported"),
        (12, dict(), "fp8", "compute capability not supported"),
    ],
)
def test_bad_configurations_are_refused_at_selection(tmp_path, capability, config_kw, kv_cache_dtype, match):
    config = _config(tmp_path, **config_kw)
    with vh.gpu_capability(capability), pytest.raises(ValueError, match=match):
        vh.select_backend(config, kv_cache_dtype)


def test_hisparse_is_read_off_vllms_attention_config_with_no_default():
    """Selection refuses HiSparse by vLLM's attention_config.hisparse_config, read directly: after a rename a default
    of None would let selection accept a HiSparse model the core does not serve."""
    from types import SimpleNamespace

    from vllm.config import AttentionConfig

    from vllm_kimi_dsa import vllm_backend

    assert vllm_backend._uses_hisparse(SimpleNamespace(attention_config=AttentionConfig())) is False
    assert vllm_backend._uses_hisparse(SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=object())))
    with pytest.raises(AttributeError, match="hisparse_config"):
        vllm_backend._uses_hisparse(SimpleNamespace(attention_config=SimpleNamespace(hisparse_cfg=object())))


def test_blackwell_keeps_vllms_bf16_path(tmp_path):
    """On SM100 what the core does not read (a BF16 cache) still selects, and the impl runs vLLM's own code."""
    config = _config(tmp_path, kv_cache_dtype="auto")
    with vh.gpu_capability(10):
        assert vh.select_backend(config, "auto") is KimiDSAFlashInferMLASparseBackend
        layer = vh.build_mla_layer(config, heads=16, topk_buffer=_topk_buffer(4))
    assert not layer.impl.served_by_core and layer.impl.lse_base_on_e is False


# ---------------------------------------------------------------- the impl, built by vLLM's constructor


def _topk_buffer(rows: int) -> torch.Tensor:
    return torch.full((rows, WIDTH), -1, dtype=torch.int32)


def _layer(config, *, heads: int, rows: int, capability: int | None = None,
           prefix: str = "model.layers.0.self_attn.mla_attn"):
    """An MLAAttention built by vLLM, its FP8 scales set as vLLM's KV-cache quant method sets them, then vLLM's
    post-load hook (which builds the step)."""
    buffer = _topk_buffer(rows)
    if capability is None:
        capability = CAPABILITY[config.cache_config.cache_dtype]
    with vh.gpu_capability(capability):
        layer = vh.build_mla_layer(config, heads=heads, topk_buffer=buffer, prefix=prefix)
    layer._q_scale_float, layer._k_scale_float = Q_SCALE, K_SCALE
    return layer, buffer


def test_vllms_constructor_builds_this_impl(tmp_path):
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import FlashInferMLASparseImpl

    config = _config(tmp_path)
    layer, _ = _layer(config, heads=16, rows=4)
    impl = layer.impl
    assert isinstance(impl, KimiDSAFlashInferMLASparseImpl) and isinstance(impl, FlashInferMLASparseImpl)
    assert dsa_on_flashinfer(layer)
    assert impl.served_by_core and impl.lse_base_on_e is True  # the core hands vLLM's combine natural-log LSE
    assert impl._step is None
    impl.process_weights_after_loading(torch.bfloat16)  # vLLM's loader calls it on every attention layer
    step = impl._step
    assert step is not None and set(step.kernels.values()) == {"triton"}
    # every decode batch vLLM may run is planned: max_num_seqs (4) and the capture sizes (1, 2, 4)
    assert step.shape.max_rows == 4 and step.shape.heads == 16 and step.shape.width == WIDTH
    assert step.core.softmax_scale == pytest.approx(impl.scale * Q_SCALE * K_SCALE)


def test_serving_a_layer_logs_one_info_line_through_vllms_logger(tmp_path, monkeypatch):
    """vLLM's post-load hook builds the step and logs, once a process (info_once, scope "process"), the line the README
    names, with the worker's TP rank."""
    from vllm_kimi_dsa import __version__, vllm_backend

    said: list[str] = []
    monkeypatch.setattr(vllm_backend.logger, "info_once", lambda msg, *a, **k: said.append(msg % a if a else msg))
    layer, _ = _layer(_config(tmp_path, dcp=1), heads=16, rows=4)
    layer.impl.process_weights_after_loading(torch.bfloat16)
    assert len(said) == 1, said
    line = said[0]
    assert line.startswith(f"vllm_kimi_dsa {__version__} serves FLASHINFER_MLA_SPARSE on cpu, TP rank 0 of 1: ")
    for part in ("Triton kernels", "kv-cache fp8", "16 query heads", "planned rows 1-4", "top-k width 128"):
        assert part in line, (part, line)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert f"{vllm_backend.STARTUP_PREFIX} <version> serves FLASHINFER_MLA_SPARSE on" in readme


# (TP, DCP, the model's heads, heads a TP rank, the workers as (global rank, TP rank, DCP rank)): TP = DCP, and TP 4 /
# DCP 2 (the TP size the line names is not the DCP size). Rank 0 is the node's and the world's first; the other not.
WORKER_LAYOUTS = {"tp2-dcp2": (2, 2, 16, 8, ((0, 0, 0), (1, 1, 1))),
                  "tp4-dcp2": (4, 2, 16, 4, ((0, 0, 0), (3, 3, 1)))}


@pytest.mark.parametrize("layout", sorted(WORKER_LAYOUTS))
def test_every_worker_logs_its_own_startup_line_with_its_ranks(tmp_path, monkeypatch, layout):
    """Two workers (global ranks 0 and another), captured through vLLM's logger itself (its info_once and scope
    check, a handler on the logger): each logs its own line, naming its TP rank of the real TP size and its DCP
    rank. vLLM's default scope ("local") keeps only the node's first rank's line, "global" only the world's first."""
    import logging

    import vllm.distributed.parallel_state as parallel_state
    import vllm.logger as vllm_logger

    from vllm_kimi_dsa import vllm_backend

    tp, dcp, model_heads, rank_heads, workers = WORKER_LAYOUTS[layout]
    lines: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Capture(level=logging.INFO)
    log = vllm_backend.logger
    old_level = log.level
    log.setLevel(logging.INFO)  # setLevel, not the attribute: it also drops the logger's cached isEnabledFor answers
    # whatever logging setup an earlier test of the session ran (a dictConfig disabling existing loggers, a global
    # logging.disable), the worker's logger is live here, as in a vLLM worker
    monkeypatch.setattr(log, "disabled", False)
    monkeypatch.setattr(logging.root.manager, "disable", logging.NOTSET)
    log.addHandler(handler)
    vllm_logger._print_info_once.cache_clear()  # lines other tests logged in this process
    try:
        config = _config(tmp_path, dcp=dcp, tp=tp, heads=model_heads)
        for global_rank, tp_rank, dcp_rank in workers:
            monkeypatch.setattr(parallel_state, "get_dcp_world_size_and_rank",
                                lambda enabled=True, d=dcp_rank: (dcp, d))
            monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda t=tp_rank: t)
            monkeypatch.setattr(parallel_state, "is_local_first_rank", lambda g=global_rank: g == 0)
            monkeypatch.setattr(parallel_state, "is_global_first_rank", lambda g=global_rank: g == 0)
            layer, _ = _layer(config, heads=rank_heads, rows=4, prefix=f"model.layers.{global_rank}.self_attn.mla_attn")
            layer.impl.process_weights_after_loading(torch.bfloat16)
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    ours = [line for line in lines if line.startswith(vllm_backend.STARTUP_PREFIX)]
    assert len(ours) == len(workers), lines
    for line, (_, tp_rank, dcp_rank) in zip(ours, workers):
        assert f"on cpu, TP rank {tp_rank} of {tp}, DCP rank {dcp_rank} of {dcp}: " in line, line
        assert f"{rank_heads * dcp} query heads ({rank_heads} a rank x DCP {dcp})" in line, line
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "every worker logs its own line" in readme


def test_startup_line_names_the_blackwell_kernel_table_and_dcp(monkeypatch):
    from vllm_kimi_dsa.serving import LayerStep, StepShape
    from vllm_kimi_dsa.synthetic import StandInImpl, StandInLayer
    from vllm_kimi_dsa.vllm_backend import startup_line

    shape = StepShape(device=torch.device("cpu"), heads=16, width=WIDTH, fmt="fp8", max_rows=4, return_lse=True,
                      dcp=2)
    step = LayerStep(StandInImpl(kv_cache_dtype="fp8"), StandInLayer(), shape, kernels=dict.fromkeys(range(1, 5),
                                                                                                      "triton"))
    step.kernels = {1: "trtllm", 2: "trtllm", 3: "prims_ts", 4: "prims_ts"}  # as kernel_table picks on SM100
    line = startup_line(step, torch.device("cpu"))
    assert "1-2:trtllm,3-4:prims_ts from the built-in table" in line and "(8 a rank x DCP 2)" in line
    monkeypatch.setenv(envs.KERNEL_TABLE, "/tables/b200.json")
    assert "from /tables/b200.json ($VLLM_KIMI_DSA_KERNEL_TABLE)" in startup_line(step, torch.device("cpu"))


def _metadata(meta, rows: int, *, decode: bool):
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import FlashInferMLASparseMetadata

    return FlashInferMLASparseMetadata(
        num_reqs=rows, max_query_len=1, max_seq_len=4 * WIDTH, num_actual_tokens=rows,
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32), slot_mapping=torch.zeros(rows, dtype=torch.int64),
        num_decodes=rows if decode else 0, num_decode_tokens=rows if decode else 0, num_prefills=0 if decode else rows,
        block_table=meta.block_table, req_id_per_token=meta.req_id_per_token, block_size=BLOCK, topk_tokens=WIDTH,
        cp_kv_cache_interleave_size=meta.cp_kv_cache_interleave_size,
    )


def _reference_check(out, lse, layer, query, cache, topk, meta, *, dcp: int = 1, rank: int = 0):
    """The float32 reference of what the layer must return, from this package's own converter's slots."""
    kv_rows, stride = flat_kv_row_view(cache, BLOCK)
    slots, counts = convert_topk_reference(
        topk, meta.req_id_per_token, meta.block_table, block_size=BLOCK, rows_per_block_stride=stride,
        dcp_size=dcp, dcp_rank=rank, interleave=meta.cp_kv_cache_interleave_size,
    )
    core = layer.impl._step.core
    # at the scales the layer holds now (the step must have been built, or rebuilt, at them): SPEC 2.1's folding
    fp8 = core.fmt == "fp8"
    softmax_scale = layer.impl.scale * layer._q_scale_float * (layer._k_scale_float if fp8 else 1.0)
    output_scale = layer._k_scale_float if fp8 else 1.0
    assert core.softmax_scale == pytest.approx(softmax_scale) and core.output_scale == pytest.approx(output_scale)
    check_decode(out, lse, query, kv_rows, slots, counts, core.fmt, softmax_scale, output_scale)
    return counts


def _through_vllms_converter(layer, buffer, fmt: str, rows: int, seed: int, *, is_decode: bool):
    """vLLM's top-k converter's flat rows and counts for a fresh case, then the impl's kernel call on them.

    forward_mqa's TP conversion goes through the index group's CUDA side stream, which a CPU lacks; the same vLLM
    converter is called here directly with the arguments forward_mqa gives it (the DCP test runs forward_mqa whole).
    """
    from vllm.v1.attention.backends.mla.sparse_utils import triton_convert_req_index_to_global_index

    heads = layer.impl.num_heads
    (cache, meta), _, topk, query = make_case(fmt, 1, 1, rows, heads, WIDTH, seed=seed)
    buffer[:rows] = topk
    _, stride = flat_kv_row_view(cache, BLOCK)
    physical, counts = triton_convert_req_index_to_global_index(
        meta.req_id_per_token, meta.block_table, buffer[:rows], BLOCK_SIZE=BLOCK, BLOCK_STRIDE_ROWS=stride,
        NUM_TOPK_TOKENS=WIDTH, return_valid_counts=True,
    )
    layer.impl._step.buffers.latent.fill_(float("nan"))  # poison: everything returned must have been written
    out, lse = layer.impl._forward_mqa_kernel(query, cache, physical, counts, layer=layer, block_size=BLOCK,
                                              is_decode=is_decode)
    assert lse is None and out.shape == (rows, heads, 512)
    step = layer.impl._step
    # a batch a graph may capture (up to max_rows) is a view of the shared buffers; only larger ones allocate
    assert (out.data_ptr() == step.buffers.latent.data_ptr()) == (rows <= step.shape.max_rows)
    ref_counts = _reference_check(out, lse, layer, query, cache, topk, meta)
    assert torch.equal(counts, ref_counts) and int(counts[0]) == 0  # row 0 of the case selects nothing
    return out, (query, cache, physical, counts)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_batch_through_vllms_conversion(tmp_path, fmt):
    """A decode batch (holes, a count-0 row, an odd size): lands in the shared buffers, equals the reference."""
    layer, buffer = _layer(_config(tmp_path, kv_cache_dtype=fmt), heads=16, rows=8)
    layer.impl.process_weights_after_loading(torch.bfloat16)
    _through_vllms_converter(layer, buffer, fmt, 3, seed=3, is_decode=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_sized_batch_runs_in_pieces(tmp_path, fmt):
    """A prefill chunk larger than any planned decode size (max_rows 4): pieces of planned size, never an error."""
    layer, buffer = _layer(_config(tmp_path, kv_cache_dtype=fmt, max_num_batched_tokens=16), heads=16, rows=16)
    layer.impl.process_weights_after_loading(torch.bfloat16)
    rows = 2 * layer.impl._step.shape.max_rows + 3
    _through_vllms_converter(layer, buffer, fmt, rows, seed=5, is_decode=False)


@pytest.mark.parametrize(
    "speculative, capture, max_rows",
    [(2, (1, 2, 4), 12), (0, (1, 2, 4, 8), 8)],
    ids=["two-draft-tokens", "capture-sizes-past-max-num-seqs"],
)
def test_step_plans_every_decode_batch_vllm_runs_or_captures(tmp_path, speculative, capture, max_rows):
    """max_num_seqs 4. With 2 speculative tokens a decode step has 4 x (1 + 2) rows; capture sizes above
    max_num_seqs (vLLM's default list runs to 2 x max_num_seqs) are batches vLLM captures. The step plans every one of
    them (one kernel a row count, the prims_ts capacities), so a batch of the largest decodes into the shared buffers
    as a captured batch must, not through the allocating path for larger batches."""
    config = _config(tmp_path, capture_sizes=capture, speculative_tokens=speculative)
    assert config.scheduler_config.max_num_seqs == 4
    layer, buffer = _layer(config, heads=16, rows=max_rows)
    layer.impl.process_weights_after_loading(torch.bfloat16)
    step = layer.impl._step
    assert step.shape.max_rows == max_rows and step.shape.capacities == tuple(sorted({*capture, max_rows}))
    assert sorted(step.kernels) == list(range(1, max_rows + 1))
    _through_vllms_converter(layer, buffer, "fp8", max_rows, seed=29, is_decode=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_new_layer_scales_rebuild_the_step_and_the_answer_follows_them(tmp_path, fmt):
    """vLLM's calculate_kv_scales sets the layer's q / k scales in a forward after the step was built (eager, so
    outside capture): the next call builds the step again at the new scales, on the same shared buffers, and answers
    as the reference does at them; calls at unchanged scales keep the step they have."""
    from vllm_kimi_dsa.reference import reference_decode

    layer, buffer = _layer(_config(tmp_path, kv_cache_dtype=fmt), heads=16, rows=4)
    layer.impl.process_weights_after_loading(torch.bfloat16)
    built = layer.impl._step
    _through_vllms_converter(layer, buffer, fmt, 3, seed=23, is_decode=True)
    assert layer.impl._step is built
    layer._q_scale_float, layer._k_scale_float = 3 * Q_SCALE, K_SCALE / 2
    out, (query, cache, slots, counts) = _through_vllms_converter(layer, buffer, fmt, 3, seed=24, is_decode=True)
    step = layer.impl._step
    assert step is not built and step.buffers is built.buffers
    # the check above tells the scales apart: the answer at the old ones is far off
    kv_rows, _ = flat_kv_row_view(cache, BLOCK)
    old, _ = reference_decode(query, kv_rows, slots, counts, fmt=fmt, softmax_scale=built.core.softmax_scale,
                              output_scale=built.core.output_scale)
    assert (out.float() - old).abs().max().item() > 0.1 * old.abs().max().item()
    _through_vllms_converter(layer, buffer, fmt, 2, seed=25, is_decode=True)
    assert layer.impl._step is step


@pytest.mark.parametrize("moved", ["k", "q"])
def test_one_scale_moving_alone_rebuilds_the_step(tmp_path, moved):
    """The layer's k scale changing alone (q unchanged) after the step is built, and q alone: the next call builds the
    step again, its folded scales follow (softmax scale x q x k, output scale k), and the answer is the reference's at
    the new scales, far from the old step's answer."""
    from vllm_kimi_dsa.reference import reference_decode

    layer, buffer = _layer(_config(tmp_path), heads=16, rows=4)
    layer.impl.process_weights_after_loading(torch.bfloat16)
    built = layer.impl._step
    if moved == "k":
        layer._k_scale_float = K_SCALE * 4
    else:
        layer._q_scale_float = Q_SCALE * 4
    out, (query, cache, slots, counts) = _through_vllms_converter(layer, buffer, "fp8", 3, seed=26, is_decode=True)
    step = layer.impl._step
    assert step is not built and layer.impl._step_scales == (layer._q_scale_float, layer._k_scale_float)
    assert step.core.softmax_scale == pytest.approx(4 * built.core.softmax_scale)
    assert step.core.output_scale == pytest.approx(built.core.output_scale * (4 if moved == "k" else 1))
    kv_rows, _ = flat_kv_row_view(cache, BLOCK)
    old, _ = reference_decode(query, kv_rows, slots, counts, fmt="fp8", softmax_scale=built.core.softmax_scale,
                              output_scale=built.core.output_scale)
    assert (out.float() - old).abs().max().item() > 0.1 * old.abs().max().item()


@pytest.mark.parametrize("fmt", FORMATS)
def test_dcp_two_ranks_merged_by_vllms_combine_equal_the_reference(tmp_path, monkeypatch, fmt):
    """DCP 2: each rank's impl decodes its own share (vLLM's DCP filter-and-convert in forward_mqa), vLLM's
    combine merges them with the base the impl declares; a row one rank never sees (count 0) is dropped."""
    import vllm.distributed.parallel_state as parallel_state
    from vllm.v1.attention.ops.dcp import _lse_weighted_combine

    heads_per_rank, dcp, interleave, rows = 8, 2, 64, 5  # 5 rows: more than one launch takes (max_rows 4)
    heads = heads_per_rank * dcp  # vLLM gathers the query heads of the DCP group
    config = _config(tmp_path, kv_cache_dtype=fmt)
    (tp_cache, tp_meta), ranks, topk, query = make_case(fmt, dcp, interleave, rows, heads, WIDTH, seed=17)
    outs, lses, counts = [], [], []
    for rank, (cache, meta) in enumerate(ranks):
        # This process has no DCP group of 2: vLLM's impl reads (size, rank) from this function in its __new__.
        monkeypatch.setattr(parallel_state, "get_dcp_world_size_and_rank", lambda enabled=True, r=rank: (dcp, r))
        layer, buffer = _layer(config, heads=heads_per_rank, rows=rows,
                               prefix=f"model.layers.{rank}.self_attn.mla_attn")
        assert (layer.impl.dcp_world_size, layer.impl.dcp_rank) == (dcp, rank)
        assert layer.impl.need_to_return_lse_for_decode
        layer.impl.process_weights_after_loading(torch.bfloat16)
        assert layer.impl._step.shape.heads == heads
        buffer[:rows] = topk
        out, lse = layer.impl.forward_mqa(query, cache, _metadata(meta, rows, decode=True), layer)
        counts.append(_reference_check(out, lse, layer, query, cache, topk, meta, dcp=dcp, rank=rank))
        outs.append(out.float().clone())
        lses.append(lse.clone())
    assert any(int(c[1]) == 0 for c in counts), "the case must give one rank a count-0 row"
    merged = _lse_weighted_combine(torch.stack(outs), torch.stack(lses), is_lse_base_on_e=layer.impl.lse_base_on_e)
    kv_rows, stride = flat_kv_row_view(tp_cache, BLOCK)
    slots, tp_counts = convert_topk_reference(topk, tp_meta.req_id_per_token, tp_meta.block_table, block_size=BLOCK,
                                              rows_per_block_stride=stride)
    core = layer.impl._step.core
    from vllm_kimi_dsa.reference import reference_decode

    ref, _ = reference_decode(query, kv_rows, slots, tp_counts, fmt=fmt, softmax_scale=core.softmax_scale,
                              output_scale=core.output_scale)
    scale = ref.abs().max().item()
    # each rank's latent is within the bf16 bound of its reference (checked above); the merge adds the interpreter's
    # bf16 truncation (2^-7) once more per rank: 4 bf16 ulps of the largest output bound the difference.
    torch.testing.assert_close(merged.float(), ref, atol=4 * 2**-7 * scale, rtol=0)
    wrong_base = _lse_weighted_combine(torch.stack(outs), torch.stack(lses), is_lse_base_on_e=False)
    assert (wrong_base.float() - ref).abs().max().item() > 8 * 2**-7 * scale, "the merge check must tell bases apart"


def test_capture_without_a_built_step_is_refused(tmp_path):
    config = _config(tmp_path)
    layer, _ = _layer(config, heads=16, rows=4)
    assert layer.impl._step is None
    if not torch.cuda.is_available():
        step = layer.impl.build_step(layer, torch.device("cpu"))  # outside capture, planning is fine
        assert layer.impl._step is step


def test_readme_tables_render_on_github():
    """Every row of every README table has its header's cell count: a bare `|` inside a cell splits it on GitHub."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    fence = False
    width = None
    for number, line in enumerate(readme.splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
        if fence or not line.startswith("|"):
            width = None
            continue
        cells = line.replace("\\|", "").strip().strip("|").split("|")
        if width is None:
            width = len(cells)
        assert len(cells) == width, f"README.md:{number} has {len(cells)} cells, its table {width}: {line[:80]}"


def test_env_docs_cover_every_variable_and_the_readme_lists_them():
    assert set(envs.DOCS) == set(envs.ENVIRONMENT_VARIABLES)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for name, (what, values) in envs.DOCS.items():
        assert f"| `{name}` | {what} | {values} |" in readme, f"README's variable table lacks {name}"


# ---------------------------------------------------------------- the metadata builder's memory under DCP


class _DcpGroup:
    """What the sparse builder reads of vLLM's DCP group (this process has none of 2 ranks)."""

    world_size = 2
    rank_in_group = 0


def _builder_workspace_requests(monkeypatch, tmp_path, *, capability: int, kv_cache_dtype: str = "fp8",
                                table: dict | None = None, heads: int = 16, batched: int = 64,
                                others: dict | None = None) -> tuple[list[int], object]:
    """The bytes vLLM's workspace allocator is asked for while this backend's metadata builder is made under DCP 2
    (one layer of `heads` heads a TP rank; `table`: a kernel-table file's contents; a Blackwell with prims_ts and
    trtllm-gen is mocked at capability 10), and the builder. vLLM's allocator is spied on: its calls are the memory
    taken. others: more layer names the builder is given, each with what the config's forward context holds under
    it (None: nothing, a name the config never registered)."""
    import vllm.distributed.parallel_state as parallel_state
    import vllm.model_executor.layers.attention.sparse_mla_attention as sparse_mla
    import vllm.v1.attention.backends.mla.flashinfer_mla_sparse as fms
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.ops.dcp import MLADCPManager

    from vllm_kimi_dsa.backends.flashinfer.features import FlashInferFeatures
    from vllm_kimi_dsa.selection import choice, reset_kernel_table_cache

    requests: list[int] = []
    monkeypatch.setattr(fms, "_get_workspace_buffer", lambda device, min_bytes=None: requests.append(min_bytes))
    monkeypatch.setattr(parallel_state, "get_dcp_world_size_and_rank", lambda enabled=True: (2, 0))
    monkeypatch.setattr(sparse_mla, "get_dcp_group", lambda: _DcpGroup())
    monkeypatch.setattr(sparse_mla, "PIN_MEMORY", False)
    # the prefill KV gather's symmetric-memory setup needs a real group of 2; it is not what this test measures
    monkeypatch.setattr(MLADCPManager, "init_kv_gather", lambda self, *a, **k: None)
    if capability == 10:
        monkeypatch.setattr(choice, "_is_blackwell", lambda device: True)
        monkeypatch.setattr(choice, "_features", lambda: FlashInferFeatures("0.7.4", True, True))
    if table is not None:
        path = tmp_path / "table.json"
        path.write_text(json.dumps(table))
        monkeypatch.setenv(envs.KERNEL_TABLE, str(path))
    reset_kernel_table_cache()
    config = _config(tmp_path, kv_cache_dtype=kv_cache_dtype, dcp=2, tp=2, heads=2 * heads,
                     max_num_batched_tokens=batched)
    layer, _ = _layer(config, heads=heads, rows=4, capability=capability)
    assert layer.impl.dcp_world_size == 2
    spec = layer.get_kv_cache_spec(config)
    context = config.compilation_config.static_forward_context
    for name, module in (others or {}).items():
        if module is not None:
            monkeypatch.setitem(context, name, module)
    names = [layer.layer_name, *(others or {})]
    with vh.gpu_capability(capability), set_current_vllm_config(config):
        builder = layer.attn_backend.get_builder_cls()(spec, names, config, torch.device("cpu"))
    assert builder.dcp_world_size == 2 and builder.supports_draft_decode_metadata_update is False
    reset_kernel_table_cache()
    return requests, builder


ALL_PRIMS_TS = {"tp": "1-4096:prims_ts", "dcp": "1-4096:prims_ts"}
SOME_TRTLLM = {"tp": "1-4096:prims_ts", "dcp": "1-2:trtllm,3-4096:prims_ts"}


@pytest.mark.parametrize("capability, table", [(9, None), (10, ALL_PRIMS_TS), (10, SOME_TRTLLM)],
                         ids=["sm90", "sm100-all-prims_ts", "sm100-core-runs-trtllm"])
def test_dcp_builder_takes_no_vllm_workspace_for_layers_the_core_serves(monkeypatch, tmp_path, capability, table):
    """vLLM's builder allocates trtllm-gen's workspace and softmax-stats slab under DCP (394 MiB + 2048 x heads x
    max_num_batched_tokens bytes) before the first forward. On Hopper no trtllm-gen kernel runs; on Blackwell with a
    table of prims_ts only neither; where the core's table names trtllm-gen, the core's kernel sizes its own workspace
    for its launch rows (test_flashinfer_conformance holds that): zero bytes of vLLM's."""
    requests, builder = _builder_workspace_requests(monkeypatch, tmp_path, capability=capability, table=table)
    assert requests == [] and builder.vllm_trtllm_layers == []
    if table is SOME_TRTLLM:  # the case is what it says: the core's table runs trtllm-gen at 1 and 2 rows
        from vllm_kimi_dsa.serving import kernel_table

        picked = kernel_table(range(1, 5), dcp=2, heads=32, kv_cache_dtype="fp8", device="cpu")
        assert picked == {1: "trtllm", 2: "trtllm", 3: "prims_ts", 4: "prims_ts"}


def test_dcp_builder_takes_vllms_workspace_where_vllms_code_runs(monkeypatch, tmp_path):
    """A BF16 cache on Blackwell runs vLLM's own impl code (trtllm-gen on vLLM's workspace): the builder takes what
    vLLM's takes, its computed size, slab included."""
    import vllm.v1.attention.backends.mla.flashinfer_mla_sparse as fms

    want = fms._required_workspace_bytes(2, 16, 64)
    assert want == 394 * 2**20 + 8 * 32 * 64 * 256 + 2**20
    requests, _ = _builder_workspace_requests(monkeypatch, tmp_path, capability=10, kv_cache_dtype="auto")
    assert requests == [want]


@pytest.mark.parametrize("capability", [9, 10], ids=["sm90", "sm100"])
def test_dcp_builder_gives_vllms_workspace_to_a_layer_it_did_not_build(monkeypatch, tmp_path, capability):
    """A layer the builder is handed but did not build (another backend's impl in the forward context, or a name the
    config never registered) is not the core's: vLLM's own code may run it (trtllm-gen reads vLLM's workspace), so
    the builder takes vLLM's workspace for it, its computed size, beside a layer the core serves."""
    import vllm.v1.attention.backends.mla.flashinfer_mla_sparse as fms
    from types import SimpleNamespace

    other_impl = SimpleNamespace(impl=object.__new__(fms.FlashInferMLASparseImpl))  # vLLM's own impl, not ours
    for others in ({"model.layers.7.self_attn.mla_attn": other_impl}, {"model.layers.8.self_attn.mla_attn": None}):
        requests, builder = _builder_workspace_requests(monkeypatch, tmp_path, capability=capability, others=others)
        assert builder.vllm_trtllm_layers == list(others)
        assert requests == [fms._required_workspace_bytes(2, 16, 64)]
