"""Transition recording (compiled runs and real instances) and the pytest coverage gate."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from calexec.machines.compiled import CHARTS, KV_TXN, compile_chart
from calexec.machines.coverage import (
    TransitionListener,
    TransitionRecorder,
    describe,
    recording,
    report,
)
from calexec.machines.paths import GuardTable


def test_a_recorder_records_only_while_attached():
    """Coverage is a listener someone attaches: a chart nobody listens to records nothing (and
    its send tests an empty tuple), an attached recorder sees each taken transition, a
    detached one stops; ``recording`` scopes one to a block beside the suite's."""
    kv = compile_chart(KV_TXN.declaration, "kv_txn")  # a table of its own: no listener at all
    rollback = kv.table[("Reserved", "rollback")][0].key
    assert kv.listeners == ()
    recorder = TransitionRecorder()
    kv.run(GuardTable.for_chart(kv)).send("rollback")
    assert recorder.hits == set()
    kv.attach(recorder)
    kv.run(GuardTable.for_chart(kv)).send("rollback")
    assert recorder.hits == {rollback} and kv.listeners == (recorder,)
    kv.detach(recorder)
    kv.run(GuardTable.for_chart(kv)).send("mark_submitted")
    assert recorder.hits == {rollback} and kv.listeners == ()
    with pytest.raises(ValueError):
        kv.detach(recorder)
    recorder.clear()
    assert recorder.hits == set()
    before = KV_TXN.listeners  # the suite's recorder (machines/coverage_plugin.py)
    with recording([KV_TXN]) as scoped:
        assert KV_TXN.listeners == before + (scoped,)
        KV_TXN.run(GuardTable.for_chart(KV_TXN)).send("rollback")
    assert KV_TXN.listeners == before and scoped.hits == {rollback}


def test_listener_maps_real_transitions_to_compiled_ids():
    recorder = TransitionRecorder()
    machine = KV_TXN.declaration(
        GuardTable.for_chart(KV_TXN), listeners=[TransitionListener(KV_TXN, recorder)]
    )
    machine.send("mark_submitted")
    machine.send("commit")
    taken = {(t.source, t.event, t.target) for t in KV_TXN.transitions if t.key in recorder.hits}
    assert taken == {("Reserved", "mark_submitted", "Submitted"), ("Submitted", "commit", "Committed")}
    (kv,) = [c for c in report(CHARTS.values(), recorder) if c.chart == "kv_txn"]
    assert kv.line() == "transition coverage kv_txn: 2/4" and not kv.complete
    assert sorted(describe(t) for t in kv.untaken) == [
        "Reserved --rollback--> RolledBack",
        "Submitted --mark_unknown--> Unknown",
    ]


CALEXEC_INI = """\
[pytest]
testpaths = tests
chart_coverage =
    calexec.machines.charts:JobChart
    calexec.machines.charts:KvTxnChart
    calexec.machines.charts:LifecycleChart
    calexec.machines.charts:BufferSlotChart
chart_coverage_min = 100
"""


def _run_pytest(tmp_path: Path, test_body: str, *args: str, gate: str | None = None,
                ini: str = CALEXEC_INI):
    """pytest in a project of its own (``tmp_path``): the plugin comes from calexec's entry
    point, as in any project where calexec is installed."""
    (tmp_path / "pytest.ini").write_text(ini)
    tests = tmp_path / "tests"
    tests.mkdir(exist_ok=True)
    (tests / "test_sample.py").write_text(textwrap.dedent(test_body))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "CALEXEC_TRANSITION_GATE")}
    if gate is not None:
        env["CALEXEC_TRANSITION_GATE"] = gate
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


PARTIAL = """
    from calexec.machines.compiled import KV_TXN
    from calexec.machines.paths import GuardTable

    def test_one():
        KV_TXN.run(GuardTable.for_chart(KV_TXN)).send("rollback")
"""

FULL = """
    from calexec.machines.compiled import CHARTS
    from calexec.machines.paths import GuardTable, drive, transition_paths

    def test_all():
        for chart in CHARTS.values():
            for path in transition_paths(chart):
                drive(chart.run(GuardTable.for_chart(chart)), path)
"""


def test_configured_gate_fails_a_whole_passing_suite_below_full_coverage(tmp_path):
    status, output = _run_pytest(tmp_path, PARTIAL)
    assert status == 1, output
    assert "transition coverage kv_txn: 1/4" in output
    assert "transition coverage gate FAILED for kv_txn: 25.0 % < 100 %" in output
    assert "Submitted --commit [device_finished_and_output_valid]--> Committed" in output


@pytest.mark.parametrize(
    ("args", "gate"),
    [((), "0"), (("-k", "one"), None), (("tests/test_sample.py",), None)],
    ids=["env-off", "keyword", "file-arg"],
)
def test_configured_gate_off_for_partial_runs_or_env(tmp_path, args, gate):
    status, output = _run_pytest(tmp_path, PARTIAL, *args, gate=gate)
    assert status == 0, output
    assert "transition coverage kv_txn: 1/4" in output
    assert "gate FAILED" not in output


