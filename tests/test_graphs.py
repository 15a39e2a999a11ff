"""CUDA graphs: convert + decode of several layers captured per batch size, replayed with inputs changed in place.

Every replay must equal the eager run bit for bit, allocate nothing, and keep layers on the shared buffers apart.
The variants' rows have ragged counts (a row cut at a random length, one full, one of a single id, the count-0 row),
changed between replays; the Hopper kernel runs its static plans and (VLLM_KIMI_DSA_SCHEDULE=counts) its scheduled
launches, whose planner reads the new counts at every replay. GPU only (a CPU cannot capture); K3.1 shapes (H=128,
K=2048), both cache formats, about 10 s a schedule on an H200.
"""

from __future__ import annotations

import gc

import pytest
import torch

from vllm_kimi_dsa import envs
from vllm_kimi_dsa.selection import fi_kernels, kernel_for
from vllm_kimi_dsa.formats import LATENT_DIM
from vllm_kimi_dsa.synthetic import StandInImpl, StandInLayer, make_step
from vllm_kimi_dsa.vllm_glue import KimiDSACores

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")

HEADS, WIDTH = 128, 2048
BATCH_SIZES = (1, 2, 5, 16, 32)  # odd and even, one (5) a prims_ts capacity would pad
LAYERS = 3
VARIANTS = 4  # distinct input sets cycled through the replays
REPLAYS = 1000


def _allocations() -> int:
    return torch.cuda.memory_stats()["allocation.all.allocated"]


class _Inputs:
    """Static inputs of every layer (what vLLM's graph reads), and VARIANTS sets to copy into them."""

    def __init__(self, fmt: str, rows: int, seed: int) -> None:
        dev = torch.device("cuda")
        g = torch.Generator(device=dev).manual_seed(seed)
        empty = 1 if rows > 1 else 0  # a count-0 row, except where it would be the whole batch
        self.steps = [make_step(rows, HEADS, WIDTH, fmt, device=dev, empty_rows=empty, seed=seed + i) for i in range(LAYERS)]
        # one block table and metadata for all layers (vLLM shares them); the caches differ per layer
        self.metadata = self.steps[0].metadata
        self.query = [s.query.clone() for s in self.steps]
        self.topk = self.steps[0].topk.clone()  # one indexer buffer, as deepseek_v2's topk_indices_buffer
        self.cache = [s.cache for s in self.steps]  # the layers' caches, changed in place below
        self.variant_query, self.variant_topk, self.variant_cache = [], [], []
        for v in range(VARIANTS):
            q = [(torch.randn(s.query.shape, device=dev, generator=g) * 4).to(torch.float8_e4m3fn) for s in self.steps]
            t = torch.roll(self.steps[0].topk, shifts=37 * v, dims=1).clone()
            t[torch.rand(t.shape, device=dev, generator=g) < 0.05 * v] = -1
            if v:  # ragged: each row cut at its own length (row `empty` keeps all, the next one id)
                cut = torch.randint(1, WIDTH + 1, (rows, 1), device=dev, generator=g)
                cut[empty:empty + 1] = WIDTH
                cut[empty + 1:empty + 2] = 1
                t[torch.arange(WIDTH, device=dev) >= cut] = -1
            t[:empty] = -1  # the count-0 row stays in every variant
            # a block-rotated cache: other bytes, still valid rows of the format
            # roll the bytes: torch.roll has no float8 CUDA kernel
            c = [torch.roll(s.cache.view(torch.uint8), shifts=v, dims=0).view(s.cache.dtype) for s in self.steps]
            self.variant_query.append(q)
            self.variant_topk.append(t)
            self.variant_cache.append(c)

    def load(self, v: int) -> None:
        """Copy variant v into the static inputs, in place (no allocation)."""
        for i in range(LAYERS):
            self.query[i].copy_(self.variant_query[v][i])
            self.cache[i].copy_(self.variant_cache[v][i])
        self.topk.copy_(self.variant_topk[v])


def _forward_all(cores: KimiDSACores, inputs: _Inputs, results: list[torch.Tensor], lses: list[torch.Tensor]) -> None:
    """All layers in order, each result copied out of the shared buffers before the next layer overwrites them."""
    for i in range(LAYERS):
        out, lse = cores.forward(i, inputs.query[i], inputs.cache[i], inputs.topk, inputs.metadata)
        results[i].copy_(out)
        lses[i].copy_(lse)


