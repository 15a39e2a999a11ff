"""Integer helpers for host code that sizes Triton launches and plans.

triton.cdiv and triton.next_power_of_2 are constexpr_functions: ~1.7 µs a call on the host (Triton 3.6 and 3.8).
The planner calls them ~10^5 times building a plan table, and every launch calls them. These twins give the same
answers (tests/test_triton_decode.py holds them to Triton's) at plain-Python cost.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceil division, as triton.cdiv."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The next power of two >= n (n >= 1), as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length()
