"""What vLLM 0.33's Python code lacks on the device machine (torch 2.11, Triton 3.6, tools/pack_vllm.sh's pack), shimmed
in one place: a GPU test calls install() before anything resolves vllm.platforms.current_platform.

Each shim acts only where the real library cannot load, and its docstring says what vLLM behaviour it could hide;
install() returns (and REPORT keeps) what each one did. Load it by path, as tools/ is no package:

    spec = importlib.util.spec_from_file_location("vllm_device_shims", ROOT / "tools" / "vllm_device_shims.py")
    shims = importlib.util.module_from_spec(spec); spec.loader.exec_module(shims); shims.install()

`python3 tools/vllm_device_shims.py` installs them, then imports what the GPU tests use and builds the tiny
DeepSeek-V3.2 / GLM-5 VllmConfigs of tests/vllm_harness.py, one line a step (exit 1 if any fails); on the device:
`bash tools/device_run.sh --vllm py tools/vllm_device_shims.py`.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import types

REPORT: dict[str, str] = {}
SHIM_ATTR = "__vllm_device_shim__"  # set on every placeholder module: what it hides
# install()'s decisions, for every child Python: vLLM inspects a model's class in a subprocess (ModelRegistry's
# _run_in_subprocess), which imports the model's modules and so needs the same shims; tools/device_boot/
# sitecustomize.py (on PYTHONPATH under device_run.sh --vllm) applies them there, without probing again.
DECISIONS_ENV = "VLLM_DEVICE_SHIMS"
REAL = "real library loads"
_decided: dict[str, str] = {}


def _child_import_error(module: str) -> str | None:
    """None if `import torch, <module>` works in a child Python, else the child's last error line.

    A child, because a library that throws while it registers its ops aborts the process that loads it."""
    done = subprocess.run([sys.executable, "-c", f"import torch, {module}"], capture_output=True, text=True,
                          timeout=600, env=os.environ.copy())
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return f"rc {done.returncode}: {lines[-1] if lines else 'no output'}"


def _load_error(module: str, shim: str | None = None) -> str | None:
    """Why `module` cannot be imported here (absent, or its library fails to load), None if it can; a parent
    process's decision for `shim` (DECISIONS_ENV) is taken as it is."""
    if shim in _decided:
        return None if _decided[shim] == REAL else _decided[shim]
    if module in sys.modules:
        return None
    try:
        if importlib.util.find_spec(module) is None:
            return "absent"
    except (ImportError, ValueError) as e:
        return f"absent ({e})"
    return _child_import_error(module)


