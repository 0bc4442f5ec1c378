"""The validators and value tests the config classes (``ExecutorConfig``, ``RecoveryPolicy``,
``HotPathTuning``, ``ServerConfig``) and the request paths share.

``number``: a finite number, an int where the field counts something, never a bool, within
its bounds; ``flag``: True or False. The error names the field and the value it got, so an
embedder's typo is found where the config is built, not deep in a thread (a NaN timeout
hung ``start()``; an infinite yield crashed a thread's wait).

``is_int`` and ``is_token_id``: an int (numpy's included, never a bool) and a token id, which
the configs' token settings, a decode stream's steps and stop tokens and the sampling
parameters ask of their values.

``shown``: a value as a JSON client wrote it, for the messages an HTTP client reads
(``null``, ``true``, ``"text"``, ``NaN``: not Python's ``None``, ``True``, ``'text'``, ``nan``).
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Callable
from typing import Any, SupportsFloat, TypeGuard

Validator = Callable[[Any, Any, Any], None]


def number(low: float = -math.inf, high: float = math.inf, *, integral: bool = False,
           above: bool = False, owner: str | None = None) -> Validator:
    """An attrs validator: a finite number in ``[low, high]`` (``(low, high]`` when
    ``above``), an int (numpy's included) when ``integral``, never a bool. TypeError for
    another kind of value, ValueError for one out of range, each naming
    ``owner.field=value`` (``field=value`` without an owner)."""
    kind = numbers.Integral if integral else numbers.Real

    def check(instance: Any, attribute: Any, value: Any) -> None:
        name = attribute.name if owner is None else f"{owner}.{attribute.name}"
        if isinstance(value, bool) or not isinstance(value, kind):
            raise TypeError(f"{name}={value!r}: expected {'an int' if integral else 'a number'}"
                            f", got {type(value).__name__}")
        as_float = to_float(value)
        if not (math.isfinite(as_float) and (as_float > low if above else as_float >= low)
                and as_float <= high):
            parts = [] if low == -math.inf else [f"{'>' if above else '>='} {low:g}"]
            parts += [] if high == math.inf else [f"<= {high:g}"]
            raise ValueError(f"{name}={value!r}: must be finite"
                             + "".join(f" and {part}" for part in parts))
    return check


def to_float(value: SupportsFloat) -> float:
    """``float(value)``, an int beyond the largest float (``10**400``) being an infinity of
    its sign: ``float()`` raises ``OverflowError`` for it, naming neither the field nor the
    value, where a finite check then names both (a deadline or wait that far away is one
    that never passes, as ``math.inf``)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf  # type: ignore[operator]  # an int here


def flag(owner: str | None = None) -> Validator:
    """An attrs validator: True or False, nothing else (a str ``"no"`` is true, an int 1 no
    setting's value): a TypeError naming ``owner.field=value``."""
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if not isinstance(value, bool):
            name = attribute.name if owner is None else f"{owner}.{attribute.name}"
            raise TypeError(f"{name}={value!r}: must be True or False, got "
                            f"{type(value).__name__}")
    return check


def is_int(value: object) -> TypeGuard[int]:
    """An int, numpy's included, never a bool (``True`` is no token 1, no count 1). A plain
    int is answered first: a decode stream asks this of every token."""
    return type(value) is int or (isinstance(value, numbers.Integral)
                                  and not isinstance(value, bool))


def is_token_id(value: object) -> TypeGuard[int]:
    """A token id: an int (``is_int``) >= 0. Whether it is below a model's vocabulary size
    is the caller's to check: a config holds ids before any model is loaded."""
    return is_int(value) and value >= 0


def token_ids(value: object) -> bool:
    """A non-empty tuple of token ids (``is_token_id``)."""
    return isinstance(value, tuple) and bool(value) and all(map(is_token_id, value))


#: a lone surrogate (a str from ``\\ud800`` escapes or ``surrogateescape``), not UTF-8 encodable
_SURROGATE = re.compile("[\ud800-\udfff]")


def _plain(value: object) -> object:
    """``json.dumps``' fallback: a numpy scalar as its Python value, anything else as text."""
    item = getattr(value, "item", None)
    if callable(item) and not isinstance(value, (list, tuple, dict)):
        try:
            got = item()
        except (TypeError, ValueError):
            return str(value)
        if isinstance(got, (bool, int, float, str)) or got is None:
            return got
    return str(value)


def shown(value: object, limit: int = 80) -> str:
    """``value`` written as JSON (as a client wrote it: ``null``, ``true``, ``"x"``, ``[1, 2]``,
    ``NaN``/``Infinity`` as Python's JSON reads them), cut to ``limit`` characters; a lone
    surrogate written as its ``\\uXXXX`` escape, so the message it goes into is UTF-8."""
    try:
        text = json.dumps(value, ensure_ascii=False, default=_plain)
    except (TypeError, ValueError, RecursionError):  # (an int past 4300 digits; a cycle)
        text = "(a value too large to show)"
    if _SURROGATE.search(text):
        text = _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    return text[:limit]


def shown_string(value: str, limit: int = 80) -> str:
    """``value`` written as a JSON string (as :func:`shown`) in at most ``limit`` characters:
    whole, or its first characters and its closing quote followed by ``...`` (``"abc"...``).
    :func:`shown` cuts the text, the closing quote with it (``"abc``), which reads as if the
    value ended there; where the string sits inside other text (a key in ``logit_bias[KEY]``)
    the reader could not tell where it ended."""
    text = shown(value, limit + 1)
    if len(text) <= limit:
        return text
    n = max(0, limit - 5)
    while n > 0 and len(shown(value[:n], 4 * limit)) > limit - 3:  # (escapes: \n, \u0001)
        n -= 1
    return shown(value[:n], 4 * limit) + "..."
