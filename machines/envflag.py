"""One reading of calexec's on/off environment variables (``CALEXEC_CHECK_LOCK_ORDER``,
``CALEXEC_TRANSITION_GATE``, ``CALEXEC_DEBUG``): ``1`` on, ``0`` off, unset or empty the
default; any other value is refused naming the variable, its value and what to give.

Each variable was read its own way until stop 67: the lock-order checker took any value but
``0`` as on (``CALEXEC_CHECK_LOCK_ORDER=false`` turned it on), the CLI's ``CALEXEC_DEBUG`` any
non-empty one (``=0`` showed the traceback), while the transition gate refused what was not
``0`` or ``1``. A word (``false``, ``off``, ``no``) is refused rather than guessed at: the one
that was read as its opposite is the defect this module ends.
"""

from __future__ import annotations

import os


class EnvFlagError(ValueError):
    """An on/off variable set to a value other than 0 or 1; the message names it."""


def env_flag(name: str, default: bool, on: str, off: str) -> bool:
    """``$name`` as an on/off switch: ``1`` True, ``0`` False, unset or empty (spaces around
    are ignored) ``default``; another value raises :class:`EnvFlagError`,
    ``NAME='false': give 1 to <on>, or 0 (or unset it) to <off>`` (the default named last)."""
    text = os.environ.get(name, "").strip()
    if text == "":
        return default
    if text in ("0", "1"):
        return text == "1"
    if default:
        raise EnvFlagError(f"{name}={text!r}: give 0 to {off}, or 1 (or unset it) to {on}")
    raise EnvFlagError(f"{name}={text!r}: give 1 to {on}, or 0 (or unset it) to {off}")
