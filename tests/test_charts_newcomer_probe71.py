"""Stop 71's newcomer probe: a team from elsewhere points the toolkit at its own charts (a
traffic light with timer guards and Unicode names, an order workflow in a package with
relative imports, compound, parallel, history and final states, an Enum's states, a chart
made by a factory, a generated chain of 200 states, async callbacks) through every ``charts``
command and the API, and at what it gets wrong."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from statemachine import Event, State, StateChart, StateMachine

from calexec.cli import main as cli
from calexec.machines.chartref import ChartRefError, load_chart
from calexec.machines.compiled import compiled
from calexec.machines.diagrams import render_chart_dot, svg_from_dot
from calexec.machines.paths import (
    GuardTable,
    PathNotFollowed,
    drive,
    state_paths,
    transition_paths,
)


class Checkout(StateMachine):
    cart = State(initial=True)
    placed = State()
    paid = State()
    shipped = State(final=True)

    place = cart.to(placed, cond="has_items")
    pay = placed.to(paid)
    ship = paid.to(shipped)


class Parcel(StateChart):
    class moving(State.Compound):
        packed = State(initial=True)
        sorted_ = State()
        sort = packed.to(sorted_)

    delivered = State(final=True)
    deliver = moving.sorted_.to(delivered)


def _not_followed(run: object, walk: object) -> str:
    with pytest.raises(PathNotFollowed) as missed:
        drive(run, walk)  # type: ignore[arg-type]
    return str(missed.value)


def test_driving_a_path_on_a_restored_run_names_the_step_and_where_the_run_began():
    """A run restored from its model's saved state (``model.state = "paid"``, as a
    python-statemachine instance restores it), made with ``state=``, or one a path was driven
    on before (replayed): ``drive`` raised the run's bare ``IllegalTransition`` ("event 'place'
    is not allowed in state 'paid'"), naming no step of the path, nor that the run was not
    where every path starts. It is now ``PathNotFollowed`` naming the step, its event, the
    state the run was in when drive began and the fresh run to drive."""
    walk = state_paths(Checkout)["shipped"]
    table = GuardTable.for_chart(Checkout)
    table.state = "paid"  # type: ignore[attr-defined]  # a saved state: the run restores it
    message = _not_followed(compiled(Checkout).run(table), walk)
    assert message.startswith("Checkout: step 1 of 3, cart --place--> placed, was not taken: "
                              "the run is in 'paid' ("), message
    assert "drive began on a run in 'paid', not in 'cart' where the path starts" in message
    assert "IllegalTransition" in message and "compiled(Checkout).run(" in message, message

    made_there = compiled(Checkout).run(GuardTable.for_chart(Checkout), state="placed")
    assert "drive began on a run in 'placed'" in _not_followed(made_there, walk)

    replayed = compiled(Checkout).run(GuardTable.for_chart(Checkout))
    assert drive(replayed, walk) == "shipped"
    message = _not_followed(replayed, walk)  # the same run, driven again
    assert "the run is in 'shipped'" in message, message
    assert "drive began on a run in 'shipped', not in 'cart'" in message, message


def test_a_statechart_run_driven_twice_says_it_began_elsewhere_not_that_a_statechart_ignores():
    """A ``StateChart`` ignores the refused event, so ``drive`` of a path on a run it drove
    before said only "a StateChart ignores a refused event and turns an action's error into
    error.execution": no error of the chart's; it now says where the run began."""
    walk = state_paths(Parcel)["delivered"]
    run = compiled(Parcel).run(GuardTable.for_chart(Parcel))
    drive(run, walk)
    message = _not_followed(run, walk)
    assert "drive began on a run in 'delivered', not in 'moving,packed' where the path " \
           "starts" in message, message
    assert "StateChart ignores" not in message, message


_WORKFLOW = '''
from statemachine import State, StateChart

from .rules import Rules  # noqa: F401  (a package's module imports its siblings)


class OrderFlow71(StateChart):
    cart = State(initial=True)
    done = State(final=True)
    checkout = cart.to(done)
'''


