"""pytest plugin: transition coverage of the declared charts, and a 100 % gate.

Attaches a ``TransitionRecorder`` (calexec.machines.coverage) as a listener to every compiled
chart for the session (``CompiledChart.attach``; outside pytest no chart has a listener and
nothing is recorded), detaches it at the end, prints one line per chart
(``transition coverage <chart>: <covered>/<declared>``) at the end and, when the session ran
the whole suite (the rootdir or its configured testpaths collected: no -k, no -m, no node ids or file args,
nothing deselected) and passed, fails it (exit status 1) if any chart is below 100 %, listing
the untaken transitions. ``CALEXEC_TRANSITION_GATE=0`` disables the gate (never set in CI).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from calexec.machines.compiled import CHARTS
from calexec.machines.coverage import TransitionRecorder, describe, report

_RECORDER = pytest.StashKey[TransitionRecorder]()
_DESELECTED = pytest.StashKey[bool]()
_GATE_FAILURE = pytest.StashKey[list]()


def pytest_configure(config: pytest.Config) -> None:
    recorder = config.stash[_RECORDER] = TransitionRecorder()
    for chart in CHARTS.values():
        chart.attach(recorder)
    config.stash[_DESELECTED] = False
    config.stash[_GATE_FAILURE] = []


def pytest_unconfigure(config: pytest.Config) -> None:
    recorder = config.stash.get(_RECORDER, None)
    if recorder is not None:
        for chart in CHARTS.values():
            chart.detach(recorder)


def pytest_deselected(items: list[pytest.Item]) -> None:
    if items:
        items[0].config.stash[_DESELECTED] = True


def _whole_suite(config: pytest.Config) -> bool:
    if config.option.keyword or config.option.markexpr or config.stash[_DESELECTED]:
        return False
    root = config.rootpath
    allowed = {root} | {(root / path).resolve() for path in config.getini("testpaths")}
    return all(
        "::" not in arg and Path(config.invocation_params.dir, arg).resolve() in allowed
        for arg in config.args
    )


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    gate_on = os.environ.get("CALEXEC_TRANSITION_GATE", "1") != "0"
    if not gate_on or exitstatus != 0 or not _whole_suite(config):
        return
    missing = [c for c in report(CHARTS.values(), config.stash[_RECORDER]) if not c.complete]
    if missing:
        config.stash[_GATE_FAILURE] = missing
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    for coverage in report(CHARTS.values(), config.stash[_RECORDER]):
        terminalreporter.write_line(coverage.line())
    for coverage in config.stash[_GATE_FAILURE]:
        terminalreporter.write_line(
            f"transition coverage gate FAILED for {coverage.chart}: untaken transitions:",
            red=True,
        )
        for transition in coverage.untaken:
            terminalreporter.write_line(f"    {describe(transition)}")
