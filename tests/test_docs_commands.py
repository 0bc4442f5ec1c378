"""What README.md and docs/*.md tell a user to type, checked against the code (stop 47).

- every ``calexec ...`` command line the docs show (in a fenced block or inline code) names a
  real command, and every ``--flag`` it shows is one that command's ``--help`` lists (the
  help comes from the console script's own entry point, ``calexec.cli.main``, in process);
- every fenced ``python`` block compiles, and every name it imports from ``calexec`` exists
  (the blocks are fragments of a user's code: their own modules are not imported here);
- the defects found by typing the docs as written, each pinned by a test below.

The whole file runs in a few seconds: the help texts are read once, in process.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import io
import re
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from calexec import cli
from calexec.commands import lookup
from calexec.contracts.manifest import default_manifest_path
from calexec.drivers.tools import explore

ROOT = Path(__file__).resolve().parent.parent
#: the user docs; traceability.md is a record of findings (it quotes bad command lines)
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md")
                                    if p.name != "traceability.md")]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
#: a command line: ``calexec WORDS...`` at its start, after ``$ ``, environment assignments or
#: ``python -m``
COMMAND = re.compile(r"^(?:\$ )?(?:[A-Z_]+=\S* )*(?:python -m )?calexec((?: [a-z][a-z-]*){1,2})(.*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def command_lines() -> list[tuple[str, str]]:
    """(doc, command line) for every ``calexec ...`` line of a fenced block or inline code,
    a fenced line's continuation (``\\``) joined, its shell comment dropped."""
    found: list[tuple[str, str]] = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for _lang, block in FENCE.findall(text):
            joined = re.sub(r"\\\n\s*", " ", block)
            current: str | None = None  # a usage line, continued by indented `[--flag ...]` lines
            for line in joined.splitlines():
                words = line.split("  #")[0].strip()
                if current is not None and line[:1].isspace() and words.startswith(("[", "--")):
                    current += " " + words
                    continue
                if current is not None:
                    found.append((path.name, current))
                current = words if COMMAND.match(words) else None
            if current is not None:
                found.append((path.name, current))
        for code in INLINE.findall(FENCE.sub("", text)):
            if "calexec " in code:
                found.append((path.name, code))
    return found


