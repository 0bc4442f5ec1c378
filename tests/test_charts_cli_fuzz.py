"""Bad command lines to the chart toolkit, generated and pinned: ``calexec charts {names,draw,
paths,cover,mutate}`` and ``calexec diagrams`` (tests/test_cli_fuzz.py covers every other
command).

A newcomer's project directory holds charts of their own and the mistakes a newcomer makes:
a module that raises on import (``SystemExit`` and ``KeyboardInterrupt`` too), one whose
``__getattr__`` raises, objects that are no chart class. Every ``MODULE:CLASS`` the toolkit
refuses, and every refused flag value, must end as a usage error: exit 2, one line on stderr
naming the reference or the flag, no traceback, nothing on stdout, and no file written. Each
case runs the console script's entry point (``calexec.cli.main``) in process and is refused
before any test command runs, so a case takes milliseconds.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import statemachine.events
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from statemachine import State, StateMachine

from calexec import cli, cliargs
from calexec.contracts.files import new_file_mode
from calexec.machines.chartref import ChartRefError, load_chart
from calexec.machines.diagrams import render_chart_dot

#: a prefix of the project's module names of its own (imports are cached per process)
PREFIX = f"fz{os.getpid()}"

CHARTS = '''
from statemachine import State, StateChart, StateMachine


class Door(StateMachine):
    closed = State(initial=True)
    opened = State()
    locked = State()
    open = closed.to(opened, cond="unlocked")
    close = opened.to(closed)
    lock = closed.to(locked)
    unlock = locked.to(closed)


class Player(StateChart):
    class playing(State.Compound):
        slow = State(initial=True)
        fast = State()
        speed = slow.to(fast) | fast.to(slow)

    stopped = State(initial=True)
    done = State(final=True)
    play = stopped.to(playing)
    stop = playing.to(stopped)
    finish = stopped.to(done)


class Base(StateMachine):
    pass


class Model:
    pass


class Unprintable:
    def __repr__(self):
        raise ValueError("no repr")


NUMBER = 42
NOTHING = None
UNPRINTABLE = Unprintable()
LONG = "x" * 500 + "\\n" + "y"


def helper():
    pass
'''

#: module name suffix -> its source: the ways a user's module fails to give a chart
MODULES = {
    "charts": CHARTS,
    "raises": "raise RuntimeError('boom at import')\n",
    "escapes": "raise RuntimeError('\\x1b[2J cleared\\nsecond line')\n",
    "exits": "import sys\nsys.exit(3)\n",
    "exits_text": "raise SystemExit('usage: this module is a script')\n",
    "interrupts": "raise KeyboardInterrupt\n",
    "lazy": "def __getattr__(name):\n    raise RuntimeError('lazy ' + name)\n",
    "refused": ("from statemachine import State, StateMachine\n\n\nclass R(StateMachine):\n"
                "    a = State(initial=True)\n    b = State()\n    c = State()\n"
                "    go = a.to(b)\n"),
}


def module(suffix: str) -> str:
    return f"{PREFIX}_{suffix}"


@pytest.fixture(scope="module")
def project_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("project")
    for suffix, source in MODULES.items():
        (root / f"{module(suffix)}.py").write_text(source)
    return root


@pytest.fixture
def project(project_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The commands run from the project directory, as docs/framework.md says."""
    monkeypatch.chdir(project_dir)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return project_dir


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def _listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if "__pycache__" not in p.parts}


def _assert_usage_error(root: Path, argv: list[str], named: str) -> str:
    before = _listing(root)
    code, out, err = _run(argv)
    lines = err.splitlines()
    assert code == cliargs.EXIT_CONFIG, (argv, code, err)
    assert len(lines) == 1 and err.endswith("\n"), (argv, err)  # no traceback, no progress
    assert "Traceback" not in err and "\x1b" not in err and "\r" not in err, (argv, err)
    assert named in lines[0], (argv, named, lines[0])
    assert out == "", (argv, out)
    assert _listing(root) == before, (argv, _listing(root) - before)  # nothing written
    return lines[0]


def _argv(command: str, ref: str, root: Path) -> list[str]:
    """The command line giving ``ref`` to ``command`` as its chart; every other part valid."""
    if command in ("draw", "paths"):
        out = ["--out", str(root / "out")] if command == "draw" else []
        return ["charts", command, *out, "--", ref]
    if command == "cover":
        return ["charts", "cover", f"--chart={ref}", "--", sys.executable, "-c", "pass"]
    return ["charts", "mutate", f"--chart={ref}", "--test-cmd", "true"]