def _placeholder(name: str, hides: str) -> types.ModuleType:
    """An empty module named `name` in sys.modules (and on its parent), findable by importlib.util.find_spec."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    setattr(module, SHIM_ATTR, hides)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:  # else Python finds the child in sys.modules when the parent is imported
        setattr(sys.modules[parent], child, module)
    return module


def _empty_unless_it_loads(name: str, hides: str, shim: str) -> str:
    """`name` as it is where it imports, else an empty placeholder (hiding `hides`); what was done, for REPORT."""
    error = _load_error(name, shim)
    if error is None:
        return REAL
    _placeholder(name, hides)
    return f"placeholder ({error})"


def stable_libtorch() -> str:
    """vllm._C_stable_libtorch as an empty module when the library is absent (not carried) or fails to load.

    Why: on a GPU machine vllm.platforms picks CudaPlatform, and vllm/platforms/cuda.py imports this library at its
    top without a guard, so every vLLM module that touches current_platform fails to import without it.
    Hides: every op the library registers (torch.ops._C.*, torch.ops._C_cache_ops.*, ...) is then missing and a
    call raises AttributeError / "no such op". DeepseekV32Attention.forward calls, through its indexer
    (torch.ops.vllm.sparse_attn_indexer): the top-k torch.ops._C.top_k_per_row_decode / top_k_per_row_prefill /
    persistent_topk / cooperative_topk (by kernel_config.sparse_indexer_topk_backend), and
    torch.ops._C_cache_ops.cp_gather_indexer_k_quant_cache (prefill chunks); indexer_k_quant_and_cache and
    concat_and_cache_mla only under PCP / HiSparse (otherwise the Triton fused_norm_rope writes both caches).
    RMSNorm and rotary are fused into Triton there; elsewhere RMSNorm runs ir.ops.rms_norm, whose CUDA default
    priority is ["vllm_c", "native"] (torch.ops._C.rms_norm): kernel_config.ir_op_priority or an inductor
    compilation picks "native". CustomOp subclasses (rotary, activations) run forward_native under
    compilation_config.custom_ops=["none"]; SparseAttnIndexer's forward_native calls forward_cuda anyway.
    """
    return _empty_unless_it_loads("vllm._C_stable_libtorch", "every torch.ops._C* op of vLLM's CUDA library",
                                  "stable_libtorch")


def deep_gemm() -> str:
    """vllm.third_party.deep_gemm as an empty module when DeepGEMM's library is absent or fails to load.

    Why: SparseAttnIndexer (DeepseekV32Attention's and DeepseekV2MLAAttention's indexer) raises at construction on
    CUDA unless vllm.utils.import_utils.has_deep_gemm(); with this placeholder it is True and the layer builds.
    Hides: the indexer's logits kernels (vllm.utils.deep_gemm fp8_fp4_mqa_logits, fp8_fp4_paged_mqa_logits,
    get_paged_mqa_logits_metadata) then raise "DeepGEMM backend is unavailable" when called: a forward through the
    indexer (or its metadata builder) fails instead of computing top-k. is_deep_gemm_supported() also turns True on
    SM90 / SM100, so FP8 block-scaled linears and MoE would pick DeepGEMM and fail the same way (not in a BF16 model).
    """
    return _empty_unless_it_loads("vllm.third_party.deep_gemm", "DeepGEMM's kernels (the DSA indexer's logits)",
                                  "deep_gemm")


def flash_attn() -> str:
    """vllm.vllm_flash_attn without its FlashAttention libraries (_vllm_fa2_C / _vllm_fa3_C, not carried: too large)
    when neither loads: the package with its own flash_attn_interface, minus the __init__'s raise.

    Why: on CUDA, vllm/v1/attention/backends/fa_utils.py imports vllm.vllm_flash_attn at its top, and the package's
    __init__ raises ImportError when neither library loads; fa_utils is imported on the way to every attention layer
    (model_executor/layers/attention/__init__ -> mm_encoder_attention), so no DSA layer builds without this.
    Hides: FlashAttention itself. The interface reports FA2 / FA3 unavailable (its own FA2_AVAILABLE, FA3_AVAILABLE,
    is_fa_version_supported), so get_flash_attn_version() is None and FlashAttention-based backends count as
    unavailable; a call of flash_attn_varlen_func fails. For a DSA layer on SM90 that is the dense-MHA prefill of
    chunks no longer than index_topk (vLLM runs FlashAttention there): without it vLLM finds no MLA prefill backend
    and sends every prefill through forward_mqa. Decodes, MTP steps and prefills longer than index_topk go through
    forward_mqa either way.
    """
    name = "vllm.vllm_flash_attn"
    error = _load_error(name, "flash_attn")
    if error is None:
        return REAL
    spec = importlib.util.find_spec(name)
    module = _placeholder(name, "FlashAttention's kernels (dense-MHA prefill)")
    module.__path__ = list(spec.submodule_search_locations)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__spec__.submodule_search_locations = module.__path__
    interface = importlib.import_module(f"{name}.flash_attn_interface")
    for attr in ("FA2_AVAILABLE", "FA3_AVAILABLE", "compile_flash_attn_varlen_func_from_specs",
                 "fa_version_unsupported_reason", "flash_attn_varlen_func", "get_scheduler_metadata",
                 "is_fa_version_supported"):
        setattr(module, attr, getattr(interface, attr))
    return f"interface only, FA2 {interface.FA2_AVAILABLE}, FA3 {interface.FA3_AVAILABLE} ({error})"


def fused_q_cutedsl() -> str:
    """vllm.models.deepseek_v32.nvidia.ops.fused_q_cutedsl, answering "not supported", when CuTeDSL (`cutlass`,
    nvidia-cutlass-dsl, not carried) cannot be imported.

    Why: DeepseekV32Attention's fused_q imports this module on every CUDA call, and the module imports `cutlass` at
    its top: without it the layer's forward raises ModuleNotFoundError before any kernel runs.
    Hides: the CuTeDSL fused_q kernel, which vLLM's own is_fused_q_cutedsl_supported picks only on compute
    capability 10.x (SM100); on SM90 it answers False and the Triton _fused_q_kernel runs, as here. So on Hopper it
    hides nothing; on a Blackwell GPU the Triton kernel would run in place of vLLM's faster CuTeDSL one.
    """
    name = "vllm.models.deepseek_v32.nvidia.ops.fused_q_cutedsl"
    error = _load_error("cutlass", "fused_q_cutedsl")
    if error is None:
        return REAL
    module = _placeholder(name, "the CuTeDSL fused_q kernel (SM100 only)")
    module.is_fused_q_cutedsl_supported = lambda *args, **kwargs: False

    def fused_q_cutedsl(*args, **kwargs):
        raise RuntimeError("vllm_device_shims: CuTeDSL (cutlass) is not on this machine")

    module.fused_q_cutedsl = fused_q_cutedsl
    return f"placeholder (cutlass {error})"


SHIMS = (stable_libtorch, deep_gemm, flash_attn, fused_q_cutedsl)


def install() -> dict[str, str]:
    """Apply every shim once (before vllm.platforms.current_platform is resolved); returns REPORT. A parent's
    decisions ($VLLM_DEVICE_SHIMS) are applied as they are, without probing; this process's go into the variable for
    its children."""
    if not REPORT:
        _decided.update(json.loads(os.environ.get(DECISIONS_ENV) or "{}"))
        for shim in SHIMS:
            done = shim()
            REPORT[shim.__name__] = _decided.get(shim.__name__, done)  # a parent's decision reads as it did there
        os.environ[DECISIONS_ENV] = json.dumps(REPORT)
    return REPORT


IMPORTS = (
    "import vllm",
    "from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import FlashInferMLASparseImpl, "
    "FlashInferMLASparseTRTLLMBackend",
    "from vllm.models.deepseek_v32.attention import DeepseekV32Attention",
    "from vllm.models.deepseek_v32.common.kernels import fused_norm_rope, fused_q",
    "from vllm.v1.attention.backends.mla.sparse_utils import triton_convert_req_index_to_global_index",
    "from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper",
    "from vllm.v1.attention.ops.dcp import *",
    "from vllm.model_executor.layers.attention.mla_attention import MLAAttention",
    "from vllm.config import VllmConfig, ModelConfig",
    "from vllm.distributed import init_distributed_environment, initialize_model_parallel",
    "from vllm.v1.worker.workspace import init_workspace_manager",
    "import vllm_kimi_dsa.vllm_backend, vllm_kimi_dsa.vllm_glue",
)


def _check() -> int:
    import tempfile
    import traceback
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root), str(root / "tests")]
    failed = 0

    def step(what: str, fn) -> None:
        nonlocal failed
        try:
            fn()
            print("OK   ", what, flush=True)
        except BaseException as e:  # noqa: BLE001  (a check: every failure is reported, the next step still runs)
            failed += 1
            print("FAIL ", what, "->", f"{type(e).__name__}: {e}"[:600], flush=True)
            if os.environ.get("VERBOSE"):
                traceback.print_exc()

    for name, what in install().items():
        print(f"shim  {name}: {what}", flush=True)
    for statement in IMPORTS:
        step(statement, lambda: exec(statement, {}))
    import torch
    import transformers
    import triton
    import vllm

    print(f"      vllm {vllm.__version__} from {os.path.dirname(vllm.__file__)}; torch {torch.__version__}, "
          f"triton {triton.__version__}, transformers {transformers.__version__}", flush=True)
    step("current_platform", lambda: print("      ", type(vllm.platforms.current_platform).__name__, flush=True))
    import vllm_harness as vh

    with tempfile.TemporaryDirectory() as tmp:
        for arch in (vh.DSV32, vh.GLM_DSA):
            step(f"VllmConfig of a tiny {arch}", lambda: vh.vllm_config(Path(tmp) / arch, arch, backend=None))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_check())
