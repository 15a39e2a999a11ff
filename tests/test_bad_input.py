"""Bad input to the core and the glue: each gets a ValueError/TypeError naming the argument, buffers untouched.

The model's shared buffers (slots, counts, latent, lse) are snapshotted byte for byte before each bad call and
compared after: a rejected call must not have half-run (e.g. converted, then refused the query).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_kimi_dsa.core import FlashInferCore
from vllm_kimi_dsa.synthetic import StandInImpl, StandInLayer, make_buffers, make_step
from vllm_kimi_dsa.vllm_glue import KimiDSACores

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS, HEADS, WIDTH, R = 3, 16, 128, 4  # table {3: triton}; buffers for 4 rows


def _bytes(t):
    return None if t is None else t.detach().contiguous().view(torch.uint8).clone()


def _snapshot(buffers):
    return [_bytes(b) for b in buffers]


def _assert_untouched(buffers, before):
    for i, (b, s) in enumerate(zip(buffers, before)):
        if b is None:
            continue
        assert torch.equal(_bytes(b), s), f"buffers[{i}] changed by a rejected call"


def _rejects(exc, match, fn, buffers):
    before = _snapshot(buffers)
    with pytest.raises(exc, match=match):
        fn()
    _assert_untouched(buffers, before)


@pytest.fixture
def setup(request):
    """An fp8 core on the real triton kernel (its construction runs on a CPU), its buffers and a good step."""
    fmt = getattr(request, "param", "fp8")
    buffers = make_buffers(R, HEADS, WIDTH, DEVICE)
    core = FlashInferCore(StandInImpl(kv_cache_dtype=fmt), StandInLayer(), HEADS, buffers, {ROWS: "triton"})
    step = make_step(ROWS, HEADS, WIDTH, fmt, device=DEVICE, seed=5)
    return core, buffers, step


def _run(core, step, **changes):
    args = dict(query=step.query, cache=step.cache, topk=step.topk, metadata=step.metadata)
    args.update(changes)
    return lambda: core.run(args["query"], args["cache"], args["topk"], args["metadata"])


def _decode(core, step, buffers, **changes):
    slots = buffers[0][:ROWS]
    counts = buffers[1][:ROWS]
    args = dict(query=step.query, cache=step.cache, slots=slots, counts=counts, block_size=64)
    args.update(changes)
    return lambda: core.decode(args["query"], args["cache"], args["slots"], args["counts"], args["block_size"])


def _build(buffers=None, heads=HEADS, kernels=None, fmt="fp8", **kw):
    buffers = make_buffers(R, heads, WIDTH, DEVICE) if buffers is None else buffers
    return lambda: FlashInferCore(StandInImpl(kv_cache_dtype=fmt), StandInLayer(), heads, buffers, kernels or {ROWS: "triton"}, **kw)


# ---------------------------------------------------------------- query


def test_query_dtype_bf16(setup):
    core, b, step = setup
    _rejects(TypeError, "query must be torch.float8_e4m3fn", _run(core, step, query=step.query.to(torch.bfloat16)), b)


def test_query_not_a_tensor(setup):
    core, b, step = setup
    _rejects(TypeError, "query must be a torch.Tensor", _run(core, step, query=step.query.tolist()), b)


def test_query_shape_2d(setup):
    core, b, step = setup
    _rejects(ValueError, "query must be", _run(core, step, query=step.query.view(ROWS, -1)), b)


def test_query_wrong_heads(setup):
    core, b, step = setup
    q = torch.randn(ROWS, 2 * HEADS, 576, device=DEVICE).to(torch.float8_e4m3fn)
    _rejects(ValueError, f"query must be \\(rows, {HEADS}, 576\\)", _run(core, step, query=q), b)


def test_query_without_rope_dims(setup):
    core, b, step = setup
    _rejects(ValueError, "query must be", _run(core, step, query=step.query[..., :512].contiguous()), b)


def test_query_not_contiguous(setup):
    core, b, step = setup
    q = torch.randn(HEADS, ROWS, 576, device=DEVICE).to(torch.float8_e4m3fn).transpose(0, 1)
    _rejects(ValueError, "query must be contiguous", _run(core, step, query=q), b)


def test_query_on_another_device(setup):
    core, b, step = setup
    q = torch.empty(ROWS, HEADS, 576, dtype=torch.float8_e4m3fn, device="meta")  # stands in for another GPU
    _rejects(ValueError, "query is on meta", _run(core, step, query=q), b)


class _RecordingKernel:
    """A stand-in DecodeKernel for any kernel name: records its calls and checks nothing (the FlashInfer kernels trust
    the core's query check too), so only the core's own check stands between a bad query and a kernel."""

    def __init__(self, name, setup):
        self.name, self.setup, self.calls = name, setup, []

    def __call__(self, query, *args, **kwargs):
        self.calls.append(tuple(query.shape))


@pytest.mark.parametrize("kernel", ["triton", "prims_ts", "trtllm"])
@pytest.mark.parametrize("path", ["decode", "run"])
def test_every_path_checks_the_query_before_its_kernel(monkeypatch, kernel, path):
    """core.decode (LayerStep's, vLLM's backend's path) and core.run check the query's heads, device and dtype with
    a clear error before any kernel runs, on every kernel of the table (FlashInfer's prims_ts and trtllm-gen too,
    here stand-ins that check nothing); a good query reaches the kernel (the check is what stops the bad ones)."""
    import vllm_kimi_dsa.core as core_module

    built: list[_RecordingKernel] = []

    def build_kernel(name, setup):
        built.append(_RecordingKernel(name, setup))
        return built[-1]

    monkeypatch.setattr(core_module, "build_kernel", build_kernel)
    buffers = make_buffers(R, HEADS, WIDTH, DEVICE)
    core = FlashInferCore(StandInImpl(kv_cache_dtype="fp8"), StandInLayer(), HEADS, buffers, {ROWS: kernel})
    (stand_in,) = built
    assert stand_in.name == kernel
    step = make_step(ROWS, HEADS, WIDTH, "fp8", device=DEVICE, seed=5)
    call = (lambda q: _decode(core, step, buffers, query=q)) if path == "decode" else \
        (lambda q: _run(core, step, query=q))
    bad = {
        "query must be \\(rows, 16, 576\\)": torch.zeros(ROWS, 2 * HEADS, 576, device=DEVICE).to(torch.float8_e4m3fn),
        "query is on meta": torch.empty(ROWS, HEADS, 576, dtype=torch.float8_e4m3fn, device="meta"),
        "query must be torch.float8_e4m3fn": step.query.to(torch.bfloat16),
    }
    for match, query in bad.items():
        _rejects((ValueError, TypeError), match, call(query), buffers)
    assert stand_in.calls == []
    call(step.query)()
    assert stand_in.calls == [(ROWS, HEADS, 576)]


def test_batch_size_missing_from_kernel_table(setup):
    core, b, step = setup
    q = step.query[:2].contiguous()
    _rejects(ValueError, r"rows=2 has no kernel", _run(core, step, query=q), b)


def test_decode_batch_size_missing_from_kernel_table(setup):
    core, b, step = setup
    _rejects(ValueError, "query has 1 rows; the kernel table", _decode(core, step, b, query=step.query[:1].contiguous()), b)


# ---------------------------------------------------------------- top-k, slots, counts


def test_topk_width_mismatch(setup):
    core, b, step = setup
    topk = torch.cat([step.topk, step.topk], dim=1)
    _rejects(ValueError, "topk width 256", _run(core, step, topk=topk), b)


def test_topk_dtype_int64(setup):
    core, b, step = setup
    _rejects(TypeError, "topk must be int32", _run(core, step, topk=step.topk.long()), b)


def test_req_id_per_token_dtype(setup):
    core, b, step = setup
    meta = SimpleNamespace(**{**vars(step.metadata), "req_id_per_token": step.metadata.req_id_per_token.long()})
    _rejects(TypeError, "req_id_per_token", _run(core, step, metadata=meta), b)


@pytest.mark.parametrize("field", ["req_id_per_token", "block_table", "block_size", "cp_kv_cache_interleave_size"])
def test_metadata_without_a_field_of_vllms_sparse_metadata(setup, field):
    """Every field of vLLM's SparseMLACommonMetadata the core converts with is read without a default: a metadata
    object lacking one (a vLLM that renamed it) is refused, naming it, before anything is written. A DCP interleave
    taken as 1 would keep another rank's tokens."""
    core, b, step = setup
    meta = SimpleNamespace(**{k: v for k, v in vars(step.metadata).items() if k != field})
    _rejects(TypeError, f"metadata.{field} is missing", _run(core, step, metadata=meta), b)


def test_slots_width_never_planned(setup):
    core, b, step = setup
    slots = torch.full((ROWS, 256), -1, dtype=torch.int32, device=DEVICE)
    _rejects(ValueError, "slots width 256 was never planned", _decode(core, step, b, slots=slots), b)


def test_slots_dtype_int64(setup):
    core, b, step = setup
    _rejects(TypeError, "slots must be torch.int32", _decode(core, step, b, slots=b[0][:ROWS].long()), b)


def test_counts_wrong_shape(setup):
    core, b, step = setup
    _rejects(ValueError, "counts must be \\(3,\\)", _decode(core, step, b, counts=b[1]), b)


def test_counts_dtype_int64(setup):
    core, b, step = setup
    _rejects(TypeError, "counts must be torch.int32", _decode(core, step, b, counts=b[1][:ROWS].long()), b)


def test_ids_past_the_cache_with_validate():
    buffers = make_buffers(R, HEADS, WIDTH, DEVICE)
    core = FlashInferCore(StandInImpl(), StandInLayer(), HEADS, buffers, {ROWS: "triton"}, validate=True)
    step = make_step(ROWS, HEADS, WIDTH, "fp8", device=DEVICE, seed=1)
    slots = torch.full((ROWS, WIDTH), -1, dtype=torch.int32, device=DEVICE)
    slots[1, 0] = step.cache.shape[0] * 64 + 5  # one past every block
    counts = torch.tensor([0, 1, 0], dtype=torch.int32, device=DEVICE)
    _rejects(ValueError, "slots index past the cache", _decode(core, step, buffers, slots=slots, counts=counts), buffers)


def _validating_case(seed: int):
    """A validating fp8 core and a decode step's slots / counts from vLLM-like data: row 0 counts its whole prefix,
    row 1 nothing, row 2 an odd count; -1 holes inside the counted prefixes; junk ids below -1 past each count."""
    buffers = make_buffers(R, HEADS, WIDTH, DEVICE)
    core = FlashInferCore(StandInImpl(), StandInLayer(), HEADS, buffers, {ROWS: "triton"}, validate=True)
    step = make_step(ROWS, HEADS, WIDTH, "fp8", device=DEVICE, seed=seed)
    num_rows = core.rows(step.cache, 64)[0].shape[0]
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, num_rows, (ROWS, WIDTH), generator=g, dtype=torch.int32)
    counts = torch.tensor([WIDTH, 0, 37], dtype=torch.int32)
    slots[0, [0, 5, WIDTH - 1]] = -1  # holes inside the counted prefix, its first and last entry included
    slots[2, 36] = -1
    slots[1, :] = -(2**31)  # past the count (0): never read, never checked
    slots[2, 37:] = -5
    return core, buffers, step, slots.to(DEVICE), counts.to(DEVICE)


def test_validate_accepts_holes_inside_the_counted_prefix():
    """A -1 inside the counted prefix is a hole (vLLM's converter leaves them; SPEC 4), not a bad id: the validating
    core decodes it as the plain one does, the hole skipped (the reference's answer), poisoned buffers overwritten."""
    from decode_checks import check_decode

    core, buffers, step, slots, counts = _validating_case(seed=7)
    out, lse = core.decode(step.query, step.cache, slots, counts, 64)
    kv_rows, _ = core.rows(step.cache, 64)
    check_decode(out, lse, step.query, kv_rows, slots, counts, "fp8", core.softmax_scale, core.output_scale,
                 config=core.decode_kernel(ROWS).config)


@pytest.mark.parametrize("bad", [-2, -(2**31)])
def test_validate_rejects_ids_below_minus_one(bad):
    """Below -1 is no hole and no row: inside the counted prefix the validating core refuses it, buffers untouched."""
    core, buffers, step, slots, counts = _validating_case(seed=8)
    slots[2, 20] = bad
    _rejects(ValueError, "slots index", _decode(core, step, buffers, slots=slots, counts=counts), buffers)


def test_counts_past_the_width_with_validate():
    buffers = make_buffers(R, HEADS, WIDTH, DEVICE)
    core = FlashInferCore(StandInImpl(), StandInLayer(), HEADS, buffers, {ROWS: "triton"}, validate=True)
    step = make_step(ROWS, HEADS, WIDTH, "fp8", device=DEVICE, seed=1)
    counts = torch.tensor([0, WIDTH + 1, 0], dtype=torch.int32, device=DEVICE)
    slots = torch.zeros((ROWS, WIDTH), dtype=torch.int32, device=DEVICE)
    _rejects(ValueError, "counts must be in", _decode(core, step, buffers, slots=slots, counts=counts), buffers)


# ---------------------------------------------------------------- cache


def test_cache_dtype_mismatch(setup):
    core, b, step = setup
    _rejects(TypeError, "cache must be torch.float8_e4m3fn for fp8", _run(core, step, cache=step.cache.view(torch.uint8)), b)


@pytest.mark.parametrize("setup", ["nvfp4_ds_mla"], indirect=True)
def test_cache_row_size_mismatch(setup):
    core, b, step = setup
    fp8_cache = make_step(ROWS, HEADS, WIDTH, "fp8", device=DEVICE).cache.view(torch.uint8)  # 576-byte rows
    _rejects(ValueError, "cache must be \\(num_blocks, block_size, 352\\)", _run(core, step, cache=fp8_cache), b)


def test_cache_on_another_device(setup):
    core, b, step = setup
    cache = torch.empty(step.cache.shape, dtype=step.cache.dtype, device="meta")
    _rejects(ValueError, "cache is on meta", _run(core, step, cache=cache), b)


def test_cache_block_size_mismatch(setup):
    core, b, step = setup
    meta = SimpleNamespace(**{**vars(step.metadata), "block_size": 32})
    _rejects(ValueError, "block_size=32", _run(core, step, metadata=meta), b)


def test_trtllm_block_size_not_32_or_64_compatible():
    # TrtllmDecode cannot be built on a CPU (cubins, SM count): its page check runs first in __call__.
    from vllm_kimi_dsa.backends.flashinfer.trtllm import TrtllmDecode

    kernel = object.__new__(TrtllmDecode)
    rows = torch.zeros((16 * 48, 576), dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"block_size=48"):
        kernel(None, rows, None, None, None, None, block_size=48, rows_per_block_stride=48)
    with pytest.raises(ValueError, match=r"rows_per_block_stride=80"):
        kernel(None, rows, None, None, None, None, block_size=64, rows_per_block_stride=80)


# ---------------------------------------------------------------- construction


def test_nvfp4_cache_with_trtllm():
    b = make_buffers(R, HEADS, WIDTH, DEVICE)
    _rejects(ValueError, r"kernels\[3\]='trtllm' reads only the fp8 cache", _build(b, kernels={3: "trtllm"}, fmt="nvfp4_ds_mla"), b)


def test_heads_not_supported():
    """Every count 1..128 is a rank's (48 builds, test_core); 129 and 0 are refused, naming heads."""
    b = make_buffers(R, 129, WIDTH, DEVICE)
    _rejects(ValueError, "heads=129", _build(b, heads=129), b)
    _rejects(ValueError, "heads must be >= 1", _build(b, heads=0), b)


def test_heads_the_kernel_cannot_take():
    b = make_buffers(R, 96, WIDTH, DEVICE)
    _rejects(ValueError, r"kernels\[3\]='trtllm' cannot take heads=96", _build(b, heads=96, kernels={3: "trtllm"}), b)


def test_unknown_kernel_name():
    b = make_buffers(R, HEADS, WIDTH, DEVICE)
    _rejects(ValueError, r"kernels\[3\]='flashmla'", _build(b, kernels={3: "flashmla"}), b)


def test_k_not_a_multiple_of_128():
    b = make_buffers(R, HEADS, 200, DEVICE)
    _rejects(ValueError, "slots width K must be a positive multiple of 128, got 200", _build(b), b)


def test_unplanned_width_in_widths():
    b = make_buffers(R, HEADS, WIDTH, DEVICE)
    _rejects(ValueError, "widths must be a positive multiple of 128, got 200", _build(b, widths=(128, 200)), b)


def test_rows_beyond_the_buffers():
    b = make_buffers(R, HEADS, WIDTH, DEVICE)
    _rejects(ValueError, r"kernels: batch size 8 must be an int in \[1, 4\]", _build(b, kernels={8: "triton"}), b)


def test_prims_ts_rows_beyond_every_capacity():
    b = make_buffers(R, HEADS, WIDTH, DEVICE)
    _rejects(ValueError, "rows=3 exceeds every plan capacity", _build(b, kernels={3: "prims_ts"}, capacities=[2]), b)


def test_latent_buffer_not_contiguous():
    slots, counts, latent, lse = make_buffers(R, HEADS, WIDTH, DEVICE)
    wide = torch.full((2 * latent.numel(),), float("nan"), dtype=torch.bfloat16, device=DEVICE)[::2]
    b = (slots, counts, wide, lse)
    _rejects(ValueError, "latent must be a contiguous", _build(b), b)


def test_slots_buffer_not_contiguous():
    slots, counts, latent, lse = make_buffers(R, HEADS, 2 * WIDTH, DEVICE)
    b = (slots[:, ::2], counts, latent, lse)
    _rejects(ValueError, "slots must be a contiguous", _build(b), b)


def test_lse_buffer_on_another_device():
    slots, counts, latent, _ = make_buffers(R, HEADS, WIDTH, DEVICE)
    b = (slots, counts, latent, torch.empty(R * HEADS, dtype=torch.float32, device="meta"))
    # the meta tensor has no bytes to snapshot; the others must be untouched
    _rejects(ValueError, r"buffers\[3\] \(lse\) is on meta", _build(b), b[:3])


def test_lse_buffer_wrong_dtype():
    slots, counts, latent, lse = make_buffers(R, HEADS, WIDTH, DEVICE)
    b = (slots, counts, latent, lse.to(torch.bfloat16))
    _rejects(TypeError, r"buffers\[3\] \(lse\) must be torch.float32", _build(b), b)


def test_dcp_rank_out_of_range():
    b = make_buffers(R, HEADS, WIDTH, DEVICE)
    _rejects(ValueError, r"rank=2 must be in \[0, dcp=2\)", _build(b, dcp=2, rank=2), b)


# ---------------------------------------------------------------- glue


def test_glue_width_not_a_multiple_of_128():
    with pytest.raises(ValueError, match="width must be a positive multiple of 128"):
        KimiDSACores([(StandInImpl(), StandInLayer())], heads=HEADS, batch_sizes=[1], width=200, kernels={1: "triton"})


def test_glue_batch_sizes_not_positive():
    with pytest.raises(ValueError, match="batch_sizes"):
        KimiDSACores([(StandInImpl(), StandInLayer())], heads=HEADS, batch_sizes=[0, 2], kernels={2: "triton"})


def test_glue_forward_bad_query_leaves_shared_buffers_untouched():
    cores = KimiDSACores([(StandInImpl(), StandInLayer())] * 2, heads=HEADS, batch_sizes=[ROWS], width=WIDTH,
                         kernels={ROWS: "triton"}, return_lse=True, device=DEVICE)
    step = make_step(ROWS, HEADS, WIDTH, "fp8", device=DEVICE, seed=2)
    b = cores.buffers.as_tuple()
    _rejects(TypeError, "query must be torch.float8_e4m3fn",
             lambda: cores.forward(1, step.query.float(), step.cache, step.topk, step.metadata), b)
