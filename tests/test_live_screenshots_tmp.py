"""Headless Chromium's temporary directory (drivers/tools/live_screenshots.py).

CI of stop 66 failed four browser tests at once: the command gave Chromium its working directory
as ``$TMPDIR``, and Chromium's singleton socket there (``org.chromium.Chromium.XXXXXX/
SingletonSocket``) must fit a unix socket's 107 bytes: under ``/tmp/pytest-of-root/pytest-1017/
<test name>`` it did not ("Socket path too long", SIGABRT), under ``pytest-938`` it just did."""

from __future__ import annotations

from pathlib import Path

import pytest

from calexec.drivers.tools.live_screenshots import chromium_capture


@pytest.mark.requires_tool("chromium")
def test_a_long_working_directory_still_gets_the_page(tmp_path: Path) -> None:
    workdir = tmp_path / ("w" * 80)
    workdir.mkdir()
    page = tmp_path / "page.html"
    page.write_text("<p id='x'>calexec-ok</p>", encoding="utf-8")
    done = chromium_capture(f"file://{page}", str(workdir), budget_ms=200, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "calexec-ok" in done.stdout
