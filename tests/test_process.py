"""drivers/serving/process.py: the GIL switch interval serving entry points set."""

from __future__ import annotations

import subprocess
import sys

import pytest

from calexec.drivers.serving.process import (
    MAX_SWITCH_INTERVAL_US,
    SERVING_SWITCH_INTERVAL_US,
    set_gil_switch_interval_us,
)


def test_sets_and_returns_the_previous_interval():
    before = sys.getswitchinterval()
    try:
        previous = set_gil_switch_interval_us(250)
        assert previous == round(before * 1e6)
        assert sys.getswitchinterval() == pytest.approx(250e-6)
        assert set_gil_switch_interval_us(0) == 250  # 0 keeps the interval
        assert sys.getswitchinterval() == pytest.approx(250e-6)
    finally:
        sys.setswitchinterval(before)


def test_negative_interval_is_refused_naming_the_value():
    with pytest.raises(ValueError, match="interval=-1 us"):
        set_gil_switch_interval_us(-1)


def test_serve_rejects_a_negative_interval_as_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "calexec", "serve", "--once",
                           "--gil-switch-us", "-5"], capture_output=True, text=True, timeout=60)
    # one line naming the flag and the value (the parser refuses it before anything starts)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "--gil-switch-us" in proc.stderr and "-5" in proc.stderr
    assert SERVING_SWITCH_INTERVAL_US < 5000  # shorter than Python's default, or pointless


def test_an_interval_past_the_bound_is_refused_not_wrapped_to_zero():
    """``serve --gil-switch-us 1000000000000000000000`` (1e21) was taken: CPython keeps the
    interval as an unsigned long of microseconds and the value wrapped silently to 0 (a switch
    at every check); past :data:`MAX_SWITCH_INTERVAL_US` it is refused, the interval in force
    unchanged."""
    before = sys.getswitchinterval()
    try:
        with pytest.raises(ValueError, match=rf"interval={MAX_SWITCH_INTERVAL_US + 1} us: "
                                             rf"must be in 0\.\.{MAX_SWITCH_INTERVAL_US}"):
            set_gil_switch_interval_us(MAX_SWITCH_INTERVAL_US + 1)
        with pytest.raises(ValueError, match="must be in"):
            set_gil_switch_interval_us(10 ** 21)
        assert sys.getswitchinterval() == before
        set_gil_switch_interval_us(MAX_SWITCH_INTERVAL_US)  # the bound itself is taken
        assert sys.getswitchinterval() == pytest.approx(MAX_SWITCH_INTERVAL_US / 1e6)
    finally:
        sys.setswitchinterval(before)


def test_serve_refuses_an_interval_past_the_bound_naming_flag_value_and_range():
    proc = subprocess.run([sys.executable, "-m", "calexec", "serve", "--once",
                           "--gil-switch-us", str(10 ** 21)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--gil-switch-us" in proc.stderr and str(10 ** 21) in proc.stderr
    assert f"0..{MAX_SWITCH_INTERVAL_US}" in proc.stderr
