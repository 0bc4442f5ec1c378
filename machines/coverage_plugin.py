"""pytest plugin (installed with calexec, entry point ``pytest11``): transition coverage of any
chart class over a test run, and a gate.

    pytest --chart-coverage=order_workflow:OrderWorkflow --chart-coverage-min=100

``--chart-coverage=MODULE:CLASS`` (repeatable; ``MODULE`` imported from the directory pytest is
run from; one in the configuration from the directory of its file, ``rootdir``, wherever pytest
is run from) records, through a listener (``coverage.track``), every transition any run of that
class takes during the session: a python-statemachine instance or a compiled run. At the end
one line per chart, ``transition coverage <chart>: <covered>/<declared>``; with
``--chart-coverage-min=PCT`` a passing run whose coverage of a chart is below ``PCT`` percent
fails (exit 1), listing the untaken transitions.

A project makes it its default in its pytest configuration instead (calexec's own
pyproject.toml does)::

    [tool.pytest.ini_options]
    chart_coverage = ["order_workflow:OrderWorkflow"]
    chart_coverage_min = "100"

The configured gate judges only a run of the whole suite (no ``-k``/``-m``, nothing
deselected, no node ids, no paths but the configured ``testpaths``): one test file alone does
not take every transition (the summary says it was not applied, and why, when a chart is below
it). ``CALEXEC_TRANSITION_GATE=0`` turns the configured gate off (1 or unset keeps it;
another value is refused). A gate
given on the command line judges whatever ran. Without either, the plugin does nothing.

``--chart-contracts=MODULE:CLASS`` (repeatable; or ``chart_contracts`` in the configuration)
checks the contracts declared in the chart class (machines/chart_contracts.py) on every run
during the session: a violation raises from the ``send`` that broke it, and a session in which
any was recorded (one a caught exception hid included) fails, naming the first. A chart that
declares no contract is a usage error (pytest's exit 4, one line naming it): the session
would check nothing while the option says it checks.

Under pytest-xdist (``-n 2``) each worker records the transitions and contract violations of
the tests it ran and sends them to the controller at its end (``config.workeroutput``: plain
lists); the controller merges every worker's (``pytest_testnodedown``), judges the gate once
on the union, prints the summary once and fails the run on a violation any worker recorded,
as one process would. Without xdist the plugin needs none of it.

Under ``calexec charts mutate`` (``CALEXEC_CHART_MUTANT`` set) a chart the unmutated run
imported and the mutant's run cannot (python-statemachine refuses a subclass the mutant left a
state unreachable in) ends the session as failed tests (exit 1, one line naming it): the tests
cannot run against the mutant, so it is killed, as it is without the plugin; a usage error
(exit 4) would judge it an error.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from calexec.machines.envflag import EnvFlagError, env_flag

if TYPE_CHECKING:
    from calexec.machines.chart_contracts import ContractMonitor
    from calexec.machines.coverage import ChartCoverage, TransitionRecorder

#: ``calexec charts mutate``'s mutant (machines/mutants.py ``ENV``: not imported, the plugin
#: loads in every pytest session)
MUTANT_ENV = "CALEXEC_CHART_MUTANT"

_STATE = pytest.StashKey["_Session"]()
#: violations (their text) the xdist workers recorded, merged on the controller
_WORKER_VIOLATIONS = pytest.StashKey[list[str]]()
#: the key of ``config.workeroutput`` a worker's record travels under (execnet: plain types)
WORKER_OUTPUT = "calexec_chart_coverage"
_CONTRACTS: pytest.StashKey[ContractMonitor] = pytest.StashKey()
GATE_ENV = "CALEXEC_TRANSITION_GATE"


class _Session:
    def __init__(self, charts: list[Any], recorder: TransitionRecorder, minimum: float | None,
                 whole_suite_only: bool, undo: list[Callable[[], None]]) -> None:
        self.charts, self.recorder, self.minimum = charts, recorder, minimum
        self.whole_suite_only, self.undo = whole_suite_only, undo
        self.deselected = False
        #: the summary's hints (a chart imported under a second name) an xdist worker saw
        self.worker_notes: list[str] = []
        self.failed: list[ChartCoverage] = []
        #: why the configured gate did not judge this run ("-k", ...; None: it did, or none)
        self.not_judged: str | None = None
        #: ``sys.path`` as the charts were imported: what a reference the summary suggests is
        #: imported from (the tests may add a directory later, ``sys.path.insert`` in a test)
        self.searched = list(sys.path)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("chart-coverage", "transition coverage of statecharts (calexec)")
    group.addoption("--chart-coverage", action="append", default=[], metavar="MODULE:CLASS",
                    help="record the transitions every run of this chart class takes "
                         "(repeatable)")
    # taken as text and read by ``_minimum``: argparse's own ``type=float`` answered a value that
    # is no number with pytest's multi-line usage, and echoed 150 as '150.0'
    group.addoption("--chart-coverage-min", default=None, metavar="PCT",
                    help="fail a passing run whose coverage of a chart is below PCT percent")
    group.addoption("--chart-contracts", action="append", default=[], metavar="MODULE:CLASS",
                    help="check the contracts declared in this chart class on every run during "
                         "the session (repeatable; machines/chart_contracts.py)")
    parser.addini("chart_contracts", type="linelist", default=[],
                  help="chart classes (MODULE:CLASS) whose contracts are checked in every test")
    parser.addini("chart_coverage", type="linelist", default=[],
                  help="chart classes (MODULE:CLASS) whose transition coverage is recorded")
    parser.addini("chart_coverage_min", default="",
                  help="gate (percent) for a whole-suite run of the configured charts")


def _minimum(text: str, origin: str) -> float:
    """``text`` as a gate, or one usage error naming ``origin`` and the value as given."""
    from calexec.machines.coverage import gate_percentage  # (imports python-statemachine)

    value = gate_percentage(text)
    if value is None:  # (nan, inf and a word included)
        raise pytest.UsageError(f"{origin}={text!r}: expected a percentage (0-100)")
    return value


def _gate_on() -> bool:
    """``$CALEXEC_TRANSITION_GATE``: 0 turns the configured gate off, 1 (or unset, or empty)
    keeps it; another value is one usage error naming it (``off`` or ``false`` kept the gate
    on, silently: only ``0`` was read). Read as every on/off variable is:
    ``machines/envflag.py``."""
    try:
        return env_flag(GATE_ENV, True, on="keep it",
                        off="turn the configured chart_coverage_min gate off")
    except EnvFlagError as err:
        raise pytest.UsageError(str(err)) from None


def _base(config: pytest.Config, given_by_flag: bool) -> str:
    """The directory a chart reference is imported from: the one pytest is run from for a
    flag, the configuration file's (pytest's ``rootdir`` when there is none) for a configured
    value, as pytest reads ``testpaths`` and ``pythonpath`` there: ``pytest`` run in a
    subdirectory of the project was refused ``No module named ...`` for the project's own
    configured chart."""
    if given_by_flag:
        return str(config.invocation_params.dir)
    inipath = config.inipath
    return str(inipath.parent if inipath is not None else config.rootpath)


def _configure_contracts(config: pytest.Config) -> None:
    flags = list(config.getoption("chart_contracts") or [])
    refs = list(dict.fromkeys(list(config.getini("chart_contracts")) + flags))
    if not refs:
        return
    from calexec.machines.chart_contracts import declared_contracts, enable_contracts
    from calexec.machines.chart_support import UnsupportedChart
    from calexec.machines.chartref import ChartRefError, load_chart

    charts = []
    for ref in refs:
        try:
            declaration = load_chart(ref, _base(config, ref in flags))
            # a chart no run takes, a contract naming no state; none: nothing would be checked
            if not declared_contracts(declaration):
                raise ValueError(
                    f"{declaration.__name__} declares no contracts, so none would be checked "
                    f"(declare them in the class with @invariant, @precondition or "
                    f"@postcondition from calexec.machines.chart_contracts)")
            charts.append(declaration)
        except (ChartRefError, UnsupportedChart, ValueError) as err:
            reason = err.reason if isinstance(err, ChartRefError) else err
            origin = "--chart-contracts" if ref in flags else "chart_contracts"
            raise pytest.UsageError(f"{origin}={ref!r}: {reason}") from None
    try:
        config.stash[_CONTRACTS] = enable_contracts(*charts)
    except (UnsupportedChart, ValueError, TypeError) as err:
        raise pytest.UsageError(f"--chart-contracts: {err}") from None


def pytest_configure(config: pytest.Config) -> None:
    _configure_contracts(config)
    refs: list[str] = list(config.getoption("chart_coverage") or [])
    configured: list[str] = list(config.getini("chart_coverage"))
    cli_min = config.getoption("chart_coverage_min")
    if not refs and not configured:
        if cli_min is not None:
            raise pytest.UsageError("--chart-coverage-min needs --chart-coverage=MODULE:CLASS "
                                    "(or chart_coverage in the pytest configuration)")
        return
    from calexec.machines.chart_support import UnsupportedChart
    from calexec.machines.chartref import ChartRefError, load_chart
    from calexec.machines.coverage import TransitionRecorder, track

    minimum: float | None
    if cli_min is not None:
        minimum, whole_suite_only = _minimum(cli_min, "--chart-coverage-min"), False
    elif config.getini("chart_coverage_min") and _gate_on():
        minimum = _minimum(str(config.getini("chart_coverage_min")), "chart_coverage_min")
        whole_suite_only = True
    else:
        minimum, whole_suite_only = None, False
    recorder = TransitionRecorder()
    charts, undo = [], []
    named: dict[str, tuple[str, type]] = {}
    def given(ref: str) -> str:  # as the user gave it: the flag, or the configuration's key
        return f"{'--chart-coverage' if ref in refs else 'chart_coverage'}={ref!r}"

    for ref in dict.fromkeys(configured + refs):
        try:
            declaration = load_chart(ref, _base(config, ref in refs))
            first = named.setdefault(declaration.__name__, (ref, declaration))
            if first[1] is not declaration:
                problem = (f"{given(ref)} and {given(first[0])}: two "
                           f"charts named {declaration.__name__} (coverage counts transitions "
                           f"by chart name); give one class another name")
            else:
                undo.append(track(declaration, recorder))
                problem = None
        except (ChartRefError, UnsupportedChart, ValueError) as err:
            reason = err.reason if isinstance(err, ChartRefError) else err
            problem = f"{given(ref)}: {reason}"
        if problem is not None:
            for done in undo:
                done()
            mutant = os.environ.get(MUTANT_ENV)
            if mutant:  # (``charts mutate``: the unmutated run imported it, so the mutant
                # broke it: a subclass python-statemachine refuses, say; the tests cannot run
                # against it, which kills it, as a collection error does without the plugin)
                pytest.exit(f"{problem} (under the chart mutant {mutant}: the mutated chart's "
                            f"module cannot be imported)", returncode=pytest.ExitCode.TESTS_FAILED)
            raise pytest.UsageError(problem)
        charts.append(declaration)
    config.stash[_STATE] = _Session(charts, recorder, minimum, whole_suite_only, undo)


def pytest_unconfigure(config: pytest.Config) -> None:
    contracts = config.stash.get(_CONTRACTS, None)
    if contracts is not None:
        contracts.disable()
    state = config.stash.get(_STATE, None)
    if state is not None:
        for undo in state.undo:
            undo()
        state.undo = []


def pytest_deselected(items: list[pytest.Item]) -> None:
    if items:
        state = items[0].config.stash.get(_STATE, None)
        if state is not None:
            state.deselected = True


def _partial(config: pytest.Config, state: _Session) -> str | None:
    """Why this run is not the whole suite (``-k``, ``-m``, ``tests deselected``, ``paths or
    node ids given``), or None when it is."""
    if config.option.keyword:
        return "-k"
    if config.option.markexpr:
        return "-m"
    if state.deselected:
        return "tests deselected"
    root = config.rootpath
    allowed = {root} | {(root / path).resolve() for path in config.getini("testpaths")}
    if all("::" not in arg and Path(config.invocation_params.dir, arg).resolve() in allowed
           for arg in config.args):
        return None
    return "paths or node ids given"


def _is_worker(config: pytest.Config) -> bool:
    """An xdist worker's session: its tests' record goes to the controller, which judges."""
    return hasattr(config, "workerinput")


def _send_to_controller(config: pytest.Config) -> None:
    """The worker's record as plain types (execnet carries nothing else) in
    ``config.workeroutput``, which xdist hands to the controller's ``pytest_testnodedown``."""
    contracts = config.stash.get(_CONTRACTS, None)
    state = config.stash.get(_STATE, None)
    record: dict[str, object] = {
        "violations": [str(v) for v in contracts.violations] if contracts is not None else [],
    }
    if state is not None:
        record["hits"] = sorted([name, ident] for name, ident in state.recorder.hits)
        record["deselected"] = state.deselected
        record["notes"] = _twin_notes(config, state)
    output: dict[str, object] = config.workeroutput  # type: ignore[attr-defined]
    output[WORKER_OUTPUT] = record


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """(xdist, on the controller) merge a worker's record into the controller's session
    (``node``: xdist's ``WorkerController``, its ``config`` and ``workeroutput``)."""
    output = getattr(node, "workeroutput", None)
    record = output.get(WORKER_OUTPUT) if isinstance(output, dict) else None
    config = getattr(node, "config", None)
    if not isinstance(record, dict) or not isinstance(config, pytest.Config):
        return  # (a worker that crashed: its tests failed the run)
    violations = config.stash.setdefault(_WORKER_VIOLATIONS, [])
    violations.extend(str(v) for v in record.get("violations", []))
    state = config.stash.get(_STATE, None)
    if state is None:
        return
    state.recorder.hits.update((str(name), int(ident)) for name, ident in record.get("hits", []))
    state.deselected = state.deselected or bool(record.get("deselected"))
    for note in record.get("notes", []):
        if note not in state.worker_notes:
            state.worker_notes.append(str(note))


