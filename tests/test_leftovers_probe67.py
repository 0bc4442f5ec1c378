"""Known defects left by earlier stops, fixed at stop 67 (docs/traceability.md, "Found at stop
67 (leftovers)")."""

from __future__ import annotations

import importlib
import json
import os
import shlex
import subprocess
import sys

import pytest

from calexec import cli
from calexec.contracts.manifest import default_manifest_path, load_manifest
from calexec.machines import switch_check
from calexec.machines.envflag import EnvFlagError
from calexec.machines.locks import LockOrder


@pytest.mark.parametrize("value", ["false", "no", "off", "true", "2"])
def test_a_lock_order_variable_that_is_not_0_or_1_is_refused_naming_it(monkeypatch, value):
    """``CALEXEC_CHECK_LOCK_ORDER=false`` turned the lock-order checker on (any value but 0
    did); now a value other than 0 or 1 is an error naming the variable and what to give,
    read as ``CALEXEC_TRANSITION_GATE`` is (one parser, machines/envflag.py)."""
    monkeypatch.setenv("CALEXEC_CHECK_LOCK_ORDER", value)
    with pytest.raises(EnvFlagError) as err:
        LockOrder()
    assert str(err.value).startswith(
        f"CALEXEC_CHECK_LOCK_ORDER={value!r}: give 1 to check the executor's lock order, "
        "or 0 (or unset it) to leave it unchecked")


