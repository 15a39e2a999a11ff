"""Host plans of the split-KV decode kernels: integer math only (no torch, no Triton).

cost: the plan model (Config, even / tail-split / lead plans, plan tables); configs: every kernel's plan Config.
"""

from __future__ import annotations

from vllm_kimi_dsa.planning.configs import default_config, few_heads_config, gluon_config, qk_on_fp8_wgmma
from vllm_kimi_dsa.planning.cost import (
    Config,
    choose_lead,
    choose_plan,
    choose_splits,
    plan_cost,
    plan_table,
    split_entries,
    split_range,
)

__all__ = ["Config", "choose_lead", "choose_plan", "choose_splits", "default_config", "few_heads_config",
           "gluon_config", "plan_cost", "plan_table", "qk_on_fp8_wgmma", "split_entries", "split_range"]
