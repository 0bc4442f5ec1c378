"""``calexec charts cover --chart MODULE:CLASS [--min PCT] -- COMMAND...``: transition coverage
of chart classes over any test command (pytest or not), and a gate.

The command runs in a fresh process tree with a ``sitecustomize`` on ``PYTHONPATH`` (as
``charts mutate`` does): every Python process it starts watches for the import of each chart's
module and, once the process imports it, records through the coverage listener
(``calexec.machines.coverage.track``) every transition any run of the class takes
(python-statemachine instances, compiled runs and those its module made as it was imported),
then writes what it saw to a scratch directory at exit. A process that never imports the
chart's module (a helper a test starts, ``python -c 'print(42)'``) never imports it: until
stop 74 each one imported every chart at start-up, so a chart module that starts a thread
that is no daemon as it is imported kept each of them from exiting, and the test command
hung. ``charts cover`` merges them and prints one line per
chart, ``transition coverage <chart>: <covered>/<declared>``, and the untaken transitions.

Exit codes: 0 the command passed and every chart is at or above ``--min`` (default 0); 1 the
command failed (its exit code is printed) or a chart is below ``--min``; 2 bad input (one line
naming it: not ``MODULE:CLASS``, not importable, not a chart; ``--min`` outside 0-100; no
command; no process of the command imported the chart's module, or could load the chart).

This is the same count and gate as the pytest plugin (``--chart-coverage=MODULE:CLASS
--chart-coverage-min=PCT``), for a command that is not one pytest session.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from calexec.cliargs import EXIT_FAILED, UserError, cannot_run, sigterm_interrupts
from calexec.cliargs import parser as cli_parser
from calexec.drivers.tools.bench.subproc import call_group
from calexec.drivers.tools.sitecustomize_template import sitecustomize_source
from calexec.machines.chart_support import bound_name
from calexec.machines.chartref import ChartRefError, load_chart, shown_ref
from calexec.machines.compiled import CompiledChart, compiled
from calexec.machines.coverage import (
    TransitionRecorder,
    describe,
    gate_percentage,
    import_directory,
    other_imports,
    report,
    track,
)
from calexec.machines.mutants import after_import

#: ``MODULE:CLASS`` references, comma-separated, that the started processes record
CHARTS_ENV = "CALEXEC_CHART_COVER"
#: directory each started process writes ``hits-<pid>.json`` into at exit
OUT_ENV = "CALEXEC_CHART_COVER_DIR"
#: JSON ``{ref: file}``: the file declaring each chart, as ``charts cover`` loaded it, so a
#: process that imports the file under another module name is told from one that never did
FILES_ENV = "CALEXEC_CHART_COVER_FILES"

SITECUSTOMIZE = sitecustomize_source(
    "`calexec charts cover`: record the transitions of the charts in CALEXEC_CHART_COVER.",
    "calexec.drivers.tools.charts_cover")



def install_from_env(environ: Mapping[str, str] = os.environ) -> None:
    """In a process started by ``charts cover``: once the process imports the module of a
    chart named by ``CALEXEC_CHART_COVER``, track that chart, and write the transitions taken
    to ``CALEXEC_CHART_COVER_DIR`` at exit. The modules are never imported here: a process
    that does not import them (a helper a test starts) runs as it would without ``charts
    cover``. A chart this process imported but cannot load is written as an error. Does
    nothing when the variables are unset."""
    refs, out = environ.get(CHARTS_ENV), environ.get(OUT_ENV)
    if not refs or not out:
        return
    try:
        files: dict[str, str] = json.loads(environ.get(FILES_ENV) or "{}")
    except ValueError:
        files = {}
    recorder = TransitionRecorder()
    loaded: dict[str, str] = {}  # ref -> chart name
    tracked: dict[str, CompiledChart] = {}
    errors: dict[str, str] = {}
    waiting: dict[str, list[str]] = {}  # module name -> the refs of charts it declares
    for ref in refs.split(","):
        waiting.setdefault(ref.partition(":")[0], []).append(ref)

    def imported(module: ModuleType) -> None:
        for ref in waiting.pop(module.__name__, []):
            try:
                chart = compiled(load_chart(ref, os.getcwd()))  # (the module is loaded)
                track(chart, recorder)  # (with the instances its import made)
                loaded[ref] = chart.name
                tracked[ref] = chart
            except (ChartRefError, ValueError, TypeError) as err:
                errors[ref] = _reason(err)

    for name in list(waiting):  # (the hook charts mutate applies its mutants with)
        after_import(name, imported)

    def write() -> None:
        path = Path(out, f"hits-{os.getpid()}.json")
        twins = {ref: other_imports(chart) for ref, chart in tracked.items()}
        for ref, file in files.items():  # (the file imported under another name only)
            if ref not in tracked and (names := modules_of_file(file, ref.partition(":")[0])):
                twins[ref] = names
        try:
            path.write_text(json.dumps({"loaded": loaded, "errors": errors, "twins": twins,
                                        "hits": sorted(recorder.hits)}), encoding="utf-8")
        except FileNotFoundError:  # (a process that left the command's group and outlived
            # the run: its directory is gone, the coverage judged; no traceback at its exit)
            pass

    atexit.register(write)


def modules_of_file(file: str, name: str) -> list[str]:
    """The names other than ``name`` of the modules of this process loaded from ``file``."""
    found = []
    for other, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None)
        if other == name or not isinstance(where, str):
            continue
        try:
            if os.path.samefile(where, file):
                found.append(other)
        except OSError:
            continue
    return sorted(found)


def declaring_file(chart: CompiledChart) -> str | None:
    """The file of the module declaring ``chart``, as this process loaded it (None: none)."""
    where = getattr(sys.modules.get(chart.declaration.__module__), "__file__", None)
    return os.path.abspath(where) if isinstance(where, str) else None


def _reason(err: Exception) -> str:
    """The first line of why ``err`` refused a chart, without the reference a
    ``ChartRefError`` starts with (the caller names it once)."""
    text = err.reason if isinstance(err, ChartRefError) else str(err)
    return text.splitlines()[0] if text else repr(err)


def _minimum(text: str) -> float:
    value = gate_percentage(text)
    if value is None:
        raise UserError(f"--min={text!r}: expected a percentage (0-100)")
    return value


def merge(scratch: Path) -> tuple[set[tuple[str, int]], set[str], dict[str, str]]:
    """The hits, the references some process loaded and the last error of those none did, from
    every ``hits-*.json`` in ``scratch``."""
    hits: set[tuple[str, int]] = set()
    loaded: set[str] = set()
    errors: dict[str, str] = {}
    for path in sorted(scratch.glob("hits-*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        hits.update((name, int(index)) for name, index in data["hits"])
        loaded.update(data["loaded"])
        errors.update(data["errors"])
    return hits, loaded, {ref: err for ref, err in errors.items() if ref not in loaded}


def _file_of(chart: CompiledChart) -> str:
    """The file declaring ``chart``, relative to the current directory where it is below it."""
    path = getattr(sys.modules.get(chart.declaration.__module__), "__file__", None) or "?"
    with contextlib.suppress(ValueError):
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    return path


def twins(scratch: Path) -> dict[str, list[str]]:
    """Reference -> the other module names any process of the command imported its file under
    (``coverage.other_imports``), from every ``hits-*.json`` in ``scratch``."""
    found: dict[str, set[str]] = {}
    for path in sorted(scratch.glob("hits-*.json")):
        for ref, names in json.loads(path.read_text(encoding="utf-8")).get("twins", {}).items():
            found.setdefault(ref, set()).update(names)
    return {ref: sorted(names) for ref, names in found.items() if names}


def path_for(chart: CompiledChart, name: str) -> str:
    """``, with PYTHONPATH=DIR ...`` when module ``name`` of the file declaring ``chart`` is
    imported from a directory this process does not import from (a test's own
    ``sys.path.insert``): ``--chart=name:Class`` alone is refused there, the module not found."""
    shown = import_directory(chart, name, sys.path)
    return "" if shown is None else f", with PYTHONPATH={shown}: the directory it is imported from"


def main(argv: list[str]) -> int:
    """``argv`` starts with the command words (``["charts", "cover", ...]``)."""
    parser = cli_parser("calexec charts cover", __doc__)
    parser.add_argument("--chart", action="append", required=True, metavar="MODULE:CLASS",
                        help="chart class whose transitions are counted (repeatable)")
    parser.add_argument("--min", default="0", metavar="PCT",
                        help="exit 1 when a chart's transition coverage is below PCT percent")
    parser.add_argument("command", nargs="*", metavar="COMMAND",
                        help="the test command, after `--` (e.g. -- python -m pytest -q)")
    parser.command_after = "--chart MODULE:CLASS"
    words = argv[2:]
    before = words[:words.index("--")] if "--" in words else words
    if any(w.partition("=")[0] == "--test-cmd" for w in before):
        # (charts mutate's flag: "unrecognized arguments: --test-cmd" said nothing of `--`)
        raise UserError("--test-cmd: charts cover takes no --test-cmd (that is charts "
                        "mutate's): give the test command after `--`, e.g. calexec charts "
                        "cover --chart MODULE:CLASS -- python -m pytest -q")
    args = parser.parse_args(words)
    minimum = _minimum(args.min)
    if not args.command:
        raise UserError("no test command: give it after `--` (e.g. -- python -m pytest -q)")
    if not args.command[0].strip():  # ('' was "Permission denied", naming nothing)
        raise UserError(f"test command {args.command[0]!r}: empty program name (the word after "
                        f"`--` is the program to run, e.g. -- python -m pytest -q)")
    if args.command[0] == "-":  # (was run: "No such file or directory")
        raise UserError("test command '-': '-' is no program (the test command is run, never "
                        "read from stdin): give it after `--`, e.g. -- python -m pytest -q")
    charts: list[CompiledChart] = []
    for ref in dict.fromkeys(args.chart):
        if "," in ref:
            raise UserError(f"--chart={shown_ref(ref)}: one MODULE:CLASS per --chart")
        try:
            chart = compiled(load_chart(ref))  # (async callbacks: its instances are counted)
            charts.append(chart)
        except (ChartRefError, ValueError, TypeError) as err:  # (UnsupportedChart: a ValueError)
            raise UserError(f"--chart={shown_ref(ref)}: {_reason(err)}") from None
    refs = list(dict.fromkeys(args.chart))
    named: dict[str, tuple[str, CompiledChart]] = {}
    for ref, chart in zip(refs, charts):
        first = named.setdefault(chart.name, (ref, chart))
        if first[1].declaration is not chart.declaration:
            raise UserError(f"--chart={shown_ref(ref)} and --chart={shown_ref(first[0])}: two charts named "
                            f"{chart.name} (coverage counts transitions by chart name); "
                            f"give one class another name")
    with tempfile.TemporaryDirectory(prefix="calexec-cover-") as scratch_dir:
        scratch = Path(scratch_dir)
        site = scratch / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
        env = dict(os.environ)
        env[CHARTS_ENV] = ",".join(refs)
        env[OUT_ENV] = str(scratch)
        env[FILES_ENV] = json.dumps({ref: file for ref, chart in zip(refs, charts)
                                     if (file := declaring_file(chart)) is not None})
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(site), os.getcwd(), env.get("PYTHONPATH")]))
        try:  # (a SIGTERM is an interrupt, as a Ctrl-C: the signal ended calexec alone and
            # left the command running)
            with sigterm_interrupts():
                code = call_group(args.command, env)
        except OSError as err:
            raise UserError(f"test command {args.command[0]!r}: "
                            f"{cannot_run(args.command[0], err)}") from None
        hits, loaded, errors = merge(scratch)
        other = twins(scratch)
        recorded = any(scratch.glob("hits-*.json"))
    if errors:
        for ref, why in errors.items():
            print(f"calexec charts cover: no process of the command imported {ref}: {why}",
                  file=sys.stderr)
        return 2
    if not recorded:
        print("calexec charts cover: the command started no Python process that recorded "
              "(is it a Python command, run with this environment?)"
              + (f"; it exited with code {code}" if code else ""), file=sys.stderr)
        return 2
    unseen = [ref for ref in refs if ref not in loaded and ref not in other]
    if unseen:  # (a process that imports the file under another name: the hint below)
        print((f"calexec charts cover: the test command failed (exit code {code}), and no "
               f"process of it" if code else "calexec charts cover: no process of the command")
              + f" imported module {unseen[0].partition(':')[0]!r}, which "
              f"declares {unseen[0]} (the transitions are counted in the processes that "
              f"import it: run the tests that use the chart)", file=sys.stderr)
        return EXIT_FAILED if code else 2
    recorder = TransitionRecorder()
    recorder.hits.update(hits)
    below = False
    for ref, chart in zip(refs, charts):
        for name in other.get(ref, []):
            if name == "__main__":  # (until stop 74 told to give --chart=__main__:Gate, refused)
                module = chart.declaration.__module__
                print(f"transition coverage {chart.name}: the command ran its file as its main "
                      f"program (python {_file_of(chart)}: module '__main__'), another class "
                      f"whose runs are not counted, and no --chart names a main program: run "
                      f"those checks from a test or script that imports {module} (from "
                      f"{module} import {bound_name(chart.declaration)}), or move the "
                      f"__main__ block into a file of its own")
                continue
            print(f"transition coverage {chart.name}: the command imported its file as module "
                  f"{name!r} too, another class whose runs are not counted: name the chart as "
                  f"it imports it (--chart={name}:{bound_name(chart.declaration)}"
                  f"{path_for(chart, name)})")
    for chart, coverage in zip(charts, report(charts, recorder), strict=True):
        print(coverage.line() + f" ({coverage.percent:.1f} %)")
        for transition in coverage.untaken:
            print(f"    untaken: {describe(transition, chart)}")
        if coverage.percent < minimum:
            below = True
            print(f"transition coverage gate FAILED for {coverage.chart}: "
                  f"{coverage.percent:.1f} % < {minimum:g} %")
    if code != 0:
        print(f"calexec charts cover: the test command failed (exit code {code})",
              file=sys.stderr)
        return EXIT_FAILED
    return EXIT_FAILED if below else 0
