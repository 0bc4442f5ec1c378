"""Found at stop 66 driving the toolkit as a newcomer team on its own charts: a pedestrian
crossing (parallel regions, eventless transitions, a final state in a compound, history), a
document approval (model properties and methods as guards, ``unless=``, validators) and a
door chart inside a package. Each test failed on the code before its fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from statemachine import State, StateChart

from calexec.cli import main as cli
from calexec.drivers.tools.interleave import explore_threads, replay_threads
from calexec.machines.clock import Clock
from calexec.machines.compiled import compiled


class Till(StateChart):  # type: ignore[type-arg]
    """An async action that raises: python-statemachine's async engine makes it
    error.execution, which no transition takes."""

    idle = State(initial=True)
    open_ = State()
    go = idle.to(open_)
    back = open_.to(idle)

    async def on_go(self) -> None:
        raise RuntimeError("drawer jammed")


class Recovering(StateChart):  # type: ignore[type-arg]
    """Takes error.execution, but the action of that transition raises too."""

    idle = State(initial=True)
    broken = State(final=True)
    go = idle.to.itself()
    error_execution = idle.to(broken, on="recover")

    def on_go(self) -> None:
        raise RuntimeError("first")

    def recover(self) -> None:
        raise RuntimeError("while recovering")


class Model:
    pass


def _sending(make: object, event: str) -> object:
    def scenario(clock: Clock) -> None:
        machine = make()  # type: ignore[operator]
        clock.start_thread(lambda: machine.send(event), "clerk")

    return scenario


def test_an_async_charts_dropped_error_fails_the_schedule() -> None:
    result = explore_threads(_sending(Till, "go"), seeds=range(2))
    assert result.failure is not None, "an async chart's dropped error passed the exploration"
    message = result.failure.message
    assert "unhandled error.execution: Till" in message
    assert "RuntimeError: drawer jammed" in message and "'on_go'" in message
    again = replay_threads(_sending(Till, "go"), result.failure.choices)
    assert again is not None and "drawer jammed" in again.message


def test_an_error_raised_while_handling_error_execution_fails_the_schedule() -> None:
    result = explore_threads(_sending(Recovering, "go"), seeds=range(2))
    assert result.failure is not None, "the error of the error handler was dropped unseen"
    message = result.failure.message
    assert "Recovering" in message and "RuntimeError: while recovering" in message
    assert "'recover'" in message and "while the chart handled error.execution" in message


def test_a_compiled_run_dropping_an_error_of_its_error_handler_is_heard_too() -> None:
    def make() -> object:
        return compiled(Recovering).run(Model())

    result = explore_threads(_sending(make, "go"), seeds=range(2))
    assert result.failure is not None
    assert "RuntimeError: while recovering" in result.failure.message


def test_the_opt_out_lets_both_pass() -> None:
    for chart in (Till, Recovering):
        result = explore_threads(_sending(chart, "go"), seeds=range(2),
                                 ignore_unhandled_errors=True)
        assert result.failure is None and result.schedules == 2


_DOOR = '''from statemachine import State, StateMachine

from .rules import MAX_TRIES


class Door(StateMachine):
    closed = State(initial=True)
    locked = State()
    lock = closed.to(locked)
    unlock = locked.to(closed)
'''


def _package(root: Path) -> Path:
    """``root/acme/charts/door.py``, a chart of package ``acme.charts`` with a relative import."""
    charts = root / "acme" / "charts"
    charts.mkdir(parents=True)
    (root / "acme" / "__init__.py").write_text("")
    (charts / "__init__.py").write_text("")
    (charts / "rules.py").write_text("MAX_TRIES = 3\n")
    (charts / "door.py").write_text(_DOOR)
    return charts


@pytest.mark.parametrize("ref", ["door.py:Door", "../../acme/charts/door.py:Door", "door.py"])
def test_a_package_charts_file_named_from_inside_its_package_names_the_package_module(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        ref: str) -> None:
    """Run inside ``acme/charts/``, ``charts paths door.py:Door`` was told to name ``door:Door``,
    which then failed on the module's relative import (a second round trip to the right
    answer); it now names ``acme.charts.door`` and where to run from."""
    monkeypatch.chdir(_package(tmp_path))
    assert cli(["charts", "paths", ref]) == 2
    err = capsys.readouterr().err
    klass = "CLASS" if ref == "door.py" else "Door"
    assert (f"it is module acme.charts.door of a package (its directory holds an __init__.py):"
            f" run from {tmp_path} and name acme.charts.door:{klass}") in err, err
    assert "door:Door" not in err.replace("acme.charts.door:Door", ""), err


def test_a_package_charts_file_named_by_its_absolute_path_names_the_package_module(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """From a directory above the project, the file's path was answered with a dotted name
    through every directory (``w.proj.acme.charts.door:Door``): a namespace-package import of
    another module than the one the tests import; it now names ``acme.charts.door``."""
    charts = _package(tmp_path / "proj")
    monkeypatch.chdir(tmp_path)
    assert cli(["charts", "paths", f"{charts / 'door.py'}:Door"]) == 2
    err = capsys.readouterr().err
    assert (f"run from {tmp_path / 'proj'} and name acme.charts.door:Door") in err, err
    assert "proj.acme" not in err, err


def test_a_package_module_named_from_inside_the_package_says_where_to_run_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``charts paths acme.charts.door:Door`` run inside ``acme/charts/`` said only ``No module
    named 'acme'``; it now names the file and the directory to run from."""
    charts = _package(tmp_path)
    monkeypatch.chdir(charts)
    assert cli(["charts", "paths", "acme.charts.door:Door"]) == 2
    err = capsys.readouterr().err
    assert (f"acme.charts.door is {charts / 'door.py'}, imported from {tmp_path}, above this "
            f"directory: run from there (or put it on the path: PYTHONPATH={tmp_path})"
            ) in err, err
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli(["charts", "paths", "acme.charts.door:Door"]) == 0


