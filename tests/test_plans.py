"""The prims_ts plan registry (backends/flashinfer/plans.py): keys, sharing, no re-planning, one workspace = max over plans, _offsets.

FlashInfer's wrapper is replaced by a recorder with a known workspace rule, so this runs anywhere
(the real wrapper's arguments are checked in test_flashinfer_conformance.py). CPU time: < 1 s.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import vllm_kimi_dsa.backends.flashinfer.features as fi_features
import vllm_kimi_dsa.backends.flashinfer.prims_ts as fi_prims_ts
from vllm_kimi_dsa.kernels.base import DecodeSetup
from vllm_kimi_dsa.backends.flashinfer.plans import PLANS, PlanKey, _offsets, _Plans, plan_arguments, qo_offsets

CPU = torch.device("cpu")


def fake_size(device, batch_size, num_qo_heads, *, max_topk, **kwargs):
    # Deliberately not monotone in rows (FlashInfer's is not either: 80 rows can need less than 5).
    return 1000 * batch_size * num_qo_heads + max_topk + (5_000_000 if batch_size == 7 else 0)


class FakeWrapper:
    instances: list["FakeWrapper"] = []

    def __init__(self, workspace_buffer=None):
        self._workspace_buffer = workspace_buffer
        self.planned_on: list[torch.Tensor] = []
        self.plan_args = None
        FakeWrapper.instances.append(self)

    def plan(self, *args, **kwargs):
        need = fake_size(*args, **kwargs)
        assert self._workspace_buffer.numel() >= need, "planned on a workspace too small for it"
        self.planned_on.append(self._workspace_buffer)
        self.plan_args = (args, kwargs)


@pytest.fixture
def plans(monkeypatch):
    module = types.ModuleType("flashinfer.attention.prims_ts")
    module.BatchSparseMLADecodePagedTSWrapper = FakeWrapper
    module.get_prims_ts_sparse_mla_decode_workspace_size = fake_size
    monkeypatch.setitem(sys.modules, "flashinfer.attention.prims_ts", module)
    monkeypatch.setattr(fi_features, "flashinfer_features", lambda: fi_features.FlashInferFeatures("0.7.4", True, True))
    FakeWrapper.instances = []
    PLANS.clear()
    yield PLANS
    PLANS.clear()


def key(rows=8, heads=128, lse=True, fmt="fp8", width=2048, device=CPU):
    return PlanKey(device, rows, heads, lse, fmt, width)


def test_offsets():
    """The seed's _offsets(capacity, rows, device) is qo_offsets."""
    assert _offsets is qo_offsets
    off = _offsets(8, 3, "cpu")
    assert off.dtype == torch.int32 and off.tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3]
    assert _offsets(4, 4, "cpu").tolist() == [0, 1, 2, 3, 4]
    assert _offsets(2, 0, "cpu").tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="rows=9 exceeds the plan capacity=8"):
        _offsets(8, 9, "cpu")
    with pytest.raises(ValueError, match="rows"):
        _offsets(8, -1, "cpu")
    with pytest.raises(ValueError, match="capacity"):
        _offsets(0, 1, "cpu")


def test_plan_arguments_and_key_rules():
    args, kwargs = plan_arguments(key(rows=32, heads=64, lse=False, fmt="nvfp4_ds_mla", width=1024))
    assert args == (CPU, 32, 64)
    assert kwargs == dict(
        max_topk=1024, max_q_len=1, packed_query=True, q_dtype=torch.float8_e4m3fn,
        qk_rope_head_dim=64, kv_cache_format="nvfp4.fp8rope", return_lse=False,
    )
    assert plan_arguments(key(fmt="fp8"))[1]["kv_cache_format"] == "native"
    for bad, match in ((key(heads=129), "heads=129"), (key(width=0), "width"), (key(rows=0), "plan_rows")):
        with pytest.raises(ValueError, match=match):
            _Plans().plan([bad])
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        _Plans().plan([key(fmt="bf16")])


def test_planning_twice_is_a_no_op(plans):
    keys = [key(rows=r, width=w) for r in (1, 8) for w in (128, 2048)]
    plans.plan(keys + keys[:2])  # duplicates in one call are planned once
    assert plans.plan_calls == 4 and len(FakeWrapper.instances) == 4
    wrappers = {k: plans.get(k) for k in keys}
    plans.plan(keys)
    plans.plan(reversed(keys))
    # An equal key spelled differently (vLLM's "fp8_e4m3") is the same plan.
    plans.plan([k._replace(format="fp8_e4m3") for k in keys])
    assert plans.plan_calls == 4 and len(FakeWrapper.instances) == 4
    assert all(plans.get(k) is w for k, w in wrappers.items())


