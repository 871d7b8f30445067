"""Checked reads of scalars and host arrays: the one place that says what a valid int, real, bool or
float dtype is. Used by the spec, HF configs, the frontend, attention and diagnostics.

Every check names the argument and what came (``name must be ..., got TYPE VALUE``); ``error`` picks
the exception class (ConfigError for config.json fields, TypeError/ValueError elsewhere). Bools are
never numbers here, although Python treats them as ints.
"""

from __future__ import annotations

import math
import numbers
import operator

import numpy as np
from array_api_compat import is_cupy_array, is_torch_array


def is_bool(value) -> bool:
    """True for Python and NumPy bools (which are not valid numbers anywhere in rotary)."""
    return isinstance(value, (bool, np.bool_))


def is_real(value) -> bool:
    """A real number that is not a bool (int, float, NumPy scalars)."""
    return isinstance(value, numbers.Real) and not is_bool(value)


def finite_float(value):
    """``value`` as a finite float, or None for a non-number, bool, inf, nan or an int too large for a float."""
    if not is_real(value):
        return None
    try:
        value = float(value)
    except OverflowError:   # an int past float's range (10**400 in a JSON config)
        return None
    return value if math.isfinite(value) else None


def as_int(value, name: str, *, error=TypeError, integral_float: bool = False) -> int:
    """``value`` as a Python int (``operator.index``); ``integral_float``: also 4.0 -> 4 (JSON configs)."""
    if is_bool(value):
        raise error(f"{name} must be an integer, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        pass
    if integral_float and isinstance(value, float) and value.is_integer():
        return int(value)
    raise error(f"{name} must be an integer, got {type(value).__name__} {value!r}")


def as_bool(value, name: str) -> bool:
    """``value`` as a bool; only Python/NumPy bools are accepted (TypeError otherwise)."""
    if not is_bool(value):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def as_finite(value, name: str, *, error=TypeError) -> float:
    """``value`` as a finite float (``error`` for a non-number or bool, ``error`` for inf/nan too)."""
    number = finite_float(value)
    if number is None:
        raise error(f"{name} must be a finite number, got {type(value).__name__} {value!r}"[:300])
    return number


def positive_real(value, name: str) -> float:
    """``value`` as a finite float > 0 (TypeError for non-numbers and bools, ValueError otherwise)."""
    if is_bool(value) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    number = finite_float(value)
    if number is None or not number > 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value}"[:300])
    return number


def optional_number(value, name: str, *, positive: bool = True, integer: bool = False):
    """None, or ``value`` as a finite (``positive``: > 0) float, or int when ``integer``."""
    if value is None:
        return None
    kinds = numbers.Integral if integer else numbers.Real
    if is_bool(value) or not isinstance(value, kinds):
        raise TypeError(f"{name} must be {'an integer' if integer else 'a real number'} or None, "
                        f"got {type(value).__name__}")
    if finite_float(value) is None:
        raise ValueError(f"{name} must be finite, got {value}"[:300])
    if positive and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return int(value) if integer else float(value)


def int_tuple(value, name: str) -> tuple:
    """A sequence of ints as a tuple (each element checked by :func:`as_int`)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a sequence of integers, got {type(value).__name__} {value!r}")
    return tuple(as_int(v, f"{name}[{i}]") for i, v in enumerate(value))


def to_numpy(a, name: str = "positions") -> np.ndarray:
    """A host NumPy copy/view of any array-like (CuPy, torch, JAX, array-api-strict, list)."""
    if isinstance(a, np.ndarray):
        return a
    if is_cupy_array(a):
        return a.get()
    if is_torch_array(a):
        return a.detach().cpu().numpy()
    try:
        return np.asarray(a)
    except Exception:
        try:
            return np.from_dlpack(a)
        except Exception as exc:
            raise TypeError(f"{name} could not be read as an integer array: {exc}") from None


def check_float(x, name: str, xp) -> None:
    """TypeError unless array ``x`` has a real floating dtype rotary computes in (fp16/bf16/fp32/fp64)."""
    if type(x) is np.ndarray and x.dtype.kind == "f":   # NumPy float16/32/64
        if x.dtype.itemsize > 8:
            raise TypeError(f"{name} has dtype {x.dtype} (np.longdouble), which rotary does not compute in: "
                            f"cast to float64 ({name}.astype(np.float64)) for a float64 rotation")
        return
    ok = False
    try:
        ok = xp.isdtype(x.dtype, "real floating")
    except Exception:
        ok = False
    if not ok:
        raise TypeError(f"{name} must have a real floating dtype (float16/bfloat16/float32/float64), got {x.dtype}")