def test_a_chart_module_named_as_a_module_imported_already_says_it_is_never_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The chart in ``./queue.py`` named ``queue:Q``: python's ``queue``, imported already, is
    what ``import`` returns, and the answer was ``module 'queue' has no attribute 'Q' (expected
    a chart class there); module 'queue' declares no chart class``, of a file that declares it;
    it now says the file is never read and to rename it."""
    (tmp_path / "queue.py").write_text(
        "from statemachine import State, StateMachine\n\n\nclass Q(StateMachine):\n"
        "    a = State(initial=True)\n    b = State(final=True)\n    go = a.to(b)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # (load_chart puts tmp_path first)
    assert cli(["charts", "paths", "queue:Q"]) == 2
    err = capsys.readouterr().err
    assert "declares no chart class" not in err, err
    assert ("module 'queue' is not queue.py but another module of that name imported already ("
            f"{sys.modules['queue'].__file__}), which import returns: queue.py is never read; "
            "rename your 'queue' (e.g. queue_chart, then queue_chart:Q)") in err, err
    (tmp_path / "queue.py").rename(tmp_path / "queue_chart.py")
    assert cli(["charts", "paths", "queue_chart:Q"]) == 0


def test_a_configured_chart_is_imported_from_the_configurations_directory(
        tmp_path: Path) -> None:
    """``chart_coverage = ["acme.charts.door:Door"]`` in the project's configuration, pytest run
    in a subdirectory (``cd acme/charts; pytest ../../test_door.py``) was refused, exit 4,
    ``No module named 'acme'``: the configured chart was imported from the directory pytest
    was run from, where pytest reads ``testpaths`` and ``pythonpath`` from the configuration's
    own; it is imported from there now (a flag's still from where pytest is run)."""
    charts = _package(tmp_path)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nchart_coverage = acme.charts.door:Door\nchart_coverage_min = 100\n")
    (tmp_path / "test_door.py").write_text(
        "from acme.charts.door import Door\n\n\ndef test_door():\n    door = Door()\n"
        "    door.send('lock')\n    door.send('unlock')\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTEST_ADDOPTS", "CALEXEC_TRANSITION_GATE", "PYTHONPATH")}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
               "../../test_door.py"]
    done = subprocess.run(command, cwd=charts, env=env, capture_output=True, text=True,
                          timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "transition coverage Door: 2/2" in output, output
    flagged = subprocess.run([*command, "--chart-coverage=acme.charts.door:Door"], cwd=charts,
                             env=env, capture_output=True, text=True, timeout=120)
    assert flagged.returncode == 4, flagged.stdout + flagged.stderr
    assert (f"--chart-coverage='acme.charts.door:Door': cannot import module 'acme.charts.door'"
            f" from {charts}") in flagged.stdout + flagged.stderr
