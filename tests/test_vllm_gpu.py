"""vLLM 0.33's DeepSeek-V3.2 attention layer with this backend, on a CUDA GPU (the device's H100 / H200).

The layer, its config, cache writer, FP8 query, index group, metadata builder and CUDA-graph wrappers are vLLM's own
(tests/vllm_gpu_rig.py says how each is made); the sparse decode is this package's. Each batch kind is checked
against float32 references of the layer's math, part by part:

- the cache rows vLLM's fused_norm_rope wrote for the step's tokens, against RMSNorm / RoPE of the same bf16
  projections: one e4m3 rounding, |got - ref| <= (2^-4 + 2^-8) |ref| + 2^-9 (half an e4m3 step, the bf16 input's
  rounding, and e4m3's subnormal spacing);
- the FP8 query vLLM's fused_q made, against the float32 chain (RMSNorm, q_b_proj, W_UK absorption, RoPE):
  one e4m3 rounding plus the bf16 roundings of the chain, at most 2^-5 of the row's rms (derivation at QUERY_ABS);
- the latent the backend returned, against the float32 decode of that query over the rows the cache holds, at the
  scales the layer's q / k scales and softmax scale give (not the core's own), with the bounds every kernel test uses
  (decode_checks.check_decode) and vLLM's flat rows equal to ours;
- the layer's output (W_UV, o_proj), against float32 of the reference latent: LAYER_REL per token;
- and, reported, the whole layer against a float32 query never rounded to e4m3 (the FP8 query's own error).

Negative controls: faults planted in the backend (a dropped slot, a softmax scale 5% high, an output scale 10% high),
in vLLM's cache writer (k scale 5% high) and in the DCP merge (the LSE base flipped) must each fail the checks.

Skipped (with the reason) where CUDA or vLLM is missing; CPU CI runs the same path in tests/test_vllm_backend.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (vLLM's layer on the device)", allow_module_level=True)


def _install_device_shims() -> dict[str, str]:
    """tools/vllm_device_shims.py's install(), before vLLM resolves its platform: a placeholder only where a library
    of vLLM's cannot load on this machine (each shim says what it could hide); a no-op under a full vLLM install."""
    path = Path(__file__).resolve().parents[1] / "tools" / "vllm_device_shims.py"
    spec = importlib.util.spec_from_file_location("vllm_device_shims", path)
    shims = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shims)
    return shims.install()


SHIMS = _install_device_shims()
pytest.importorskip("vllm.models.deepseek_v32.attention", reason="needs vLLM 0.33's Python tree")

import vllm_layer as rig  # noqa: E402
from vllm_layer import check_step, rel_l2  # noqa: E402

from vllm_kimi_dsa import vllm_glue  # noqa: E402
from vllm_kimi_dsa.convert import convert_topk_reference  # noqa: E402
from vllm_kimi_dsa.formats import flat_kv_row_view  # noqa: E402
from vllm_kimi_dsa.reference import reference_decode  # noqa: E402

DEVICE = torch.device("cuda")
REPORT: dict[str, dict] = {}


@pytest.fixture(scope="module", autouse=True)
def plugin():
    vllm_glue.register()
    REPORT["shims"] = SHIMS
    REPORT["gpu"] = {"name": torch.cuda.get_device_name(), "torch": torch.__version__}
    yield


@pytest.fixture(autouse=True)
def report():
    """REPORT to $KIMI_DSA_GPU_REPORT after every test (a device call cut short keeps what ran)."""
    yield
    path = os.environ.get("KIMI_DSA_GPU_REPORT")
    if path:
        Path(path).write_text(json.dumps(REPORT, indent=1))


_RIGS: dict[tuple, rig.LayerRig] = {}


CALIBRATED = (0.125, 0.25)  # q / k scales as a calibrated checkpoint (or calculate_kv_scales) sets them
UNIT = (1.0, 1.0)  # an unquantized checkpoint's scales: the serving default, vLLM's skip-scale cache writer


def layer_rig(tmp_path_factory, heads: int, spec_tokens: int = 0, scales: tuple[float, float] = CALIBRATED
              ) -> rig.LayerRig:
    """One layer a (heads, speculative tokens, q / k scales), built once: each test draws fresh inputs from it."""
    key = (heads, spec_tokens, scales)
    if key not in _RIGS:
        name = f"h{heads}s{spec_tokens}" + ("unit" if scales == UNIT else "")
        _RIGS[key] = rig.LayerRig(tmp_path_factory.mktemp(name), heads=heads, spec_tokens=spec_tokens,
                                  q_scale=scales[0], k_scale=scales[1], seed=heads * 10 + spec_tokens)
    return _RIGS[key]


