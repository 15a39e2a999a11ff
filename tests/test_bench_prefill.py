"""The bench's prefill section (vllm_kimi_dsa.bench.prefill) on a CPU: the case builder's contracts, the floor's
arithmetic, and the section end to end on a tiny chunk in Triton's interpreter, with and without a peer (a float32
stand-in of flash_mla_sparse_fwd that checks the arguments vLLM's `_bf16_flash_mla_kernel` passes).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from vllm_kimi_dsa.bench import plot
from vllm_kimi_dsa.bench import prefill as bp
from vllm_kimi_dsa.bench.peers import flashmla_prefill as prefill_peer
from vllm_kimi_dsa.formats import HEAD_DIM, LATENT_DIM

ROOT = Path(__file__).resolve().parents[1]
HARNESS_SOURCES = ROOT / "benchmarks" / "peers" / "flashmla_prefill"  # prepare.sh and the sources it builds

CEIL = {"copy_GBps": 3000.0, "bf16_TFLOPs": 800.0, "fp8_TFLOPs": 1600.0}
TINY = dict(width=128, prior=100, max_rows=4)  # prior < K: the first tokens see fewer than K and end in -1


def test_case_contract() -> None:
    case = bp.PrefillCase(4, 1024, 128)
    assert (case.rows, case.seq_len, case.pieces, case.name) == (4096, 1024 + 2048, 8, "4x1024")
    assert bp.PrefillCase(1, 4097, 16).pieces == 9
    for bad in (dict(heads=0), dict(heads=129), dict(width=100), dict(width=0), dict(tokens=0), dict(prior=-1),
                dict(max_rows=0)):
        args = {"requests": 1, "tokens": 8, "heads": 16, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            bp.PrefillCase(**args)


def test_inputs_are_what_vllm_hands_the_backend() -> None:
    case = bp.PrefillCase(2, 40, 16, **TINY)
    inp = bp.make_prefill_inputs(case, "cpu", seed=3)
    rows, k = case.rows, case.width
    assert inp.query.shape == (rows, 16, HEAD_DIM) and inp.query.dtype == torch.float8_e4m3fn
    assert inp.cache.dtype == torch.float8_e4m3fn and inp.cache.shape[1:] == (case.block_size, HEAD_DIM)
    assert inp.slots.shape == (rows, k) and inp.slots.dtype == torch.int32 and inp.slots.is_contiguous()
    assert inp.counts.dtype == torch.int32 and inp.req_id.tolist() == [0] * 40 + [1] * 40
    t = torch.arange(rows) % case.tokens
    visible = case.prior + t + 1
    assert inp.counts.tolist() == torch.clamp(visible, max=k).tolist()  # causal: min(K, tokens it can see)
    pos = torch.arange(k)
    valid = pos < inp.counts.unsqueeze(1)
    assert bool((inp.slots[valid] >= 0).all()) and bool((inp.slots[~valid] == -1).all())  # a prefix, then -1
    assert bool((inp.topk[~valid] == -1).all())
    assert bool((inp.topk[valid] < visible.repeat_interleave(valid.sum(1))).all())  # causal
    for i in range(rows):  # distinct ids a row
        ids = inp.topk[i, : inp.counts[i]]
        assert ids.unique().numel() == ids.numel()
    # each slot is its id's row in the request's blocks
    ids = inp.topk.clamp(min=0).long()
    blocks = inp.block_table[inp.req_id.long()].long().gather(1, ids // case.block_size)
    want = blocks * case.block_size + ids % case.block_size
    assert torch.equal(inp.slots[valid].long(), want[valid])
    # the peer's view: the context gathered in request order, the ids as offsets into it, the same rows
    ctx = bp.context_rows(inp)
    widx = bp.workspace_indices(inp)
    assert ctx.numel() == case.requests * case.seq_len and widx.dtype == torch.int32
    assert torch.equal(ctx[widx[valid].long()], inp.slots[valid].long())
    assert bool((widx[~valid] == -1).all())
    ws = torch.empty((ctx.numel(), HEAD_DIM), dtype=torch.bfloat16)
    bp.gather_workspace(inp.kv_rows, ctx, ws)
    assert torch.equal(ws.float(), inp.kv_rows[ctx].float() * bp.K_SCALE)  # exact in BF16


def test_floor_arithmetic() -> None:
    case = bp.PrefillCase(1, 4096, 128)
    fl = bp.prefill_floor(case, CEIL, q_bytes=1, kv_row_bytes=576, compute="bf16")
    flops = 2 * 4096 * 128 * 2048 * 1088
    assert fl["flops"] == flops
    io = 4096 * 128 * 576 * 1 + 4096 * 128 * 512 * 2
    assert fl["bytes"] == io + 6144 * 576 and fl["gathered_bytes"] == 4096 * 2048 * 576
    assert fl["floor_flops_us"] == pytest.approx(flops / 800e12 * 1e6, abs=1e-3)
    assert fl["floor_bw_us"] == pytest.approx((io + 6144 * 576) / 3000e9 * 1e6, abs=1e-3)
    assert fl["floor_us"] == fl["floor_flops_us"] and fl["floor_bound"] == "compute"
    qk = 2 * 4096 * 128 * 2048 * 576
    mixed = bp.prefill_floor(case, CEIL, q_bytes=1, kv_row_bytes=576, compute="fp8qk")
    assert mixed["floor_flops_us"] == pytest.approx((qk / 1600e12 + (flops - qk) / 800e12) * 1e6, abs=1e-3)
    fp8 = bp.prefill_floor(case, {**CEIL, "fp8_TFLOPs": None}, q_bytes=1, kv_row_bytes=576, compute="fp8")
    assert fp8["floor_flops_us"] == fl["floor_flops_us"]  # no FP8 rate measured: the BF16 one
    slow_copy = bp.prefill_floor(bp.PrefillCase(1, 64, 1), {**CEIL, "copy_GBps": 1.0}, q_bytes=2, kv_row_bytes=1152,
                                 compute="bf16")
    assert slow_copy["floor_bound"] == "bandwidth" and slow_copy["floor_us"] == slow_copy["floor_bw_us"]
    timed = bp.with_time(fl, 2 * fl["floor_us"])
    assert timed["of_floor"] == pytest.approx(0.5, abs=1e-3)
    assert timed["tflops"] == pytest.approx(flops / (2 * fl["floor_us"] * 1e-6) / 1e12, rel=1e-3)
    with pytest.raises(ValueError, match="compute"):
        bp.prefill_floor(case, CEIL, q_bytes=1, kv_row_bytes=576, compute="tf32")


def test_floor_of_several_requests_reads_every_requests_context() -> None:
    """3 requests of 5 tokens, each over its own 100 tokens of context: the floor's bytes count each request's 105
    rows once (3 x 105), not one request's, while the flops count every query token."""
    case = bp.PrefillCase(3, 5, 16, **TINY)
    fl = bp.prefill_floor(case, CEIL, q_bytes=1, kv_row_bytes=576, compute="bf16")
    io = 15 * 16 * HEAD_DIM * 1 + 15 * 16 * LATENT_DIM * 2
    assert fl["bytes"] == io + 3 * 105 * 576
    assert fl["floor_bw_us"] == pytest.approx((io + 3 * 105 * 576) / 3000e9 * 1e6, abs=1e-3)
    assert fl["flops"] == 2.0 * 15 * 16 * 128 * (HEAD_DIM + LATENT_DIM)
    one = bp.prefill_floor(bp.PrefillCase(1, 5, 16, **TINY), CEIL, q_bytes=1, kv_row_bytes=576, compute="bf16")
    assert fl["bytes"] - 3 * (one["bytes"] - 5 * 16 * (HEAD_DIM + 2 * LATENT_DIM)) == io  # three contexts, not one


