"""The benchmark suite of `python -m vllm_kimi_dsa bench`: its sections, peers, tables and pictures, installed with the
package so a wheel runs it (the peers where their libraries and harnesses are present).

suite: the decode suite (decode, torch, convert, fused, accuracy) and its CLI; prefill: the prefill section (and its
CLI, `python -m vllm_kimi_dsa.bench.prefill`); plot: pictures and markdown tables from the JSON; peers: the Hopper
peers (FlashInfer's fa3, FlashMLA's sparse decode and prefill). Nothing below the CLI imports this package.
"""
