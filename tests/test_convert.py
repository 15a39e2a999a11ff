"""convert_topk (Triton) against convert_topk_reference (torch) and a scalar Python oracle.

A batched fuzz (>= 10,000 independent row cases), named corner cases, CUDA-graph capture on a GPU,
and one bad-input test per argument error. Every comparison is exact: the outputs are integers.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from vllm_kimi_dsa import convert as convert_mod
from vllm_kimi_dsa.convert import convert_topk, convert_topk_reference, default_tile

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
# The kernel runs on a CPU only under Triton's interpreter (conftest sets it when no GPU exists).
needs_kernel = pytest.mark.skipif(
    not ON_GPU and not convert_mod._INTERPRETED,
    reason="no CUDA GPU and TRITON_INTERPRET=1 was not set before Triton was imported",
)
# Interpreter launches cost ~5 ms per row and tile, so the CPU runs small widths; a GPU runs K3.1's.
BIG_K = 2048
FUZZ_WIDTHS = (1024, 2048, 384) if ON_GPU else (128, 256, 384)
FUZZ_ROWS = 600 if ON_GPU else 180
FUZZ_MIN_CASES = 10_000
BLOCK_SIZES = (64, 16, 1, 3, 5, 7, 13, 61, 69)
INT32_MAX = 2**31 - 1


# ----------------------------------------------------------------------------------------- helpers


def _global_id(local: int, rank: int, dcp: int, interleave: int) -> int:
    """The inverse of the DCP map: the global id of `rank`'s local token `local`."""
    return (local // interleave) * dcp * interleave + rank * interleave + local % interleave


def _scalar_convert(ids, req, table, B, S, D, r, I):  # noqa: E741
    """SPEC 4 one id at a time in plain Python (an oracle independent of both tensor versions)."""
    if not 0 <= req < len(table):
        return []
    out = []
    for t in ids:
        if t < 0 or (t // I) % D != r:
            continue
        local = (t // (D * I)) * I + t % I
        blk, off = divmod(local, B)
        if blk < len(table[req]):
            out.append(table[req][blk] * S + off)
    return out


def _sentinel(gen: random.Random) -> int:
    return gen.randrange(10_000, 2**30)


def _buffers(rows_buf: int, K: int, device, gen: random.Random, sentinel: int):
    """Poisoned slots (row stride > K, so writes past K show) and counts (sometimes strided)."""
    pad = gen.choice((0, 3, 128))
    slots_store = torch.full((rows_buf, K + pad), sentinel, dtype=torch.int32, device=device)
    counts_step = gen.choice((1, 2))
    counts_store = torch.full((rows_buf * counts_step,), sentinel, dtype=torch.int32, device=device)
    return slots_store, slots_store[:, :K], counts_store, counts_store[::counts_step]


def _block_table(num_reqs: int, max_blocks: int, S: int, device, gen: random.Random, tgen):
    """Random block ids (large enough that flat rows pass 2**16) in a row-major or strided layout."""
    hi = min(2**24, (INT32_MAX - S) // S)  # every flat row stays an int32
    layout = gen.choice(("contiguous", "padded", "column_major"))
    if layout == "padded":
        store = torch.randint(0, hi, (num_reqs, max_blocks + 5), generator=tgen, dtype=torch.int32)
        bt = store[:, :max_blocks]
    elif layout == "column_major":
        bt = torch.randint(0, hi, (max_blocks, num_reqs), generator=tgen, dtype=torch.int32).t()
    else:
        bt = torch.randint(0, hi, (num_reqs, max_blocks), generator=tgen, dtype=torch.int32)
    return bt.to(device) if device != "cpu" else bt


def _row_ids(K: int, extent: int, D: int, I: int, gen: random.Random, tgen) -> torch.Tensor:  # noqa: E741
    """One top-k row: a random mix of holes, negatives, in-table ids, boundary ids and far ids."""
    mode = gen.random()
    if mode < 0.03:
        return torch.full((K,), -1, dtype=torch.int32)
    if mode < 0.05:
        return torch.randint(-(2**31), 0, (K,), generator=tgen, dtype=torch.int32)
    p = torch.tensor([gen.random() for _ in range(5)]) ** 2 + 1e-3
    kind = torch.multinomial(p / p.sum(), K, replacement=True, generator=tgen)
    near = max(2 * D * I, 8)
    choices = torch.stack(
        [
            torch.full((K,), -1, dtype=torch.int64),
            torch.randint(-(2**31), 0, (K,), generator=tgen),
            torch.randint(0, max(extent, 1), (K,), generator=tgen),
            torch.randint(max(extent - near, 0), extent + near, (K,), generator=tgen),
            torch.randint(extent, INT32_MAX, (K,), generator=tgen),
        ]
    )
    return choices.gather(0, kind[None]).squeeze(0).to(torch.int32)


class _Launch:
    """One kernel launch of many independent rows sharing (K, tile, B, S, D, r, I)."""

    def __init__(self, device, gen: random.Random, *, K, B, S, D, r, I, tile, rows):  # noqa: E741
        tgen = torch.Generator().manual_seed(gen.randrange(2**62))
        self.kw = dict(block_size=B, rows_per_block_stride=S, dcp_size=D, dcp_rank=r, interleave=I)
        self.tile, self.rows, self.K = tile, rows, K
        self.max_blocks = gen.randint(1, 12)
        rows_buf = rows + gen.randint(0, 4)
        num_reqs = rows_buf + gen.randint(0, 3)  # every buffer row draws a distinct request
        self.table = _block_table(num_reqs, self.max_blocks, S, device, gen, tgen)
        # Every row its own request; a few point outside the table (stale padded rows).
        req = torch.randperm(num_reqs, generator=tgen)[:rows_buf].to(torch.int32)
        for i in range(rows_buf):
            if gen.random() < 0.02:
                req[i] = gen.choice((-1, -(2**31), num_reqs, num_reqs + 7))
        self.req = req.to(device)
        # The id range that lands inside the table: D * I-groups hold I tokens per rank.
        extent = D * self.max_blocks * B
        ids = torch.stack([_row_ids(K, extent, D, I, gen, tgen) for _ in range(rows_buf)])
        if gen.random() < 0.25:  # a strided top-k buffer (last dim not contiguous)
            store = torch.full((rows_buf, 2 * K), 7, dtype=torch.int32)
            store[:, ::2] = ids
            self.topk = store.to(device)[:, ::2]
        else:
            self.topk = ids.to(device)
        self.sentinel = _sentinel(gen)
        self.slots_store, self.slots, self.counts_store, self.counts = _buffers(
            rows_buf, K, device, gen, self.sentinel
        )

    def run_and_check(self, scalar_rows: int = 1) -> None:
        out_s, out_c = convert_topk(
            self.topk, self.req, self.table, slots=self.slots, counts=self.counts,
            rows=self.rows, tile=self.tile, **self.kw,
        )
        ref_s, ref_c = convert_topk_reference(self.topk, self.req, self.table, rows=self.rows, **self.kw)
        where = f"K={self.K} tile={self.tile} max_blocks={self.max_blocks} {self.kw}"
        assert out_s.data_ptr() == self.slots.data_ptr() and out_s.shape == (self.rows, self.K), where
        assert out_c.data_ptr() == self.counts.data_ptr() and out_c.shape == (self.rows,), where
        if not torch.equal(out_c, ref_c):
            bad = (out_c != ref_c).nonzero()[0].item()
            raise AssertionError(f"counts row {bad}: {out_c[bad].item()} != {ref_c[bad].item()} ({where})")
        if not torch.equal(out_s, ref_s):
            bad = (out_s != ref_s).any(1).nonzero()[0].item()
            raise AssertionError(f"slots row {bad} differ ({where})")
        # Only [:rows, :K] may be written: buffer rows past `rows` and the row padding keep the poison.
        mask = torch.ones_like(self.slots_store, dtype=torch.bool)
        mask[: self.rows, : self.K] = False
        assert bool((self.slots_store[mask] == self.sentinel).all()), f"slots written outside [:rows, :K] ({where})"
        cmask = torch.ones_like(self.counts_store, dtype=torch.bool)
        cmask[: self.rows * self.counts.stride(0) : self.counts.stride(0)] = False
        assert bool((self.counts_store[cmask] == self.sentinel).all()), f"counts written outside [:rows] ({where})"
        # The reference itself against the scalar oracle on a few rows.
        table = self.table.cpu().tolist()
        kw = self.kw
        for i in range(min(scalar_rows, self.rows)):
            want = _scalar_convert(
                self.topk[i].cpu().tolist(), int(self.req[i]), table, kw["block_size"],
                kw["rows_per_block_stride"], kw["dcp_size"], kw["dcp_rank"], kw["interleave"],
            )
            got = ref_s[i].cpu().tolist()
            assert ref_c[i].item() == len(want) and got == want + [-1] * (self.K - len(want)), where


# ------------------------------------------------------------------------------------------- fuzz


@needs_kernel
@pytest.mark.parametrize("device", [DEVICE])
def test_fuzz_matches_reference_exactly(device):
    """Every rank of DCP 1/2/4/8 x interleave 1/64, two launches each, hundreds of rows a launch.

    A case is one row with its own request, block-table row, ids and the launch's (K, tile, B, S,
    D, r, I); rows are independent, so batching them changes nothing but the launch count.
    """
    gen = random.Random(20261202)
    cases, launches, t0 = 0, 0, time.perf_counter()
    for D in (1, 2, 4, 8):
        for r in range(D):
            for I in (1, 64):  # noqa: E741
                for _ in range(2):
                    K = gen.choice(FUZZ_WIDTHS)
                    # A quarter of the launches split the row into several tiles.
                    tiles = [t for t in (32, 64, 128, 256, 512, 1024) if t < K and -(-K // t) <= 4]
                    tile = gen.choice(tiles) if gen.random() < 0.25 else None
                    B = gen.choice(BLOCK_SIZES)
                    S = B if gen.random() < 0.6 else B + gen.randint(1, 9)
                    rows = FUZZ_ROWS + gen.randint(0, 30)
                    launch = _Launch(device, gen, K=K, B=B, S=S, D=D, r=r, I=I, tile=tile, rows=rows)
                    launch.run_and_check(scalar_rows=2)
                    cases += rows
                    launches += 1
    print(f"fuzz: {cases} cases in {launches} launches, {time.perf_counter() - t0:.1f} s on {device}")
    assert cases >= FUZZ_MIN_CASES


# ------------------------------------------------------------------------------------ corner cases


def _one(device, ids_rows, *, B=64, S=None, D=1, r=0, I=1, max_blocks=8, tile=None, table=None):  # noqa: E741
    """Run kernel and reference on given id rows (row i uses request i); return (slots, counts, table)."""
    S = B if S is None else S
    rows, K = len(ids_rows), len(ids_rows[0])
    if table is None:
        tgen = torch.Generator().manual_seed(rows * 1000 + K)
        table = torch.randint(1, 50_000, (rows, max_blocks), generator=tgen, dtype=torch.int32)
    table = table.to(device)
    topk = torch.tensor(ids_rows, dtype=torch.int32, device=device)
    req = torch.arange(rows, dtype=torch.int32, device=device)
    slots = torch.full((rows, K), 12345, dtype=torch.int32, device=device)
    counts = torch.full((rows,), 12345, dtype=torch.int32, device=device)
    kw = dict(block_size=B, rows_per_block_stride=S, dcp_size=D, dcp_rank=r, interleave=I)
    out_s, out_c = convert_topk(topk, req, table, slots=slots, counts=counts, tile=tile, **kw)
    ref_s, ref_c = convert_topk_reference(topk, req, table, **kw)
    assert torch.equal(out_s, ref_s) and torch.equal(out_c, ref_c)
    tab = table.cpu().tolist()
    for i, ids in enumerate(ids_rows):
        want = _scalar_convert(ids, i, tab, B, S, D, r, I)
        assert out_c[i].item() == len(want)
        assert out_s[i].cpu().tolist() == want + [-1] * (K - len(want))
    return out_s.cpu(), out_c.cpu(), tab


def _width(small: int) -> int:
    return BIG_K if ON_GPU else small


@needs_kernel
@pytest.mark.parametrize("device", [DEVICE])
def test_all_holes_and_all_negative_rows_count_zero(device):
    K = _width(256)
    gen = random.Random(1)
    rows = [[-1] * K, [gen.randrange(-(2**31), 0) for _ in range(K)]]
    s, c, _ = _one(device, rows)
    assert c.tolist() == [0, 0] and bool((s == -1).all())


@needs_kernel
@pytest.mark.parametrize("device", [DEVICE])
def test_full_row_counts_k_in_topk_order(device):
    K = _width(256)
    B, max_blocks = 16, K // 16 + 3
    ids = random.Random(2).sample(range(max_blocks * B), K)  # distinct, shuffled: order matters
    s, c, tab = _one(device, [ids], B=B, max_blocks=max_blocks)
    assert c.tolist() == [K]
    assert s[0].tolist() == [tab[0][t // B] * B + t % B for t in ids]


@needs_kernel
@pytest.mark.parametrize("device", [DEVICE])
@pytest.mark.parametrize("K", [128, 2048])
def test_widths_128_and_2048(device, K):
    gen = random.Random(K)
    rows = [[gen.choice((-1, gen.randrange(0, 700))) for _ in range(K)] for _ in range(3)]
    _, c, _ = _one(device, rows, B=64, D=2, r=1, I=1, max_blocks=6)
    assert 0 < c.min() and c.max() < K  # mixed rows: the test exercised both sides


@needs_kernel
@pytest.mark.parametrize("device", [DEVICE])
def test_odd_block_size_and_stride(device):
    K = _width(256)
    B, S = 13, 13 + 6  # a strided cache view: block b starts at row b * 19
    gen = random.Random(3)
    rows = [[gen.choice((-1, gen.randrange(0, 5 * B * 4))) for _ in range(K)] for _ in range(4)]
    s, c, tab = _one(device, rows, B=B, S=S, max_blocks=5)
    flat = s[0][: c[0]]
    assert bool(((flat % S) < B).all())  # never lands in the gap between blocks


@needs_kernel
@pytest.mark.parametrize("device", [DEVICE])
@pytest.mark.parametrize("D,r,I", [(1, 0, 1), (4, 2, 64), (8, 7, 1), (2, 1, 3)])
def test_last_block_and_the_max_blocks_boundary(device, D, r, I):  # noqa: E741
    """The last local token of the table is valid and uses the last block; the next one is not."""
    K, B, max_blocks = 128, 16, 5
    last = max_blocks * B - 1
    inside = [_global_id(last - j, r, D, I) for j in range(B)]  # the whole last block
    outside = [_global_id(last + 1 + j, r, D, I) for j in range(B)]  # blk == max_blocks
    other_rank = [_global_id(j, (r + 1) % D, D, I) for j in range(B)] if D > 1 else []
    ids = inside + outside + other_rank
    ids = ids + [-1] * (K - len(ids))
    s, c, tab = _one(device, [ids], B=B, D=D, r=r, I=I, max_blocks=max_blocks)
    assert c.tolist() == [B]
    assert s[0, :B].tolist() == [tab[0][max_blocks - 1] * B + (B - 1 - j) for j in range(B)]


@needs_kernel
@pytest.mark.parametrize("device", [DEVICE])
@pytest.mark.parametrize("pattern", ["last_tile_only", "alternating", "descending", "first_of_each_tile"])
def test_topk_order_kept_across_tiles(device, pattern):
    K = _width(512)
    tile = 512 if ON_GPU else 128  # 4 tiles either way
    B, max_blocks = 64, K // 64 + 2
    n = max_blocks * B
    gen = random.Random(pattern)
    if pattern == "last_tile_only":
        ids = [-1] * (K - tile) + gen.sample(range(n), tile)
    elif pattern == "alternating":
        ids = [gen.randrange(n) if j % 2 else -1 for j in range(K)]
    elif pattern == "descending":
        ids = sorted(gen.sample(range(n), K), reverse=True)
        ids[::3] = [n + 5] * len(ids[::3])  # past the table
    else:
        ids = [gen.randrange(n) if j % tile == 0 else -1 for j in range(K)]
    assert K // tile == 4
    s, c, tab = _one(device, [ids], B=B, max_blocks=max_blocks, tile=tile)
    want = [tab[0][t // B] * B + t % B for t in ids if 0 <= t < n]
    assert s[0, : c[0]].tolist() == want


@needs_kernel
@pytest.mark.parametrize("device", [DEVICE])
def test_default_tile_splits_a_2048_row(device):
    assert default_tile(2048) == 512 and default_tile(128) == 128 and default_tile(384) == 512
    K = 2048
    gen = random.Random(7)
    ids = [gen.randrange(-5, 3000) for _ in range(K)]
    _one(device, [ids], B=64, max_blocks=40)


@needs_kernel
@pytest.mark.parametrize("device", [DEVICE])
def test_rows_zero_and_bad_request_ids(device):
    K = 128
    topk = torch.randint(0, 64, (3, K), dtype=torch.int32, device=device)
    table = torch.randint(0, 100, (2, 2), dtype=torch.int32, device=device)
    req = torch.tensor([0, -1, 2], dtype=torch.int32, device=device)  # 2 == num_reqs: out of range
    slots = torch.full((3, K), 99, dtype=torch.int32, device=device)
    counts = torch.full((3,), 99, dtype=torch.int32, device=device)
    kw = dict(block_size=64, rows_per_block_stride=64)
    s, c = convert_topk(topk, req, table, slots=slots, counts=counts, rows=0, **kw)
    assert s.shape == (0, K) and c.shape == (0,) and bool((slots == 99).all()) and bool((counts == 99).all())
    s, c = convert_topk(topk, req, table, slots=slots, counts=counts, **kw)
    assert c.tolist() == [K, 0, 0] and bool((s[1:] == -1).all())
    assert s[0].tolist() == (table[0, 0].long() * 64 + topk[0].long()).tolist()


@pytest.mark.skipif(not ON_GPU, reason="CUDA graph capture needs a CUDA GPU")
def test_cuda_graph_capture_and_replay():
    """No allocation and no host sync: the launch captures, and replays on new ids in place."""
    gen = random.Random(11)
    launch = _Launch("cuda", gen, K=BIG_K, B=64, S=64, D=2, r=1, I=64, tile=None, rows=64)
    args = (launch.topk, launch.req, launch.table)
    kw = dict(slots=launch.slots, counts=launch.counts, rows=launch.rows, **launch.kw)
    convert_topk(*args, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        convert_topk(*args, **kw)
    for _ in range(3):
        launch.topk.copy_(torch.randint(-1, 2000, launch.topk.shape, dtype=torch.int32, device="cuda"))
        launch.slots.fill_(launch.sentinel)
        graph.replay()
        ref_s, ref_c = convert_topk_reference(*args, rows=launch.rows, **launch.kw)
        assert torch.equal(launch.slots[: launch.rows], ref_s) and torch.equal(launch.counts[: launch.rows], ref_c)


# -------------------------------------------------------------------------------------- bad input


def _good(device=DEVICE, K=128, rows=4):
    return dict(
        topk=torch.full((rows, K), -1, dtype=torch.int32, device=device),
        req_id_per_token=torch.zeros(rows, dtype=torch.int32, device=device),
        block_table=torch.zeros(2, 3, dtype=torch.int32, device=device),
        block_size=64,
        rows_per_block_stride=64,
        slots=torch.empty(rows, K, dtype=torch.int32, device=device),
        counts=torch.empty(rows, dtype=torch.int32, device=device),
    )


def _call(**kw):
    topk, req, bt = kw.pop("topk"), kw.pop("req_id_per_token"), kw.pop("block_table")
    return convert_topk(topk, req, bt, **kw)


@pytest.mark.parametrize("name", ["topk", "req_id_per_token", "block_table", "slots", "counts"])
def test_bad_dtype_names_the_argument(name):
    kw = _good()
    kw[name] = kw[name].to(torch.int64)
    with pytest.raises(TypeError, match=name):
        _call(**kw)


@pytest.mark.parametrize("name", ["topk", "req_id_per_token", "block_table", "slots", "counts"])
def test_bad_ndim_names_the_argument(name):
    kw = _good()
    kw[name] = kw[name].unsqueeze(0)
    with pytest.raises(ValueError, match=name):
        _call(**kw)


def test_not_a_tensor():
    kw = _good()
    kw["topk"] = [[-1] * 128]
    with pytest.raises(TypeError, match="topk"):
        _call(**kw)


def test_width_mismatch_names_slots():
    kw = _good()
    kw["slots"] = torch.empty(4, 256, dtype=torch.int32)
    with pytest.raises(ValueError, match="slots"):
        _call(**kw)


@pytest.mark.parametrize("K", [100, 130, 0])
def test_width_not_a_multiple_of_128_names_topk(K):
    kw = _good(K=K)
    with pytest.raises(ValueError, match="topk"):
        _call(**kw)
    with pytest.raises(ValueError, match="topk"):
        convert_topk_reference(kw["topk"], kw["req_id_per_token"], kw["block_table"], block_size=64,
                               rows_per_block_stride=64)


@pytest.mark.parametrize(
    "arg,value,exc",
    [
        ("dcp_rank", 2, ValueError),
        ("dcp_rank", -1, ValueError),
        ("dcp_size", 0, ValueError),
        ("interleave", 0, ValueError),
        ("block_size", 0, ValueError),
        ("rows_per_block_stride", 32, ValueError),  # < block_size: blocks would overlap
        ("block_size", 64.0, TypeError),
        ("rows", -1, ValueError),
        ("tile", 100, ValueError),
    ],
)
def test_bad_scalar_names_the_argument(arg, value, exc):
    kw = _good()
    kw["dcp_size"] = 2
    kw[arg] = value
    with pytest.raises(exc, match=arg):
        _call(**kw)
    if arg not in ("tile",):
        kw.pop("slots"), kw.pop("counts"), kw.pop("tile", None)
        topk, req, bt = kw.pop("topk"), kw.pop("req_id_per_token"), kw.pop("block_table")
        with pytest.raises(exc, match=arg):
            convert_topk_reference(topk, req, bt, **kw)


@pytest.mark.parametrize("name", ["topk", "req_id_per_token", "slots", "counts"])
def test_rows_past_a_buffer_names_both(name):
    kw = _good(rows=6)
    kw[name] = kw[name][:4]
    with pytest.raises(ValueError, match=rf"rows=5.*{name}"):
        _call(rows=5, **kw)


@pytest.mark.parametrize("name", ["req_id_per_token", "block_table", "slots", "counts"])
def test_tensor_on_another_device_names_it(name):
    kw = _good()
    kw[name] = kw[name].to("meta")  # shapes and dtypes intact, only the device differs
    with pytest.raises(ValueError, match=name):
        _call(**kw)


def test_slots_last_dim_not_contiguous():
    kw = _good()
    kw["slots"] = torch.empty(4, 256, dtype=torch.int32)[:, ::2]
    with pytest.raises(ValueError, match="slots"):
        _call(**kw)


def test_launcher_never_reads_values(monkeypatch):
    """Validation is host metadata only: a value read (.item/.tolist/bool) would sync a GPU."""
    kw = _good()

    def boom(*_a, **_k):
        raise AssertionError("the launcher read a tensor value")

    monkeypatch.setattr(convert_mod, "_convert_topk_kernel", _NoLaunch())
    monkeypatch.setattr(convert_mod, "_INTERPRETED", True)
    for attr in ("item", "tolist", "__bool__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, attr, boom)
    _call(**kw)
    monkeypatch.undo()


class _NoLaunch:
    """Stands in for the kernel so the check above also runs where the kernel cannot."""

    def __getitem__(self, grid):
        return lambda *a, **k: None
