"""The vLLM backend's per-step body (serving.LayerStep) on tensors laid out as vLLM lays them, without vLLM.

What vLLM hands `_forward_mqa_kernel`: the FP8 query (rows, H, 576) from its concat-and-quantize op; the layer's
cache (num_blocks, block_size, row_bytes), here with a block stride above the block size as vLLM's padded pages
can have (FlashInfer's customize_spec aligns blocks to 32-row pages); the flat rows of each row's selection compacted to a prefix (vLLM's converter with return_valid_counts) and the counts.
CPU: Triton's interpreter at small shapes. GPU (the H200): K3.1's shapes, every head count, decode and prefill
batches, a CUDA graph replayed bit-identically with no allocation.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import computed_operands, fp8_wgmma_dims
from decode_checks import check_decode

from vllm_kimi_dsa import serving
from vllm_kimi_dsa.convert import convert_topk_reference
from vllm_kimi_dsa.formats import HEAD_DIM, flat_kv_row_view, quantize_rows
from vllm_kimi_dsa.serving import LayerStep, StepShape
from vllm_kimi_dsa.synthetic import StandInImpl, StandInLayer, make_step

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
FORMATS = ("fp8", "nvfp4_ds_mla")
# CPU: the interpreter at small shapes; GPU: K3.1's width and every head count of SPEC 1.
WIDTH = 2048 if GPU else 128
HEADS = (128, 96, 64, 32, 16, 12) if GPU else (16,)
MAX_ROWS = 64 if GPU else 4


def _vllm_inputs(rows: int, heads: int, fmt: str, seed: int, *, block_stride: int | None = 96, width: int = WIDTH):
    """A step as vLLM hands it to the backend: flat rows compacted to a prefix in top-k order, counts.

    The cache holds quantized N(0, 1) rows (every 7th x8: large values, peaked softmax) and the query e4m3(1.5 z),
    the data decode_checks' bounds are stated for (make_step's random cache bytes span e4m3's whole range)."""
    step = make_step(rows, heads, width, fmt, device=DEVICE, empty_rows=1, block_stride=block_stride, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    blocks, block_size, _ = step.cache.shape
    x = torch.randn((blocks * block_size, HEAD_DIM), generator=g)
    x[::7] *= 8.0
    rows_bytes = quantize_rows(x, fmt).view(torch.uint8).view(blocks, block_size, -1)
    step.cache.view(torch.uint8)[:] = rows_bytes.to(DEVICE)
    step.query.copy_((torch.randn((rows, heads, HEAD_DIM), generator=g) * 1.5).to(torch.float8_e4m3fn).to(DEVICE))
    _, stride_rows = flat_kv_row_view(step.cache, 64)
    slots, counts = convert_topk_reference(
        step.topk, step.metadata.req_id_per_token, step.metadata.block_table,
        block_size=64, rows_per_block_stride=stride_rows,
    )
    return step, slots.contiguous(), counts


def _layer_step(heads: int, fmt: str, *, return_lse: bool, max_rows: int = MAX_ROWS) -> LayerStep:
    shape = StepShape(device=DEVICE, heads=heads, width=WIDTH, fmt=fmt, max_rows=max_rows, return_lse=return_lse)
    return LayerStep(StandInImpl(kv_cache_dtype=fmt), StandInLayer(), shape, kernels=dict.fromkeys(
        range(1, max_rows + 1), "triton"))


def _check(step: LayerStep, out, lse, inputs, rows: int) -> None:
    case, slots, counts = inputs
    kv_rows, _ = flat_kv_row_view(case.cache, 64)
    core = step.core
    kernel = core.decode_kernel(min(rows, step.shape.max_rows))
    # against the decode the kernel computes (a Gluon nvfp4 form: the fp8 one on formats.nvfp4_as_fp8 of the rows)
    q, kv, fmt, ss, os_ = computed_operands(kernel, core.fmt, case.query, kv_rows, core.softmax_scale,
                                            core.output_scale)
    check_decode(out, lse, q, kv, slots, counts, fmt, ss, os_,
                 config=getattr(kernel, "config", None), wgmma=fp8_wgmma_dims(kernel, core.fmt) or False)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads", HEADS)
def test_decode_batch_matches_the_reference(fmt: str, heads: int) -> None:
    rows = 3 if not GPU else 37
    step = _layer_step(heads, fmt, return_lse=True)
    inputs = _vllm_inputs(rows, heads, fmt, seed=heads)
    step.buffers.latent.fill_(float("nan"))  # poison: every element the call returns must be written
    step.buffers.lse.fill_(float("nan"))
    out, lse = step(inputs[0].query, inputs[0].cache, inputs[1], inputs[2], 64)
    assert out.shape == (rows, heads, 512) and lse.shape == (rows, heads)
    assert out.data_ptr() == step.buffers.latent.data_ptr(), "a decode batch must land in the shared buffer"
    _check(step, out, lse, inputs, rows)


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_sized_batch_runs_in_pieces(fmt: str) -> None:
    """More rows than any planned launch (a prefill chunk, a mixed batch): pieces of max_rows, same answer."""
    heads = HEADS[-1]
    rows = 2 * MAX_ROWS + 3  # two full pieces and an odd tail
    step = _layer_step(heads, fmt, return_lse=True)
    inputs = _vllm_inputs(rows, heads, fmt, seed=11)
    out, lse = step(inputs[0].query, inputs[0].cache, inputs[1], inputs[2], 64)
    assert out.shape == (rows, heads, 512) and lse.shape == (rows, heads)
    assert out.data_ptr() != step.buffers.latent.data_ptr()  # its own tensors: the shared ones hold max_rows
    _check(step, out, lse, inputs, rows)


def test_a_batch_of_exactly_max_rows_decodes_into_the_shared_buffers() -> None:
    """The largest planned batch (vLLM's largest captured size) takes the path every smaller batch takes: views of
    the shared buffers (a graph captures it without allocating); only a larger batch allocates."""
    heads = HEADS[-1]
    step = _layer_step(heads, "fp8", return_lse=True)
    inputs = _vllm_inputs(MAX_ROWS, heads, "fp8", seed=13)
    step.buffers.latent.fill_(float("nan"))
    step.buffers.lse.fill_(float("nan"))
    out, lse = step(inputs[0].query, inputs[0].cache, inputs[1], inputs[2], 64)
    assert out.shape == (MAX_ROWS, heads, 512) and lse.shape == (MAX_ROWS, heads)
    assert out.data_ptr() == step.buffers.latent.data_ptr() and lse.data_ptr() == step.buffers.lse.data_ptr()
    _check(step, out, lse, inputs, MAX_ROWS)


def _vllm_config(max_num_seqs: int, capture=(1, 2, 4), speculative: int | None = None, batched: int = 8192):
    """The attributes of a VllmConfig planned_rows reads (tests/test_vllm_backend builds real ones)."""
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=batched),
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=None if capture is None else list(capture)),
        speculative_config=None if speculative is None else SimpleNamespace(num_speculative_tokens=speculative),
    )