def test_sample_rows_cover_every_piece() -> None:
    rows = bp.sample_rows(4096, 512, n=8)
    for start in range(0, 4096, 512):
        assert start in rows.tolist() and start + 511 in rows.tolist()
    assert bp.sample_rows(3, 512, n=48).tolist() == [0, 1, 2]


def test_padded_heads_as_vllm() -> None:
    peer = prefill_peer
    assert [peer.padded_heads(h) for h in (1, 16, 64, 65, 96, 128)] == [64, 64, 64, 128, 128, 128]
    with pytest.raises(ValueError, match="heads"):
        peer.padded_heads(129)


def fake_sparse_fwd(calls: list[dict]):
    """flash_mla_sparse_fwd in float32, checking the contract FlashMLA's API checks (and vLLM's padding)."""

    def fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
        s_q, h_q, d = q.shape
        assert q.dtype == kv.dtype == torch.bfloat16 and d == HEAD_DIM and d_v == LATENT_DIM
        assert h_q in (64, 128), "the SM90 kernel takes 64 or 128 heads; vLLM pads"
        assert kv.dim() == 3 and kv.shape[1:] == (1, HEAD_DIM)
        assert indices.shape[:2] == (s_q, 1) and indices.dtype == torch.int32
        assert attn_sink is None and topk_length.shape == (s_q,) and topk_length.dtype == torch.int32
        calls.append({"h_q": h_q, "s_q": s_q})
        idx = indices[:, 0].long()
        live = (torch.arange(idx.shape[1]) < topk_length.unsqueeze(1)) & (idx >= 0)
        rows = kv[:, 0].float()[idx.clamp(min=0)]  # (s_q, K, 576)
        logits = torch.einsum("qhd,qkd->qhk", q.float(), rows) * sm_scale
        logits = logits.masked_fill(~live.unsqueeze(1), float("-inf"))
        lse = torch.logsumexp(logits, -1)
        out = torch.einsum("qhk,qkd->qhd", torch.exp(logits - lse.unsqueeze(-1)), rows[..., :d_v])
        return out.to(torch.bfloat16), logits.amax(-1), lse

    return fwd