# ---- MODULE:CLASS references that name no chart ----------------------------------------------
_MALFORMED = st.one_of(
    st.sampled_from(["", ":", "x", "x:", ":X", "::", "a.b", " : ", "x.py:X", "./x.py:X",
                     "/nonexistent/x.py:X", ".x:X", "x.:X", "é中:X", "x:é中", "a\x01b:C",
                     "m\nn:C", "m:C\n", "\x1b[31m:X", "m:\u2028", "m\x85:C", "-x:Y", "--x:Y"]),
    st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12))
_ATTRIBUTES = st.sampled_from(["Nope", "Door.nope", "Door.closed", "Model", "Base", "NUMBER",
                               "NOTHING", "UNPRINTABLE", "LONG", "helper", "State", "Door:x",
                               "Door..x", ".Door"])
_BROKEN = st.sampled_from(["raises", "escapes", "exits", "exits_text", "interrupts", "lazy",
                           "refused"])
_REFS = st.one_of(
    _MALFORMED,
    _ATTRIBUTES.map(lambda attribute: f"{module('charts')}:{attribute}"),
    _BROKEN.map(lambda suffix: f"{module(suffix)}:X"),
    st.sampled_from([f"{module('nosuch')}:X", f"{module('charts')}.py:Door",
                     f"./{module('charts')}.py:Door"]))
_COMMANDS = st.sampled_from(["draw", "paths", "cover", "mutate"])


def _is_calexec_chart_name(ref: str) -> bool:  # mutate's --chart takes calexec's own by name
    return ref.strip() in ("job", "kv_txn", "lifecycle", "buffer_slot")