# ---------------------------------------------------------------- batch kinds


@pytest.mark.parametrize("heads, scales", [(128, CALIBRATED), (16, CALIBRATED), (8, CALIBRATED), (128, UNIT),
                                            (16, UNIT)], ids=["h128", "h16", "h8", "h128-unit-scales",
                                                              "h16-unit-scales"])
def test_decode_batch(tmp_path_factory, heads, scales):
    """An odd decode batch (5 requests, contexts 1 to 4000 tokens: fewer and more than index_topk), -1 holes, one
    token with nothing selected; 16 and 8 heads are what a TP8 / TP16 rank of a 128-head model sees. Calibrated
    scales, and q / k scales of 1.0 (the usual serving case: vLLM's writer skips the scale)."""
    r = layer_rig(tmp_path_factory, heads, scales=scales)
    batch = r.batch([rig.Request(c, 1) for c in (1, 130, 2047, 2500, 4000)], empty_rows=(1,))
    r.impl._step.buffers.latent.fill_(float("nan"))  # poison: everything returned must be written
    out = r.forward(batch)
    assert r.impl._step_scales == (r.q_scale, r.k_scale), "the step must run at the layer's scales"
    found = REPORT[f"decode_h{heads}" + ("_unit" if scales == UNIT else "")] = check_step(r, batch, out)
    from vllm_kimi_dsa.vllm_backend import startup_line

    found["startup_line"] = startup_line(r.impl._step, DEVICE)
    assert found["is_decode"] is True


def test_prefill_chunk_longer_than_index_topk(tmp_path_factory):
    """One request's prefill chunk of 2200 tokens over 300 cached (more tokens than index_topk and than one launch
    takes): its seq_len (2500) is past index_topk, so vLLM sends it through forward_mqa, not to dense MHA; the backend
    decodes it in pieces."""
    r = layer_rig(tmp_path_factory, 128)
    batch = r.batch([rig.Request(300, 2200)], empty_rows=(5,))
    metadata = r.metadata(batch)
    assert metadata.num_prefills == 1 and metadata.num_decode_tokens == 0
    out = r.forward(batch)
    found = REPORT["prefill_2200"] = check_step(r, batch, out)
    assert found["is_decode"] is False and batch.tokens > r.impl._step.shape.max_rows


def test_mixed_batch(tmp_path_factory):
    """Three decodes and a 1100-token prefill chunk (over 1500 cached) in one step."""
    r = layer_rig(tmp_path_factory, 128)
    batch = r.batch([rig.Request(50, 1), rig.Request(2100, 1), rig.Request(3000, 1), rig.Request(1500, 1100)],
                    empty_rows=(0,))
    metadata = r.metadata(batch)
    assert metadata.num_decodes == 3 and metadata.num_prefills == 1
    out = r.forward(batch)
    found = REPORT["mixed_3x1_1100"] = check_step(r, batch, out)
    assert found["is_decode"] is False


@pytest.mark.parametrize("spec_tokens", [1, 3])
def test_speculative_batch(tmp_path_factory, spec_tokens):
    """MTP's verification step: each request brings 1 + k query tokens (vLLM's FLASHINFER_MLA_SPARSE counts them as
    decodes); the planned rows cover max_num_seqs x (1 + k)."""
    r = layer_rig(tmp_path_factory, 128, spec_tokens)
    per = 1 + spec_tokens
    assert r.impl._step.shape.max_rows >= r.config.scheduler_config.max_num_seqs * per
    batch = r.batch([rig.Request(c, per) for c in (7, 900, 2600, 3100, 64)], empty_rows=(per,))
    metadata = r.metadata(batch)
    assert metadata.num_decode_tokens == batch.tokens
    out = r.forward(batch)
    found = REPORT[f"mtp_k{spec_tokens}"] = check_step(r, batch, out)
    assert found["is_decode"] is True


@pytest.mark.parametrize("fault", sorted(rig.FAULTS))
def test_check_step_catches_a_planted_fault(tmp_path_factory, fault):
    """The checks' negative controls on the GPU: each planted fault makes check_step fail with the message of the
    check meant to catch it; the same batch passes once the fault is gone."""
    r = layer_rig(tmp_path_factory, 128)
    batch = r.batch([rig.Request(c, 1) for c in (1, 130, 2500)], empty_rows=(1,))
    with rig.planted(r, fault):
        out = r.forward(batch)
        with pytest.raises(AssertionError, match=rig.FAULTS[fault]):
            check_step(r, batch, out)
    check_step(r, batch, r.forward(batch))
    REPORT.setdefault("negative_controls", {})[fault] = "caught"


