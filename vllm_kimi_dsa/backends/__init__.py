"""The kernels the core runs, by family: FlashInfer's Blackwell kernels (flashinfer/) and the Hopper dispatcher.

Each backend builds from a DecodeSetup and runs as a DecodeKernel (kernels/base.py); selection picks among them.
"""