@pytest.mark.parametrize(
    "config, want",
    [
        (_vllm_config(6), (6, (1, 2, 4, 6))),  # max_num_seqs past every capture size
        (_vllm_config(4, speculative=0), (4, (1, 2, 4))),
        # speculative decoding: a request's token and its drafts are rows of one step, max_num_seqs x (1 + n)
        (_vllm_config(4, speculative=2), (12, (1, 2, 4, 12))),
        (_vllm_config(8, capture=(1, 2, 4, 8), speculative=1), (16, (1, 2, 4, 8, 16))),
        # capture sizes above max_num_seqs (vLLM's default list runs to 2 x max_num_seqs): the largest is planned
        (_vllm_config(4, capture=(1, 2, 4, 8)), (8, (1, 2, 4, 8))),
        (_vllm_config(4, capture=(8, 1, 16, 2)), (16, (1, 2, 8, 16))),
        (_vllm_config(4, capture=(1, 2, 4, 8, 16, 24), speculative=3), (24, (1, 2, 4, 8, 16, 24))),
        # never past max_num_batched_tokens (vLLM drops capture sizes past it too); no capture sizes (eager)
        (_vllm_config(4, speculative=3, batched=10), (10, (1, 2, 4, 10))),
        (_vllm_config(3, capture=None), (3, (3,))),
        (_vllm_config(3, capture=()), (3, (3,))),
    ],
    ids=["max-num-seqs", "no-drafts", "two-drafts", "one-draft", "capture-8", "capture-16-unsorted",
         "capture-24-three-drafts", "batched-tokens", "eager-none", "eager-empty"],
)
def test_planned_rows_take_speculative_tokens_and_every_capture_size(config, want) -> None:
    assert serving.planned_rows(config) == want


@pytest.mark.parametrize("section, renamed", [
    ("speculative_config", "num_speculative_tokens"),
    ("scheduler_config", "max_num_batched_tokens"),
    ("compilation_config", "cudagraph_capture_sizes"),
])
def test_planned_rows_refuse_a_config_without_a_field_they_read(section, renamed) -> None:
    """A field vLLM renamed is an error naming it, not a default: without num_speculative_tokens the MTP rows of a
    step (max_num_seqs x (1 + drafts)) would be planned as max_num_seqs and every verification batch split."""
    config = _vllm_config(4, speculative=2)
    fields = vars(getattr(config, section))
    fields[f"{renamed}_v2"] = fields.pop(renamed)  # the field under another name, as a new vLLM might call it
    with pytest.raises(TypeError, match=f"vllm_config.{section}.{renamed} is missing"):
        serving.planned_rows(config)