def test_configured_gate_passes_at_full_coverage(tmp_path):
    status, output = _run_pytest(tmp_path, FULL)
    assert status == 0, output
    for chart in CHARTS.values():
        n = len(chart.transitions)
        assert f"transition coverage {chart.name}: {n}/{n}" in output


USER_CHART = """
    from statemachine import State, StateMachine


    class Kettle(StateMachine):
        cold = State(initial=True)
        hot = State()
        empty = State(final=True)

        heat = cold.to(hot, cond="has_water") | cold.to(empty)
        cool = hot.to(cold)
"""

USER_TESTS = """
    from kettle import Kettle


    class Water:
        def __init__(self, full):
            self.full = full

        def has_water(self):
            return self.full


    def test_heat_and_cool():
        kettle = Kettle(Water(True))
        kettle.send("heat")
        kettle.send("cool")
"""


def test_command_line_gate_counts_real_instances_of_a_user_chart(tmp_path):
    """A user's project, a chart of its own, python-statemachine instances only: the command
    line gate judges this run (a file argument included) and names the untaken transition."""
    (tmp_path / "kettle.py").write_text(textwrap.dedent(USER_CHART))
    ini = "[pytest]\ntestpaths = tests\npythonpath = .\n"
    status, output = _run_pytest(tmp_path, USER_TESTS, "--chart-coverage=kettle:Kettle",
                                 "--chart-coverage-min=100", "tests/test_sample.py", ini=ini)
    assert status == 1, output
    assert "transition coverage Kettle: 2/3" in output
    assert "transition coverage gate FAILED for Kettle: 66.7 % < 100 %" in output
    assert "    cold --heat [else]--> empty" in output  # (the fallback: since stop 72)
    status, output = _run_pytest(tmp_path, USER_TESTS, "--chart-coverage=kettle:Kettle",
                                 "--chart-coverage-min=60", ini=ini)
    assert status == 0 and "transition coverage Kettle: 2/3" in output, output
    status, output = _run_pytest(tmp_path, USER_TESTS, "--chart-coverage=kettle:Kettle", ini=ini)
    assert status == 0 and "transition coverage Kettle: 2/3" in output, output


def test_a_chart_the_tests_import_under_another_module_name_is_named(tmp_path):
    """The chart file ``app/kettle.py``, given as ``--chart-coverage=app.kettle:Kettle`` from
    the project directory while the tests import it as ``kettle`` (``pythonpath = app``): the
    same file imported twice is two classes, the listener heard only the one the tests never
    ran, and the run said ``transition coverage Kettle: 0/3`` (a gate failing on every
    transition) with no hint why. The count is still the given class's, but the summary names
    the other module and the reference to give."""
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "kettle.py").write_text(textwrap.dedent(USER_CHART))
    ini = "[pytest]\ntestpaths = tests\npythonpath = app\n"
    status, output = _run_pytest(tmp_path, USER_TESTS, "--chart-coverage=app.kettle:Kettle", ini=ini)
    assert status == 0, output
    assert "transition coverage Kettle: 0/3" in output, output
    assert ("transition coverage Kettle: the tests imported its file as module 'kettle' too, "
            "another class whose runs are not counted: name the chart as they import it "
            "(kettle:Kettle)") in output, output
    status, output = _run_pytest(tmp_path, USER_TESTS, "--chart-coverage=kettle:Kettle", ini=ini)
    assert status == 0 and "transition coverage Kettle: 2/3" in output, output
    assert "imported its file as module" not in output, output


