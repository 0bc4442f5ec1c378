"""``calexec charts mutate``: mutation testing of declared statecharts.

For each chart (calexec's four by default, or any python-statemachine chart class, flat or
hierarchical, given as ``--chart module:Class``) the mutants of ``calexec.machines.mutants`` are
derived from the declaration; each is run against a test command in a fresh process that
applies it at start-up (a ``sitecustomize`` on ``PYTHONPATH`` imports the chart and mutates
it, ``mutants.install_from_env``), so the code
under test, and for calexec the compiled table the executor runs, is the mutant. A mutant is
**killed** when the command fails, **survived** when it passes, and **error** when it could
not be judged (the mutant was never applied because the command did not import the chart,
or the command exited with a code of ``--error-codes``: pytest's internal error, usage error,
no tests). A command that exceeds ``--timeout`` is killed (``how: timeout``), as PIT counts it.
The unmutated command runs first and must pass.

A survivor listed in the ``--equivalent`` TOML file (``[[mutant]]`` tables with ``chart``,
``id`` and ``reason``; calexec's is ``docs/chart_mutants_equivalent.toml``) is reported
**equivalent** with its reason and left out of the score; a listed mutant that is killed is
reported as a stale entry.

Report: Markdown on stdout (``--json``: JSON instead), both into ``--report DIR``
(``mutation.md``, ``mutation.json``); score per chart = killed / (killed + survived).

Exit codes: 0 done; 1 a mutant is an error, survives undocumented (``--fail-on-survivor``) or a
chart scores below ``--fail-under``; 2 bad input, in one line naming the flag and its value (a
chart that is no chart, a selection of no mutant, an unmutated run that fails, a ``--report``
that cannot be written); 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from calexec import cliargs
from calexec.drivers.tools.bench.subproc import end_leftovers
from calexec.drivers.tools.sitecustomize_template import sitecustomize_source
from calexec.machines import mutants as mutants_mod
from calexec.machines.chart_support import UnsupportedChart, refuse_unsupported
from calexec.machines.chartref import ChartRefError, load_chart, shown_ref
from calexec.machines.coverage import gate_percentage

#: calexec's own charts, by the names ``machines.charts.DECLARED`` gives them.
CALEXEC_CHARTS = {
    "job": "calexec.machines.charts:JobChart",
    "kv_txn": "calexec.machines.charts:KvTxnChart",
    "lifecycle": "calexec.machines.charts:LifecycleChart",
    "buffer_slot": "calexec.machines.charts:BufferSlotChart",
}
#: the files ``--report DIR`` gets
REPORT_FILES = ("mutation.md", "mutation.json")
#: The model-based tests of calexec's charts at a fast size: the charts on both forms, the
#: generated paths on bare charts and through the executor (job, KV txn, lifecycle), the
#: chart rules proved through the executor (tests/test_chart_rules_*.py: one test per rule
#: only the tests of the charts alone checked before), the single-thread stateful test.
#: A mutant that breaks path generation is a collection error; the other files still run, so
#: the report still says whether the executor's tests notice it too. LangSmith's pytest plugin
#: (the ``[clients]`` extra installs it; none of these tests uses it) is not loaded: its
#: imports cost 2-3 s of each run's start, once per mutant.
DEFAULT_TEST_CMD = (
    f"{shlex.quote(sys.executable)} -m pytest -q -p no:cacheprovider -p no:langsmith_plugin "
    "--hypothesis-profile=mutate --continue-on-collection-errors "
    "tests/test_charts_declared.py tests/test_charts_compiled.py tests/test_charts_paths.py "
    "tests/test_executor_paths.py tests/test_recovery.py::test_lifecycle_transition_reached_through_executor "
    "tests/test_chart_rules_job.py tests/test_chart_rules_buffer_slot.py "
    "tests/test_executor_stateful.py::TestExecutorStateful"
)
#: Killers under this prefix test a chart alone; the report also counts mutants killed by any
#: other test (for calexec: through the executor).
DEFAULT_CHART_ONLY_PREFIX = "tests/test_charts_"
#: calexec's documented equivalent mutants, relative to --cwd (used when it exists).
DEFAULT_EQUIVALENT = "docs/chart_mutants_equivalent.toml"
#: CALEXEC_STATEFUL_EXAMPLES the default command's stateful test runs (``--examples``)
DEFAULT_EXAMPLES = 30
#: the most mutants ``--jobs`` runs at once: each is a test process of its own (``--jobs
#: 10**30`` was taken, a pool as large as the mutants: hundreds of pytest processes at once)
MAX_JOBS = 64
STATUSES = ("killed", "survived", "equivalent", "error")
#: modules (comma-separated) the unmutated run reports importing, into CALEXEC_CHART_MUTANT_ACK
PROBE_ENV = "CALEXEC_CHART_MUTATE_PROBE"
SITECUSTOMIZE = sitecustomize_source(
    "`calexec charts mutate`: apply the chart mutant named in CALEXEC_CHART_MUTANT.",
    "calexec.machines.mutants") + f'''
# the unmutated run: report which chart modules this process imported (as it exits: however it
# imported them), so a command that never imports a chart is said before every mutant runs
if _os.environ.get("{PROBE_ENV}") and _os.environ.get("{mutants_mod.ACK_ENV}"):
    import atexit as _atexit

    def _report_imports(names=_os.environ["{PROBE_ENV}"].split(","),
                        ack=_os.environ["{mutants_mod.ACK_ENV}"]):
        seen = [name for name in names if name in _sys.modules]
        if seen:
            # (a module named from a file name that is no UTF-8 holds a lone surrogate)
            with open(ack, "a", encoding="utf-8", errors="surrogateescape") as out:
                out.write("".join("imported " + name + "\\n" for name in seen))

    _atexit.register(_report_imports)
'''
#: a failing test's id in pytest's short summary: the whole id up to `` - <message>`` (a
#: parametrized id holds spaces, ``test_x[call fail]``: it was cut at the first one)
FAILED_LINE = re.compile(r"^(?:FAILED|ERROR) ([^\[\n]+?(?:\[.*?\])?)(?: - |$)", re.MULTILINE)


@attrs.frozen
class Chart:
    name: str
    target: str  # module:Class
    declaration: type


@attrs.define
class Outcome:
    chart: str
    mutant: mutants_mod.Mutant
    status: str = "error"  # one of STATUSES
    how: str = ""
    seconds: float = 0.0
    exit_code: int | None = None
    killed_by: list[str] = attrs.Factory(list)
    output_tail: str = ""
    reason: str = ""  # why it is equivalent, from the --equivalent list

    def to_json(self) -> dict[str, Any]:
        return {
            "chart": self.chart, "id": self.mutant.id, "kind": self.mutant.kind,
            "transition": self.mutant.transition, "detail": self.mutant.detail,
            "status": self.status, "how": self.how, "seconds": round(self.seconds, 2),
            "exit_code": self.exit_code, "killed_by": self.killed_by,
            **({"reason": self.reason} if self.reason else {}),
            **({"output_tail": self.output_tail} if self.status == "error" else {}),
        }


def _parser() -> argparse.ArgumentParser:
    parser = cliargs.parser("calexec charts mutate", __doc__)
    parser.add_argument("--chart", action="append", metavar="NAME|module:Class",
                        help="a chart to mutate (repeatable): one of calexec's "
                             f"({', '.join(CALEXEC_CHARTS)}) or any python-statemachine chart class "
                             "as module:Class (then --test-cmd is required); default: calexec's four")
    parser.add_argument("charts", nargs="*", metavar="CHART",
                        help="the same as --chart CHART (as 'charts draw' and 'charts paths' "
                             "take their chart)")
    parser.add_argument("--test-cmd", help="the command that tests the chart, run once per "
                        "mutant (shell words, no shell); default: calexec's model-based tests")
    parser.add_argument("--cwd", default=".", help="directory the test command runs in and "
                        "that is put on sys.path to import --chart modules (default: .)")
    parser.add_argument("--targets-per-transition", type=cliargs.non_negative_int, default=2, metavar="K",
                        help="target mutants per transition: the source itself, then the states "
                             "declared after the target, a state entered exactly as the target "
                             "is (a compound's initial child) last (0: every other state)")
    parser.add_argument("--kind", action="append", choices=mutants_mod.KINDS,
                        help="only these mutant kinds (repeatable)")
    parser.add_argument("--mutant", action="append", metavar="ID",
                        help="only this mutant id (repeatable; CHART/ID when several charts)")
    parser.add_argument("--sample", type=cliargs.positive_int, metavar="N",
                        help="a deterministic sample of N mutants spread over charts and kinds")
    parser.add_argument("--seed", type=cliargs.non_negative_int, default=0, help="seed of --sample (default 0)")
    # (taken and ignored without --sample: every mutant ran, in the same order, whatever it was)
    parser.only_with("--seed", lambda args: args.sample is not None,
                     "seeds --sample's choice, and no --sample is given (every mutant runs; "
                     "give --sample N, or leave --seed out)")
    parser.add_argument("--jobs", type=cliargs.int_in(1, MAX_JOBS), default=2,
                        help=f"mutants run at once, 1..{MAX_JOBS} (default 2)")
    parser.add_argument("--timeout", metavar="S",  # (text: read in main, named as given)
                        help="seconds per mutant; longer counts as killed (default: 5x the "
                             "unmutated run + 30)")
    parser.add_argument("--first-failure", action="store_true",
                        help="calexec's default command stops a mutant's run at its first "
                             "failing test (pytest -x): a killed mutant's verdict comes in "
                             "seconds instead of after every test (or the timeout, for a "
                             "mutant that makes the executor wait); the report then names one "
                             "killer per mutant. For your own --test-cmd, add your runner's "
                             "flag to it")
    parser.add_argument("--examples", type=cliargs.positive_int, default=None,
                        help=f"CALEXEC_STATEFUL_EXAMPLES for the default command (default "
                             f"{DEFAULT_EXAMPLES})")
    parser.add_argument("--error-codes", default="3,4,5",
                        help="exit codes meaning 'not judged' rather than killed, each "
                             "1..255 or -N for signal N (default 3,4,5: pytest's internal "
                             "error, usage error, no tests)")
    parser.add_argument("--chart-only-prefix", metavar="PREFIX",
                        help="failing test ids under this prefix test the chart alone; the "
                             "report also scores kills by other tests (default for calexec's "
                             f"command: {DEFAULT_CHART_ONLY_PREFIX})")
    parser.add_argument("--equivalent", metavar="TOML",
                        help="documented equivalent mutants ([[mutant]] chart, id, reason); "
                             f"default for calexec's command: {DEFAULT_EQUIVALENT}")
    parser.add_argument("--fail-under", metavar="PCT",  # (text: read in main, named as given)
                        help="exit 1 when a chart's score is below PCT percent (0-100)")
    parser.add_argument("--fail-on-survivor", action="store_true",
                        help="exit 1 when a mutant survives that is not a documented equivalent")
    parser.add_argument("--json", action="store_true", help="print the JSON report, not Markdown")
    parser.add_argument("--report", metavar="DIR", type=cliargs.not_stdout,
                        help="also write mutation.md and mutation.json")
    return parser


def _resolve_chart(spec: str, cwd: Path) -> Chart:
    name, target = spec, CALEXEC_CHARTS.get(spec, spec)
    if "=" in spec:
        name, _, target = spec.partition("=")
        if not name.strip():  # (the report's rows and its JSON key would name no chart)
            raise ValueError(f"--chart={shown_ref(spec)}: empty chart name before '=' (NAME=MODULE:CLASS "
                             f"names the chart in the report: Order2=billing.orders:Order; or "
                             f"give MODULE:CLASS alone)")
    if ":" not in target:
        raise ValueError(f"--chart={shown_ref(spec)}: expected one of {', '.join(CALEXEC_CHARTS)} or "
                         f"MODULE:CLASS")
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the report (--json)
            declaration = load_chart(target, str(cwd))
    except ChartRefError as err:
        raise ValueError(f"--chart={shown_ref(spec)}: {err.reason}") from None
    try:
        refuse_unsupported(declaration, "chart mutation", runs=False)  # (async: its instances)
    except UnsupportedChart as err:  # named by the flag, as charts cover's --chart is
        raise ValueError(f"--chart={shown_ref(spec)}: {err}") from None
    class_name = target.partition(":")[2]
    if spec == target and ":" in spec:  # a bare module:Class: calexec's own keep their names
        name = next((n for n, t in CALEXEC_CHARTS.items() if t == target), class_name)
    return Chart(name, target, declaration)


#: a run expected to take longer than this is told of ``--sample`` before it starts
LONG_RUN_S = 600.0


#: held while a worker writes its mutant's progress line
_PROGRESS_LOCK = threading.Lock()


def _progress(line: str) -> None:
    """One progress line on stderr, whole: the ``--jobs`` workers finish mutants at once, and
    ``print`` writes a line's text and its end apart (until stop 72 two workers' lines came
    out as one, ``... (0.1 s)  [2/121] error ...``, then an empty line)."""
    with _PROGRESS_LOCK:
        try:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # (a stderr that cannot be written: the run goes on)
            pass


def mutation_plan(count: int, baseline_s: float, jobs: int, sampled: bool) -> str:
    """The line ``charts mutate`` prints before its mutants run: how many, and about how long
    at the unmutated run's time each on ``jobs`` workers; for a long run not sampled already,
    the option that makes it shorter (a chart of 1,000 transitions has some 3,400 mutants:
    many hours, where each mutant's line came only as it ended)."""
    rounds = -(-count // max(jobs, 1))
    seconds = rounds * baseline_s
    took = (f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"
            if seconds >= 60 else f"{seconds:.0f} s")
    line = (f"charts mutate: {count} mutant(s) to run on {jobs} worker(s), about {took} at the "
            f"unmutated run's {baseline_s:.1f} s each")
    if seconds > LONG_RUN_S and not sampled:
        line += ("; --sample N runs a deterministic sample of N of them (--kind, --mutant "
                 "narrow it too)")
    return line


def select_mutants(charts: list[Chart], args: argparse.Namespace) -> list[tuple[Chart, mutants_mod.Mutant]]:
    chosen = []
    for chart in charts:
        for mutant in mutants_mod.derive(chart.declaration, args.targets_per_transition):
            if args.kind and mutant.kind not in args.kind:
                continue
            chosen.append((chart, mutant))
    if args.mutant:
        # (an id names states: its UTF-8 bytes as text, whatever the locale decoded them as:
        # under LC_ALL=C PYTHONUTF8=0 'drop:prêté-...' was no such mutant)
        args.mutant = [mutants_mod.env_text(m) for m in args.mutant]
        wanted = set(args.mutant)
        by_id = {}
        for chart in charts:  # explicit ids may name any target, whatever --targets-per-transition
            for mutant in mutants_mod.derive(chart.declaration, 0):
                # an id of before stop 61 too (``Mutant.aliases``: no other mutant's id)
                for known in (mutant.id, *mutant.aliases):
                    by_id[f"{chart.name}/{known}"] = (chart, mutant)
                    if len(charts) == 1:
                        by_id[known] = (chart, mutant)
        unknown = sorted(wanted - set(by_id))
        if unknown:  # (the id it resembles, as an --equivalent entry's: a typo or an old id)
            close = difflib.get_close_matches(unknown[0], list(by_id), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"--mutant={unknown[0]!r}: no such mutant{hint} (list them with "
                             f"--json on a --sample run, or see derive())")
        chosen = list(dict.fromkeys(by_id[m] for m in args.mutant))
        other = next((m for m in args.mutant if args.kind and by_id[m][1].kind not in args.kind),
                     None)
        if other is not None:  # (both flags narrow the run: this mutant is outside --kind)
            raise ValueError(f"--mutant={other!r}: a {by_id[other][1].kind} mutant, not of "
                             f"--kind={','.join(args.kind)}; name mutants of that kind, or "
                             f"drop --kind")
    if not chosen:  # nothing would be judged: a pass would say nothing (PIT refuses it too)
        names = ", ".join(chart.name for chart in charts)
        if args.kind:
            raise ValueError(f"--kind={','.join(args.kind)}: no mutant of {names} is of that "
                             f"kind (a chart without guards has no guard mutants)")
        raise ValueError(f"--chart: {names} declare(s) no transition to mutate")
    if args.sample is not None and args.sample < len(chosen):
        groups: dict[tuple[str, str], list] = {}
        for item in chosen:
            groups.setdefault((item[0].name, item[1].kind), []).append(item)
        rng = random.Random(args.seed)
        queues = [rng.sample(items, len(items)) for items in groups.values()]
        picked: set[int] = set()
        while len(picked) < args.sample:
            for queue in queues:
                if queue and len(picked) < args.sample:
                    picked.add(id(queue.pop()))
        chosen = [item for item in chosen if id(item) in picked]
    return chosen


class _Stopped(Exception):
    """A worker's run after the interrupt: its command was ended, its outcome is nobody's."""


class _Running:
    """The test commands running now, each its own process group, for :meth:`stop` to end
    on an interrupt. A command started after the stop (a worker's ``Popen()`` under way as
    the main thread took the Ctrl-C: a worker thread holds no signal) is ended as it is
    recorded: it ran on, calexec waiting for its timeout before it could exit 130."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[subprocess.Popen[bytes]] = set()
        self._stopped = False

    def check(self) -> None:
        """Raise :class:`_Stopped` once stopped."""
        with self._lock:
            if self._stopped:
                raise _Stopped

    def add(self, proc: subprocess.Popen[bytes]) -> None:
        """Record ``proc``; once stopped, end it and raise :class:`_Stopped`."""
        with self._lock:
            if not self._stopped:
                self._live.add(proc)
                return
        _kill(proc)
        raise _Stopped

    def discard(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._live.discard(proc)

    def stop(self) -> None:
        """End every command recorded, and any recorded after."""
        with self._lock:
            self._stopped = True
            live = list(self._live)
        for proc in live:
            _kill(proc)


def _shown(text: str) -> str:
    """``text`` from the command line or a path, for the report: a byte that was not UTF-8
    (a lone surrogate in Python's str) written as ``\\xff``, so mutation.md and stdout can
    take it (it ended a finished run as an internal error, the report unwritten)."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: float | None,
         running: _Running):
    """(exit code or None on timeout, seconds, output). The command runs in its own process
    group, killed whole on timeout and on an interrupt (a Ctrl-C reaches calexec only, not a
    session of its own: the unmutated run, calexec's whole suite by default, ran on after
    exit 130), and once it exited: what it left running in the background (a server a test
    started and never stopped, ``sh -c 'server & pytest'``) held its output open, and the run
    waited for it: for ever in the unmutated run, and a mutant that passed was judged killed
    by its timeout (until stop 71); it is ended with SIGTERM, SIGKILL at most
    ``TERM_GRACE_S`` later (``end_leftovers``). Raises :class:`_Stopped` in a worker's run
    after ``running`` stopped."""
    running.check()
    start = time.monotonic()
    proc: subprocess.Popen[bytes] | None = None
    try:
        with cliargs.interrupts_held():  # (a Ctrl-C inside Popen(): the command, started but
            # not yet returned to end, ran on after exit 130)
            proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            running.add(proc)
        chunks: list[bytes] = []
        reader = threading.Thread(target=_read_all, args=(proc, chunks), daemon=True,
                                  name="calexec-mutate-output")
        reader.start()
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        if code is None:  # (timed out: the group at once)
            _kill(proc)
            proc.wait()
        else:  # what the command left running, its output's last holders: SIGTERM first
            end_leftovers(proc.pid)
        # (a process that left the group, setsid, may hold the output for ever: not waited for)
        reader.join(_LEFT_OUTPUT_S)
    except BaseException:  # (KeyboardInterrupt: Ctrl-C, or SIGTERM while it is one)
        if proc is not None:
            _kill(proc)
        raise
    finally:
        if proc is not None:
            running.discard(proc)
    running.check()  # (ended by the stop: no outcome line after "interrupted")
    # (a test's output is shown, never parsed: a byte that is not UTF-8, a test printing
    # binary, is U+FFFD, not a UnicodeDecodeError ending the whole run as an internal error)
    output = b"".join(list(chunks)).decode("utf-8", errors="replace")
    return code, time.monotonic() - start, output


#: how long a run's output is read after its process group was killed (a process that left
#: the group may hold it open: what it wrote by then is kept)
_LEFT_OUTPUT_S = 5.0


def _read_all(proc: subprocess.Popen[bytes], chunks: list[bytes]) -> None:
    """Append what ``proc``'s output pipe gives to ``chunks`` until it closes."""
    stream = proc.stdout
    if stream is None:  # (never: started with stdout=PIPE)
        return
    with stream:
        fd = stream.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # (closed under it)
                return
            if not chunk:
                return
            chunks.append(chunk)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass


def _on_sigterm_interrupt() -> Any:
    """Make SIGTERM raise KeyboardInterrupt in the main thread; return the old handler (None
    when not on the main thread, where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


def runs_as_main(command: Sequence[str], cwd: Path, declaration: type) -> str | None:
    """The word of ``command`` that runs the file declaring ``declaration`` as the main
    program (``python door.py``, ``python -m door``): its chart is then module ``__main__``'s,
    another class than the one ``--chart`` names, which no mutant reaches; None when no word
    does."""
    module = sys.modules.get(declaration.__module__)
    path = getattr(module, "__file__", None)
    if not path:
        return None
    words = list(command[1:])
    for index, word in enumerate(words):
        if word == "-m" and index + 1 < len(words) and words[index + 1] == declaration.__module__:
            return f"-m {words[index + 1]}"
        if word.endswith(".py"):
            with contextlib.suppress(OSError):
                if os.path.samefile(cwd / word, path):
                    return word
    return None


def _main_hint(module: str, main: str) -> str:
    return (f"the command runs {main} as its main program, module '__main__': a class of its "
            f"own, which no mutant reaches (and no --chart names): run the checks from a test "
            f"or script that imports {module}, or move the __main__ block into a file of its own")


def _judge(outcome: Outcome, code: int | None, output: str, applied: bool,
           error_codes: set[int], module: str = "", main: str | None = None) -> None:
    outcome.exit_code = code
    if not applied:
        outcome.status, outcome.how = "error", (
            "mutant never applied: the command did not import the chart"
            + (f" (module {module!r}; {_main_hint(module, main)})" if module and main else
               f" (module {module!r}; a file its tests import under another module name is "
               f"another class: give --chart as they import it)" if module else ""))
    elif code is None:
        outcome.status, outcome.how = "killed", "timeout"
    elif code == 0:
        outcome.status = "survived"
    elif code in error_codes:
        outcome.status, outcome.how = "error", f"exit code {code}"
    else:
        outcome.status, outcome.how = "killed", f"exit code {code}"
        outcome.killed_by = list(dict.fromkeys(m.strip() for m in FAILED_LINE.findall(output)))
    if outcome.status == "error":
        outcome.output_tail = output[-2000:]


#: the largest signal number: a test command a signal ended exits -N (``Popen.returncode``)
MAX_SIGNAL = signal.NSIG - 1

#: the largest --equivalent file read
EQUIVALENT_MAX_BYTES = 16 * 1024 * 1024

#: what an --equivalent file must be, in a refusal of one
EQUIVALENT_GIVE = (f"give a TOML file of [[mutant]] tables, each with chart, id and reason "
                   f"(as {DEFAULT_EQUIVALENT})")


def load_equivalents(path: Path) -> dict[tuple[str, str], str]:
    """(chart, mutant id) -> reason, from a TOML file of ``[[mutant]]`` tables."""
    try:  # (a FIFO or /dev/zero: refused, never waited on nor read without end)
        text = cliargs.read_small_text("--equivalent", path, EQUIVALENT_MAX_BYTES,
                                       "a TOML list of equivalent mutants")
        data = tomllib.loads(text)
    except cliargs.UserError as err:
        raise ValueError(str(err)) from None
    except tomllib.TOMLDecodeError as err:  # (until stop 72 the parser's words alone: a
        # chart's .py or /etc/passwd given there read "Expected '=' after a key in a key/value
        # pair", saying neither that TOML was expected nor what the file should hold)
        raise ValueError(f"--equivalent={str(path)!r}: not TOML ({err}); expected a TOML list "
                         f"of equivalent mutants: {EQUIVALENT_GIVE}") from err
    other = sorted(key for key in data if key != "mutant")
    if other:  # (pyproject.toml: TOML, no [[mutant]] table, taken as an empty list)
        shown = ", ".join(repr(k) for k in other[:3]) + (", ..." if len(other) > 3 else "")
        raise ValueError(f"--equivalent={str(path)!r}: no list of equivalent mutants (it has "
                         f"{shown}, not [[mutant]] tables only): {EQUIVALENT_GIVE}")
    entries = data.get("mutant", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"--equivalent={str(path)!r}: 'mutant' must be [[mutant]] tables "
                         f"(chart, id, reason), not {type(entries).__name__} {entries!r:.40}")
    result = {}
    for index, entry in enumerate(entries):
        missing = [k for k in ("chart", "id", "reason") if not str(entry.get(k, "")).strip()]
        if missing:
            raise ValueError(f"--equivalent={str(path)!r}: [[mutant]] #{index + 1} has no "
                             f"{', '.join(missing)}")
        result[(str(entry["chart"]), str(entry["id"]))] = str(entry["reason"]).strip()
    return result


def refuse_unknown_equivalents(equivalents: dict[tuple[str, str], str], charts: list[Chart],
                               path: Path) -> None:
    """A ``ValueError`` naming the first entry of the ``--equivalent`` list for a chart of this
    run whose id names no mutant of it (a typo, or a mutant of a chart since changed: it was
    ignored without a word, its survivor reported undocumented and the entry never checked
    again). Each id is looked up among every mutant the chart has (all kinds, every target,
    the ids of before stop 61 too), not those this run picked: a run narrowed by
    ``--mutant``, ``--kind``, ``--sample`` or ``--targets-per-transition`` judges an entry as
    the whole run would. An entry for a chart not mutated in this run is not judged (one list
    serves several charts: calexec's names all four); a list none of whose entries names a
    chart of this run is a warning on stderr."""
    names = {chart.name for chart in charts}
    if equivalents and not any(chart in names for chart, _ in equivalents):
        listed = ", ".join(sorted({chart for chart, _ in equivalents}))
        print(f"calexec charts mutate: warning: --equivalent={_shown(str(path))!r}: no entry "
              f"names a chart of this run ({', '.join(sorted(names))}); its entries name "
              f"{listed:.200} (an entry's chart is the chart's name here: CHART, or NAME of "
              f"NAME=module:Class, or the class's name)", file=sys.stderr)
    for chart in charts:
        wanted = [mutant_id for name, mutant_id in equivalents if name == chart.name]
        if not wanted:
            continue
        every = mutants_mod.derive(chart.declaration, 0)
        known = {known for mutant in every for known in (mutant.id, *mutant.aliases)}
        unknown = [mutant_id for mutant_id in wanted if mutant_id not in known]
        if not unknown:
            continue
        close = difflib.get_close_matches(unknown[0], [m.id for m in every], n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        others = ", ".join(map(repr, unknown[1:4])) + (", ..." if len(unknown) > 4 else "")
        more = (f" (and {len(unknown) - 1} more entr{'y' if len(unknown) == 2 else 'ies'} of "
                f"{chart.name}: {others})" if len(unknown) > 1 else "")
        raise ValueError(
            f"--equivalent={_shown(str(path))!r}: the entry chart = {chart.name!r}, id = "
            f"{unknown[0]!r} names no mutant of {chart.name} ({chart.target}){hint}{more}: "
            f"correct it or remove it (a chart changed since the entry was written has "
            f"mutants of other ids: mutants.derive(Chart, 0) lists the {len(every)} of "
            f"{chart.name}, and a report names each mutant it ran)")


def _score(killed: int, survived: int) -> float | None:
    return None if killed + survived == 0 else 100.0 * killed / (killed + survived)


def summarise(outcomes: list[Outcome], charts: list[Chart], prefix: str | None) -> dict[str, Any]:
    summary = {}
    for chart in charts:
        mine = [o for o in outcomes if o.chart == chart.name]
        counts = {s: sum(o.status == s for o in mine) for s in STATUSES}
        entry: dict[str, Any] = {"class": chart.target, "mutants": len(mine), **counts,
                                 "score": _score(counts["killed"], counts["survived"])}
        if prefix:
            beyond = sum(o.status == "killed" and (o.how == "timeout" or any(
                not k.startswith(prefix) for k in o.killed_by)) for o in mine)
            entry["killed_beyond_chart_only_tests"] = beyond
            entry["score_beyond_chart_only_tests"] = _score(
                beyond, counts["killed"] + counts["survived"] - beyond)
        summary[chart.name] = entry
    return summary


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} %"


def markdown(report: dict[str, Any]) -> str:
    prefix = report["chart_only_prefix"]
    lines = ["# Chart mutation report", "",
             f"- command: `{report['command']}` (in `{report['cwd']}`)",
             f"- unmutated run: {report['baseline_s']:.1f} s; target mutants per transition: "
             f"{report['targets_per_transition'] or 'all'}; mutants run: {len(report['mutants'])}"
             f" in {report['elapsed_s']:.0f} s with {report['jobs']} worker(s)", ""]
    head = "| chart | mutants | killed | survived | equivalent | error | score |"
    rule = "|---|---:|---:|---:|---:|---:|---:|"
    if prefix:
        head += f" killed beyond `{prefix}*` | score beyond |"
        rule += "---:|---:|"
    lines += [head, rule]
    for name, entry in report["charts"].items():
        row = (f"| {name} | {entry['mutants']} | {entry['killed']} | {entry['survived']} | "
               f"{entry['equivalent']} | {entry['error']} | {_pct(entry['score'])} |")
        if prefix:
            row += (f" {entry['killed_beyond_chart_only_tests']} | "
                    f"{_pct(entry['score_beyond_chart_only_tests'])} |")
        lines.append(row)
    for stale in report["stale_equivalents"]:
        lines.append(f"\n**stale equivalent entry**: {stale['chart']} `{stale['id']}` is killed now; "
                     f"remove it from the list")
    lines += ["", "| chart | mutant | status | s | killed by / why |", "|---|---|---|---:|---|"]
    order = {"survived": 0, "error": 1, "equivalent": 2, "killed": 3}
    for m in sorted(report["mutants"], key=lambda m: order[m["status"]]):
        killers = ", ".join(f"`{k}`" for k in m["killed_by"][:3])
        if len(m["killed_by"]) > 3:
            killers += f" (+{len(m['killed_by']) - 3})"
        detail = killers or m.get("reason") or m["how"]
        lines.append(f"| {m['chart']} | `{m['id']}` | {m['status']} | {m['seconds']:.1f} | "
                     f"{detail} |")
    return "\n".join(lines) + "\n"


def _percentage(flag: str, text: str) -> float:
    """``text`` as a percentage, or a ``ValueError`` naming ``flag`` and ``text`` as given (a
    word, nan, inf and 1e400 included), as ``charts cover --min`` and the pytest plugin's
    ``--chart-coverage-min`` refuse theirs."""
    value = gate_percentage(text)
    if value is None:  # (nan too)
        raise ValueError(f"{flag}={_as_given(text)}: expected a percentage (0-100)")
    return value


def _as_given(text: str) -> str:
    """A flag's value in its refusal: as typed (``1e400``, ``most``), quoted when it would
    not read as one line (``'5\\n6'``: the refusal is one line)."""
    return text if text.isprintable() else repr(text)


def _seconds(flag: str, text: str) -> float:
    """``text`` as seconds > 0 and at most ``cliargs.MAX_SECONDS``, or a ``ValueError`` naming
    ``flag`` and ``text`` as given (0 and 1e400 were echoed converted, as 0.0 and inf; a word
    was argparse's 'invalid float value'), as ``--fail-under`` names its value."""
    value = cliargs.ascii_number(text)  # (float() also reads "1_0" and "٣")
    if value is None or not 0 < value <= cliargs.MAX_SECONDS:  # (nan; 1e30 overflowed a wait)
        raise ValueError(f"{flag}={_as_given(text)}: must be a number of seconds > 0 and at "
                         f"most {cliargs.MAX_SECONDS:g}")
    return value


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    while argv[:1] in (["charts"], ["mutate"]):  # the dispatcher passes the command words
        argv = argv[1:]
    args = _parser().parse_args(argv)
    cwd = Path(args.cwd or ".").resolve()
    try:
        if args.timeout is not None:
            args.timeout = _seconds("--timeout", args.timeout)
        for flag, value in (("--report", args.report), ("--cwd", args.cwd),
                            ("--equivalent", args.equivalent)):
            if value is not None and not value:  # ('' was taken for no flag, or for '.')
                raise ValueError(f"{flag}='': empty path (omit the flag for its default)")
        if args.fail_under is not None:
            args.fail_under = _percentage("--fail-under", args.fail_under)
        if not cwd.is_dir():
            raise ValueError(f"--cwd={args.cwd!r}: not a directory")
        codes = [cliargs.ascii_integer(c) for c in args.error_codes.split(",") if c.strip()]
        error_codes = {c for c in codes if c is not None}
        if None in codes:  # (ASCII digits: int() also reads "1_0" and "٣")
            raise ValueError(f"--error-codes={args.error_codes!r}: expected exit codes separated "
                             f"by commas (e.g. 3,4,5)")
        for code in sorted(error_codes):  # (a code no run ends with was taken and never matched)
            if code == 0:
                raise ValueError(f"--error-codes={args.error_codes!r}: 0 is a passing run (the "
                                 f"mutant survived), never 'not judged'")
            if not -MAX_SIGNAL <= code <= 255:
                raise ValueError(f"--error-codes={args.error_codes!r}: {code} is no exit code a "
                                 f"run can end with (1..255, or -1..-{MAX_SIGNAL}: the signal "
                                 f"that ended it)")
        specs = [*(args.chart or ()), *args.charts] or list(CALEXEC_CHARTS)
        charts: list[Chart] = []
        for spec in specs:
            chart = _resolve_chart(spec, cwd)
            same = next((c for c in charts if c.name == chart.name), None)
            if same is None:
                charts.append(chart)
            elif same.declaration is not chart.declaration:
                raise ValueError(f"--chart: {same.target!r} and {chart.target!r} are two charts "
                                 f"named {chart.name}; name one: NAME=module:Class (e.g. "
                                 f"{chart.name}2={chart.target})")
            # (the same chart given twice, as CHART and --chart: mutated once, as cover counts it)
        for chart in charts:  # (until stop 72 a subclass's mutants changed its base unsaid)
            shared = mutants_mod.sharing_states(chart.declaration)
            if shared:
                names = ", ".join(other.__name__ for other in shared)
                print(f"calexec charts mutate: warning: {chart.name} shares its states with "
                      f"{names} (python-statemachine gives a subclass its base chart's very "
                      f"states): each mutant of {chart.name} changes {names} too, so a test of "
                      f"{names} can kill it (its killers in the report say which); declare "
                      f"{chart.name}'s states in its own class body to mutate it alone",
                      file=sys.stderr)
        own = all(c.target in CALEXEC_CHARTS.values() for c in charts)
        if args.test_cmd is None and not own:
            raise ValueError("--test-cmd is required for a chart that is not calexec's own")
        if args.test_cmd is None and not (cwd / "tests" / "test_executor_stateful.py").is_file():
            raise ValueError(f"--cwd={str(cwd)!r}: calexec's default test command needs its "
                             f"tests/ directory (run from the calexec checkout or give --test-cmd)")
        if args.first_failure and args.test_cmd is not None:
            raise ValueError("--first-failure applies to calexec's default command; add your "
                             "runner's own flag (pytest: -x) to --test-cmd")
        if args.examples is not None and args.test_cmd is not None:  # (it was ignored)
            raise ValueError(f"--examples={args.examples} applies to calexec's default command "
                             f"(CALEXEC_STATEFUL_EXAMPLES of its stateful tests); set your own "
                             f"tests' example count in --test-cmd")
        command_text = args.test_cmd if args.test_cmd is not None else (
            DEFAULT_TEST_CMD.replace(" -q ", " -q -x ", 1) if args.first_failure
            else DEFAULT_TEST_CMD)
        try:
            command = shlex.split(command_text)
        except ValueError as err:
            raise ValueError(f"--test-cmd={command_text!r}: {err}") from None
        if not command:
            raise ValueError(f"--test-cmd={command_text!r}: empty command")
        if command[0] == "-":  # (was run: "cannot run '-': No such file or directory")
            raise ValueError(f"--test-cmd={command_text!r}: '-' is no program (the test "
                             f"command is run, never read from stdin): give the command that "
                             f"tests the chart, e.g. --test-cmd 'python -m pytest -q tests'")
        if args.report:
            try:  # before the run, not after it: a report that cannot be written is bad input
                cliargs.output_dir("--report", args.report, REPORT_FILES)
            except cliargs.UserError as err:
                raise ValueError(str(err)) from None
        chosen = select_mutants(charts, args)
        equivalent_path = Path(args.equivalent) if args.equivalent else (
            cwd / DEFAULT_EQUIVALENT if args.test_cmd is None and own else None)
        equivalents = {}
        if equivalent_path is not None and (args.equivalent or equivalent_path.is_file()):
            equivalents = load_equivalents(cwd / equivalent_path)
            refuse_unknown_equivalents(equivalents, charts, equivalent_path)
    except ValueError as err:
        print(f"calexec charts mutate: {err}", file=sys.stderr)
        return 2
    prefix = args.chart_only_prefix if args.chart_only_prefix is not None else (
        DEFAULT_CHART_ONLY_PREFIX if args.test_cmd is None else None)

    with tempfile.TemporaryDirectory(prefix="calexec-mutate-") as scratch_dir:
        scratch = Path(scratch_dir)
        site = scratch / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
        base_env = dict(os.environ)
        for name in (mutants_mod.ENV, mutants_mod.ACK_ENV):
            base_env.pop(name, None)
        base_env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(site), str(cwd), base_env.get("PYTHONPATH")]))
        if args.test_cmd is None:
            base_env["CALEXEC_STATEFUL_EXAMPLES"] = str(
                DEFAULT_EXAMPLES if args.examples is None else args.examples)

        def env_for(tag: str) -> dict[str, str]:
            env = dict(base_env)
            env["HYPOTHESIS_STORAGE_DIRECTORY"] = str(scratch / f"hypothesis-{tag}")
            return env

        print(f"charts mutate: unmutated run of `{_shown(command_text)}` ...", file=sys.stderr)
        probe = env_for("baseline")
        # (every chart of a module: two charts of one module kept the last alone, and the
        # other's mutants each ran the whole command to be "never applied", unwarned)
        modules: dict[str, list[Chart]] = {}
        for chart in charts:
            modules.setdefault(chart.target.partition(":")[0], []).append(chart)
        probe[PROBE_ENV] = ",".join(modules)
        probe[mutants_mod.ACK_ENV] = str(scratch / "ack-baseline")
        running = _Running()
        previous = _on_sigterm_interrupt()  # (a SIGTERM ends the command's run too)
        try:
            code, baseline_s, output = _run(command, cwd, probe, None, running)
        except OSError as err:  # not found, not executable
            print(f"calexec charts mutate: --test-cmd={command_text!r}: cannot run "
                  f"{command[0]!r}: {cliargs.cannot_run(command[0], err, cwd)}", file=sys.stderr)
            return 2
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        if code != 0:
            print(f"calexec charts mutate: the test command fails without any mutant "
                  f"(exit code {code}); fix it first. Its output ends:\n{output[-3000:]}",
                  file=sys.stderr)
            return 2
        timeout = args.timeout if args.timeout is not None else 5 * baseline_s + 30
        print(mutation_plan(len(chosen), baseline_s, args.jobs, args.sample is not None),
              file=sys.stderr)
        try:
            imported = set((scratch / "ack-baseline").read_text(
                encoding="utf-8", errors="surrogateescape").splitlines())
        except OSError:  # no process of the command reported any
            imported = set()
        unseen = {chart.name for name, in_module in modules.items() for chart in in_module
                  if f"imported {name}" not in imported}
        for name, chart in ((name, chart) for name, in_module in modules.items()
                            for chart in in_module):
            if chart.name in unseen:
                main = runs_as_main(command, cwd, chart.declaration)
                print(f"calexec charts mutate: warning: the unmutated run of --test-cmd never "
                      f"imported module {name!r} (--chart={chart.target!r}): no mutant of "
                      f"{chart.name} can be applied, each will be an error (its mutants stop "
                      f"running once one is not applied). "
                      + (f"{_main_hint(name, main)[0].upper()}{_main_hint(name, main)[1:]}"
                         if main else "Give --chart as the tests import it, or a command "
                         "that imports it"), file=sys.stderr)
        #: charts the unmutated run did not import and whose mutant, run, was not applied
        #: either (an acknowledgement written as the mutant is applied, not at exit: a
        #: process that ends by os._exit, which the import report misses, still writes it):
        #: their other mutants are errors without a run (each took a whole test run to say so)
        never_applied: dict[str, str] = {}

        def one(index: int, chart: Chart, mutant: mutants_mod.Mutant) -> Outcome:
            outcome = Outcome(chart.name, mutant)
            if chart.name in never_applied:
                _judge(outcome, None, "", False, error_codes, chart.target.partition(":")[0],
                       runs_as_main(command, cwd, chart.declaration))
                outcome.how += f"; not run: neither the unmutated run nor mutant " \
                    f"{never_applied[chart.name]} imported it"
                _progress(f"  [{index + 1}/{len(chosen)}] {outcome.status:8} {chart.name} "
                          f"{mutant.id} (not run)")
                return outcome
            env = env_for(str(index))
            ack = scratch / f"ack-{index}"
            named = f"{chart.target}@{mutant.id}"
            env[mutants_mod.ENV] = mutants_mod.env_value(named)  # (its UTF-8, in any locale)
            env[mutants_mod.ACK_ENV] = str(ack)
            code, outcome.seconds, output = _run(command, cwd, env, timeout, running)
            applied = ack.is_file() and named in ack.read_text(
                encoding="utf-8", errors="surrogateescape").splitlines()
            _judge(outcome, code, output, applied, error_codes, chart.target.partition(":")[0],
                   None if applied else runs_as_main(command, cwd, chart.declaration))
            if not applied and chart.name in unseen:
                never_applied.setdefault(chart.name, mutant.id)
            outcome.reason = next((equivalents[(chart.name, known)] for known in (
                mutant.id, *mutant.aliases) if (chart.name, known) in equivalents), "")
            if outcome.status == "survived" and outcome.reason:
                outcome.status = "equivalent"
            _progress(f"  [{index + 1}/{len(chosen)}] {outcome.status:8} {chart.name} "
                      f"{mutant.id} ({outcome.seconds:.1f} s)")
            return outcome

        start = time.monotonic()
        pool = ThreadPoolExecutor(max_workers=args.jobs)
        previous = _on_sigterm_interrupt()
        try:
            outcomes = list(pool.map(lambda item: one(item[0], *item[1]), enumerate(chosen)))
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: no test command outlives the run
            pool.shutdown(wait=False, cancel_futures=True)
            running.stop()
            print("calexec charts mutate: interrupted", file=sys.stderr)
            return 130
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        pool.shutdown()
        elapsed = time.monotonic() - start

    report = {
        "command": _shown(command_text), "cwd": _shown(str(cwd)),
        "baseline_s": round(baseline_s, 2),
        "targets_per_transition": args.targets_per_transition, "jobs": args.jobs,
        "timeout_s": round(timeout, 1), "elapsed_s": round(elapsed, 1),
        "chart_only_prefix": prefix,
        "equivalent_list": _shown(str(equivalent_path)) if equivalents else None,
        "charts": summarise(outcomes, charts, prefix),
        "stale_equivalents": [{"chart": o.chart, "id": o.mutant.id} for o in outcomes
                              if o.reason and o.status == "killed"],
        "mutants": [o.to_json() for o in outcomes],
    }
    text = markdown(report)
    unwritten = None
    if args.report:  # (checked before the run; what changed since is still one line, exit 2)
        out = Path(args.report)
        try:
            with cliargs.staged_report("--report", out, REPORT_FILES) as staged:  # (both or neither)
                Path(staged, "mutation.md").write_text(text, encoding="utf-8",
                                                       errors="surrogateescape")
                Path(staged, "mutation.json").write_text(json.dumps(report, indent=2) + "\n",
                                                         encoding="utf-8")
        except cliargs.UserError as err:
            unwritten = err
        except OSError as err:
            unwritten = cliargs.cannot_write(args.report, err, "--report")
    print(json.dumps(report, indent=2) if args.json else text)  # the run's result, whatever
    if unwritten is not None:
        print(f"calexec charts mutate: {unwritten}", file=sys.stderr)
        return cliargs.EXIT_CONFIG
    if any(o.status == "error" for o in outcomes):
        return 1
    if args.fail_on_survivor and any(o.status == "survived" for o in outcomes):
        return 1
    if args.fail_under is not None and any(
            (e["score"] is not None and e["score"] < args.fail_under)
            for e in report["charts"].values()):
        return 1
    return 0