def test_one_workspace_is_the_max_over_plans_and_growth_replans(plans):
    small = [key(rows=1, width=128), key(rows=2, width=128)]
    plans.plan(small)
    ws = plans.workspace(CPU)
    assert ws.dtype == torch.uint8 and ws.numel() >= max(fake_size(*plan_arguments(k)[0], **plan_arguments(k)[1]) for k in small)
    assert all(plans.get(k)._workspace_buffer is ws for k in small)
    # A plan that fits: no new workspace, nothing re-planned.
    plans.plan([key(rows=3, width=128)])
    assert plans.workspace(CPU) is ws and plans.plan_calls == 3
    # A plan that needs more: one new workspace, the existing wrappers re-planned onto it in place.
    before = {k: plans.get(k) for k in plans.keys()}
    plans.plan([key(rows=7, width=2048)])
    grown = plans.workspace(CPU)
    assert grown is not ws and grown.numel() >= fake_size(CPU, 7, 128, max_topk=2048)
    assert plans.plan_calls == 3 + 3 + 1
    for k, w in before.items():
        assert plans.get(k) is w and w._workspace_buffer is grown and w.planned_on[-1] is grown
    sizes = [plans.workspace_size(k) for k in plans.keys()]
    assert grown.numel() >= max(sizes) and grown.numel() - max(sizes) < (1 << 20)


def test_unplanned_width_or_rows_is_a_value_error(plans):
    plans.plan([key(rows=8, width=2048)])
    with pytest.raises(ValueError, match=r"rows=8, width=1024"):
        plans.get(key(rows=8, width=1024))
    with pytest.raises(ValueError, match=r"rows=16, width=2048"):
        plans.get(key(rows=16, width=2048))


def test_no_planning_during_graph_capture(plans, monkeypatch):
    plans.plan([key(rows=8)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    plans.plan([key(rows=8)])  # already planned: fine during capture
    with pytest.raises(RuntimeError, match="before CUDA graph capture"):
        plans.plan([key(rows=16)])


def _setup(widths=(128, 2048), row_counts=(1, 3, 20), capacities=(4, 32), fmt="fp8", heads=64):
    return DecodeSetup(
        device=CPU, fmt=fmt, heads=heads, row_counts=row_counts, capacities=capacities, widths=widths,
        return_lse=True, softmax_scale=0.1, output_scale=1.0,
    )


def test_layers_share_plans_across_widths(plans):
    layers = [fi_prims_ts.PrimsTsDecode(_setup()) for _ in range(5)]
    # rows 1 and 3 share the capacity-4 plan; 20 takes the 32 one; times two widths.
    assert plans.plan_calls == 4 and len(plans.keys()) == 4
    for rw in ((1, 128), (3, 128), (20, 2048)):
        assert len({id(layer._wrappers[rw]) for layer in layers}) == 1
    assert layers[0]._wrappers[(1, 128)] is layers[0]._wrappers[(3, 128)]
    assert layers[0]._wrappers[(1, 128)] is not layers[0]._wrappers[(1, 2048)]
    assert layers[0]._qo_indptr[3].tolist() == [0, 1, 2, 3, 3]
    # Another layer kind (other heads / format) adds only its own plans, on the same workspace.
    fi_prims_ts.PrimsTsDecode(_setup(fmt="nvfp4_ds_mla"))
    assert plans.plan_calls == 8
    assert len({id(plans.get(k)._workspace_buffer) for k in plans.keys()}) == 1


def test_no_capacities_plans_each_row_count(plans):
    layer = fi_prims_ts.PrimsTsDecode(_setup(row_counts=(2, 5), capacities=(), widths=(256,)))
    assert layer.plan_rows == {2: 2, 5: 5}
    assert sorted(k.plan_rows for k in plans.keys()) == [2, 5]
    with pytest.raises(ValueError, match="rows=40"):
        fi_prims_ts.PrimsTsDecode(_setup(row_counts=(40,), capacities=(4, 32)))