@settings(max_examples=250, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(command=_COMMANDS, ref=_REFS)
def test_a_reference_to_no_chart_is_one_line_naming_it_exit_2(project: Path, command: str,
                                                                ref: str):
    if _is_calexec_chart_name(ref) or (command == "mutate" and "=" in ref):
        return  # (a name of calexec's own; NAME=module:Class: the part after '=' is the ref)
    line = _assert_usage_error(project, _argv(command, ref, project), f"calexec charts {command}")
    shown = repr(ref)
    if command in ("cover", "mutate"):
        assert f"--chart={shown}" in line or f"--chart={ref!r}" in line, line
    elif ref:
        assert shown in line or "expected MODULE:CLASS" in line, line


@pytest.mark.parametrize(("suffix", "said"), [
    ("raises", "(RuntimeError at {m}.py:1: boom at import)"),
    ("exits", "(SystemExit at {m}.py:2: 3)"),
    ("exits_text", "(SystemExit at {m}.py:1: usage: this module is a script)"),
    # was `interrupted`, exit 130: a KeyboardInterrupt the module raises is no Ctrl-C
    ("interrupts", "(KeyboardInterrupt at {m}.py:1: raised by the module as it was imported, "
                   "no Ctrl-C)"),
    # an escape sequence in the module's own message is shown escaped, its first line only
    ("escapes", "(RuntimeError at {m}.py:1: \\x1b[2J cleared)"),
])
def test_a_module_that_fails_on_import_is_named_with_why(project: Path, suffix: str, said: str):
    ref = f"{module(suffix)}:X"
    line = _assert_usage_error(project, ["charts", "paths", ref], repr(ref))
    assert said.format(m=module(suffix)) in line, line


def test_ctrl_c_while_a_module_is_imported_still_interrupts(project: Path):
    """A SIGINT that arrives while the chart's module is imported is the user's Ctrl-C: it
    interrupts (exit 130 from the command), as before the module-raised one was refused."""
    name = module("sigint")
    (project / f"{name}.py").write_text(textwrap.dedent("""
        import os, signal
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10_000_000):  # the handler runs at the next instruction
            pass
        raise RuntimeError("the SIGINT was not delivered")
    """))
    # Python's own handler, as in a terminal (a job started in the background, CI's run
    # under nohup among them, inherits SIGINT ignored: no Ctrl-C can come, test below)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            load_chart(f"{name}:X")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
        code, _, err = _run(["charts", "paths", f"{name}:X"])
        assert code == 130 and "interrupted" in err, (code, err)
    finally:
        signal.signal(signal.SIGINT, before)


def test_with_sigint_ignored_a_module_raising_keyboardinterrupt_is_refused(project: Path):
    """A process that ignores SIGINT (started in the background) gets no Ctrl-C: a
    ``KeyboardInterrupt`` while the module is imported is the module's own, refused by name
    (exit 2), not 'interrupted' (CI's first run under nohup, stop 47)."""
    name = module("interrupts")
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code, _, err = _run(["charts", "paths", f"{name}:X"])
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # left as it was
    finally:
        signal.signal(signal.SIGINT, before)
    assert code == 2 and "raised by the module as it was imported" in err, (code, err)


@pytest.mark.parametrize(("attribute", "said"), [
    # was `internal error: RuntimeError: lazy Door`, exit 70
    ("Door", "reading 'Door' of module '{m}' raised RuntimeError: lazy Door"),
])
def test_a_module_getattr_that_raises_is_named(project: Path, attribute: str, said: str):
    ref = f"{module('lazy')}:{attribute}"
    line = _assert_usage_error(project, ["charts", "draw", ref], repr(ref))
    assert said.format(m=module("lazy")) in line, line


@pytest.mark.parametrize(("attribute", "said"), [
    # was `internal error: ValueError: no repr`, exit 70
    ("UNPRINTABLE", "UNPRINTABLE is Unprintable <"),
    # a None attribute was 'has no attribute'
    ("NOTHING", "NOTHING is NoneType None, not a python-statemachine chart class"),
    # the value's repr was cut mid-word with nothing saying so, its second line kept
    ("LONG", "LONG is str 'xxxxxxxxxx"),
])
def test_an_attribute_that_is_no_chart_is_shown_in_one_short_line(project: Path,
                                                                   attribute: str, said: str):
    ref = f"{module('charts')}:{attribute}"
    line = _assert_usage_error(project, ["charts", "paths", ref], repr(ref))
    assert said in line, line
    if attribute == "LONG":
        assert "...," in line and "yyy" not in line and len(line) < 250, line


def test_the_module_s_own_charts_are_taken_and_paths_json_is_json(project: Path):
    for ref, states in ((f"{module('charts')}:Door", {"closed", "opened", "locked"}),
                        (f"{module('charts')}:Player", {"stopped", "playing", "slow", "fast",
                                                        "done"})):
        code, out, err = _run(["charts", "paths", ref, "--json"])
        assert code == 0 and err == "", err
        data = json.loads(out)  # stdout is the JSON document alone
        assert set(data["states"]) == states and data["class"].endswith(ref.split(":")[1])
        assert len(data["ends"]["tour"]) == len(data["tour"])


# ---- flag values the chart commands refuse ---------------------------------------------------
_PERCENT = st.one_of(
    st.sampled_from(["", " ", "x", "nan", "inf", "-inf", "100.0001", "-0.1", "1e3", "%", "101%", "50%%",
                     "--", "é", "5\n6"]),
    st.floats(min_value=100, exclude_min=True).map(repr),
    st.floats(max_value=0, exclude_max=True).map(repr))
_SECONDS = st.one_of(
    st.sampled_from(["nan", "inf", "-inf", "0", "-0", "-1", "1e30", "1e8", str(10 ** 30)]),
    st.floats(max_value=0.0).map(repr),
    st.floats(min_value=cliargs.MAX_SECONDS, exclude_min=True, allow_infinity=False).map(repr))
_NOT_AN_INT = st.sampled_from(["", "x", "1.5", "1e3", "nan", "--", "é", "5\n6"])

#: command -> flag -> (refused values, what else the command line needs to reach the flag)
FLAGS: dict[str, dict[str, st.SearchStrategy[str]]] = {
    "charts draw": {"--out": st.just("")},
    "charts names": {"--out": st.just("")},
    "charts cover": {"--min": _PERCENT},
    "charts mutate": {"--timeout": _SECONDS, "--fail-under": _PERCENT,
                      "--report": st.just(""), "--cwd": st.just(""),
                      "--equivalent": st.just(""), "--jobs": st.one_of(_NOT_AN_INT, st.sampled_from(
                          ["0", "-1", "65", str(10 ** 30)])),
                      "--sample": _NOT_AN_INT, "--examples": st.sampled_from(["0", "-1", "x"]),
                      "--seed": st.sampled_from(["-1", "x", "1.5"]),
                      "--targets-per-transition": st.sampled_from(["-1", "x", ""]),
                      "--error-codes": st.sampled_from(["three", "1,x", "1.5", "0", "3,0", "256",
                                                        "-1000", str(10 ** 30)])},
    "diagrams": {"--out": st.just(""), "--png": st.just("")},
}


def _rest(command: str) -> list[str]:
    chart = f"{module('charts')}:Door"
    return {"charts draw": [chart], "charts cover": ["--chart", chart, "--", "true"],
            "charts mutate": ["--chart", chart, "--test-cmd", "true"]}.get(command, [])


@st.composite
def _bad_value(draw: st.DrawFn) -> tuple[list[str], str, str]:
    command = draw(st.sampled_from(sorted(FLAGS)))
    flag = draw(st.sampled_from(sorted(FLAGS[command])))
    value = draw(FLAGS[command][flag])
    return [*command.split(), f"{flag}={value}", *_rest(command)], flag, value


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=_bad_value())
def test_a_refused_flag_value_is_one_line_naming_the_flag_exit_2(
        project: Path, case: tuple[list[str], str, str]):
    argv, flag, value = case
    line = _assert_usage_error(project, argv, flag)
    shown = value.strip()
    if shown and shown.isprintable() and len(shown) < 30:  # (--timeout too: as given)
        assert shown in line or repr(value) in line, (argv, line)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(sorted((c, f) for c in FLAGS for f in FLAGS[c])),
       typo=st.sampled_from(["drop", "double"]))
