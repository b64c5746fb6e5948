"""One helper per kind of input check, for the doors (public functions, the CLI, HTTP).

Every helper raises with a message that names the argument, the value and what was expected, and
returns the value (normalised where that helps: `token_ids` gives a list, `number` a float), so a door
reads `self.top_p = probability("top_p", top_p)`.

The rule for which exception:
  TypeError  -- the object is the wrong KIND: a str or float where an int is wanted, a bool where an int
                is wanted (True is not a count), an int where a bool is wanted, a dict where a list is.
  ValueError -- the kind is right but the VALUE is not allowed: 0 where a positive int is wanted, a
                probability of 1.5, a name not among the choices, a token id outside the vocabulary.
A token-id list is a value check on each element: a prompt holding 'a' or 3.0 or 999 is a bad prompt
(ValueError), while a prompt that is not a list at all is the wrong kind (TypeError).

Code behind a door trusts its arguments; these helpers are for the doors only (never a hot loop).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

import torch


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def instance(name: str, value, kind: type | tuple[type, ...]):
    """`value` is a `kind` (a class or a tuple of classes), else TypeError."""
    if not isinstance(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        wanted = " or ".join(k.__name__ for k in kinds)
        raise TypeError(f"{name} must be a {wanted}, got {type(value).__name__}")
    return value


def boolean(name: str, value) -> bool:
    """True or False, nothing else (1 and "yes" are not bools)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be a bool, got {type(value).__name__}")
    return value


def string(name: str, value, *, empty: bool = True) -> str:
    """A str; `empty=False` refuses "" (ValueError)."""
    if not isinstance(value, str):
        raise TypeError(f"{name}={value!r} must be a string, got {type(value).__name__}")
    if not empty and not value:
        raise ValueError(f"{name} is empty; expected at least one character")
    return value


def path_like(name: str, value, what: str = "a path"):
    """A str or os.PathLike (`what` says which path: "a directory path", ...)."""
    if not isinstance(value, str | os.PathLike):
        raise TypeError(f"{name}={value!r} must be {what} (str or os.PathLike)")
    return value


def integer(name: str, value, *, low: int | None = None, high: int | None = None, expected: str = "") -> int:
    """An int (not a bool) in [low, high] (either bound may be None). `expected` overrides the wording."""
    if not _is_int(value):
        raise TypeError(f"{name}={value!r} must be an int, got {type(value).__name__}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name}={value} must be {expected or _int_range(low, high)}")
    return value


def _int_range(low: int | None, high: int | None) -> str:
    if high is None:
        named = {1: "a positive integer", 0: "a non-negative integer", None: "an integer"}
        return named.get(low, f"an integer >= {low}")
    if low is None:
        return f"an integer <= {high}"
    return f"an integer in [{low}, {high}]"


def positive_int(name: str, value) -> int:
    """An int >= 1."""
    return integer(name, value, low=1)


def non_negative_int(name: str, value) -> int:
    """An int >= 0."""
    return integer(name, value, low=0)


def power_of_two(name: str, value, *, low: int = 1) -> int:
    """An int that is a power of two and >= low."""
    integer(name, value)
    if value < low or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= {low}")
    return value


def number(name: str, value, *, low: float = -math.inf, high: float = math.inf,
           low_open: bool = False, high_open: bool = False, expected: str = "") -> float:
    """A finite int or float (not a bool) in the interval low..high; `*_open` leaves that end out.
    Returns it as a float."""
    if not _is_number(value):
        raise TypeError(f"{name}={value!r} must be a number, got {type(value).__name__}")
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if not math.isfinite(value) or below or above:
        raise ValueError(f"{name}={value} must be {expected or _real_range(low, high, low_open, high_open)}")
    return float(value)


def _real_range(low: float, high: float, low_open: bool, high_open: bool) -> str:
    if high == math.inf:
        if low == -math.inf:
            return "a finite number"
        return f"a finite number {'>' if low_open else '>='} {low:g}"
    if low == -math.inf:
        return f"a number {'<' if high_open else '<='} {high:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def positive_number(name: str, value) -> float:
    """A finite number > 0."""
    return number(name, value, low=0.0, low_open=True, expected="a positive finite number")


def probability(name: str, value, *, zero: bool = True, one: bool = True) -> float:
    """A number in [0, 1]; `zero=False` / `one=False` leave that end out (dropout: [0, 1), top_p: (0, 1])."""
    return number(name, value, low=0.0, high=1.0, low_open=not zero, high_open=not one)


def choice(name: str, value, choices: Iterable):
    """One of `choices`, else ValueError listing them (whatever the kind of `value`)."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not known; expected one of {', '.join(map(str, choices))}")
    return value


def token_id(name: str, value, vocab_size: int) -> int:
    """One token id: an int in [0, vocab_size)."""
    return integer(name, value, low=0, high=vocab_size - 1, expected=f"a token id in [0, vocab_size={vocab_size})")


def token_ids(name: str, ids, vocab_size: int | None = None, *, empty: bool = False) -> list[int]:
    """A list/tuple of token ids, or a 1-D integer tensor, as a list of ints. Each id is an int in
    [0, vocab_size) (any id >= 0 when vocab_size is None); `empty=False` refuses an empty sequence."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor, got shape {tuple(ids.shape)} of dtype {ids.dtype}")
        ids = ids.tolist()
    if not isinstance(ids, list | tuple):
        raise TypeError(f"{name}={ids!r} must be a list of token ids, got {type(ids).__name__}")
    if not empty and not ids:
        raise ValueError(f"{name} is empty; expected at least one token id")
    for token in ids:
        if not _is_int(token) or token < 0 or (vocab_size is not None and token >= vocab_size):
            expected = f"token ids in [0, vocab_size={vocab_size})" if vocab_size is not None else "token ids >= 0"
            raise ValueError(f"{name} contains {token!r}, expected {expected}")
    return list(ids)