def _replay_all(graph, cores, inputs, results, lses, eager, eager_lse, mismatches) -> int:
    """REPLAYS replays on rotating variants; returns the allocations (and memory_allocated changes) they made and
    appends (replay, variant, layer) to `mismatches` where a replay differs from eager."""
    allocated = 0
    for n in range(REPLAYS):
        v = (n * 3 + 1) % VARIANTS  # not the captured variant first, and no fixed pairing with n
        for r in results:
            r.fill_(float("nan"))  # an unwritten result shows
        cores.buffers.latent.fill_(float("nan"))
        before, mem = _allocations(), torch.cuda.memory_allocated()
        inputs.load(v)
        graph.replay()
        allocated += _allocations() - before + (torch.cuda.memory_allocated() != mem)
        for i in range(LAYERS):
            if not (torch.equal(results[i], eager[v][i]) and torch.equal(lses[i], eager_lse[v][i])):
                mismatches.append((n, v, i))
    return allocated


@pytest.mark.parametrize("schedule", ["static", "counts"])
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4_ds_mla"])
def test_graph_replays_equal_eager_without_allocation(fmt, schedule, monkeypatch):
    monkeypatch.setenv(envs.SCHEDULE, schedule)
    dev = torch.device("cuda")
    available = fi_kernels(fmt, device=dev)
    table = {r: kernel_for(r, 1, available, HEADS) for r in BATCH_SIZES}
    pairs = [(StandInImpl(kv_cache_dtype=fmt), StandInLayer(_q_scale_float=0.05 + 0.01 * i, _k_scale_float=0.02 + 0.005 * i))
             for i in range(LAYERS)]
    cores = KimiDSACores(pairs, heads=HEADS, batch_sizes=BATCH_SIZES, width=WIDTH, kernels=table,
                         return_lse=True, lse_base2=False, device=dev)
    for rows in BATCH_SIZES:
        inputs = _Inputs(fmt, rows, seed=rows)
        results = [torch.empty((rows, HEADS, LATENT_DIM), dtype=torch.bfloat16, device=dev) for _ in range(LAYERS)]
        lses = [torch.empty((rows, HEADS), dtype=torch.float32, device=dev) for _ in range(LAYERS)]

        # Eager answers per variant; each layer alone, in reverse order, so no state can carry across layers.
        eager, eager_lse = [], []
        for v in range(VARIANTS):
            inputs.load(v)
            outs, ls = [None] * LAYERS, [None] * LAYERS
            for i in reversed(range(LAYERS)):
                out, lse = cores.forward(i, inputs.query[i], inputs.cache[i], inputs.topk, inputs.metadata)
                outs[i], ls[i] = out.clone(), lse.clone()
            eager.append(outs)
            eager_lse.append(ls)
        for v in range(VARIANTS):  # the layers (scales, caches) and the variants really differ
            info = [(float(eager[v][i].float().abs().max()), eager_lse[v][i][:, :3].tolist()) for i in range(LAYERS)]
            assert not torch.equal(eager[v][0], eager[v][1]), f"rows={rows} v={v}: layers 0, 1 equal; {info}"
            assert not torch.equal(eager[v][0], eager[(v + 1) % VARIANTS][0]), f"rows={rows} v={v}: variants equal; {info}"

        # Warm up on a side stream (Triton compiles, lazy inits), then capture all layers in one graph.
        inputs.load(0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _forward_all(cores, inputs, results, lses)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _forward_all(cores, inputs, results, lses)
        torch.cuda.synchronize()

        # Python's cycle collector, run at a random point of the loop, can free a CUDA tensor of an earlier test and
        # move memory_allocated: collect first and keep it off while measuring, so only this core's own
        # allocations count (an H200 run of 2026-12-03 counted 1 event in the 1000 replays at rows = 1 once; that cause is
        # presumed, not proven: the same test passed on every other run).
        mismatches: list[tuple[int, int, int]] = []
        gc.collect()
        gc.disable()
        try:
            allocated_during_replay = _replay_all(graph, cores, inputs, results, lses, eager, eager_lse, mismatches)
        finally:
            gc.enable()
        torch.cuda.synchronize()
        assert allocated_during_replay == 0, f"rows={rows}: replays allocated"
        assert not mismatches, f"rows={rows}: replay != eager at (replay, variant, layer) {mismatches[:5]}"
        # layer 0's saved answer is untouched by layers 1, 2 running after it on the same buffers
        assert not torch.equal(results[0], results[LAYERS - 1])
        del graph