def test_a_mistyped_chart_flag_is_refused_with_a_suggestion(project: Path,
                                                            case: tuple[str, str], typo: str):
    command, flag = case
    wrong = flag[:-1] if typo == "drop" else flag + flag[-1]
    known = {f for flags in FLAGS.values() for f in flags} | {"--check", "--png", "--json",
                                                             "--chart", "--test-cmd"}
    if wrong in known:  # (an abbreviation is refused too, since stop 67: tested here)
        return
    line = _assert_usage_error(project, [*command.split(), *_rest(command)[:2], wrong, "1"],
                               wrong)
    assert "did you mean --" in line, line


# ---- the cases found (stop 47), pinned ---------------------------------------------------------
@pytest.mark.parametrize(("argv", "flag", "said"), [
    # `charts draw --out ''` drew into the working directory, exit 0 (as `diagrams --out ''`
    # did before stop 46); `charts names --out ''` said `--out='.'`, and with --check exit 1
    (["charts", "draw", "{m}:Door", "--out", ""], "--out", "empty path"),
    (["charts", "names", "--out", ""], "--out", "empty path"),
    (["charts", "names", "--check", "--out", ""], "--out", "empty path"),
    # `charts mutate --report ''` ran every mutant and wrote no report, saying nothing
    (["charts", "mutate", "--chart", "{m}:Door", "--test-cmd", "true", "--report", ""],
     "--report", "--report='': empty path"),
    # `--timeout 1e30` ran the unmutated command, then `internal error: OverflowError`, exit 70
    (["charts", "mutate", "--chart", "{m}:Door", "--test-cmd", "true", "--timeout", "1e30"],
     "--timeout", "at most 1e+06"),
    # `--jobs 10**30` was taken (a worker pool as large as the mutants: a test process each,
    # hundreds at once), `--jobs x` said argparse's `invalid int value` (stop 60)
    (["charts", "mutate", "--chart", "{m}:Door", "--test-cmd", "true", "--jobs",
      str(10 ** 30)], "--jobs", "must be in 1..64"),
    (["charts", "mutate", "--chart", "{m}:Door", "--test-cmd", "true", "--jobs", "x"],
     "--jobs", "'x' is not an integer"),
    (["charts", "mutate", "--chart", "{m}:Door", "--test-cmd", "true", "--examples", "1.5"],
     "--examples", "'1.5' is not an integer"),
    # `charts cover -- ''` said `Permission denied`
    (["charts", "cover", "--chart", "{m}:Door", "--", ""], "test command ''",
     "empty program name"),
])
def test_found_by_fuzzing_is_a_usage_error(project: Path, argv: list[str], flag: str, said: str):
    line = _assert_usage_error(project, [a.format(m=module("charts")) for a in argv], flag)
    assert said in line, line


@pytest.mark.parametrize("what", ["directory", "device"])
def test_names_check_of_what_is_no_file_is_one_line_exit_2(project: Path, what: str):
    """``charts names --check --out /dev/zero`` read without end until the kernel killed it
    (out of memory); ``--out DIR`` was ``stale: DIR: Is a directory``, exit 1, and a fix
    command that fails. Both are bad input now, named."""
    target = str(project) if what == "directory" else os.devnull.replace("null", "zero")
    line = _assert_usage_error(project, ["charts", "names", "--check", "--out", target],
                               f"--out={target!r}")
    assert ("is a directory" if what == "directory" else "not a regular file") in line


