"""Type checks for values that arrive untyped (JSON, YAML, Ray calls, host configs).

``bool`` is a subclass of ``int`` in Python, so ``true`` in a config or ``True`` passed by
mistake would read as 1 through a plain ``isinstance(x, int)``; every check here refuses it.
"""

from __future__ import annotations

import math
from typing import TypeGuard


def is_int(value: object) -> TypeGuard[int]:
    """``value`` is an int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """``value`` is an int or a float and not a bool (NaN and infinities included)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite(value: object) -> TypeGuard[int | float]:
    """``value`` is a finite int or float and not a bool."""
    return is_number(value) and math.isfinite(value)
