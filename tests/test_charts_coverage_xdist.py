"""The coverage plugin (machines/coverage_plugin.py) under pytest-xdist: a user's project run
on two workers (``-n 2``) gets one gate over every worker's transitions and fails on a
contract violation any worker recorded, as one process does.

Until stop 66 the plugin was per process: the controller runs no test, so it judged the
transitions it had seen itself, none (``transition coverage Lamp: 0/2``, the gate FAILED on a
suite that takes both), and a violation recorded in a worker was never seen (a passing run).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

LAMP = '''
from statemachine import State, StateMachine

from calexec.machines.chart_contracts import invariant


class Lamp(StateMachine):
    off = State(initial=True)
    on = State()
    switch_on = off.to(on)
    switch_off = on.to(off)

    @invariant("on")
    def lit_only_with_a_bulb(model) -> bool:
        return model.bulb


class Socket:
    bulb = True
'''

TEST_ON = '''
from lamp import Lamp, Socket


def test_on():
    Lamp(Socket()).send("switch_on")
'''

TEST_OFF = '''
from lamp import Lamp, Socket


def test_off():
    lamp = Lamp(Socket())
    lamp.send("switch_on")
    lamp.send("switch_off")
'''

TEST_OFF_ONLY = '''
from lamp import Lamp, Socket


def test_off_only():
    assert Lamp(Socket()).current_state.id == "off"
'''

TEST_NO_BULB = '''
from lamp import Lamp


class NoBulb:
    bulb = False


def test_no_bulb():
    try:
        Lamp(NoBulb()).send("switch_on")
    except Exception:
        pass  # the code under test swallows errors: the session still fails
'''

INI = """\
[pytest]
testpaths = tests
chart_coverage = lamp:Lamp
chart_coverage_min = 100
"""


def _project(tmp_path: Path, files: dict[str, str], ini: str = INI) -> Path:
    (tmp_path / "pytest.ini").write_text(ini)
    (tmp_path / "lamp.py").write_text(LAMP)
    tests = tmp_path / "tests"
    tests.mkdir()
    for name, body in files.items():
        (tests / name).write_text(body)
    return tmp_path


def _pytest(project: Path, *args: str) -> tuple[int, str]:
    """pytest in the project on two xdist workers, the plugin from calexec's entry point."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTEST_ADDOPTS", "CALEXEC_TRANSITION_GATE", "PYTHONPATH")}
    env["PYTHONPATH"] = str(project)  # (the workers import the chart module too)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "xdist",
               "-p", "no:hypothesispytest", "-q", "-n", "2", *args]
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=300)
    return done.returncode, done.stdout + done.stderr


def test_two_workers_each_taking_one_transition_reach_the_gate_together(tmp_path):
    project = _project(tmp_path, {"test_on.py": TEST_ON, "test_off.py": TEST_OFF})
    status, output = _pytest(project, "--dist", "loadfile")
    assert status == 0, output
    assert output.count("transition coverage Lamp: 2/2") == 1, output  # once, the controller's
    assert "gate FAILED" not in output


def test_a_transition_no_worker_took_fails_the_gate_of_a_two_worker_run(tmp_path):
    project = _project(tmp_path, {"test_on.py": TEST_ON, "test_off_only.py": TEST_OFF_ONLY})
    status, output = _pytest(project, "--dist", "loadfile")
    assert status == 1, output
    assert "transition coverage Lamp: 1/2" in output
    assert output.count("transition coverage gate FAILED for Lamp: 50.0 % < 100 %") == 1, output
    assert "on --switch_off--> off" in output


@pytest.mark.parametrize(("args", "why"), [
    (("tests/test_on.py",), "paths or node ids given"),
    (("-k", "test_on"), "-k"),
    (("--deselect", "tests/test_off_only.py::test_off_only"), "tests deselected"),
], ids=["path", "keyword", "deselect"])
def test_a_partial_two_worker_run_is_not_judged_by_the_configured_gate(tmp_path, args, why):
    """The whole-suite-only gate reads the controller's arguments, and a deselection that
    happened in a worker (workers collect, the controller does not) reaches it."""
    project = _project(tmp_path, {"test_on.py": TEST_ON, "test_off_only.py": TEST_OFF_ONLY})
    status, output = _pytest(project, *args)
    assert status == 0, output
    assert "transition coverage Lamp: 1/2" in output
    assert (f"transition coverage gate chart_coverage_min=100 not applied: a partial run "
            f"({why}); it judges a run of the whole suite") in output


def test_a_contract_violation_in_a_worker_fails_the_two_worker_run(tmp_path):
    project = _project(tmp_path, {"test_on.py": TEST_ON, "test_no_bulb.py": TEST_NO_BULB},
                       ini="[pytest]\ntestpaths = tests\n")
    status, output = _pytest(project, "--dist", "loadfile", "--chart-contracts=lamp:Lamp")
    assert status == 1, output
    assert output.count("chart contracts: 1 violation(s); the first: Lamp: invariant "
                        "'lit_only_with_a_bulb'") == 1, output
    status, output = _pytest(project, "--dist", "loadfile")  # the option off: it passes
    assert status == 0, output
