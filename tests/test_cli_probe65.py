"""What the CLI probe of stop 65 found in the command-line entry points, each pinned
(docs/traceability.md, "Found at stop 65 (cli)")."""

from __future__ import annotations

import os

import pytest

from calexec import cliargs
from calexec.drivers.tools.charts_mutate import load_equivalents
from test_cli import calexec, one_line

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo")


@needs_fifo
def test_a_token_file_that_is_a_fifo_no_one_writes_to_is_not_called_empty(tmp_path):
    """``serve --admin-token-file FIFO`` whose writer has not started said ``is empty``: the
    user looked at a file that is not empty (it is no file) and at a writer they had not yet
    started; the line says it is a FIFO that gave nothing and what to give instead."""
    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    done = calexec("serve", "--once", "--admin-token-file", str(fifo), timeout=60)
    line = one_line(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert line == (f"calexec serve: --admin-token-file={str(fifo)!r}: a FIFO that gave nothing "
                    "(no process was writing to it when it was read); give a regular file, or "
                    "start the writer first (a shell's <(command) is one)"), line


@needs_fifo
def test_a_small_text_file_loses_its_byte_order_mark_and_a_pipe_still_reads():
    """A token file (or an ``--equivalent`` TOML) saved with a UTF-8 byte order mark, as
    Notepad writes one: the mark is an encoding's, not the text's. It was kept, and the token
    refused as ``has U+FEFF at character 1`` (a character no editor shows), the TOML as
    ``Invalid statement (at line 1, column 1)``."""
    for payload, text in ((b"\xef\xbb\xbfsecret\r\n", "secret\r\n"),
                          (b"secret\n", "secret\n"),
                          (b"a\xef\xbb\xbfb", "a\ufeffb")):  # (only a leading one is the mark's)
        read, write = os.pipe()
        os.write(write, payload)
        os.close(write)
        try:
            assert cliargs.read_small_text("--x", f"/dev/fd/{read}", 64, "a token") == text
        finally:
            os.close(read)


def test_a_token_file_with_a_byte_order_mark_is_read_as_its_token(tmp_path):
    """The refusal the mark brought at ``serve`` start, gone: a token file written by an
    editor with a BOM and CRLF passes the token check (here ended by the two-line refusal
    below, so no server starts: the BOM is no longer what is named)."""
    token = tmp_path / "token"
    token.write_bytes(b"\xef\xbb\xbfs3cret\r\nsecond\r\n")
    token.chmod(0o600)
    done = calexec("serve", "--once", "--admin-token-file", str(token), timeout=60)
    line = one_line(done.stderr)
    assert done.returncode == 2 and "U+FEFF" not in line, line


def test_a_token_file_of_two_lines_says_so(tmp_path):
    """``--admin-token-file`` holding two lines (a token and a comment, two tokens) was
    refused as ``the token has U+000A at character 7, not printable ASCII: HTTP headers are
    latin-1 ...``: a newline named as a code point; it now says the file holds 2 lines."""
    token = tmp_path / "token"
    token.write_text("s3cret\nold-token\n")
    token.chmod(0o600)
    done = calexec("serve", "--once", "--admin-token-file", str(token), timeout=60)
    line = one_line(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert line == (f"calexec serve: --admin-token-file={str(token)!r} holds 2 lines: the file "
                    "holds the token alone, on one line"), line
    assert "s3cret" not in done.stderr  # (the token is never echoed)


@needs_fifo
def test_an_equivalent_file_that_is_a_fifo_no_one_writes_to_is_refused(tmp_path):
    """``charts mutate --equivalent FIFO`` with no writer read as an empty TOML: no mutant
    was declared equivalent, silently, and the run went on; now refused before any run."""
    fifo = tmp_path / "eq.toml"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="a FIFO that gave nothing"):
        load_equivalents(fifo)


@needs_fifo
def test_an_interrupted_build_lets_its_group_clean_up_before_it_is_killed(tmp_path, monkeypatch):
    """A Ctrl-C (or SIGTERM) during ``conform``'s or ``bench overhead``'s build killed make's
    process group with SIGKILL at once: gcc's temporary files (``/tmp/ccXXXX.s``, ``.o``)
    stayed behind at every interrupted build. The group is now told SIGTERM first (gcc and
    make clean up on it), SIGKILL only for what is left after a grace. Here a program that
    cleans up on SIGTERM: once it says it is ready (through a FIFO) and ``run_group`` waits
    on it, this process is interrupted, and the program's cleanup must have run."""
    import signal
    import subprocess
    import sys
    import threading

    from calexec.drivers.tools.bench import subproc

    # a grace no loaded machine outlasts: what is checked is the order, SIGTERM first
    monkeypatch.setattr(subproc, "TERM_GRACE_S", 60.0, raising=False)
    waiting = threading.Event()
    communicate = subprocess.Popen.communicate

    def communicating(self, *args, **kwargs):  # (the interrupt must come while it waits)
        waiting.set()
        return communicate(self, *args, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "communicate", communicating)
    ready, mark = tmp_path / "ready", tmp_path / "cleaned"
    os.mkfifo(ready)
    program = ("import pathlib, signal, sys, time\n"
               "def cleanup(*_):\n"
               f"    pathlib.Path({str(mark)!r}).write_text('cleaned')\n"
               "    sys.exit(143)\n"
               "signal.signal(signal.SIGTERM, cleanup)\n"
               f"pathlib.Path({str(ready)!r}).write_text('ready')\n"
               "time.sleep(60)\n")  # (bounded, should all else fail)

    def interrupt_once_ready() -> None:
        with open(ready) as fifo:  # (returns once the program has its trap set and writes)
            fifo.read()
        if waiting.wait(60):
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_ready, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        subproc.run_group([sys.executable, "-c", program], timeout=90)
    assert mark.read_text() == "cleaned"


def test_the_browser_of_diagrams_live_keeps_its_temporary_files_in_a_directory_removed_after(
        tmp_path, monkeypatch):
    """A Ctrl-C (or SIGTERM) during ``calexec diagrams live``'s shot killed Chromium, which
    left its ``org.chromium.Chromium.XXXXXX`` directory in ``$TMPDIR`` (/tmp) each time; the
    browser's ``TMPDIR`` is now a directory of its own, removed after it (stop 67: not the
    command's working directory, whose path can be too long for Chromium's singleton socket,
    tests/test_live_screenshots_tmp.py). A stand-in ``chromium`` on PATH makes its directory
    there and reports the TMPDIR it was given."""
    from calexec.drivers.tools.live_screenshots import chromium_capture

    bin_dir, workdir = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir()
    workdir.mkdir()
    fake = bin_dir / "chromium"
    fake.write_text('#!/bin/sh\nmkdir "$TMPDIR/org.chromium.Chromium.x" && printf %s "$TMPDIR"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    done = chromium_capture("file:///nothing", str(workdir))
    assert done.returncode == 0 and done.stdout, (done.stdout, done.stderr)
    assert not os.path.exists(done.stdout), "the browser's temporary directory was left behind"
    assert len(done.stdout + "/org.chromium.Chromium.XXXXXX/SingletonSocket") <= 107
