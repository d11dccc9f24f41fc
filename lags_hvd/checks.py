"""The validations repeated across the library, one helper each (pure)."""

from __future__ import annotations

import math
import numbers

__all__ = ["is_count", "check_count", "check_number", "check_flag"]


def is_count(value) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is an int to Python, never a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_count(value, name: str, minimum: int = 0) -> int:
    """``value`` if it is a count >= ``minimum``, else ValueError naming ``name``."""
    if not is_count(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_number(
    value,
    name: str,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = True,
    none: bool = False,
) -> float | None:
    """``value`` as a float in the interval from ``low`` to ``high`` (open at the ends said so;
    NaN and bools are refused); with ``none``, None passes. ValueError naming ``name``."""
    if value is None and none:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or math.isnan(value)
        or value < low
        or (low_open and value == low)
        or value > high
        or (high_open and value == high)
    ):
        if high == math.inf:
            interval = f"{'>' if low_open else '>='} {low:g}"
        else:
            interval = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be a number {interval}{' or None' if none else ''}, got {value!r}")
    return float(value)


def check_flag(value, name: str, none: str = ""):
    """``value`` if it is True or False (or None, where ``none`` says what None means), else
    ValueError naming ``name``."""
    if not isinstance(value, bool) and not (none and value is None):
        allowed = f"True, False or None ({none})" if none else "True or False"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value