# ---------------------------------------------------------------- DCP 2, merged by vLLM's MLADCPManager


def test_dcp2_merged_by_mladcpmanager_equals_tp(tmp_path_factory, monkeypatch):
    """Decode context parallel 2: each rank's impl (built by vLLM's MLAAttention constructor with the DCP rank vLLM
    reads) decodes its own share through SparseMLACommonImpl.forward_mqa (vLLM's DCP filter-and-convert), and
    vLLM's MLADCPManager merges the two (its combine: all-gather of the LSEs, correct_attn_out, reduce-scatter over
    heads), the ranks in two threads over an in-process group (rig.RankGroup: NCCL cannot put two ranks on one GPU).
    The merge equals the TP reference; a row one rank never sees (count 0) is dropped by its LSE."""
    import vllm.distributed.parallel_state as parallel_state
    import vllm.v1.attention.ops.dcp as dcp_ops
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import FlashInferMLASparseMetadata
    from vllm.v1.attention.ops.dcp import _lse_weighted_combine

    import vllm_harness as vh
    from dcp_cases import make_case

    # the all-gather / reduce-scatter combine (vLLM's default dcp_comm_backend), not the symmetric-memory ones,
    # which need a real multi-GPU group
    monkeypatch.setenv("VLLM_USE_DIRECT_DCP_Q_GATHER", "0")
    monkeypatch.setenv("VLLM_USE_DIRECT_DCP_A2A", "0")
    heads_per_rank, dcp, interleave, rows, width = 8, 2, 64, 5, rig.TOPK
    heads = heads_per_rank * dcp
    config = rig.engine_config(tmp_path_factory.mktemp("dcp"), heads=heads_per_rank)
    (tp_cache, tp_meta), ranks, topk, query = make_case("fp8", dcp, interleave, rows, heads, width, seed=41)
    outs, lses, layers = [], [], []
    for rank, (cache, meta) in enumerate(ranks):
        monkeypatch.setattr(parallel_state, "get_dcp_world_size_and_rank", lambda enabled=True, r_=rank: (dcp, r_))
        buffer = torch.full((rows, width), -1, dtype=torch.int32, device=DEVICE)
        buffer[:rows] = topk
        layer = vh.build_mla_layer(config, heads=heads_per_rank, topk_buffer=buffer,
                                   prefix=f"model.layers.{rank}.self_attn.attn")
        layer._q_scale_float, layer._k_scale_float = 0.3, 0.5
        layer.impl.process_weights_after_loading(torch.bfloat16)
        assert (layer.impl.dcp_world_size, layer.impl.dcp_rank) == (dcp, rank) and layer.impl.lse_base_on_e
        metadata = FlashInferMLASparseMetadata(
            num_reqs=rows, max_query_len=1, max_seq_len=4 * width, num_actual_tokens=rows,
            query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=DEVICE),
            slot_mapping=torch.zeros(rows, dtype=torch.int64, device=DEVICE), num_decodes=rows,
            num_decode_tokens=rows, num_prefills=0, block_table=meta.block_table,
            req_id_per_token=meta.req_id_per_token, block_size=rig.BLOCK, topk_tokens=width,
            cp_kv_cache_interleave_size=interleave,
        )
        out, lse = layer.impl.forward_mqa(query, cache, metadata, layer)
        outs.append(out.clone())
        lses.append(lse.clone())
        layers.append(layer)
    group = rig.RankGroup(dcp)
    monkeypatch.setattr(dcp_ops, "get_dcp_group", lambda: group)
    with set_current_vllm_config(config):
        manager = dcp_ops.MLADCPManager(
            config, DEVICE, num_heads=heads_per_rank, query_head_dim=576, output_head_dim=512,
            query_dtype=torch.float8_e4m3fn, output_dtype=torch.bfloat16, padded_num_heads=None,
            is_lse_base_on_e=layers[0].impl.lse_base_on_e, use_pcp=False,
        )
    merged: list[torch.Tensor | None] = [None, None]
    errors: list[BaseException] = []

    def rank_thread(rank: int) -> None:
        try:
            group.bind(rank)
            merged[rank] = manager.combine(outs[rank], lses[rank])
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors.append(e)

    threads = [threading.Thread(target=rank_thread, args=(rank,)) for rank in range(dcp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    full = torch.cat(merged, dim=1).float()  # each rank keeps its heads_per_rank heads of the merge
    kv_rows, stride = flat_kv_row_view(tp_cache, rig.BLOCK)
    slots, tp_counts = convert_topk_reference(topk, tp_meta.req_id_per_token, tp_meta.block_table,
                                              block_size=rig.BLOCK, rows_per_block_stride=stride)
    core = layers[0].impl._step.core
    ref, _ = reference_decode(query, kv_rows, slots, tp_counts, fmt="fp8", softmax_scale=core.softmax_scale,
                              output_scale=core.output_scale)
    _check_merge(full, ref)
    REPORT["dcp2_mladcpmanager"] = {"rel_l2": rel_l2(full, ref), "rows": rows, "heads": heads}
    # negative control: the same ranks' shards merged in the other LSE base (log2 read as ln) must fail the check
    flipped = _lse_weighted_combine(torch.stack(outs), torch.stack(lses),
                                    is_lse_base_on_e=not layers[0].impl.lse_base_on_e)
    with pytest.raises(AssertionError):
        _check_merge(flipped.float(), ref)
    REPORT["dcp2_mladcpmanager"]["flipped_base_caught"] = True


# ---------------------------------------------------------------- CUDA graphs, as vLLM captures this model
# (last in the module: a capture that fails midway leaves the CUDA generator in capture mode for later tests)


def allocations() -> int:
    """The caching allocator's count of allocations so far (a replay that allocates nothing leaves it unchanged)."""
    return torch.cuda.memory_stats()["allocation.all.allocated"]


def _graph_batch(r: rig.LayerRig, n: int, static: rig.Batch | None, per: int = 1):
    """A uniform decode batch of n requests of `per` query tokens each (1 + MTP's draft tokens); with `static`, its
    values copied into static's tensors (the runner's persistent inputs: a graph reads the addresses it was captured
    with)."""
    tokens = n * per
    # contexts up to 3500 tokens, as many as the rig's cache holds for n requests (seen on the H100 2026-12-07: 8
    # requests of up to 3500 outgrew its 256 blocks)
    high = min(3500, (r.num_blocks // n - 1) * rig.BLOCK - per)
    fresh = r.batch([rig.Request(int(c), per) for c in torch.randint(1, high, (n,), generator=r.gen)],
                    empty_rows=(tokens - 1,) if tokens > 2 else ())
    if static is None:
        width = r.num_blocks  # room for any request of the test: the table keeps one shape
        table = torch.zeros((n, width), dtype=torch.int32, device=r.device)
        table[:, : fresh.block_table.shape[1]] = fresh.block_table
        fresh.block_table = table
        return fresh
    static.block_table.zero_()
    static.block_table[:, : fresh.block_table.shape[1]] = fresh.block_table
    for name in ("positions", "hidden", "topk", "slot_mapping", "query_start_loc", "seq_lens", "req_of_token"):
        getattr(static, name).copy_(getattr(fresh, name))
    static.requests = fresh.requests
    return static


def _counting(obj, name: str, counter: list[int]) -> None:
    """Wrap obj.name (a replay method) so each call adds one to counter[0]."""
    inner = getattr(obj, name)

    def counted(*args, **kwargs):
        counter[0] += 1
        return inner(*args, **kwargs)

    setattr(obj, name, counted)


GRAPH_LAYOUTS = [(128, 0), (16, 0), (8, 0), (128, 1)]
# Every wrapper stays alive to the end of the module, as vLLM's model runner keeps its graphs for the engine's life:
# all wrappers capture into vLLM's one global graph pool, and capturing into it again after every graph of it was
# freed trips torch's CachingHostAllocator (`use_count > 0` in create_or_incref_pool; torch 2.11 on the H100,
# 2026-12-07), which then leaves the CUDA generator in capture mode for every later test.
_HELD_GRAPHS: list = []


@pytest.mark.parametrize("heads, spec_tokens", GRAPH_LAYOUTS, ids=["h128", "h16", "h8", "h128-mtp1"])
@pytest.mark.parametrize("wrapper", ["full", "breakable"])
def test_cuda_graph_replay_equals_eager(tmp_path_factory, wrapper, heads, spec_tokens):
    """Uniform decode batches captured at several of vLLM's capture sizes: FULL through vLLM's CUDAGraphWrapper (how
    vLLM runs uniform decode batches: the backend's decode inside the graph) and PIECEWISE through vLLM's
    BreakableCUDAGraphWrapper (VLLM_USE_BREAKABLE_CUDAGRAPH, on for DeepSeek-V3.2: the attention an eager break), at
    128, 16 and 8 heads and with MTP rows (2 query tokens a request). Each size is captured once (the wrapper holds
    one graph a size, with one eager break in the breakable one) and replayed once on new inputs (counted), the
    backend running in the eager break at that replay: equal to an eager step on the same inputs bit for bit, no
    allocation by the backend in the replay (none at all in FULL)."""
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    r = layer_rig(tmp_path_factory, heads, spec_tokens)
    per = 1 + spec_tokens
    capture_sizes = r.config.compilation_config.cudagraph_capture_sizes
    sizes = [s for s in capture_sizes if s % per == 0 and s // per in (1, 2, 4, 8)]
    sizes = sizes[:3] if per > 1 else [s for s in sizes if s in (1, 4, 8)]
    assert sizes, capture_sizes
    mode = CUDAGraphMode.FULL if wrapper == "full" else CUDAGraphMode.PIECEWISE

    def run_layer(positions, hidden):
        return r.layer(positions, hidden)

    graphed = (CUDAGraphWrapper(run_layer, r.config, runtime_mode=mode) if wrapper == "full"
               else BreakableCUDAGraphWrapper(run_layer, r.config, runtime_mode=mode))
    _HELD_GRAPHS.append(graphed)
    r.spying = False
    try:
        for captured, tokens in enumerate(sizes, 1):
            n = tokens // per
            static = _graph_batch(r, n, None, per)
            descriptor = BatchDescriptor(num_tokens=tokens, num_reqs=n, uniform=True)
            r.topk_buffer[:tokens].copy_(static.topk)
            r.forward(static)  # warm-up, as vLLM runs before capture (compiles every kernel of the step)
            with r.forward_context(static, r.metadata(static), mode=mode, descriptor=descriptor):
                graphed(static.positions, static.hidden)  # capture
            replays = [0]
            if wrapper == "full":
                entries = graphed.concrete_cudagraph_entries
                assert len(entries) == captured and entries[descriptor].cudagraph is not None, "no graph captured"
                _counting(entries[descriptor].cudagraph, "replay", replays)
                segments = None
            else:
                entries = graphed.entries
                assert len(entries) == captured and entries[descriptor].capture is not None, "no graph captured"
                capture = entries[descriptor].capture
                assert capture.num_eager_breaks == 1 and capture.num_graphs >= 1, repr(capture)
                segments = (capture.num_graphs, capture.num_eager_breaks)
                _counting(capture, "replay", replays)
            _graph_batch(r, n, static, per)  # new inputs, same addresses
            r.topk_buffer[:tokens].copy_(static.topk)
            metadata = r.metadata(static)
            torch.cuda.synchronize()
            ours: list[int] = []  # the backend's own allocations (breakable: its call runs in an eager segment)
            kernel = r.impl._forward_mqa_kernel

            def counting(*args, **kwargs):
                start = allocations()
                result = kernel(*args, **kwargs)
                ours.append(allocations() - start)
                return result

            r.impl._forward_mqa_kernel = counting
            before = allocations()
            try:
                with r.forward_context(static, metadata, mode=mode, descriptor=descriptor):
                    replayed = graphed(static.positions, static.hidden)
                torch.cuda.synchronize()
            finally:
                r.impl._forward_mqa_kernel = kernel
            allocated = allocations() - before
            replayed = replayed.clone()
            eager = r.forward(static)
            REPORT.setdefault(f"graph_{wrapper}_h{heads}s{spec_tokens}", {})[str(tokens)] = found = {
                "bit_equal": bool(torch.equal(replayed, eager)), "replay_allocations": allocated,
                "backend_allocations": sum(ours), "backend_calls_in_replay": len(ours), "replays": replays[0],
                "graphs_held": len(entries), "segments": segments}
            assert replays[0] == 1, f"{wrapper}: {replays[0]} replays of the {tokens}-token graph, expected 1"
            assert found["bit_equal"], f"{wrapper} graph of {tokens} rows differs from eager"
            assert sum(ours) == 0, f"the backend allocated {sum(ours)} times in a {wrapper} replay of {tokens} rows"
            if wrapper == "full":  # the whole step is one graph: nothing at all may allocate, nothing eager runs
                assert allocated == 0 and not ours, f"FULL replay of {tokens} rows allocated {allocated} times"
            else:  # the attention is the eager break: the backend runs in it at every replay
                assert len(ours) == 1, f"the backend ran {len(ours)} times in the replay's eager break"
    finally:
        r.spying = True


def _check_merge(merged: torch.Tensor, ref: torch.Tensor) -> None:
    """Each rank's latent within the decode bound, bf16-rounded; the merge rounds once more: 4 bf16 ulps of the
    largest output bound the difference."""
    scale = ref.abs().max().item()
    torch.testing.assert_close(merged, ref, atol=4 * 2**-8 * scale, rtol=0)