def test_the_hint_names_the_path_a_test_put_on_sys_path_itself(tmp_path):
    """A src layout whose test puts ``src/`` on ``sys.path`` itself and imports ``kettle``,
    the chart given as ``src.kettle:Kettle``: the summary said to name it ``kettle:Kettle``,
    which the next run refused (``cannot import module 'kettle'``: the plugin imports the chart
    before any test has put ``src`` there). It now names the path to add as pytest starts, and
    both ways it names count the tests' runs."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "kettle.py").write_text(textwrap.dedent(USER_CHART))
    ini = "[pytest]\ntestpaths = tests\n"
    own_path = ("import sys, pathlib\n"
                "sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / 'src'))\n")
    tests = own_path + textwrap.dedent(USER_TESTS)
    status, output = _run_pytest(tmp_path, tests, "--chart-coverage=src.kettle:Kettle", ini=ini)
    assert status == 0 and "transition coverage Kettle: 0/3" in output, output
    assert ("name the chart as they import it (kettle:Kettle, with src on the path as pytest "
            "starts: PYTHONPATH=src, or pythonpath = src in the pytest configuration; the tests "
            "put it on sys.path themselves, after the chart was imported)") in output, output
    status, output = _run_pytest(tmp_path, tests, "--chart-coverage=kettle:Kettle",
                                 ini=ini + "pythonpath = src\n")
    assert status == 0 and "transition coverage Kettle: 2/3" in output, output
    assert "imported its file as module" not in output, output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--chart-coverage=kettle",), "--chart-coverage='kettle': expected MODULE:CLASS"),
        (("--chart-coverage=nowhere:Kettle",), "--chart-coverage='nowhere:Kettle': cannot import"),
        (("--chart-coverage=kettle:Pot",), "module 'kettle' has no attribute 'Pot'"),
        (("--chart-coverage=kettle:Kettle", "--chart-coverage-min=120"),
         "ERROR: --chart-coverage-min='120': expected a percentage (0-100)\n"),
        # a word was argparse's own error: pytest's usage, several lines, naming no percentage
        (("--chart-coverage=kettle:Kettle", "--chart-coverage-min=abc"),
         "ERROR: --chart-coverage-min='abc': expected a percentage (0-100)\n"),
        (("--chart-coverage=kettle:Kettle", "--chart-coverage-min="),
         "ERROR: --chart-coverage-min='': expected a percentage (0-100)\n"),
        # (named as given, not as the float it became: 'inf')
        (("--chart-coverage=kettle:Kettle", "--chart-coverage-min=1e400"),
         "ERROR: --chart-coverage-min='1e400': expected a percentage (0-100)\n"),
        (("--chart-coverage-min=50",), "--chart-coverage-min needs --chart-coverage"),
    ],
    ids=["no-colon", "no-module", "no-class", "min-out-of-range", "min-not-a-number",
         "min-empty", "min-overflow", "min-without-chart"],
)
def test_bad_plugin_options_are_one_usage_error(tmp_path, args, message):
    (tmp_path / "kettle.py").write_text(textwrap.dedent(USER_CHART))
    ini = "[pytest]\ntestpaths = tests\npythonpath = .\n"
    status, output = _run_pytest(tmp_path, USER_TESTS, *args, ini=ini)
    assert status == 4, output  # pytest's usage error
    assert message in output and "Traceback" not in output, output
    assert "usage:" not in output, output  # one line, not pytest's usage


def test_a_bad_configured_chart_is_named_by_its_configuration_key(tmp_path):
    """``chart_coverage = kettle:Pot`` (or ``chart_contracts``) in the pytest configuration,
    no flag given: the usage error said ``--chart-coverage='kettle:Pot': ...``, a flag the
    user never passed, sending them to look for it in scripts and CI files. A configured
    value is named by its key; a value given by the flag still by the flag."""
    (tmp_path / "kettle.py").write_text(textwrap.dedent(USER_CHART))
    for key in ("chart_coverage", "chart_contracts"):
        ini = f"[pytest]\ntestpaths = tests\npythonpath = .\n{key} = kettle:Pot\n"
        status, output = _run_pytest(tmp_path, USER_TESTS, ini=ini)
        assert status == 4, output
        assert (f"ERROR: {key}='kettle:Pot': module 'kettle' has no attribute 'Pot'"
                in output), output
        flag = "--" + key.replace("_", "-")
        status, output = _run_pytest(tmp_path, USER_TESTS, f"{flag}=kettle:Pan", ini=ini)
        assert status == 4 and f"ERROR: {key}='kettle:Pot'" in output, output  # the first
    ini = "[pytest]\ntestpaths = tests\npythonpath = .\n"
    status, output = _run_pytest(tmp_path, USER_TESTS, "--chart-contracts=kettle:Pan", ini=ini)
    assert status == 4 and "ERROR: --chart-contracts='kettle:Pan': module" in output, output


def test_a_chart_module_found_only_below_the_directory_names_the_path_to_add(tmp_path):
    """``--chart-coverage=kettle:Kettle`` in a src layout whose tests put ``src`` on
    ``sys.path`` themselves (so ``from kettle import Kettle`` works in every test) was refused
    naming only the missing module, ``No module named 'kettle'``: the plugin imports the chart
    before any test runs. The refusal now names the file it would be and the path to add; a
    module that is nowhere below is refused as before."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "kettle.py").write_text(textwrap.dedent(USER_CHART))
    ini = "[pytest]\ntestpaths = tests\n"
    tests = ("import sys, pathlib\n"
             "sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / 'src'))\n"
             + textwrap.dedent(USER_TESTS))
    status, output = _run_pytest(tmp_path, tests, "--chart-coverage=kettle:Kettle", ini=ini)
    assert status == 4, output
    assert (f"ERROR: --chart-coverage='kettle:Kettle': cannot import module 'kettle' from "
            f"{tmp_path} (ModuleNotFoundError: No module named 'kettle'); src/kettle.py is there: "
            f"put src on the path as the command starts (PYTHONPATH=src; in pytest's "
            f"configuration, pythonpath = src)") in output, output
    status, output = _run_pytest(tmp_path, tests, "--chart-coverage=kettle:Kettle",
                                 ini=ini + "pythonpath = src\n")
    assert status == 0 and "transition coverage Kettle: 2/3" in output, output
    status, output = _run_pytest(tmp_path, tests, "--chart-coverage=teapot:Kettle", ini=ini)
    assert status == 4 and ("cannot import module 'teapot' from "
                            f"{tmp_path} (ModuleNotFoundError: No module named 'teapot')\n"
                            ) in output, output