def test_names_check_of_a_missing_file_is_stale_exit_1(project: Path):
    code, out, err = _run(["charts", "names", "--check", "--out", "missing.py"])
    assert code == 1 and out == ""
    assert err.splitlines() == ["stale: missing.py: missing",
                                "fix: calexec charts names --out missing.py"]


def test_cover_of_a_command_that_records_nothing_says_its_exit_code(project: Path):
    code, out, err = _run(["charts", "cover", "--chart", f"{module('charts')}:Door", "--",
                           "false"])
    assert code == 2 and out == ""
    assert err.splitlines() == [
        "calexec charts cover: the command started no Python process that recorded (is it a "
        "Python command, run with this environment?); it exited with code 1"]


@pytest.mark.requires_tool("dot")
def test_draw_that_cannot_write_one_file_writes_none(project: Path):
    """``<Class>.svg`` a directory: Door.dot was written, then the refusal (exit 2), leaving a
    half-drawn chart; with --png, .dot and .svg were written before the .png failed."""
    ref = f"{module('charts')}:Door"
    for png, blocked in (([], "Door.svg"), (["--png"], "Door.png")):
        out = project / f"blocked_{blocked.replace('.', '_')}"
        (out / blocked).mkdir(parents=True)
        (out / "Door.dot").write_text("the user's old file\n")
        line = _assert_usage_error(project, ["charts", "draw", ref, "--out", str(out), *png],
                                   f"--out={str(out)!r}")
        assert f"cannot write {str(out / blocked)!r}: Is a directory" in line, line
        assert (out / "Door.dot").read_text() == "the user's old file\n"
    fresh = project / "fresh"
    code, out_text, _ = _run(["charts", "draw", ref, "--out", str(fresh), "--png"])
    assert code == 0 and sorted(os.listdir(fresh)) == ["Door.dot", "Door.png", "Door.svg"]
    assert out_text.split() == [str(fresh / f"Door.{s}") for s in ("dot", "svg", "png")]
    mode = os.stat(fresh / "Door.svg").st_mode & 0o777
    assert mode == new_file_mode()  # as an ordinary write makes it, not a scratch file's 0600
    assert _run(["charts", "draw", ref, "--out", str(fresh), "--png", "--check"])[0] == 0


def test_draw_without_graphviz_names_it_and_makes_nothing(project: Path,
                                                           monkeypatch: pytest.MonkeyPatch):
    """graphviz missing: the refusal came after --out was made (an empty directory left)."""
    monkeypatch.setenv("PATH", str(project / "no-bin"))
    line = _assert_usage_error(
        project, ["charts", "draw", f"{module('charts')}:Door", "--out", "drawn"], "graphviz")
    assert line.startswith("calexec charts draw: drawing needs graphviz's dot: "), line


@pytest.mark.requires_tool("dot")
def test_diagrams_that_cannot_write_one_file_write_none(project: Path):
    """``lifecycle.svg`` a directory: job's and kv_txn's diagrams were rewritten before the
    refusal, the set half new, half old."""
    out = project / "calexec_diagrams"
    (out / "lifecycle.svg").mkdir(parents=True)
    line = _assert_usage_error(project, ["diagrams", "--out", str(out)], "--out=")
    assert f"cannot write {str(out / 'lifecycle.svg')!r}: Is a directory" in line, line
    assert os.listdir(out) == ["lifecycle.svg"]
    png = project / "calexec_png"
    (png / "kv_txn.png").mkdir(parents=True)
    good = project / "calexec_good"
    line = _assert_usage_error(project, ["diagrams", "--out", str(good), "--png", str(png)],
                               f"--png={str(png)!r}")
    assert os.listdir(png) == ["kv_txn.png"] and not good.exists()


def _chain(states: int) -> type[StateMachine]:
    """A flat chart of ``states`` states in a row, each with a guarded way back to the first."""
    namespace: dict[str, object] = {f"s{i}": State(initial=i == 0) for i in range(states)}
    for i in range(states - 1):
        namespace[f"e{i}"] = (namespace[f"s{i}"].to(namespace["s0"], cond=f"g{i}")  # type: ignore[attr-defined]
                              | namespace[f"s{i}"].to(namespace[f"s{i + 1}"]))  # type: ignore[attr-defined]
    namespace["back"] = namespace[f"s{states - 1}"].to(namespace["s0"])  # type: ignore[attr-defined]
    return type(f"Chain{states}", (StateMachine,), namespace)