def test_without_dcp_no_lse_and_the_same_latent() -> None:
    heads, rows = HEADS[-1], 3
    inputs = _vllm_inputs(rows, heads, "fp8", seed=5)
    with_lse, _ = _layer_step(heads, "fp8", return_lse=True)(inputs[0].query, inputs[0].cache, *inputs[1:], 64)
    with_lse = with_lse.clone()
    out, lse = _layer_step(heads, "fp8", return_lse=False, max_rows=MAX_ROWS + 1)(
        inputs[0].query, inputs[0].cache, *inputs[1:], 64
    )
    assert lse is None
    torch.testing.assert_close(out, with_lse, rtol=0, atol=0)


def test_layers_share_one_set_of_buffers() -> None:
    a = _layer_step(16, "fp8", return_lse=True)
    b = _layer_step(16, "fp8", return_lse=True)
    assert a.buffers is b.buffers and a.core.buffers.latent.data_ptr() == b.core.buffers.latent.data_ptr()
    c = _layer_step(16, "fp8", return_lse=False)
    assert c.buffers is not a.buffers


def test_zero_rows_return_empty_views() -> None:
    step = _layer_step(16, "fp8", return_lse=True)
    inputs = _vllm_inputs(1, 16, "fp8", seed=3)
    out, lse = step(inputs[0].query[:0], inputs[0].cache, inputs[1][:0], inputs[2][:0], 64)
    assert out.shape == (0, 16, 512) and lse.shape == (0, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("fmt", FORMATS)
def test_graph_replay_is_bit_identical_and_allocates_nothing(fmt: str) -> None:
    heads, rows = 128, 20
    step = _layer_step(heads, fmt, return_lse=True)
    case, slots, counts = _vllm_inputs(rows, heads, fmt, seed=21)
    eager_out, eager_lse = step(case.query, case.cache, slots, counts, 64)
    eager_out, eager_lse = eager_out.clone(), eager_lse.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(case.query, case.cache, slots, counts, 64)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step(case.query, case.cache, slots, counts, 64)
    torch.cuda.synchronize()
    step.buffers.latent.fill_(float("nan"))
    before = torch.cuda.memory_allocated()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)


def test_shared_buffers_registry_is_keyed_by_shape() -> None:
    shape = StepShape(device=DEVICE, heads=12, width=WIDTH, fmt="fp8", max_rows=3, return_lse=False)
    assert serving.shared_buffers(shape) is serving.shared_buffers(shape)
    other = StepShape(device=DEVICE, heads=12, width=WIDTH, fmt="fp8", max_rows=5, return_lse=False)
    assert serving.shared_buffers(other).latent.numel() == 5 * 12 * 512


@pytest.mark.parametrize(
    "change", [dict(width=2 * WIDTH), dict(heads=16), dict(max_rows=5), dict(return_lse=True)],
    ids=["width", "heads", "max_rows", "return_lse"],
)
def test_shared_buffers_are_keyed_by_every_field_that_sizes_them(change) -> None:
    """Two shapes differing in one field the buffers are made from get two sets, each of its own shape: a step of
    another top-k width gets slots of that width (the core refuses slots of a width it never planned)."""
    base = dict(device=DEVICE, heads=12, width=WIDTH, fmt="fp8", max_rows=3, return_lse=False)
    one, two = StepShape(**base), StepShape(**{**base, **change})
    first, second = serving.shared_buffers(one), serving.shared_buffers(two)
    assert second is not first and second is serving.shared_buffers(two)
    for shape, buffers in ((one, first), (two, second)):
        assert buffers.slots.shape == (shape.max_rows, shape.width) and buffers.counts.shape == (shape.max_rows,)
        assert buffers.latent.numel() == shape.max_rows * shape.heads * 512
        assert (buffers.lse is not None) == shape.return_lse
        assert buffers.lse is None or buffers.lse.numel() == shape.max_rows * shape.heads


def test_a_step_of_another_width_decodes_into_buffers_of_that_width() -> None:
    heads, rows, width = HEADS[-1], 2, 2 * WIDTH
    narrow = _layer_step(heads, "fp8", return_lse=True)
    shape = StepShape(device=DEVICE, heads=heads, width=width, fmt="fp8", max_rows=MAX_ROWS, return_lse=True)
    wide = LayerStep(StandInImpl(kv_cache_dtype="fp8"), StandInLayer(), shape,
                     kernels=dict.fromkeys(range(1, MAX_ROWS + 1), "triton"))
    assert wide.buffers is not narrow.buffers and wide.buffers.slots.shape == (MAX_ROWS, width)
    inputs = _vllm_inputs(rows, heads, "fp8", seed=31, width=width)
    wide.buffers.latent.fill_(float("nan"))
    out, lse = wide(inputs[0].query, inputs[0].cache, inputs[1], inputs[2], 64)
    assert out.data_ptr() == wide.buffers.latent.data_ptr()
    _check(wide, out, lse, inputs, rows)


@pytest.mark.parametrize("bad", [dict(max_rows=0), dict(width=100), dict(fmt="bf16")])
def test_step_shape_rejects_bad_values(bad) -> None:
    kw = dict(device=DEVICE, heads=16, width=WIDTH, fmt="fp8", max_rows=4, return_lse=False)
    kw.update(bad)
    with pytest.raises(ValueError):
        StepShape(**kw)
