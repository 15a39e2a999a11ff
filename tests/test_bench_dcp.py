"""benchmarks/bench_dcp.py on a CPU: the data split, and the whole script on two gloo ranks (Triton's interpreter).

The script is meant for several GPUs (torchrun, NCCL); here two processes with torchrun's variables run its main
at tiny shapes (H = 16, K = 128, rows 3 and 5, interleave 1 and 64, device cpu, backend gloo) and the JSON rank 0
writes must say that every check passed: the merge of the ranks' decodes equals the single-rank decode and the
float32 reference within the script's bounds, count-0 rows (row 0 on every rank, row 1 on rank 1) give 0, and the
bound rejects broken merges. About 15 s on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vllm_kimi_dsa.convert import convert_topk_reference
from vllm_kimi_dsa.formats import flat_kv_row_view

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_dcp.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_dcp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- the split


@pytest.mark.parametrize("dcp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("interleave", [1, 64])
def test_owner_and_local_cover_every_token_once(dcp, interleave):
    t = torch.arange(5 * dcp * interleave + 37)
    owner, local = bench.owner_and_local(t, dcp, interleave)
    assert bool(((owner >= 0) & (owner < dcp)).all())
    for r in range(dcp):
        loc = local[owner == r]
        assert torch.equal(loc, torch.arange(loc.numel())), "a rank's local indices must be dense and increasing"
    # the inverse: (owner, local) -> t is one to one, so every token is held exactly once
    pairs = set(zip(owner.tolist(), local.tolist()))
    assert len(pairs) == t.numel()


@pytest.mark.parametrize("dcp", [2, 4])
def test_rank_caches_hold_every_token_exactly_once(dcp):
    """Each rank's cache holds its tokens' bytes at their local index (read back through its block table); over
    the ranks every token of every request is held once; each rank's converted ids read the bytes of exactly the
    ids it owns, so the ranks' selections together are the single-rank selection; row 0 is count 0 everywhere,
    row 1 on every rank but 0."""
    interleaves = (1, 64)
    data = bench.make_global(3, 16, 128, "fp8", dcp, interleaves, seed=5)
    reqs, context = data.tokens.shape[0], data.context
    assert context > 2 * dcp * max(interleaves) and context % 64  # partial last block and group
    cpu = torch.device("cpu")
    tp = bench.rank_cache(data, "fp8", 1, 0, 1, 5, cpu)
    tp_rows, tp_stride = flat_kv_row_view(tp.cache, bench.BLOCK)
    req_ids = torch.arange(reqs, dtype=torch.int32)
    tp_slots, tp_counts = convert_topk_reference(data.topk, req_ids, tp.block_table, block_size=bench.BLOCK,
                                                 rows_per_block_stride=tp_stride)
    assert int(tp_counts[0]) == 0 and int(tp_counts[1]) > 0
    for interleave in interleaves:
        owner, local = bench.owner_and_local(torch.arange(context), dcp, interleave)
        held = torch.zeros((reqs, context), dtype=torch.int32)
        total = torch.zeros(reqs, dtype=torch.int32)
        for rank in range(dcp):
            rc = bench.rank_cache(data, "fp8", dcp, rank, interleave, 5, cpu)
            rows, stride = flat_kv_row_view(rc.cache, bench.BLOCK)
            mine = (owner == rank).nonzero().flatten()
            assert rc.tokens_per_req == mine.numel()
            for req in range(reqs):
                loc = local[mine]
                flat = rc.block_table[req].long()[loc // bench.BLOCK] * stride + loc % bench.BLOCK
                assert torch.equal(rows[flat].view(torch.uint8), data.tokens[req, mine].view(torch.uint8))
                held[req, mine] += 1
            slots, counts = convert_topk_reference(
                data.topk, req_ids, rc.block_table, block_size=bench.BLOCK, rows_per_block_stride=stride,
                dcp_size=dcp, dcp_rank=rank, interleave=interleave)
            total += counts
            for req in range(reqs):
                ids = data.topk[req][data.topk[req] >= 0].long()
                want = ids[owner[ids] == rank]  # top-k order kept
                assert int(counts[req]) == want.numel()
                got = rows[slots[req, : int(counts[req])].long()].view(torch.uint8)
                assert torch.equal(got, data.tokens[req, want].view(torch.uint8))
            assert int(counts[0]) == 0
            if rank > 0:
                assert int(counts[1]) == 0, "row 1's ids must all live on rank 0"
        assert bool((held == 1).all()), "every token must be held by exactly one rank"
        assert torch.equal(total, tp_counts)
    # the single-rank cache holds the same bytes at the top-k ids
    for req in range(reqs):
        got = tp_rows[tp_slots[req, : int(tp_counts[req])].long()].view(torch.uint8)
        ids = data.topk[req][data.topk[req] >= 0].long()
        assert torch.equal(got, data.tokens[req, ids].view(torch.uint8))


def test_global_data_is_the_same_for_the_same_seed():
    a = bench.make_global(3, 16, 128, "fp8", 2, (1, 64), seed=9)
    b = bench.make_global(3, 16, 128, "fp8", 2, (1, 64), seed=9)
    c = bench.make_global(3, 16, 128, "fp8", 2, (1, 64), seed=10)
    assert a.digest() == b.digest() != c.digest()


# ---------------------------------------------------------------- the script on two gloo ranks


# The script's two ranks take about 19 s of CPU together here and wait for each other at every case, so on a loaded
# 2-core machine their wall time grows with the load (19-55 s measured beside other test runs). The deadline only ends
# a hang: it is past the script's own process-group timeout (5 minutes), so a stuck collective ends as the script's
# error, with its log, not as this test's guess.
DEADLINE_S = 900.0
PORT_TAKEN = ("eaddrinuse", "address already in use")  # MASTER_PORT taken between _free_port and rank 0's store


def _launch(world: int, out: Path, extra: list[str], port: int) -> list[subprocess.CompletedProcess]:
    """The script on `world` processes (torchrun's variables when world > 1), each one's output in a log file (no
    pipe to fill); when a rank fails the others are stopped at once (they would wait for it in a collective)."""
    env = dict(os.environ)
    env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--backend", "gloo", "--heads", "16", "--width", "128",
           "--out", str(out), *extra]
    if world > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world))
    logs = [out / f"rank{rank}.log" for rank in range(world)]
    procs = []
    try:
        for rank, log in enumerate(logs):
            e = dict(env)
            if world > 1:
                e.update(RANK=str(rank), LOCAL_RANK=str(rank))
            with log.open("w") as f:
                procs.append(subprocess.Popen(cmd, env=e, stdout=f, stderr=subprocess.STDOUT, text=True))
        end = time.monotonic() + DEADLINE_S
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > end:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    note = "" if all(p.returncode == 0 for p in procs) else f"\n[stopped: a rank failed, or {DEADLINE_S:.0f} s passed]"
    return [subprocess.CompletedProcess(cmd, p.returncode, log.read_text() + note, "") for p, log in zip(procs, logs)]


def _run_ranks(world: int, out: Path, extra: list[str], attempts: int = 3) -> list[subprocess.CompletedProcess]:
    """_launch, again on a new port when another process took the one _free_port gave (up to `attempts` times)."""
    for _ in range(attempts):
        runs = _launch(world, out, extra, _free_port())
        if world == 1 or not any(taken in r.stdout.lower() for r in runs for taken in PORT_TAKEN):
            break
    return runs


def test_two_gloo_ranks_merge_equals_one_rank(tmp_path):
    runs = _run_ranks(2, tmp_path, ["--rows", "3,5", "--interleave", "1,64"])
    logs = "\n".join(f"--- rank {i} rc={r.returncode}\n{r.stdout}" for i, r in enumerate(runs))
    assert all(r.returncode == 0 for r in runs), logs
    report = json.loads((tmp_path / "bench_dcp.json").read_text())
    meta = report["meta"]
    assert meta["D"] == 2 and meta["gpus"] == ["cpu", "cpu"] and meta["backend"] == "gloo"
    assert meta["H"] == 16 and meta["K"] == 128 and meta["NCCL_NVLS_ENABLE"] == "0"
    assert report["ok"] is True, logs
    got = {(x["interleave"], x["rows"]) for x in report["results"]}
    assert got == {(1, 3), (1, 5), (64, 3), (64, 5)}
    for x in report["results"]:
        where = f"I={x['interleave']} rows={x['rows']}"
        assert x["ok"] is True and all(x["checks"].values()), (where, x["checks"])
        for name in ("merged_matches_tp", "merged_lse_matches_tp", "merged_count0_rows_zero",
                     "merged_matches_reference", "tp_matches_reference", "poisoned_count0_dropped",
                     "ranks_count0_rows_zero_and_live_rows_finite", "row1_rank0_only",
                     "same_global_data_on_every_rank", "bound_rejects_broken_merges"):
            assert x["checks"][name] is True, (where, name)
        assert 0 <= x["err_over_bound"] <= 1 and x["max_err"] <= x["bound"] or x["max_err"] == 0
        assert x["merged_vs_reference"]["err_over_bound"] <= 1
        assert all(x["broken_merges_rejected"].values()), x["broken_merges_rejected"]
        # row 0 is count 0 on both ranks, row 1 also on rank 1; every valid id is counted on one rank
        assert x["count0_rows_per_rank"][0] >= 1 and x["count0_rows_per_rank"][1] >= 2
        assert sum(x["tokens_per_rank"]) == x["tp_tokens"] and min(x["tokens_per_rank"]) > 0
        assert x["decode_us_per_rank"] == [None, None] and x["merge_us"] is None  # timing is CUDA only
    assert "bench_dcp.json" in runs[0].stdout and "ok" in runs[0].stdout


def test_single_process_without_torchrun(tmp_path):
    """No torchrun variables: one process, D = 1 (the merge of one rank is that rank's result)."""
    (run,) = _run_ranks(1, tmp_path, ["--rows", "3", "--interleave", "64"])
    assert run.returncode == 0, run.stdout
    report = json.loads((tmp_path / "bench_dcp.json").read_text())
    assert report["ok"] is True and report["meta"]["D"] == 1
    (x,) = report["results"]
    assert x["max_err"] == 0.0 and x["broken_merges_rejected"] is None
