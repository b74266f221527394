"""Durations at the API are seconds (int/float) or ``timedelta``; on the wire, integer ms."""

from __future__ import annotations

import math
from datetime import timedelta

from .exceptions import LockConfigurationError

Duration = float | int | timedelta


def seconds(value: object, what: str) -> float:
    """``value`` as finite seconds >= 0, or ``LockConfigurationError`` naming ``what``."""
    if type(value) is float and 0.0 <= value < math.inf:  # as settings are, once resolved: no conversion
        return value
    if isinstance(value, timedelta):
        result = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            result = float(value)
        except OverflowError:  # an int too large for a float: out of range, not a crash
            result = math.inf
    else:
        raise LockConfigurationError(f"{what} must be a number of seconds or a timedelta, got {value!r}")
    if not math.isfinite(result) or result < 0:
        raise LockConfigurationError(f"{what} must be finite and >= 0 seconds, got {value!r}")
    return result


def to_ms(secs: float) -> int:
    """Seconds to whole milliseconds for PX/PEXPIRE, never rounding a positive value down to 0."""
    return max(1, math.ceil(secs * 1000)) if secs > 0 else 0
