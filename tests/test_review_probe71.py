"""Stop 71 (review): defects found reviewing the stop's merged change.

1. A reload's check (``switch_check.check_calbin``) opens the calbin once and says it reads
   what it opened (its first bytes, the runtime's loader, the sha256), but it gave the
   runtime's loader (``inspect_calbin``) the path again: a file replaced after the check's
   look was what the loader read (a FIFO there: ``calbin.invalid``, "the loader refused it
   (ERR_FILE_READ)", of a calbin that was whole when looked at). The loader now reads the
   file the check holds open (``/proc/self/fd/N``), as the switch's load does.
2. A flag no command has, typed after a switch (``calexec diagrams --check --frobnicate``),
   was told it was the switch's value: "(--check is a switch and takes no value:
   '--frobnicate' after it is no value of it)". argparse reads no word starting with ``-``
   as a value; only such a word is now told so, an unknown flag is told what any is.
3. A directory given for a chart's module (``charts draw shop/:Order``) is searched for the
   module declaring the class, "at most 200 files" read: but the walk went on through every
   directory under it once 200 were read (``./:Order`` from a home directory walked all of
   it), and a ``.py`` name that is a FIFO was opened and waited on for ever. The search now
   ends at its bound and reads only regular files.
"""

from __future__ import annotations

import os
import threading

import pytest

from calexec.cli import main as cli
from calexec.contracts.manifest import default_manifest_path, load_manifest
from calexec.drivers.calrt.runtime import CalRT
from calexec.drivers.synthetic import calbin
from calexec.machines import switch_check
from calexec.machines.chartref import ChartRefError, load_chart
from fifo_swap import fifo_after_look