def test_a_large_chart_s_dot_is_rendered_in_quadratic_not_cubic_work(
        monkeypatch: pytest.MonkeyPatch):
    """Each edge label looked every event's name up by a pass over every transition: 22 s
    to render the DOT of 400 states (800 transitions) before graphviz even started. Counted,
    not timed: the passes over a transition's events stay within a few times T**2."""
    chart = _chain(60)
    transitions = 2 * 59 + 1
    passes = itertools.count()
    iterate = statemachine.events.Events.__iter__

    def counting(self):  # type: ignore[no-untyped-def]
        next(passes)
        return iterate(self)

    monkeypatch.setattr(statemachine.events.Events, "__iter__", counting)
    dot = render_chart_dot(chart)
    assert dot.count(" -> ") >= transitions
    assert next(passes) <= 3 * transitions ** 2  # (cubic: ~1.7 million)


def test_load_chart_raises_chart_ref_error_for_a_module_raised_keyboard_interrupt(
        project: Path):
    with pytest.raises(ChartRefError, match="raised by the module as it was imported"):
        load_chart(f"{module('interrupts')}:X")


def test_other_imports_passes_over_a_module_whose_getattr_raises(
        project: Path, monkeypatch: pytest.MonkeyPatch):
    """A module with a ``__getattr__`` that raises anywhere in ``sys.modules`` (a lazy-loading
    library) ended the coverage plugin's summary in an INTERNALERROR traceback, and ``charts
    cover``'s record at exit: each module with a file was asked for the chart's class name,
    of whatever file."""
    from calexec.machines.coverage import other_imports

    lazy = types.ModuleType(f"{PREFIX}_lazy_library")
    lazy.__file__ = str(project / f"{module('raises')}.py")

    def refuse(name: str) -> object:
        raise RuntimeError(f"lazy {name}")

    lazy.__getattr__ = refuse  # type: ignore[method-assign]  # (PEP 562: a module's own)
    monkeypatch.setitem(sys.modules, lazy.__name__, lazy)
    chart = load_chart(f"{module('charts')}:Door")
    assert other_imports(chart) == []


def test_a_chart_graphviz_cannot_draw_is_named_with_its_size_and_nothing_written(
        project: Path, monkeypatch: pytest.MonkeyPatch):
    """graphviz failing (here a ``dot`` that exits 1; for real, 400 states that do not lay out
    within its 60 s) was ``graphviz's dot failed (install graphviz): ...`` with graphviz
    installed, after --out was made; a large chart gave no word before the wait."""
    bin_dir = project / "fake_bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "dot").write_text("#!/bin/sh\necho 'layout failed' >&2\nexit 1\n")
    (bin_dir / "dot").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    name = module("large")
    (project / f"{name}.py").write_text(
        "from statemachine import State, StateMachine\n\n"
        "names = {f's{i}': State(initial=i == 0) for i in range(120)}\n"
        "names.update({f'e{i}': names[f's{i}'].to(names[f's{i + 1}']) for i in range(119)})\n"
        "names['back'] = names['s119'].to(names['s0'])\n"
        "Large = type('Large', (StateMachine,), names)\n")
    before = _listing(project)
    code, out, err = _run(["charts", "draw", f"{name}:Large", "--out", "large_out"])
    assert code == 2 and out == "" and _listing(project) == before
    assert err.splitlines() == [
        "calexec charts draw: laying out Large (120 states, 120 transitions) with graphviz's "
        "dot, at most 60 s per format ...",
        "calexec charts draw: graphviz's dot could not draw Large (120 states, 120 "
        "transitions): dot -Tsvg exited 1: layout failed; nothing written (`charts paths` and "
        "`charts draw --check` need no graphviz)"]


