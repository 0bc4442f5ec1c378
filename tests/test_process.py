"""drivers/serving/process.py: the GIL switch interval serving entry points set."""

from __future__ import annotations

import subprocess
import sys

import pytest

from calexec.drivers.serving.process import SERVING_SWITCH_INTERVAL_US, set_gil_switch_interval_us


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