@functools.cache
def help_text(name: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([*name.split(), "--help"])
    assert code == 0, f"calexec {name} --help: exit {code}: {err.getvalue()}"
    return out.getvalue()


def flag_problems(doc: str, line: str) -> list[str]:
    """What is wrong with one documented command line: an unknown command, a flag its help
    does not list. A line that names no command (``calexec --help``, prose) is skipped."""
    match = COMMAND.match(line)
    if match is None:
        return []
    words = match.group(1).split()
    name = lookup([*words, ""])
    if name is None:
        return [f"{doc}: `{line}`: no command {' '.join(words)!r}"]
    rest = (match.group(1) + match.group(2))[len(" " + name):]
    rest = rest.split(" -- ")[0]  # `charts cover ... -- COMMAND...`: the test command's own
    help_ = help_text(name)
    return [f"{doc}: `{line}`: calexec {name} has no {flag}"
            for flag in FLAG.findall(rest)
            if not re.search(re.escape(flag) + r"(?![a-z0-9-])", help_)]


def test_every_documented_command_line_names_a_command_and_flags_it_has():
    lines = command_lines()
    assert len(lines) > 100  # the extraction found the docs' commands
    problems = [p for doc, line in lines for p in flag_problems(doc, line)]
    assert problems == [], "\n".join(problems)


def test_the_command_line_check_sees_an_unknown_flag_and_command():
    assert flag_problems("x.md", "calexec demo --seqs 2") == []
    assert flag_problems("x.md", "calexec demo --sequences 2") == [
        "x.md: `calexec demo --sequences 2`: calexec demo has no --sequences"]
    assert flag_problems("x.md", "calexec sim bnch --json") == [
        "x.md: `calexec sim bnch --json`: no command 'sim bnch'"]
    # the flags after `--` are the test command's, not calexec's
    assert flag_problems("x.md", "calexec charts cover --chart a:B -- python -m pytest --lf") == []


def python_blocks() -> list[tuple[str, int, str]]:
    """(doc, line number, code) of every fenced ``python`` block."""
    blocks = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            if match.group(1) == "python":
                blocks.append((path.name, text[:match.start()].count("\n") + 1, match.group(2)))
    return blocks


def submodule(module: types.ModuleType, name: str) -> bool:
    """``from package import name`` of a submodule not imported yet."""
    if not hasattr(module, "__path__"):
        return False
    try:
        importlib.import_module(f"{module.__name__}.{name}")
    except ImportError:
        return False
    return True


def import_problems(doc: str, line: int, code: str) -> list[str]:
    """A block that does not compile (``...`` stands for elided code, as in Python), or a
    ``calexec`` import of a module or name that does not exist."""
    where = f"{doc}:{line}"
    try:
        tree = ast.parse(code, where)
    except SyntaxError as exc:
        return [f"{where}: does not compile: {exc}"]
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "calexec":
            try:
                module = importlib.import_module(node.module)
            except ImportError as exc:
                problems.append(f"{where}: from {node.module}: {exc}")
                continue
            problems += [f"{where}: {node.module} has no {alias.name}" for alias in node.names
                         if not hasattr(module, alias.name)
                         and not submodule(module, alias.name)]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "calexec":
                    try:
                        importlib.import_module(alias.name)
                    except ImportError as exc:
                        problems.append(f"{where}: import {alias.name}: {exc}")
    return problems


def test_every_python_block_compiles_and_its_calexec_imports_exist():
    blocks = python_blocks()
    assert len(blocks) >= 10
    problems = [p for block in blocks for p in import_problems(*block)]
    assert problems == [], "\n".join(problems)


def test_the_snippet_check_sees_a_missing_name_and_a_syntax_error():
    assert import_problems("x.md", 1, "from calexec.machines.paths import as_data\n") == []
    assert import_problems("x.md", 1, "from calexec.machines.paths import as_dict\n") == [
        "x.md:1: calexec.machines.paths has no as_dict"]
    assert import_problems("x.md", 1, "def f(:\n")[0].startswith("x.md:1: does not compile")


# ---- defects found by typing the docs as written ----------------------------------------------

def test_explore_write_calbins_makes_its_directory(tmp_path):
    """docs/testing.md: ``explore.explore_seed(explore.write_calbins("/tmp/x"), 14)`` in a fresh
    shell was ``FileNotFoundError: '/tmp/x/explore_main.calbin'``: the directory is made."""
    directory = tmp_path / "not" / "yet"
    calbins = explore.write_calbins(str(directory))
    assert sorted(calbins) == ["main", "other"]
    assert all(Path(path).is_file() and Path(path).parent == directory
               for path in calbins.values())


def test_serve_once_names_the_calbin_it_serves(tmp_path):
    """docs/server.md's smoke run: ``serve --once --calbin X`` said it served "the synthetic
    calbin on the bundled emulator" whatever was given; it names the calbin and runtime."""
    calbin = tmp_path / "mine.calbin"
    assert cli.main(["sim", "write-calbin", str(calbin)]) == 0
    run = subprocess.run([sys.executable, "-m", "calexec", "serve", "--once", "--calbin",
                          str(calbin)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    banner = run.stdout.splitlines()[0]
    assert banner.startswith(f"calexec serve --once: calbin {str(calbin)!r} on the bundled "
                             "emulator, serving http://127.0.0.1:"), banner


def test_serve_once_without_a_calbin_says_it_serves_the_synthetic_one(tmp_path):
    run = subprocess.run([sys.executable, "-m", "calexec", "serve", "--once"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("calexec serve --once: the synthetic calbin on the bundled "
                                 "emulator, serving http://127.0.0.1:")


@pytest.mark.parametrize(("command", "flag"), [("charts mutate", "--targets-per-transition"),
                                               ("serve", "--cors-origin")])
def test_a_flag_help_states_its_default_once(command, flag):
    """``charts mutate --help`` said ``default 2) (default: 2)``; ``serve --help``
    ``default: CORS off (default: [])``: the formatter appended a second default."""
    lines = help_text(command).splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(f"{flag} "))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith(" " * 8))
    entry = " ".join(" ".join(lines[start:end]).split())
    assert len(re.findall(r"\bdefault\b", entry)) == 1, entry


def test_golden_record_does_not_warn_about_the_golden_it_pins(tmp_path, capsys, caplog):
    """docs/manifest.md §6: ``calexec golden record --calbin X --manifest M`` printed
    ``allow_unpinned_golden: ... goes Ready on an unpinned golden ... (first run trusted; §9.2
    asks for a fixed golden)`` while pinning that very golden; it prints the pin alone."""
    calbin, manifest = tmp_path / "m5.calbin", tmp_path / "my.toml"
    assert cli.main(["sim", "write-calbin", str(calbin), "--seed", "5"]) == 0
    manifest.write_text(Path(default_manifest_path()).read_text(encoding="utf-8"),
                        encoding="utf-8")
    capsys.readouterr()
    caplog.set_level("WARNING")
    assert cli.main(["golden", "record", "--calbin", str(calbin), "--manifest",
                     str(manifest)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("pinned golden for calbin sha256 "), out
    assert (tmp_path / "my.goldens.toml").is_file()
    assert "unpinned" not in err, err
    assert [r.getMessage() for r in caplog.records if "unpinned" in r.getMessage()] == []


def test_every_mutant_id_docs_testing_md_names_is_one_of_calexecs_charts():
    """``calexec charts mutate --chart job --mutant ID`` with an id docs/testing.md shows
    must select a mutant (``S-`` stands for any source state, ``...`` for elided parts)."""
    from calexec.machines import charts, mutants

    ids = {m.id for chart in (charts.JobChart, charts.KvTxnChart, charts.LifecycleChart,
                              charts.BufferSlotChart) for m in mutants.derive(chart, 0)}
    text = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`((?:guard-true|guard-false|drop|target):[^`'\s]+)", text))
    assert len(named) > 20
    unknown = sorted(i for i in named if i not in ids and "..." not in i and ":S-" not in i)
    assert unknown == []


def test_demo_reports_the_pool_after_the_last_slot_came_back(monkeypatch, capsys):
    """``calexec demo --seqs 1 --tokens 1 --prompt-len 1`` printed ``slots={'Free': 5, ...,
    'InFlight': 1, ...}; shutdown ok`` about one run in six: the completion thread gives a
    job's slot back just after resolving it, and the demo read the pool in between. The slot's
    return is delayed here so that the window is always hit; the demo reports the pool once it
    settled."""
    from calexec.machines.pool import BufferPool

    real = BufferPool.device_done

    def slow_device_done(self: BufferPool, lease: object) -> bool:
        time.sleep(0.2)  # the completion thread, preempted between resolve and give-back
        return real(self, lease)

    monkeypatch.setattr(BufferPool, "device_done", slow_device_done)
    assert cli.main(["demo", "--seqs", "1", "--tokens", "1", "--prompt-len", "1"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert "'Leased': 0, 'InFlight': 0" in last, last
    assert "shutdown ok, lifecycle Stopped" in last


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_mutants_derive_refuses_a_targets_per_transition_it_cannot_mean(bad):
    """docs/framework.md's public ``derive(Chart, targets_per_transition)``: ``-1`` gave 43 of
    OrderWorkflow's 50 target-complete mutants (a slice from the end), silently, where
    ``calexec charts mutate --targets-per-transition -1`` is refused; it is a ValueError
    (TypeError for a non-int) naming the argument and the value."""
    from calexec.machines import mutants

    sys.path.insert(0, str(ROOT / "examples" / "charts"))
    try:
        from order_workflow import OrderWorkflow
    finally:
        sys.path.remove(str(ROOT / "examples" / "charts"))
    with pytest.raises((ValueError, TypeError), match=r"targets_per_transition="):
        mutants.derive(OrderWorkflow, bad)
    assert len(mutants.derive(OrderWorkflow, 0)) > len(mutants.derive(OrderWorkflow, 2)) > 0


def test_readme_states_the_decode_us_range_each_command_takes():
    """README "Commands" gives each command's ``--decode-us`` range; each is the range that
    command takes (stop 65: it gave every command the emulator's 0..60000000, and
    ``calexec bench overhead --decode-us 0`` or ``--decode-us 2000000`` was refused)."""
    import argparse

    from calexec import cliargs
    from calexec.drivers.tools.bench import core, soak

    def takes(check: Callable[[int], object], value: int) -> bool:
        try:
            check(value)
        except (ValueError, argparse.ArgumentTypeError):
            return False
        return True

    checks: dict[str, Callable[[int], object]] = {
        "demo": lambda us: cliargs.latency_us(str(us)),
        "bench server": lambda us: cliargs.latency_us(str(us)),
        "bench overhead": lambda us: core.decode_profiles([str(us)]),
        "bench soak": lambda us: soak.parse_phases(str(us)),
    }
    text = re.sub(r"\s+", " ", (ROOT / "README.md").read_text(encoding="utf-8"))
    stated = re.search(r"an emulated latency \(`--decode-us`\) (.*?) \(docs/benchmarks\.md", text)
    assert stated is not None, "README no longer states the --decode-us ranges"
    ranges = {}
    # each range, then the commands it is for: "0..N us (...) for `demo` and `bench server`"
    for bounds in re.finditer(r"(\d+)\.\.(\d+) us(.*?)(?=\d+\.\.\d+ us|$)", stated.group(1)):
        for name in re.findall(r"`([a-z ]+)`", bounds.group(3)):
            ranges[name] = (int(bounds.group(1)), int(bounds.group(2)))
    assert set(ranges) == set(checks), ranges
    for name, (lo, hi) in ranges.items():
        check = checks[name]
        assert takes(check, lo) and takes(check, hi), (name, lo, hi)
        assert not takes(check, lo - 1) and not takes(check, hi + 1), (name, lo, hi)