@pytest.mark.requires_tool("dot")
def test_draw_over_a_fifo_named_like_its_file_does_not_wait_for_a_writer(project: Path):
    """``<out>/Door.dot`` a FIFO: draw read it to see whose diagram it was, and waited for a
    writer for ever. It is replaced as any file that is not a diagram is."""
    out = project / "fifo_out"
    out.mkdir()
    os.mkfifo(out / "Door.dot")
    done = subprocess.run(  # (its own process: a regression waits, bounded, not the suite)
        [sys.executable, "-m", "calexec.cli", "charts", "draw", f"{module('charts')}:Door",
         "--out", str(out)], cwd=project, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (out / "Door.dot").is_file() and "Door (declared in" in (out / "Door.dot").read_text()


def test_a_sigint_handler_the_chart_module_installs_is_kept(project: Path):
    """Telling a module's own ``KeyboardInterrupt`` from a Ctrl-C puts a handler in place while
    the module is imported; a handler the module installs itself is not undone after it."""
    name = module("handler")
    (project / f"{name}.py").write_text(textwrap.dedent("""
        import signal
        from statemachine import State, StateMachine

        def on_sigint(signum, frame):
            pass

        signal.signal(signal.SIGINT, on_sigint)

        class Switch(StateMachine):
            off = State(initial=True)
            on = State()
            flip = off.to(on) | on.to(off)
    """))
    try:
        chart = load_chart(f"{name}:Switch")
        handler = signal.getsignal(signal.SIGINT)
        assert callable(handler) and getattr(handler, "__name__", "") == "on_sigint"
        assert chart.__name__ == "Switch"
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def test_cover_of_a_command_that_runs_no_transition_is_zero_not_an_error(project: Path):
    """A decision, pinned: a Python command that imports the chart but takes none of its
    transitions is 0/N, exit 0 at the default ``--min 0`` (the untaken transitions listed); a
    gate above 0 fails it, exit 1. A command in which no Python process recorded at all, or
    none imported the chart's module (since stop 74 a process records a chart once it imports
    its module: tests/test_left_probe74.py), is bad input (exit 2)."""
    argv = ["charts", "cover", "--chart", f"{module('charts')}:Door", "--", sys.executable,
            "-c", f"import {module('charts')}"]
    code, out, err = _run(argv)
    assert code == 0 and err == "", err
    assert out.splitlines()[0] == "transition coverage Door: 0/4 (0.0 %)"
    assert sum(line.startswith("    untaken: ") for line in out.splitlines()) == 4
    code, out, _ = _run([*argv[:4], "--min", "1", *argv[4:]])
    assert code == 1 and "transition coverage gate FAILED for Door: 0.0 % < 1 %" in out


@pytest.mark.parametrize("command", ["charts draw", "charts names", "diagrams"])
def test_the_fix_command_of_a_stale_check_can_be_pasted(project: Path, command: str):
    """``--check`` prints the command that fixes what is stale: an ``--out`` with a space (or
    a reference with a shell character) was printed bare, so the pasted command wrote
    somewhere else or failed."""
    out = project / "my diagrams" / ("names.py" if command == "charts names" else "")
    argv = [*command.split(), "--check", "--out", str(out)]
    if command == "charts draw":
        argv.insert(2, f"{module('charts')}:Door")
    code, _, err = _run(argv)
    assert code == 1, err
    fix = err.splitlines()[-1]
    assert fix.startswith("fix: calexec "), fix
    quoted = "'" + str(out).rstrip("/") + "'"
    assert f"--out {quoted}" in fix, fix


@pytest.mark.requires_tool("dot")
def test_a_ctrl_c_while_draw_replaces_its_files_leaves_no_mix(project: Path,
                                                               monkeypatch: pytest.MonkeyPatch):
    """``charts draw`` had its own all-or-none writer, which renamed the scratch files over
    the old ones one by one: a Ctrl-C between two renames left ``Door.dot`` new and
    ``Door.svg`` (and ``.png``) the previous chart's, a set ``--check`` calls stale. It writes
    through ``cliargs.staged_report`` now, as every report does: the Ctrl-C is held until
    every file is replaced, then interrupts."""
    from calexec.drivers.tools import charts_cli

    out = project / "interrupted"
    out.mkdir()
    for suffix in ("dot", "svg", "png"):
        (out / f"Door.{suffix}").write_text("the previous chart's\n")
    replace = os.replace
    calls: list[str] = []

    def interrupted_replace(src: str, dst: str) -> None:
        calls.append(os.path.basename(dst))
        if len(calls) == 2:  # a Ctrl-C between the first file and the second
            os.kill(os.getpid(), signal.SIGINT)
        replace(src, dst)

    monkeypatch.setattr(os, "replace", interrupted_replace)
    # Python's handler, whatever this process inherited (a run started in the background,
    # under nohup among them, inherits SIGINT ignored: its Ctrl-C never comes; CI at stop 53)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), contextlib.redirect_stdout(io.StringIO()):
            charts_cli.draw([f"{module('charts')}:Door", "--out", str(out), "--png"])
    finally:
        signal.signal(signal.SIGINT, before)
    monkeypatch.undo()
    assert len(calls) >= 2
    old = [p.name for p in sorted(out.iterdir()) if p.read_bytes() == b"the previous chart's\n"]
    assert old in ([], ["Door.dot", "Door.png", "Door.svg"]), old
    assert sorted(os.listdir(out)) == ["Door.dot", "Door.png", "Door.svg"]  # no scratch left


def test_draw_into_a_file_is_refused_before_graphviz_runs(project: Path,
                                                          monkeypatch: pytest.MonkeyPatch):
    """``--out`` naming a file was refused before the layout; writing every format first
    (this stop) moved the refusal after it: a minute's layout, then ``not a directory``. It
    comes first again (here graphviz would fail, and is never asked)."""
    bin_dir = project / "failing_bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "dot").write_text("#!/bin/sh\necho 'should not run' >&2\nexit 1\n")
    (bin_dir / "dot").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    (project / "a_file").write_text("mine\n")
    line = _assert_usage_error(project, ["charts", "draw", f"{module('charts')}:Door", "--out",
                                         "a_file"], "--out='a_file'")
    assert line == "calexec charts draw: --out='a_file': not a directory", line
    assert (project / "a_file").read_text() == "mine\n"


def test_mutate_says_after_the_unmutated_run_that_the_command_never_imports_the_chart(
        project: Path):
    """``--test-cmd`` that never imports the chart (``true``, a test file of another project, a
    module name the tests import otherwise): every mutant ran and was reported "never applied"
    only in the final report. The unmutated run now reports the modules its processes
    imported, and a chart none imported is said before the first mutant runs. The verdicts
    stay as they were (each such mutant an error, exit 1)."""
    ref = f"{module('charts')}:Door"
    mutant = "drop:opened-close->closed"
    for command, imports in ((f"{sys.executable} -c pass", False),
                             (f"{sys.executable} -c 'import {module('charts')}'", True)):
        code, out, err = _run(["charts", "mutate", "--chart", ref, "--test-cmd", command,
                               "--mutant", mutant, "--json"])
        warned = [line for line in err.splitlines() if "warning:" in line]
        status = json.loads(out)["mutants"][0]["status"]
        if imports:
            assert code == 0 and warned == [] and status == "survived", err
        else:
            assert code == 1 and status == "error", err
            assert warned == [
                f"calexec charts mutate: warning: the unmutated run of --test-cmd never imported "
                f"module {module('charts')!r} (--chart={ref!r}): no mutant of Door can be "
                f"applied, each will be an error (its mutants stop running once one is not "
                f"applied). Give --chart as the tests import it, or a "
                f"command that imports it"], err
            lines = err.splitlines()
            assert lines.index(warned[0]) < next(i for i, line in enumerate(lines)
                                                 if line.startswith("  [1/1]"))


@pytest.mark.requires_tool("dot")
@pytest.mark.parametrize("special", ["devnull", "fifo"])
@pytest.mark.parametrize("command", ["charts names", "charts draw"])
def test_a_link_to_a_device_where_a_file_goes_is_refused_not_replaced(project: Path,
                                                                       command: str,
                                                                       special: str):
    """``charts names --out /dev/null`` (or ``/dev/stdout``, a link to the terminal or a
    pipe; or such a link in ``charts draw``'s place of ``Door.svg``) renamed the new file
    over it, exit 0: as root, a regular file took the place of ``/dev/null`` itself for
    every process of the machine. A device, or a link to anything that is no regular file,
    where the staged writer would put a file is refused now, naming it, exit 2, and stays
    (here a link to ``os.devnull`` or to a FIFO, never ``/dev/null`` itself; a FIFO of its
    own in the output directory is replaced, as
    ``test_draw_over_a_fifo_named_like_its_file_does_not_wait_for_a_writer`` pins)."""
    out = project / f"special_{command.replace(' ', '_')}_{special}"
    out.mkdir()
    target = os.devnull
    if special == "fifo":
        target = str(out / "a_fifo")
        os.mkfifo(target)
    link = out / ("names.py" if command == "charts names" else "Door.svg")
    link.symlink_to(target)
    argv = (["charts", "names", "--out", str(link)] if command == "charts names"
            else ["charts", "draw", f"{module('charts')}:Door", "--out", str(out)])
    line = _assert_usage_error(project, argv, "not a regular file")
    assert line.startswith(f"calexec {command}: --out="), line
    assert str(link) in line, line
    assert os.path.islink(link) and os.readlink(link) == target
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


@pytest.mark.parametrize("out", [".", "..", "/", "a_directory"])
def test_names_out_naming_a_directory_is_one_line_exit_2(project: Path, out: str):
    """``charts names --out .`` wrote the module to the scratch directory's own path once
    ``charts names`` wrote through ``staged_report``: an internal error (exit 70)."""
    (project / "a_directory").mkdir(exist_ok=True)
    line = _assert_usage_error(project, ["charts", "names", "--out", out], f"--out={out!r}")
    assert line.endswith("is a directory, not a generated chart names module"), line