def _bounded(call, fifo: str) -> list:
    """``call()`` in a thread, waited for at most 30 s (then unblocked by opening ``fifo``'s
    writing end): what it returned, empty when it was still running."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(30.0)
    if thread.is_alive():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        thread.join(30.0)
        os.close(fd)
        return []
    return out


def test_a_reload_check_runs_the_loader_on_the_file_it_looked_at(tmp_path, monkeypatch):
    """The check's ``fstat`` of what it opened says a regular calbin; the path is then
    replaced by a FIFO (an operator's script rewriting the file): the runtime's loader of
    the check reads the file looked at, and the check passes, as the switch's load would."""
    path = str(tmp_path / "next.calbin")
    calbin.write(path, calbin.default_spec())
    swapped = fifo_after_look(monkeypatch, path)  # once the check looked at the calbin
    answered = _bounded(lambda: switch_check.check_calbin(
        CalRT.load(), load_manifest(default_manifest_path()), path), path)
    monkeypatch.undo()
    assert swapped, "the check never looked at the file it opened"
    assert answered, "the check waited in an open of the FIFO (unblocked by the test)"
    assert answered[0].ok, answered[0]


def test_a_reload_checks_loader_refusal_names_the_file_not_its_descriptor(tmp_path, caplog):
    """The loader of the check reads ``/proc/self/fd/N``; its log line refusing a file that
    is no calbin names the file the operator gave, not that descriptor."""
    path = tmp_path / "odd.calbin"  # (a tensor of a dtype the emulator does not know)
    text = calbin.dumps(calbin.default_spec()).decode()
    assert " S32 " in text
    path.write_text(text.replace(" S32 ", " Q99 ", 1))
    caplog.set_level("ERROR", logger="calexec")
    status = switch_check.check_calbin(CalRT.load(), load_manifest(default_manifest_path()),
                                       str(path))
    assert status.code == "calbin.invalid", status
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert lines and all(str(path) in line and "/proc/self/fd" not in line
                         for line in lines), lines


@pytest.mark.parametrize("argv, word", [
    (["diagrams", "--check", "--frobnicate"], "--frobnicate"),
    (["diagrams", "--check", "-z"], "-z"),
])
def test_an_unknown_flag_after_a_switch_is_not_called_its_value(capsys, argv, word):
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {word}" in err, err
    assert "is a switch and takes no value" not in err, err


def test_a_word_after_a_switch_is_still_told_the_switch_takes_none(capsys):
    assert cli(["diagrams", "--check", "yes"]) == 2
    err = capsys.readouterr().err
    assert ("unrecognized arguments: yes (--check is a switch and takes no value: 'yes' "
            "after it is no value of it)") in err, err


def test_a_directory_search_for_a_chart_ends_once_it_read_its_bound(tmp_path, monkeypatch):
    """201 modules declaring nothing, then 30 directories more: the walk stops at the bound
    (the first directory), not after listing the 30."""
    first = tmp_path / "shop" / "a"
    first.mkdir(parents=True)
    for i in range(201):
        (first / f"m{i}.py").write_text("x = 1\n")
    for i in range(30):
        (tmp_path / "shop" / f"z{i}").mkdir()
    real_walk = os.walk
    listed: list[str] = []

    def counted_walk(top, *args, **kwargs):
        for here, dirs, files in real_walk(top, *args, **kwargs):
            listed.append(here)
            yield here, dirs, files

    monkeypatch.setattr(os, "walk", counted_walk)
    with pytest.raises(ChartRefError, match="is a directory, not a module name"):
        load_chart("shop/:Order", cwd=str(tmp_path))
    monkeypatch.undo()
    assert len(listed) <= 2, listed


def test_a_fifo_named_like_a_module_is_not_waited_on(tmp_path):
    """A FIFO ``a.py`` in the directory given: not opened; the module declaring the chart,
    further on, is still named."""
    shop = tmp_path / "shop"
    shop.mkdir()
    os.mkfifo(shop / "a.py")
    (shop / "orders.py").write_text("class Order(object):\n    pass\n")

    def refusal():
        try:
            load_chart("shop/:Order", cwd=str(tmp_path))
        except ChartRefError as err:
            return str(err)
        return None

    answered = _bounded(refusal, str(shop / "a.py"))
    assert answered, "the search waited in an open of the FIFO (unblocked by the test)"
    assert "Order is declared in shop/orders.py: name shop.orders:Order" in answered[0], answered


#: a command that leaves a background process whose SIGTERM handler writes a marker (its
#: clean-up: a socket removed, a file flushed), then exits
_LEAVES_A_SERVER = (
    "import os, signal, subprocess, sys\n"
    "child = subprocess.Popen([sys.executable, '-c', "
    "\"import os, signal, sys, time\\n"
    "def bye(*_):\\n"
    "    open(sys.argv[1], 'w').write('cleaned up')\\n"
    "    os._exit(0)\\n"
    "signal.signal(signal.SIGTERM, bye)\\n"
    "open(sys.argv[2], 'w').write('up')\\n"
    "time.sleep(60)\\n\", sys.argv[1], sys.argv[2]])\n"
    "import time\n"
    "deadline = time.monotonic() + 30\n"
    "while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:\n"
    "    time.sleep(0.01)\n"
)


def test_what_a_command_left_running_is_asked_to_end_before_it_is_killed(tmp_path):
    """Found at stop 71 (the review probe, recommended; done by the lead): ``charts cover``'s
    and ``charts mutate``'s command runs (``subproc.call_group`` and the mutation runs)
    ended what the command left in its process group when it exited with SIGKILL at once: a
    server a test started and never stopped had no chance to clean up (its socket, its pid
    file). It gets SIGTERM first, SIGKILL only if still there ``TERM_GRACE_S`` later."""
    import sys

    from calexec.drivers.tools.bench.subproc import call_group

    marker, up = tmp_path / "cleaned", tmp_path / "up"
    script = tmp_path / "leaves.py"
    script.write_text(_LEAVES_A_SERVER)
    assert call_group([sys.executable, str(script), str(marker), str(up)]) == 0
    assert up.exists()
    assert marker.exists() and marker.read_text() == "cleaned up"
