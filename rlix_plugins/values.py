"""Type checks for values that arrive untyped (JSON, YAML, Ray calls, host configs).

``bool`` is a subclass of ``int`` in Python, so ``true`` in a config or ``True`` passed by
mistake would read as 1 through a plain ``isinstance(x, int)``; every check here refuses it.
"""

from __future__ import annotations

import enum
import math
import operator
from typing import TypeGuard, TypeVar

_E = TypeVar("_E", bound=enum.Enum)


def is_int(value: object) -> TypeGuard[int]:
    """``value`` is an int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """``value`` is an int or a float and not a bool (NaN and infinities included)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite(value: object) -> TypeGuard[int | float]:
    """``value`` is a finite int or float a float can hold, and not a bool (an int such as
    ``10**400`` is not: ``math.isfinite`` raises OverflowError for it, an untyped error for
    the caller's input check)."""
    if not is_number(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def as_index(value: object) -> int | None:
    """``value`` as an int when it is an integer (ints and numpy/torch integer scalars, through
    ``operator.index``), else None: never a bool, a float or a string."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def count(value: object, error: type[Exception], what: str) -> int:
    """``value`` as an int >= 0 (see :func:`as_index`); ``error`` naming ``what`` otherwise."""
    out = as_index(value)
    if out is None or out < 0:
        raise error(f"{what}={value!r} is not valid; valid: an int >= 0")
    return out


def enum_member(cls: type[_E], value: object, error: type[Exception], what: str) -> _E:
    """``value`` as a member of ``cls`` (a member or its value, as configs and wire calls send
    it); ``error`` naming ``what`` and the valid values otherwise."""
    try:
        return cls(value)
    except ValueError:
        valid = sorted(str(m.value) for m in cls)
        raise error(f"unknown {what} {value!r}; valid values are {valid}") from None