def test_section_end_to_end_in_the_interpreter() -> None:
    """The section as the bench runs it on a tiny chunk (2 requests x 5 tokens, pieces of 4 rows, -1 tails): our
    LayerStep's latent, then (after the build) the peer path's on the same inputs remade from their seed (padded
    query, workspace offsets, topk_length), both match the float32 reference."""
    calls: list[dict] = []
    logs: list[str] = []

    class Build:  # what PeerBuild.wait gives once the child's checks passed
        def wait(self):
            return {"fake/bf16": (fake_sparse_fwd(calls), [])}, {"rc": 0, "wall_s": 1.0, "records": [], "tail": ""}

    section = bp.prefill_suite("cpu", CEIL, Build(), cases=((2, 5),), heads=(16,), reps=1, warmup=0,
                               kernels=dict.fromkeys(range(1, 5), "triton"), log=logs.append, **TINY)
    assert section["failures"] == [], section["failures"]
    assert section["info"]["peer_build"]["rc"] == 0
    ours, peer = section["results"]
    assert ours["kernel"] == bp.OURS and ours["pieces"] == 3 and ours["rows"] == 10 and ours["heads"] == 16
    assert ours["impl"].startswith("triton") and ours["piece_copy_floor_us"] > 0
    assert peer["kernel"] == "fake/bf16" and peer["padded_heads"] == 64 and peer["vllm_runs_it"] is False
    assert calls and all(c == {"h_q": 64, "s_q": 10} for c in calls)
    for rec in (ours, peer):
        assert rec["us"] > 0 and rec["floor_us"] > 0 and math.isfinite(rec["of_floor"])
    by_kernel = {a["kernel"]: a for a in section["accuracy"]}
    assert by_kernel[bp.OURS]["nonfinite"] == 0 and by_kernel[bp.OURS]["rel_l2"] < 1e-2
    assert by_kernel["fake/bf16"]["nonfinite"] == 0 and by_kernel["fake/bf16"]["rel_l2"] < 1e-2
    # the peer's gather floor: each of the 2 x 105 context rows read as a 656 B fp8_ds_mla row and written as a BF16
    # one (576 x 2 B), at the copy rate
    assert peer["gather_floor_us"] == pytest.approx(2 * 105 * (656 + 2 * HEAD_DIM) / 3000e9 * 1e6, abs=1e-3)
    # over the peer's kernel plus the gather's floor: the gather counted once (its floor), not its time and its floor
    kernel_plus_floor = peer["kernel_us"] + peer["gather_floor_us"]
    assert peer["kernel_plus_gather_floor_us"] == pytest.approx(kernel_plus_floor, abs=1e-3)
    assert section["ratios"] == [{"case": "2x5", "heads": 16, "peer": "fake/bf16",
                                  "ours_over_peer": pytest.approx(ours["us"] / peer["us"], abs=1e-3),
                                  "ours_over_peer_with_gather": pytest.approx(ours["us"] / kernel_plus_floor,
                                                                              rel=2e-3, abs=1e-3),
                                  "vllm_runs_it": False}]
    assert peer["kernel_us"] > 0 and peer["gather_us"] > 0  # timed with the gather (us) and without (kernel_us)
    table = bp.prefill_table(section)
    assert "| layerstep/fp8 |" in table and "2x5 H=16" in table and "ours / fake/bf16" in table
    assert len(logs) == 3  # ours, the build's report, the peer


