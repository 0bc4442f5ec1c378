"""Found at stop 56 (fleet, admin, debug and server leftovers): each test names what a user
hit before its fix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from calexec.drivers.serving.service import MAX_CHOICES, ServerConfig


def test_serve_refuses_a_max_choices_past_its_bound_naming_flag_value_and_range():
    """``serve --max-choices 100000000000`` was taken: one request with a huge ``n`` then set
    up that many choices (an admission, a task, a held answer each) and exhausted memory.
    Refused now in one line naming the flag, the value and the range (exit 2)."""
    proc = subprocess.run([sys.executable, "-m", "calexec", "serve", "--once",
                           "--max-choices", str(10 ** 11)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--max-choices" in proc.stderr and str(10 ** 11) in proc.stderr
    assert f"1..{MAX_CHOICES}" in proc.stderr


def test_a_server_config_refuses_a_max_choices_past_its_bound():
    """The embedder's way to the same cap (``ServerConfig``, a Ray replica's settings)."""
    with pytest.raises(ValueError, match=rf"^max_choices={10 ** 11}: must be .*<= "
                                         rf"{MAX_CHOICES}"):
        ServerConfig(max_choices=10 ** 11)
    assert ServerConfig(max_choices=MAX_CHOICES).max_choices == MAX_CHOICES  # (the bound)
