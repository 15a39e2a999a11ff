"""Checks of public functions' integer arguments and of the fields read off vLLM's objects, with errors that name them.

The lowest layer of the package (imports nothing of it): selection, the FlashInfer plans and the core share it.
"""

from __future__ import annotations

import operator
from typing import Any


def positive_int(value: Any, name: str) -> int:
    """`value` as an int >= 1 (numpy ints too); TypeError for a non-int or a bool, ValueError below 1, naming it."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def dcp_flag(value: Any, name: str = "dcp") -> bool:
    """Whether `value` says "under decode context parallelism": a bool is the flag itself (the seed's
    `FI_KERNEL["dcp" if dcp else "tp"]`); an int (numpy ints too) is a DCP size, 0 or 1 tensor parallel and > 1 under
    DCP. TypeError for anything else (a float, a str), ValueError below 0, naming the argument."""
    if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):  # numpy.bool_ is no int subclass
        return bool(value)
    try:
        size = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a bool or an int (a DCP size: 0 or 1 tensor parallel, > 1 under DCP), "
                        f"got {type(value).__name__}") from None
    if size < 0:
        raise ValueError(f"{name} must be >= 0 (0 or 1: tensor parallel, > 1: a DCP size), got {size}")
    return size > 1


def required_field(obj: Any, name: str, what: str) -> Any:
    """`obj.name`, read directly: a field a vLLM object carries in the pinned release (README: "Why vLLM is pinned").
    TypeError naming `what.name` where it is missing, instead of a default that would silently do the wrong thing
    after a rename (tests/test_vllm_pin.py names every such field)."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise TypeError(f"{what}.{name} is missing ({type(obj).__name__} has no {name!r}); vLLM 0.33's object "
                        f"carries it: a vLLM that renamed it is not the one this package is pinned to") from None


__all__ = ["dcp_flag", "positive_int", "required_field"]
