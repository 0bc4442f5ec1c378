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

PLUGIN_DIR = Path(__file__).resolve().parent


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
    before = KV_TXN.listeners  # the suite's recorder (tests/transition_coverage_plugin.py)
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


def _run_pytest(tmp_path: Path, test_body: str, *args: str, gate: str | None = None):
    (tmp_path / "pytest.ini").write_text("[pytest]\ntestpaths = tests\n")
    tests = tmp_path / "tests"
    tests.mkdir(exist_ok=True)
    (tests / "test_sample.py").write_text(textwrap.dedent(test_body))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "CALEXEC_TRANSITION_GATE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGIN_DIR), env.get("PYTHONPATH")]))
    if gate is not None:
        env["CALEXEC_TRANSITION_GATE"] = gate
    command = [sys.executable, "-m", "pytest", "-p", "transition_coverage_plugin",
               "-p", "no:cacheprovider", "-q", *args]
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


def test_gate_fails_a_whole_passing_suite_below_full_coverage(tmp_path):
    status, output = _run_pytest(tmp_path, PARTIAL)
    assert status == 1, output
    assert "transition coverage kv_txn: 1/4" in output
    assert "transition coverage gate FAILED for kv_txn" in output
    assert "Submitted --commit [device_finished_and_output_valid]--> Committed" in output


@pytest.mark.parametrize(
    ("args", "gate"),
    [((), "0"), (("-k", "one"), None), (("tests/test_sample.py",), None)],
    ids=["env-off", "keyword", "file-arg"],
)
def test_gate_off_for_partial_runs_or_env(tmp_path, args, gate):
    status, output = _run_pytest(tmp_path, PARTIAL, *args, gate=gate)
    assert status == 0, output
    assert "transition coverage kv_txn: 1/4" in output
    assert "gate FAILED" not in output


def test_gate_passes_at_full_coverage(tmp_path):
    status, output = _run_pytest(tmp_path, FULL)
    assert status == 0, output
    for chart in CHARTS.values():
        n = len(chart.transitions)
        assert f"transition coverage {chart.name}: {n}/{n}" in output