def test_a_bad_lock_order_variable_is_one_line_exit_2_from_a_command(monkeypatch, capsys):
    """``CALEXEC_CHECK_LOCK_ORDER=false calexec demo``: the refusal, raised as the executor is
    built, is a configuration error (one line, exit 2), not an internal error (exit 70)."""
    monkeypatch.setenv("CALEXEC_CHECK_LOCK_ORDER", "false")
    assert cli.main(["demo"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "calexec demo: CALEXEC_CHECK_LOCK_ORDER='false': give 1 to check the executor's lock "
        "order, or 0 (or unset it) to leave it unchecked (ExecutorConfig.check_lock_order "
        "still turns it on)"]


@pytest.mark.parametrize(("value", "checking"), [("0", False), ("", False), (" 1 ", True),
                                                 ("1", True)])
def test_a_lock_order_variable_of_0_or_1_turns_the_checker_off_or_on(monkeypatch, value,
                                                                     checking):
    monkeypatch.setenv("CALEXEC_CHECK_LOCK_ORDER", value)
    assert LockOrder().checking is checking
    assert LockOrder(checking=True).checking is True


@pytest.mark.parametrize("value", ["0", "", "no"])
def test_calexec_debug_0_keeps_the_internal_error_to_one_line(monkeypatch, capsys, value):
    """``CALEXEC_DEBUG=0 calexec ...`` raised the traceback of an internal error (any
    non-empty value did); 0 now keeps the one line, and a word is named as refused."""
    module = importlib.import_module(cli.COMMANDS["demo"].module)
    monkeypatch.setattr(module, "main", lambda argv: 1 / 0)
    monkeypatch.setenv("CALEXEC_DEBUG", value)
    assert cli.main(["demo"]) == 70
    lines = capsys.readouterr().err.splitlines()
    assert "internal error: ZeroDivisionError" in lines[-1], lines
    assert (lines[:-1] == [] if value != "no" else lines[:-1] == [
        "calexec demo: CALEXEC_DEBUG='no': give 1 to see the traceback, or 0 (or unset it) "
        "to see this one line"]), lines


def test_calexec_debug_1_raises_the_traceback(monkeypatch):
    module = importlib.import_module(cli.COMMANDS["demo"].module)
    monkeypatch.setattr(module, "main", lambda argv: 1 / 0)
    monkeypatch.setenv("CALEXEC_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        cli.main(["demo"])


@pytest.mark.parametrize(("path", "reason", "said"), [
    ("/proc/self/environ", "not_a_file",
     "its size is given as 0 but a read returns bytes: a file made up as it is read"),
    ("/proc/self/status", "not_a_file", "its size is given as 0 but a read returns bytes"),
    (None, "empty", "the file is empty"),  # (an empty file on a disk: tmp_path's)
])
def test_a_reload_of_a_proc_file_is_not_called_empty(tmp_path, path, reason, said):
    """``POST /admin/reload {"calbin": "/proc/self/environ"}`` (any /proc or sysfs file,
    whose ``st_size`` is 0) was refused ``calbin.empty: the file is empty`` while a read
    returns its bytes; the check reads one byte (without blocking) when stat says 0, and
    refuses such a file ``calbin.not_a_file`` saying why. An empty file is still empty."""
    if path is None:
        path = str(tmp_path / "empty.calbin")
        (tmp_path / "empty.calbin").write_bytes(b"")
    manifest = load_manifest(default_manifest_path())
    checked = switch_check.check_calbin(object(), manifest, path)
    assert checked.code == f"calbin.{reason}", checked
    assert (checked.message or "").startswith(f'calbin="{path}": {said}'), checked.message



PRET = '''
from statemachine import State, StateMachine


class Pret(StateMachine):
    rangé = State(initial=True)
    prêté = State()
    perdu = State(final=True)

    emprunter = rangé.to(prêté)
    rendre = prêté.to(rangé)
    perdre = prêté.to(perdu)
'''


def test_charts_mutate_of_non_ascii_states_runs_under_an_ascii_locale(tmp_path):
    """``LC_ALL=C PYTHONUTF8=0 calexec charts mutate --chart pret:Pret --mutant
    'drop:prêté-perdre->perdu' ...`` (state names that are not ASCII): the id given was "no
    such mutant" (the argument decoded as ASCII), every mutant's run an internal error (exit
    70: the mutant's id in the child's environment could not be encoded), and mutation.md
    could not be written. The id is taken as its UTF-8 bytes, passed to the child as them and
    read back so; the report is written in UTF-8."""
    (tmp_path / "pret.py").write_text(PRET, encoding="utf-8")
    check = "import pret; p = pret.Pret(); p.emprunter(); p.perdre(); assert p.perdu.is_active"
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0"}
    env.pop("PYTHONIOENCODING", None)
    code = ("import sys; from calexec.cli import main\n"
            "assert sys.getfilesystemencoding() == 'ascii', sys.getfilesystemencoding()\n"
            "sys.exit(main(sys.argv[1:]))")
    done = subprocess.run(
        [sys.executable, "-c", code, "charts", "mutate", "--cwd", str(tmp_path), "--json",
         "--chart", "pret:Pret", "--test-cmd", f"{sys.executable} -c {shlex.quote(check)}",
         "--mutant", "drop:prêté-perdre->perdu", "--report", str(tmp_path / "report")],
        env=env, capture_output=True, timeout=300)
    err = done.stderr.decode("utf-8", "replace")
    assert done.returncode == 0, err
    (mutant,) = json.loads(done.stdout)["mutants"]
    assert (mutant["id"], mutant["status"]) == ("drop:prêté-perdre->perdu", "killed"), err
    assert "drop:prêté-perdre->perdu" in (tmp_path / "report" / "mutation.md").read_text(
        encoding="utf-8")


DROPPED = '''
import sys
from calexec.contracts.manifest import default_manifest_path, load_manifest
from calexec.drivers.calrt.runtime import CalRT
from calexec.machines.executor import DeviceExecutor, ExecutorConfig


def started():
    ex = DeviceExecutor(CalRT.load(), load_manifest(default_manifest_path()),
                        ExecutorConfig(calbin_path=sys.argv[1]))
    assert ex.start().ok
    return ex


started()  # dropped: never shut down
assert started().shutdown(5.0).ok
'''


def test_an_executor_dropped_without_shutdown_is_a_resource_warning(tmp_path):
    """An embedder that drops a started ``DeviceExecutor`` without ``shutdown()``: its threads
    keep it alive (never collected, no finalizer), run on, and its device stays open, and
    nothing said so. At exit each such executor is now a ``ResourceWarning`` (shown under
    ``-W default`` or ``-X dev``, as Python's own for an unclosed file); one shut down is
    not."""
    from calexec.drivers.synthetic import calbin

    path = tmp_path / "model.calbin"
    calbin.write(str(path), calbin.default_spec())
    (tmp_path / "dropped.py").write_text(DROPPED)
    done = subprocess.run([sys.executable, "-W", "default", str(tmp_path / "dropped.py"),
                           str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    warned = [line for line in done.stderr.splitlines() if "ResourceWarning" in line]
    assert len(warned) == 1, done.stderr
    assert ("ResourceWarning: a DeviceExecutor started in this process (lifecycle Ready) was "
            "never shut down" in warned[0]), warned