def _violations(config: pytest.Config) -> list[str]:
    """Every contract violation of the run: this process's and its xdist workers'."""
    contracts = config.stash.get(_CONTRACTS, None)
    own = [str(v) for v in contracts.violations] if contracts is not None else []
    return own + config.stash.get(_WORKER_VIOLATIONS, [])


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if _is_worker(config):
        _send_to_controller(config)
        return
    if _violations(config):  # one a caught exception hid too
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    state = config.stash.get(_STATE, None)
    if state is None or state.minimum is None or exitstatus != 0:
        return
    if state.whole_suite_only:
        state.not_judged = _partial(config, state)
        if state.not_judged is not None:
            return
    from calexec.machines.coverage import report

    minimum = state.minimum
    state.failed = [c for c in report(state.charts, state.recorder) if c.percent < minimum]
    if state.failed:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            config: pytest.Config) -> None:
    if _is_worker(config):
        return
    violations = _violations(config)
    if violations:
        terminalreporter.write_line(f"chart contracts: {len(violations)} violation(s); "
                                    f"the first: {violations[0]}", red=True)
    state = config.stash.get(_STATE, None)
    if state is None:
        return
    from calexec.machines.coverage import describe, report

    coverages = report(state.charts, state.recorder)
    for coverage in coverages:
        terminalreporter.write_line(coverage.line())
    if state.not_judged is not None and state.minimum is not None and any(
            coverage.percent < state.minimum for coverage in coverages):
        # (a partial run below the gate passed without a word: read as a passing gate)
        terminalreporter.write_line(
            f"transition coverage gate chart_coverage_min={state.minimum:g} not applied: a "
            f"partial run ({state.not_judged}); it judges a run of the whole suite",
            yellow=True)
    for note in dict.fromkeys(_twin_notes(config, state) + state.worker_notes):
        terminalreporter.write_line(note, yellow=True)
    charts = {coverage.chart: chart for chart, coverage in zip(state.charts, coverages)}
    for coverage in state.failed:
        terminalreporter.write_line(
            f"transition coverage gate FAILED for {coverage.chart}: {coverage.percent:.1f} % < "
            f"{state.minimum:g} %; untaken transitions:", red=True)
        for transition in coverage.untaken:
            terminalreporter.write_line(
                f"    {describe(transition, charts.get(coverage.chart))}")


def _twin_notes(config: pytest.Config, state: _Session) -> list[str]:
    """One hint per chart file the tests imported under a second module name too (its runs
    there are another class's, not counted)."""
    from calexec.machines.chart_support import bound_name
    from calexec.machines.coverage import import_directory, other_imports

    notes = []
    for declaration in state.charts:
        for twin in other_imports(declaration):
            # (a directory the tests put on sys.path themselves, after the plugin imported the
            # charts: until stop 57 the hint named the reference alone, which the next run
            # refused, "cannot import module 'kettle'")
            where = import_directory(declaration, twin, state.searched,
                                     str(config.invocation_params.dir))
            path = "" if where is None else (
                f", with {where} on the path as pytest starts: PYTHONPATH={where}, or "
                f"pythonpath = {where} in the pytest configuration; the tests put it on "
                f"sys.path themselves, after the chart was imported")
            notes.append(
                f"transition coverage {declaration.__name__}: the tests imported its file as "
                f"module {twin!r} too, another class whose runs are not counted: name the "
                f"chart as they import it ({twin}:{bound_name(declaration)}{path})")
    return notes
