"""The kernels the core runs, by family: FlashInfer's Blackwell kernels (flashinfer/) and the Hopper dispatcher of
this package's Triton / Gluon kernels (hopper/); registry maps each kernel name to its class.

Each backend builds from a DecodeSetup and runs as a DecodeKernel (kernels/base.py); selection picks among them.
"""