def _package(tmp_path: Path, name: str) -> str:
    """A package ``name`` (one per test: a module imported once stays in ``sys.modules``)
    holding ``workflow.py``, whose chart imports a sibling module relatively."""
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "rules.py").write_text("class Rules:\n    pass\n")
    (package / "workflow.py").write_text(_WORKFLOW)
    return str(tmp_path)


def test_a_package_directory_given_for_the_module_names_the_module_declaring_the_class(
        tmp_path: Path) -> None:
    """``charts paths shop/:OrderFlow`` (a package directory, tab-completed by the shell) said
    "'shop/' is a file path, not a module name: run from the directory that holds it and name
    the module (e.g. shop/:OrderFlow)": the very text refused, from the directory that holds
    it. It now says it is a directory and names the module that declares the class."""
    root = _package(tmp_path, "shop71a")
    with pytest.raises(ChartRefError) as refused:
        load_chart("shop71a/:OrderFlow71", cwd=root)
    message = str(refused.value)
    assert "e.g. shop71a/:OrderFlow71" not in message, message
    assert message == (
        "'shop71a/:OrderFlow71': 'shop71a/' is a directory, not a module name: OrderFlow71 is "
        "declared in shop71a/workflow.py: name shop71a.workflow:OrderFlow71"), message


def test_a_package_named_for_the_module_of_its_submodules_chart_names_the_submodule(
        tmp_path: Path) -> None:
    """``charts paths shop:OrderFlow``, the package named where its module ``shop.workflow``
    declares the chart (the package's ``__init__`` imports nothing): "module 'shop' has no
    attribute 'OrderFlow' ...; module 'shop' declares no chart class", no word of where the
    class is. It now ends with the module that declares it."""
    root = _package(tmp_path, "shop71b")
    with pytest.raises(ChartRefError) as refused:
        load_chart("shop71b:OrderFlow71", cwd=root)
    message = str(refused.value)
    assert message.endswith("; OrderFlow71 is declared in shop71b/workflow.py: name "
                            "shop71b.workflow:OrderFlow71"), message
    assert load_chart("shop71b.workflow:OrderFlow71", cwd=root).__name__ == "OrderFlow71"


_LAMP = '''
from statemachine import State, StateMachine


class Lamp71(StateMachine):
    off = State(initial=True)
    on = State()
    switch = off.to(on) | on.to(off)
'''


def _lamp_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "lamp71.py").write_text(_LAMP)
    (tmp_path / "run_tests.py").write_text("print('ok')\n")  # a script, not executable
    (tmp_path / "tests").mkdir()
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("program, says", [
    ("run_tests.py", "'run_tests.py' is not on PATH, but a file of that name is in the "
                     "directory the command runs in: give python run_tests.py"),
    ("tests", "'tests' is a directory, not a program"),
])
def test_cover_given_a_script_of_the_directory_or_a_directory_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        program: str, says: str) -> None:
    """``charts cover --chart lamp:Lamp -- run_tests.py`` (the script beside the chart, not on
    PATH) said "test command 'run_tests.py': No such file or directory", of a file that is
    there, and ``-- tests`` (a directory) "Permission denied"; each now says what it is and
    what to give."""
    _lamp_project(tmp_path, monkeypatch)
    assert cli(["charts", "cover", "--chart", "lamp71:Lamp71", "--", program]) == 2
    err = capsys.readouterr().err
    assert says in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("program, says", [
    ("run_tests.py", "'run_tests.py' is not on PATH, but a file of that name is in the "
                     "directory the command runs in: give python run_tests.py"),
    ("./tests", "'./tests' is a directory, not a program"),
])
def test_mutate_given_a_script_of_the_directory_or_a_directory_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        program: str, says: str) -> None:
    """``charts mutate --test-cmd run_tests.py`` and ``--test-cmd ./tests``: as ``cover``'s,
    "cannot run 'run_tests.py': No such file or directory" / "Permission denied"."""
    _lamp_project(tmp_path, monkeypatch)
    assert cli(["charts", "mutate", "--chart", "lamp71:Lamp71", "--test-cmd", program,
                "--report", str(tmp_path / "report")]) == 2
    err = capsys.readouterr().err
    assert says in err, err


