"""selection: spec strings, kernel_for's rules, fi_kernels per machine, plan_rows_for, kernel-table files.

Pure Python; the FlashInfer / GPU probes are monkeypatched so every machine case runs on a CPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

import vllm_kimi_dsa.selection.choice as choice
import vllm_kimi_dsa.selection.specs as d
from vllm_kimi_dsa.selection import (
    FI_KERNEL,
    KERNELS,
    fi_kernels,
    kernel_for,
    kernel_from_spec,
    load_kernel_table,
    parse_kernel_spec,
    plan_rows_for,
    save_kernel_table,
)

ALL = ("prims_ts", "trtllm", "triton", "sparse")


@pytest.fixture(autouse=True)
def _no_env_table(monkeypatch):
    """Each test starts from the built-in table, with an empty file cache."""
    monkeypatch.delenv(d.KERNEL_TABLE_ENV, raising=False)
    d.reset_kernel_table_cache()
    yield
    d.reset_kernel_table_cache()


def test_kernels_constant():
    assert KERNELS == ("prims_ts", "trtllm", "triton")
    assert "sparse" not in KERNELS
    assert set(FI_KERNEL) == {"tp", "dcp"}
    for spec in FI_KERNEL.values():
        parse_kernel_spec(spec)  # the built-in priors are well formed


# ---------------------------------------------------------------- spec strings


def test_parse_kernel_spec_forms():
    assert parse_kernel_spec("1-8:trtllm,16-64:prims_ts") == ((1, 8, "trtllm"), (16, 64, "prims_ts"))
    assert parse_kernel_spec("5:trtllm") == ((5, 5, "trtllm"),)
    assert parse_kernel_spec(" 1 - 3 : triton , 7:sparse ") == ((1, 3, "triton"), (7, 7, "sparse"))
    assert parse_kernel_spec("") == ()
    assert parse_kernel_spec("   ") == ()


@pytest.mark.parametrize(
    "spec, match",
    [
        ("1-8:trtllm,,9:prims_ts", "empty entry"),
        ("1-8:trtllm,", "empty entry"),
        ("1-8trtllm", "'1-8trtllm'"),
        ("1-8:", "'1-8:'"),
        ("a-8:trtllm", "non-integer"),
        ("1-b:trtllm", "non-integer"),
        ("1.5:trtllm", "non-integer"),
        ("9-8:trtllm", "lo 9 > hi 8"),
        ("0-8:trtllm", "start at 1"),
        ("-3:trtllm", "'-3:trtllm'"),
        ("1-8:flashmla", "unknown kernel 'flashmla'"),
        ("1-8:TRTLLM", "unknown kernel"),
    ],
)
def test_parse_kernel_spec_errors(spec, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_kernel_spec(spec)
    assert "spec" in str(info.value)


def test_parse_kernel_spec_type():
    with pytest.raises(TypeError, match="spec"):
        parse_kernel_spec(None)  # type: ignore[arg-type]


def test_kernel_from_spec_last_entry_wins_and_inclusive_bounds():
    spec = "1-64:trtllm,16-32:prims_ts,20:triton"
    assert kernel_from_spec(spec, 1) == "trtllm"
    assert kernel_from_spec(spec, 15) == "trtllm"
    assert kernel_from_spec(spec, 16) == "prims_ts"  # lo inclusive
    assert kernel_from_spec(spec, 19) == "prims_ts"
    assert kernel_from_spec(spec, 20) == "triton"  # the single number overrides both
    assert kernel_from_spec(spec, 32) == "prims_ts"  # hi inclusive
    assert kernel_from_spec(spec, 33) == "trtllm"
    assert kernel_from_spec(spec, 64) == "trtllm"
    assert kernel_from_spec(spec, 65) is None
    assert kernel_from_spec("", 3) is None


# ---------------------------------------------------------------- kernel_for

TABLE = {"tp": "1-8:trtllm,9-16:triton,17-64:prims_ts", "dcp": "1-4:triton,5-64:trtllm"}


def test_kernel_for_follows_the_table_per_topology():
    ks = ("prims_ts", "trtllm", "triton")
    assert kernel_for(3, 1, ks, 64, TABLE) == "trtllm"
    assert kernel_for(12, 1, ks, 64, TABLE) == "triton"
    assert kernel_for(40, 1, ks, 64, TABLE) == "prims_ts"
    assert kernel_for(3, 2, ks, 64, TABLE) == "triton"  # dcp > 1 reads "dcp"
    assert kernel_for(30, 8, ks, 64, TABLE) == "trtllm"


def test_kernel_for_default_is_prims_ts_then_kernels_order():
    ks = ("triton", "trtllm", "prims_ts")
    assert kernel_for(100, 1, ks, 64, TABLE) == "prims_ts"  # 100 rows: no entry
    # the table says trtllm but it is not offered
    assert kernel_for(3, 1, ("prims_ts", "triton"), 64, TABLE) == "prims_ts"
    # neither the table's choice nor prims_ts: the first candidate in KERNELS order, not the caller's
    assert kernel_for(12, 1, ("triton", "trtllm"), 64, {"tp": "1-64:prims_ts"}) == "trtllm"


def test_kernel_for_ignores_names_outside_kernels():
    assert kernel_for(3, 2, ("sparse", "triton", "nonsense"), 64, TABLE) == "triton"
    # the table may name "sparse"; it is never picked
    assert kernel_for(3, 1, ("sparse", "prims_ts", "triton"), 64, {"tp": "1-8:sparse"}) == "prims_ts"
    with pytest.raises(ValueError, match="kernels"):
        kernel_for(3, 1, ("sparse",), 64)


def test_kernel_for_head_rules():
    ks = ("prims_ts", "trtllm", "triton")
    want_trtllm = {"tp": "1-64:trtllm", "dcp": "1-64:trtllm"}
    # 64 < H < 128: trtllm is out even when the table wants it
    for heads in (65, 96, 127):
        assert kernel_for(4, 1, ks, heads, want_trtllm) == "prims_ts"
        assert kernel_for(4, 1, ("trtllm", "triton"), heads, want_trtllm) == "triton"
        with pytest.raises(ValueError, match=r"kernels.*heads=" + str(heads) + ".*trtllm"):
            kernel_for(4, 1, ("trtllm",), heads)
    # H <= 64 keeps trtllm
    for heads in (12, 16, 64):
        assert kernel_for(4, 1, ks, heads, want_trtllm) == "trtllm"
    # H > 128: no kernel takes it (the Triton kernel too stops at 128, heads.py)
    with pytest.raises(ValueError, match=r"kernels.*heads=256.*prims_ts.*128.*triton takes 1 to 128"):
        kernel_for(4, 1, ks, 256, want_trtllm)


def test_kernel_for_128_heads():
    ks = ("prims_ts", "trtllm", "triton")
    prefer_prims = {"tp": "1-4096:prims_ts", "dcp": "1-4096:prims_ts"}
    assert kernel_for(100, 1, ks, 128, prefer_prims) == "trtllm"  # TP, 128 heads: trtllm whatever the table
    assert kernel_for(100, 2, ks, 128, prefer_prims) == "prims_ts"  # under DCP the table decides
    assert kernel_for(100, 1, ("prims_ts", "triton"), 128, {"tp": "1-4096:triton"}) == "triton"


def test_kernel_for_single_candidate_skips_the_table():
    assert kernel_for(3, 1, ("triton",), 64, {"tp": "1-8:prims_ts"}) == "triton"
    assert kernel_for(3, 1, ("prims_ts", "sparse"), 64, {"tp": "1-8:trtllm"}) == "prims_ts"


def test_kernel_for_builtin_and_partial_tables(monkeypatch):
    monkeypatch.setitem(FI_KERNEL, "tp", "1-4:triton")
    monkeypatch.setitem(FI_KERNEL, "dcp", "1-4:trtllm")
    ks = ("prims_ts", "trtllm", "triton")
    assert kernel_for(2, 1, ks, 64) == "triton"
    assert kernel_for(2, 4, ks, 64) == "trtllm"
    # a table without "dcp" falls back to FI_KERNEL's for it
    assert kernel_for(2, 4, ks, 64, {"tp": "1-4:prims_ts"}) == "trtllm"


# The built-in table's documented choices (FI_KERNEL: trtllm-gen for TP batches up to 32 rows, prims_ts above and
# under DCP), on both sides of each boundary row count; past 4096 no entry names a kernel: prims_ts, the default.
BUILTIN_CHOICES = {
    1: [(1, "trtllm"), (32, "trtllm"), (33, "prims_ts"), (4096, "prims_ts"), (4097, "prims_ts")],  # TP
    2: [(1, "prims_ts"), (32, "prims_ts"), (33, "prims_ts"), (4096, "prims_ts"), (4097, "prims_ts")],  # DCP 2
}


@pytest.mark.parametrize("dcp", sorted(BUILTIN_CHOICES), ids=["tp", "dcp"])
@pytest.mark.parametrize("heads", [16, 64])
def test_kernel_for_builtin_table_at_each_boundary(dcp, heads):
    """No table and no table file: kernel_for reads FI_KERNEL. Both FlashInfer kernels offered (as fi_kernels gives
    them for fp8 on Blackwell) at head counts trtllm-gen takes, so the table alone decides."""
    ks = ("prims_ts", "trtllm", "triton")
    got = [(rows, kernel_for(rows, dcp, ks, heads=heads)) for rows, _ in BUILTIN_CHOICES[dcp]]
    assert got == BUILTIN_CHOICES[dcp]


@pytest.mark.parametrize(
    "args, exc, name",
    [
        ((0, 1, ("prims_ts",), 64), ValueError, "rows"),
        ((1, -1, ("prims_ts",), 64), ValueError, "dcp"),  # 0 and 1: tensor parallel (test_heads.py)
        ((1, 2.0, ("prims_ts",), 64), TypeError, "dcp"),
        ((1, 1, ("prims_ts",), 0), ValueError, "heads"),
        ((1.0, 1, ("prims_ts",), 64), TypeError, "rows"),
        ((1, 1, "prims_ts", 64), TypeError, "kernels"),
        ((1, 1, (), 64), ValueError, "kernels"),
    ],
)
def test_kernel_for_bad_input(args, exc, name):
    with pytest.raises(exc, match=name):
        kernel_for(*args)


def test_kernel_for_bad_table():
    with pytest.raises(ValueError, match="table"):
        kernel_for(3, 1, ("prims_ts", "triton"), 64, {"tp": "1-8:bogus"})
    with pytest.raises(ValueError, match="table"):
        kernel_for(3, 1, ("prims_ts", "triton"), 64, {"pp": "1-8:triton"})


def test_kernel_for_accepts_numpy_ints():
    np = pytest.importorskip("numpy")
    assert kernel_for(np.int64(3), np.int32(1), ("prims_ts", "triton"), np.int64(64), {"tp": "3:triton"}) == "triton"


# ---------------------------------------------------------------- fi_kernels


@dataclass
class Features:
    version: str = "0.7.4"
    prims_ts: bool = True
    trtllm_mla: bool = True


def _machine(monkeypatch, *, blackwell: bool, features: Features | None, triton: bool):
    calls = {"features": 0}

    def features_probe():
        calls["features"] += 1
        return features

    monkeypatch.setattr(choice, "_is_blackwell", lambda device: blackwell)
    monkeypatch.setattr(choice, "_features", features_probe)
    monkeypatch.setattr(choice, "triton_runs", lambda device: triton)
    return calls


CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize(
    "blackwell, features, triton, fp8, nvfp4",
    [
        # Blackwell with FlashInfer 0.7.4
        (True, Features(), True, ("prims_ts", "trtllm", "sparse"), ("prims_ts",)),
        # Blackwell with vLLM's pinned FlashInfer 0.7.2 (no prims_ts): nvfp4 falls to triton
        (True, Features("0.7.2.post1", prims_ts=False), True, ("trtllm", "sparse"), ("triton",)),
        # Blackwell, FlashInfer missing entirely
        (True, None, True, ("sparse", "triton"), ("triton",)),
        (True, Features(prims_ts=False, trtllm_mla=False), False, ("sparse",), ()),
        # Hopper (or any non-Blackwell GPU): FlashInfer's kernels and "sparse" are dropped
        (False, Features(), True, ("triton",), ("triton",)),
        # a CPU without TRITON_INTERPRET
        (False, None, False, (), ()),
    ],
)
def test_fi_kernels_per_machine(monkeypatch, blackwell, features, triton, fp8, nvfp4):
    _machine(monkeypatch, blackwell=blackwell, features=features, triton=triton)
    assert fi_kernels("fp8", CUDA) == fp8
    assert fi_kernels("fp8_e4m3", CUDA) == fp8
    assert fi_kernels("nvfp4_ds_mla", CUDA) == nvfp4


def test_fi_kernels_does_not_probe_flashinfer_off_blackwell(monkeypatch):
    calls = _machine(monkeypatch, blackwell=False, features=Features(), triton=True)
    fi_kernels("fp8", CUDA)
    assert calls["features"] == 0


def test_fi_kernels_bad_dtype(monkeypatch):
    _machine(monkeypatch, blackwell=True, features=Features(), triton=True)
    for bad in ("auto", "bf16", "fp8_ds_mla", ""):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            fi_kernels(bad, CUDA)
    with pytest.raises(TypeError, match="kv_cache_dtype"):
        fi_kernels(torch.float8_e4m3fn, CUDA)  # type: ignore[arg-type]


def test_fi_kernels_real_probes_on_cpu(monkeypatch):
    """The unpatched probes on a CPU: nothing Blackwell; triton only under the interpreter."""
    cpu = torch.device("cpu")
    assert not choice._is_blackwell(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fi_kernels("fp8", cpu) == ("triton",)
    assert fi_kernels("nvfp4_ds_mla", "cpu") == ("triton",)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert fi_kernels("fp8", cpu) == ()


def test_fi_kernels_feed_kernel_for(monkeypatch):
    _machine(monkeypatch, blackwell=True, features=Features(), triton=True)
    assert kernel_for(4, 1, fi_kernels("nvfp4_ds_mla", CUDA), 128) == "prims_ts"  # trtllm cannot read nvfp4
    assert kernel_for(4, 1, fi_kernels("fp8", CUDA), 128) == "trtllm"


# ---------------------------------------------------------------- plan_rows_for


def test_plan_rows_for():
    caps = (1, 8, 32, 128)
    assert [plan_rows_for(r, caps) for r in (1, 2, 8, 9, 32, 33, 128)] == [1, 8, 8, 32, 32, 128, 128]
    assert plan_rows_for(7, None) == 7
    assert plan_rows_for(7, ()) == 7
    assert plan_rows_for(7, [16]) == 16


@pytest.mark.parametrize(
    "rows, caps, exc, match",
    [
        (129, (8, 128), ValueError, r"rows=129.*capacities"),
        (0, (8,), ValueError, "rows"),
        (3, (8, 4), ValueError, "capacities.*sorted"),
        (3, (4, 4), ValueError, "capacities"),
        (3, (0, 4), ValueError, "capacities.*positive"),
        (3, (-4, 4), ValueError, "capacities"),
        (3, (2.5, 4), ValueError, "capacities"),
        ("3", (4,), TypeError, "rows"),
    ],
)
def test_plan_rows_for_errors(rows, caps, exc, match):
    with pytest.raises(exc, match=match):
        plan_rows_for(rows, caps)


# ---------------------------------------------------------------- kernel-table files


def test_table_round_trip_through_env(tmp_path, monkeypatch):
    ks = ("prims_ts", "trtllm", "triton")
    assert kernel_for(2, 1, ks, 64) == kernel_from_spec(FI_KERNEL["tp"], 2)  # built-in prior first
    path = tmp_path / "kernels.json"
    table = {"tp": "1-4:triton,5-64:prims_ts", "dcp": "1-64:trtllm"}
    save_kernel_table(path, table, {"gpu": "B200", "heads": 64})
    data = json.loads(path.read_text())
    assert data["tp"] == table["tp"] and data["meta"]["gpu"] == "B200"
    assert load_kernel_table(path) == table

    monkeypatch.setenv(d.KERNEL_TABLE_ENV, str(path))
    assert d.active_kernel_table() == table
    assert kernel_for(2, 1, ks, 64) == "triton"
    assert kernel_for(10, 1, ks, 64) == "prims_ts"
    assert kernel_for(10, 2, ks, 64) == "trtllm"
    # an explicit table still wins over the file
    assert kernel_for(2, 1, ks, 64, {"tp": "1-4:trtllm"}) == "trtllm"

    # read once: a rewritten file is seen only after the cache is reset
    save_kernel_table(path, {"tp": "1-64:trtllm"})
    assert kernel_for(2, 1, ks, 64) == "triton"
    d.reset_kernel_table_cache()
    assert kernel_for(2, 1, ks, 64) == "trtllm"
    assert d.active_kernel_table()["dcp"] == FI_KERNEL["dcp"]  # a topology the file omits keeps the prior


def test_load_kernel_table_errors(tmp_path, monkeypatch):
    cases = {
        "bad_spec.json": json.dumps({"tp": "1-8:warp"}),
        "not_json.json": "{tp: 1",
        "list.json": "[1, 2]",
        "no_topology.json": json.dumps({"meta": {}}),
        "spec_not_str.json": json.dumps({"tp": 5}),
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match="path=|kernel table"):
            load_kernel_table(tmp_path / name)
    with pytest.raises(ValueError, match="path="):
        load_kernel_table(tmp_path / "missing.json")
    monkeypatch.setenv(d.KERNEL_TABLE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=d.KERNEL_TABLE_ENV):
        kernel_for(2, 1, ("prims_ts", "triton"), 64)


def test_save_kernel_table_errors(tmp_path):
    path = tmp_path / "t.json"
    with pytest.raises(ValueError, match="table"):
        save_kernel_table(path, {"tp": "1-8:nope"})
    with pytest.raises(ValueError, match="table"):
        save_kernel_table(path, {"ep": "1-8:triton"})
    with pytest.raises(ValueError, match="table"):
        save_kernel_table(path, {})
    with pytest.raises(TypeError, match="meta"):
        save_kernel_table(path, {"tp": "1-8:triton"}, {"when": object()})
    assert not path.exists()  # nothing half-written