def test_section_without_the_peer_and_a_failure_recorded() -> None:
    """No peer: our rows only. A case the step cannot take (heads outside 1..128) is a recorded failure, not a crash."""
    section = bp.run_prefill_section("cpu", CEIL, cases=((1, 3),), heads=(16, 200), reps=1, warmup=0,
                                     kernels=dict.fromkeys(range(1, 5), "triton"), log=lambda *a: None, **TINY)
    assert [r["kernel"] for r in section["results"]] == [bp.OURS] and section["ratios"] == []
    assert len(section["failures"]) == 1 and section["failures"][0]["heads"] == 200
    assert "ValueError" in section["failures"][0]["error"]


@pytest.mark.skipif(not (ROOT / ".carry" / "flashmla" / "csrc" / "api").is_dir(),
                    reason="FlashMLA's sources are unpacked by /work/shared/device/flashmla-sm90/prepare.sh .carry")
def test_make_api_reduces_flashmla_to_the_sm90_prefill() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("fmla_make_api", HARNESS_SOURCES / "make_api.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    root = ROOT / ".carry" / "flashmla"
    src = mod.reduce_api((root / "csrc" / "api" / "sparse_fwd.h").read_text())
    assert "sm100::" not in src and "Sm100" not in src and "sm100/" not in src  # no SM100 kernel, class or header
    assert "run_fwd_phase1_kernel<576, HAVE_TOPK_LENGTH>" in src and '"sparse_prefill_fwd"' in src


def test_bench_options_run_the_prefill_section() -> None:
    """`python -m vllm_kimi_dsa bench --sections prefill` is the prefill section alone; --flashmla-prefill names the
    peer's harness; the default suite lists it among its sections."""
    from vllm_kimi_dsa.bench import suite as bench

    ap = bench.build_parser()
    args = ap.parse_args(["--out", "x", "--sections", "prefill", "--flashmla-prefill", "h", "--peers", "flashmla"])
    assert args.sections == ("prefill",) and args.flashmla_prefill == "h" and args.peers == ("flashmla",)
    assert "prefill" in bench.SECTIONS and ap.parse_args(["--out", "x"]).flashmla_prefill is None


def test_harness_discovery(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer's harness: an explicit folder, else $FLASHMLA_PREFILL_DIR; incomplete ones say what is missing."""
    peer = prefill_peer
    monkeypatch.delenv(peer.ENV_SO, raising=False)
    monkeypatch.setattr(peer, "CARRY_DIR", tmp_path / "nowhere")
    ok, why = peer.available(tmp_path)
    assert not ok and "prepare.sh" in why
    harness = tmp_path / "flashmla_prefill"
    (harness / "objs").mkdir(parents=True)
    (harness / "api_prefill.cpp").write_text("// generated")
    ok, why = peer.available(harness)
    assert not ok and "phase1_k576_topklen.o" in why and "flashmla" in why and "build_ext.py" in why
    for name in ("phase1_k576_topklen.o", "phase1_k576.o"):
        (harness / "objs" / name).write_bytes(b"\0")
    (harness / "build_ext.py").write_text("")  # prepare.sh copies it beside the objects
    (tmp_path / "flashmla" / "csrc").mkdir(parents=True)
    assert peer.available(harness) == (True, str(harness.resolve()))
    monkeypatch.setenv(peer.ENV_DIR, str(harness))
    assert peer.harness_dir() == harness.resolve()
    build, note = bp.start_peer_build(str(tmp_path / "nowhere"), (16,))  # $FLASHMLA_PREFILL_DIR still finds it
    assert build is not None and note == f"building from {harness.resolve()}"
    build.proc.kill()
    build.proc.wait()
    build.log.close()
    os.unlink(build.log.name)


@pytest.mark.parametrize("kernel_us", [3200.0, None], ids=["timed", "older-record"])
def test_plot_renders_the_prefill_section(kernel_us) -> None:
    """bench.plot's README table carries the prefill table when the JSON has the section. The peer's call (3500 µs)
    includes its gather (300 µs); over its kernel plus the gather's floor (3200 + 3.6 µs) ours is 1.25, where the
    gather counted twice (3500 + 3.6) would give 1.14. A record without kernel_us (before it was timed apart) gives
    the same: its call less its gather."""
    peer = {"kernel": "flashmla/bf16", "case": "1x4096", "heads": 128, "us": 3500.0, "tflops": 669.0,
            "of_floor": 0.87, "gather_us": 300.0, "gather_floor_us": 3.6}
    if kernel_us is not None:
        peer.update(kernel_us=kernel_us, kernel_plus_gather_floor_us=kernel_us + 3.6)
    res = [{"kernel": bp.OURS, "case": "1x4096", "heads": 128, "us": 4000.0, "tflops": 585.0, "of_floor": 0.6}, peer]
    section = {"results": res, "ratios": bp.ratios(res),
               "accuracy": [{"kernel": bp.OURS, "case": "1x4096", "heads": 128, "rel_l2": 2e-3, "nonfinite": 0}]}
    md = plot.markdown({"info": {}, "results": [], "prefill": section})
    assert "**Prefill**" in md and "| layerstep/fp8 | 4000.0 (585; 0.60) |" in md
    assert "| ours / flashmla/bf16 (time, its gather included; over its kernel + the gather's floor) | 1.14 (1.25) |" \
        in md


def test_below_32_heads_vllm_runs_the_decode_kernel_over_the_chunk() -> None:
    """With vLLM's pack the section also runs FlashMLA's FP8 decode kernel over the whole chunk at H < 32, as
    vLLM's mixed batch does ((1, T, 64) on the fp8_ds_mla cache, no gather): vllm_runs_it there, while the BF16
    prefill kernel's row says vLLM does not run it; both against the float32 reference (a stand-in of vLLM's ops)."""
    from test_peer_flashmla import _StandInOps

    calls: list[dict] = []
    ops = _StandInOps()

    class Build:
        def wait(self):
            return ({"fake/bf16": (fake_sparse_fwd(calls), []), bp.DECODE_KIND: (ops, [])},
                    {"rc": 0, "wall_s": 1.0, "records": [], "tail": ""})

    section = bp.prefill_suite("cpu", CEIL, Build(), cases=((2, 5),), heads=(16,), reps=1, warmup=0,
                               kernels=dict.fromkeys(range(1, 5), "triton"), log=lambda *a: None, **TINY)
    assert section["failures"] == [], section["failures"]
    by = {r["kernel"]: r for r in section["results"]}
    assert by[bp.DECODE_KIND]["vllm_runs_it"] is True and by["fake/bf16"]["vllm_runs_it"] is False
    assert by[bp.DECODE_KIND]["padded_heads"] == 64 and by[bp.DECODE_KIND]["gather_us"] == 0.0
    assert all(c["q"].shape == (1, 10, 64, 576) for c in ops.calls)
    acc = {a["kernel"]: a for a in section["accuracy"]}
    assert acc[bp.DECODE_KIND]["nonfinite"] == 0 and acc[bp.DECODE_KIND]["rel_l2"] < 3e-2
    table = bp.prefill_table(section)
    assert f"| {bp.DECODE_KIND}: vLLM runs it here | yes |" in table and "| fake/bf16: vLLM runs it here | no |" in table
