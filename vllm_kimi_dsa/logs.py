"""The package's loggers: vLLM's `init_logger`, under vLLM's "vllm" logger so VLLM_LOGGING_LEVEL and its format apply.

vLLM configures only the "vllm" logger tree, so ours are named "vllm.kimi_dsa.<module>". Without vLLM (the H200, a
bare checkout) a plain `logging` logger of the module's own name.
"""

from __future__ import annotations

import logging


PREFIX = "vllm.kimi_dsa"


def init_logger(name: str) -> logging.Logger:
    """The logger for module `name` ("vllm_kimi_dsa.x"): vLLM's "vllm.kimi_dsa.x" when vLLM imports, else `name`."""
    try:
        from vllm.logger import init_logger as vllm_init_logger
    except ImportError:
        return logging.getLogger(name)
    suffix = name.split(".", 1)[1] if name.startswith("vllm_kimi_dsa.") else name
    return vllm_init_logger(f"{PREFIX}.{suffix}")


__all__ = ["PREFIX", "init_logger"]
