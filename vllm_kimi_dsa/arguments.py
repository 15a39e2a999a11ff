"""Checks of public functions' integer arguments, with errors that name the argument.

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


__all__ = ["positive_int"]
