"""Every Python a device run starts (tools/device_run.sh --vllm puts this folder on PYTHONPATH): where a parent
process installed tools/vllm_device_shims.py ($VLLM_DEVICE_SHIMS holds its decisions), the same shims, before anything
imports vLLM. vLLM inspects a model's class in a child process (ModelRegistry's _run_in_subprocess), which imports the
model's modules: without the shims there, vllm.vllm_flash_attn's ImportError fails every ModelConfig (seen on the H100,
2026-12-07: "Model architectures ['DeepseekV32ForCausalLM'] failed to be inspected")."""

import os

if os.environ.get("VLLM_DEVICE_SHIMS"):
    import importlib.util
    import pathlib
    import sys

    _path = pathlib.Path(__file__).resolve().parents[1] / "vllm_device_shims.py"
    _spec = importlib.util.spec_from_file_location("vllm_device_shims", _path)
    _shims = importlib.util.module_from_spec(_spec)
    sys.modules["vllm_device_shims"] = _shims
    _spec.loader.exec_module(_shims)
    _shims.install()
