"""FlashInfer's sparse MLA decode kernels for Blackwell: prims_ts (planned, shared workspace) and trtllm-gen.

FlashInfer is imported lazily, so this package loads on a machine without it; `features` says what is installed.
"""