def test_cover_takes_a_gate_written_with_a_percent_sign(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``charts cover --min 90%``, as a newcomer writes a percentage: "--min='90%': expected a
    percentage (0-100)", of a percentage. ``90%`` is now 90."""
    _lamp_project(tmp_path, monkeypatch)
    command = ["python", "-c", "import lamp71; lamp71.Lamp71().send('switch')"]
    assert cli(["charts", "cover", "--chart", "lamp71:Lamp71", "--min", "50%", "--"]
               + command) == 0
    assert "transition coverage Lamp71: 1/2 (50.0 %)" in capsys.readouterr().out
    assert cli(["charts", "cover", "--chart", "lamp71:Lamp71", "--min", "90 %", "--"]
               + command) == 1
    assert "transition coverage gate FAILED for Lamp71: 50.0 % < 90 %" in capsys.readouterr().out
    assert cli(["charts", "cover", "--chart", "lamp71:Lamp71", "--min", "%", "--"]
               + command) == 2
    assert "--min='%': expected a percentage (0-100)" in capsys.readouterr().err


def test_the_plugin_and_mutate_take_a_gate_written_with_a_percent_sign(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``pytest --chart-coverage-min=50%`` was a usage error, exit 4, and ``charts mutate
    --fail-under 80%`` exit 2, as ``charts cover --min``'s."""
    _lamp_project(tmp_path, monkeypatch)
    (tmp_path / "tests" / "test_lamp.py").write_text(
        "import lamp71\n\ndef test_switch():\n    lamp71.Lamp71().send('switch')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for gate, status in (("50%", 0), ("100%", 1)):
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
             "--chart-coverage=lamp71:Lamp71", f"--chart-coverage-min={gate}", "tests"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        output = done.stdout + done.stderr
        assert done.returncode == status, output
        assert "transition coverage Lamp71: 1/2" in output, output
    # (accepted, the next check refuses the run: --cwd)
    assert cli(["charts", "mutate", "--chart", "lamp71:Lamp71", "--test-cmd", "true",
                "--fail-under", "80%", "--cwd", "nowhere"]) == 2
    assert "--cwd='nowhere': not a directory" in capsys.readouterr().err


class Folders(StateMachine):
    load = State("C:\\logs\\load", initial=True)
    done = State("R&D &lt;ok&gt;", final=True)
    go = Event(load.to(done), name="go \\left")


def test_a_backslash_l_or_an_entity_in_a_name_is_drawn_as_written():
    """A state named ``C:\\logs\\load`` was drawn on three lines, ``C:`` / ``ogs`` / ``oad
    (load)``: the DOT string kept every ``\\l`` of the text as graphviz's left-justified line
    end, the user's own included; and ``R&D &lt;ok&gt;`` was drawn ``R&D <ok>`` (graphviz
    reads an entity in a label). Both are now escaped: the text is drawn as written."""
    dot = render_chart_dot(Folders)
    assert 'label="C:\\\\logs\\\\load (load)"' in dot, dot
    assert 'label="R&amp;D &amp;lt;ok&amp;gt; (done)"' in dot, dot
    assert 'label="go \\\\left\\l"' in dot, dot  # (the label's own line end is kept)


@pytest.mark.skipif(shutil.which("dot") is None, reason="the chart's drawing: graphviz")
def test_graphviz_draws_a_backslash_l_and_an_entity_in_a_name_as_written():
    svg = svg_from_dot(render_chart_dot(Folders))
    assert ">C:\\logs\\load (load)<" in svg, svg
    assert ">R&amp;D &amp;lt;ok&amp;gt; (done)<" in svg, svg


_LEAVES_A_SERVER = '''
import os, subprocess, sys
# a test that starts a server and never stops it: it inherits the test's output
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "pids"), "a") as pids:
    pids.write(f"{child.pid}\\n")
import lamp71
lamp = lamp71.Lamp71()
lamp.send("switch")
assert lamp.configuration_values == {"on"} or list(lamp.configuration_values) == ["on"]
'''


def test_mutate_does_not_wait_for_what_the_test_command_left_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``charts mutate --test-cmd 'python leaves_server.py'``, a test command that starts a
    server (a child holding its output) and never stops it: the unmutated run waited for that
    server to end, for ever (here 600 s); a mutant's run would have been judged killed by its
    timeout though its tests passed. The run now ends when the command exits, and the group
    it left is killed."""
    _lamp_project(tmp_path, monkeypatch)
    (tmp_path / "leaves_server.py").write_text(_LEAVES_A_SERVER)
    report = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "calexec.cli", "charts", "mutate", "--chart", "lamp71:Lamp71",
         "--test-cmd", f"{sys.executable} leaves_server.py", "--kind", "drop", "--report",
         str(report), "--json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)  # (a hang: 600 s)
    assert done.returncode in (0, 1), done.stderr
    statuses = {m["id"]: m["status"] for m in json.loads(done.stdout)["mutants"]}
    assert statuses == {"drop:off-switch->on": "killed", "drop:on-switch->off": "survived"}, \
        statuses
    pids = [int(line) for line in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 3, pids  # the unmutated run and each mutant's
    assert not [pid for pid in pids if _alive(pid)], pids  # (killed with its group)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie its new parent has not reaped yet does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_a_state_or_event_of_a_chart_given_for_the_chart_names_the_chart(
        tmp_path: Path) -> None:
    """``charts draw shop.workflow:OrderFlow.processing`` (a compound state a newcomer means
    to draw alone) said "OrderFlow.processing is State State('Processing', ...), not a
    python-statemachine chart class", no word of the chart it belongs to; it now ends with
    the chart to give."""
    root = _package(tmp_path, "shop71c")
    for ref, kind in (("shop71c.workflow:OrderFlow71.cart", "a state"),
                      ("shop71c.workflow:OrderFlow71.checkout", "an event")):
        with pytest.raises(ChartRefError) as refused:
            load_chart(ref, cwd=root)
        assert str(refused.value).endswith(
            f"; it is {kind} of chart OrderFlow71: the tools take a whole chart, "
            f"shop71c.workflow:OrderFlow71"), str(refused.value)


class SelfTest(StateChart):
    selftest = State(initial=True)
    ready = State()
    degraded = State()
    off = State(final=True)
    selftest.to(ready, cond="healthy")
    selftest.to(degraded, unless="healthy")
    shutdown = ready.to(off) | degraded.to(off)


def test_a_path_with_a_start_driven_on_a_run_made_without_it_says_so():
    """The path to ``degraded --shutdown--> off`` starts under ``{'healthy': False}`` (its
    start step); driven on a run made without those outcomes (it starts in ``ready``), the
    refusal must name that start, not a restored or replayed run."""
    path = next(p for p in transition_paths(SelfTest) if p.start and p.steps)
    message = _not_followed(compiled(SelfTest).run(GuardTable.for_chart(SelfTest)), path)
    assert ("drive began on a run in 'ready', not in 'degraded' where the path starts: the "
            "path starts under outcomes {'healthy': False} set before the chart starts (its "
            "start step), which the run was not made with; drive each path on a fresh run, "
            "compiled(SelfTest).run(GuardTable.for_chart(SelfTest, outcomes=path.start))"
            ) in message, message
    fresh = compiled(SelfTest).run(GuardTable.for_chart(SelfTest, outcomes=path.start))
    assert drive(fresh, path) == "off"


@pytest.mark.parametrize("argv, says", [
    (["--png=d"], "argument --png: ignored explicit argument 'd' (refused: --png is a switch "
                  "and takes no value: give --png alone)"),
    (["--png", "d"], "unrecognized arguments: d (--png is a switch and takes no value: 'd' "
                     "after it is no value of it)"),
])
def test_a_value_given_to_a_switch_says_the_switch_takes_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        argv: list[str], says: str) -> None:
    """``charts draw lamp:Lamp --png d`` (as ``calexec diagrams --png DIR`` takes a directory)
    said "unrecognized arguments: d", and ``--png=d`` argparse's "ignored explicit argument
    'd'", which reads as if the run went on without it; each now says ``--png`` takes no
    value."""
    _lamp_project(tmp_path, monkeypatch)
    assert cli(["charts", "draw", "lamp71:Lamp71", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_a_chart_file_of_this_directory_whose_name_is_no_identifier_says_to_drop_py(
        tmp_path: Path) -> None:
    """``charts paths my-charts.py:Lamp``, run where ``my-charts.py`` is, said "run from the
    directory that holds it and name the module (e.g. my-charts:Lamp)": the command ran
    there already. It now says to name the module without ``.py``, as ``lamp.py:Lamp`` is
    told."""
    (tmp_path / "my-lamp71.py").write_text(_LAMP)
    with pytest.raises(ChartRefError) as refused:
        load_chart("my-lamp71.py:Lamp71", cwd=str(tmp_path))
    assert str(refused.value) == (
        f"'my-lamp71.py:Lamp71': 'my-lamp71.py' is a file path, not a module name: name the "
        f"module, without .py: my-lamp71:Lamp71 (imported from {tmp_path}, where the file is)")


_LEAVES_A_PYTHON_CHILD = '''
import os, subprocess, sys
# a test that starts a helper (a Python server importing the chart) and never stops it
child = subprocess.Popen([sys.executable, "-c", "import lamp71, time; time.sleep(600)"])
with open("pids", "a") as pids:
    pids.write(f"{child.pid}\\n")
import lamp71
lamp71.Lamp71().send("switch")
'''


def test_cover_ends_what_the_test_command_left_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``charts cover --chart lamp:Lamp -- python leaves_child.py``, a test command leaving a
    Python helper running: the helper ran on after calexec exited, and at its own exit wrote
    its transitions into the run's directory, removed by then: a ``FileNotFoundError``
    traceback on the terminal, long after the command. It now ends with the command."""
    _lamp_project(tmp_path, monkeypatch)
    (tmp_path / "leaves_child.py").write_text(_LEAVES_A_PYTHON_CHILD)
    try:
        assert cli(["charts", "cover", "--chart", "lamp71:Lamp71", "--", sys.executable,
                    "leaves_child.py"]) == 0
        assert "transition coverage Lamp71: 1/2" in capsys.readouterr().out
        pids = [int(line) for line in (tmp_path / "pids").read_text().split()]
        assert pids and not [pid for pid in pids if _alive(pid)], pids
    finally:
        for pid in [int(line) for line in (tmp_path / "pids").read_text().split()]:
            if _alive(pid):  # (the old code's leak: not left to this run)
                os.kill(pid, signal.SIGKILL)


def test_a_refused_step_is_still_a_chart_transition_error_to_code_catching_it():
    """Found at stop 71 (the review probe): ``drive`` now raises ``PathNotFollowed`` for a
    step the run refuses, where it raised the run's own ``IllegalTransition``; code of a
    team catching ``ChartTransitionError`` (the base of every refusal of a run) around
    ``drive`` no longer caught it. ``PathNotFollowed`` is a ``ChartTransitionError``, its
    cause the run's own error."""
    from calexec.machines.chart_support import ChartTransitionError, IllegalTransition

    walk = state_paths(Checkout)["shipped"]
    run = compiled(Checkout).run(GuardTable.for_chart(Checkout))
    assert drive(run, walk) == "shipped"
    with pytest.raises(ChartTransitionError) as caught:
        drive(run, walk)  # the same run again: step 1 refused
    assert isinstance(caught.value, PathNotFollowed)
    assert isinstance(caught.value.__cause__, IllegalTransition)
