"""``calexec charts cover`` (issue 26): transition coverage of a chart class over any test
command, printed and gated like the pytest plugin (``--chart-coverage``,
``--chart-coverage-min``), with bad input one line and exit 2."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from calexec.cli import main as cli

CHART = """
    from statemachine import State, StateMachine


    class Light(StateMachine):
        off = State(initial=True)
        on = State()
        gone = State(final=True)

        switch = off.to(on, cond="powered") | on.to(off)
        unplug = on.to(gone)


    class Power:
        def powered(self):
            return True
"""

TEST_FILE = """
    from {module} import Light, Power


    def test_switch_on_and_off():
        light = Light(Power())
        light.send("switch")
        light.send("switch")
"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's project directory with the chart ``Light`` in a module of its own name and a
    test file that takes two of its three transitions."""
    module = f"light_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(CHART))
    (tmp_path / "test_light.py").write_text(textwrap.dedent(TEST_FILE.format(module=module)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path, module


def pytest_cmd() -> list[str]:
    # no cache, no hypothesis plugin: a pytest start-up of its own costs seconds on a busy host
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "-p", "no:hypothesispytest", "test_light.py"]


def test_cover_gates_a_pytest_command_as_the_plugin_does(project, capsys):
    """The same pytest command: under ``charts cover`` and under the plugin, the same count and
    the same verdict for a gate of 100 %."""
    _, module = project
    chart = f"{module}:Light"
    assert cli(["charts", "cover", "--chart", chart, "--min", "100", "--", *pytest_cmd()]) == 1
    out = capsys.readouterr().out
    assert "transition coverage Light: 2/3 (66.7 %)" in out
    assert "    untaken: on --unplug--> gone" in out
    assert "transition coverage gate FAILED for Light: 66.7 % < 100 %" in out
    plugin = subprocess.run([*pytest_cmd(), f"--chart-coverage={chart}",
                             "--chart-coverage-min=100"],
                            capture_output=True, text=True, timeout=120)
    assert plugin.returncode == 1, plugin.stdout + plugin.stderr
    assert "transition coverage Light: 2/3" in plugin.stdout


def test_cover_counts_a_plain_python_command_and_compiled_runs(project, capsys):
    _, module = project
    script = (f"from {module} import Light, Power\n"
              "from calexec.machines.compiled import compiled\n"
              "run = compiled(Light).run(Power())\n"
              "run.send('switch'); run.send('unplug')\n")
    assert cli(["charts", "cover", "--chart", f"{module}:Light", "--min", "50", "--",
                sys.executable, "-c", script]) == 0
    assert "transition coverage Light: 2/3" in capsys.readouterr().out


def test_a_failing_command_fails_the_cover_run(project, capsys):
    _, module = project
    assert cli(["charts", "cover", "--chart", f"{module}:Light", "--",
                sys.executable, "-c", "raise SystemExit(3)"]) == 1
    assert "the test command failed (exit code 3)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--chart", "{m}", "--", "true"], "--chart='{m}': expected MODULE:CLASS"),
        (["--chart", "{m}:Nope", "--", "true"], "--chart='{m}:Nope': module"),
        (["--chart", "{m}:Light", "--min", "120", "--", "true"],
         "--min='120': expected a percentage (0-100)"),
        (["--chart", "{m}:Light"], "no test command: give it after `--`"),
        (["--chart", "{m}:Light", "--", "no-such-command-xyz"],
         "test command 'no-such-command-xyz': No such file or directory"),
        (["--chart", "{m}:Light", "--", "true"],
         "the command started no Python process that recorded"),
    ],
    ids=["no-colon", "no-class", "bad-min", "no-command", "no-executable", "not-python"],
)
def test_bad_input_is_one_line_exit_2(project, capsys, args, message):
    _, module = project
    args = [a.format(m=module) for a in args]
    assert cli(["charts", "cover", *args]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert message.format(m=module) in lines[0], lines[0]


def test_the_chart_reference_is_named_once_in_each_message(project, capsys):
    """``charts cover`` printed the reference twice, ``--chart='m:Nope': 'm:Nope': module ...``
    and ``... imported m:Light: 'm:Light': cannot import ...``: its own prefix, then the
    reference the loader's message starts with."""
    root, module = project
    ref = f"{module}:Nope"
    assert cli(["charts", "cover", "--chart", ref, "--", "true"]) == 2
    err = capsys.readouterr().err
    assert err.count(ref) == 1, err
    # a chart no process of the command imports (since stop 74 none is imported for it)
    ref = f"{module}:Light"
    assert cli(["charts", "cover", "--chart", ref, "--", sys.executable, "-c", "pass"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "no process of the command imported module" in lines[0], err
    assert lines[0].count(ref) == 1, lines[0]


def test_two_charts_of_the_same_name_are_refused_by_cover_and_the_plugin(project, capsys):
    """Coverage keys a transition by (chart name, index): ``--chart shop_a:Flow --chart
    shop_b:Flow`` credited shop_b's Flow with what shop_a's took (a run of shop_a alone
    printed 'Flow: 1/2' for shop_b), under two lines both named Flow."""
    root, module = project
    (root / f"other_{module}.py").write_text(textwrap.dedent(CHART))
    args = ["--chart", f"{module}:Light", "--chart", f"other_{module}:Light"]
    assert cli(["charts", "cover", *args, "--", sys.executable, "-c", "pass"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"calexec charts cover: --chart='other_{module}:Light' and --chart='{module}:Light': "
        "two charts named Light (coverage counts transitions by chart name); give one class "
        "another name"]
    plugin = subprocess.run([*pytest_cmd(), f"--chart-coverage={module}:Light",
                             f"--chart-coverage=other_{module}:Light"],
                            capture_output=True, text=True, timeout=120)
    assert plugin.returncode == 4, plugin.stdout + plugin.stderr
    assert (f"--chart-coverage='other_{module}:Light' and --chart-coverage='{module}:Light': "
            "two charts named Light") in plugin.stderr, plugin.stderr


def test_a_chart_the_command_imports_under_another_module_name_is_named(project, capsys):
    """``--chart app_x.lamp:Light`` while the command imports the same file as ``lamp`` (its
    directory on ``sys.path``): two module names, two classes, and the count said ``0/3`` with
    no hint that the runs were of the other class. The output names the other module and the
    ``--chart`` to give; that one counts the runs."""
    root, module = project
    package = root / f"app_{module}"
    package.mkdir()
    (package / "lamp.py").write_text(textwrap.dedent(CHART))
    script = (f"import sys\nsys.path.insert(0, {str(package)!r})\n"
              "from lamp import Light, Power\nLight(Power()).send('switch')\n")
    assert cli(["charts", "cover", "--chart", f"app_{module}.lamp:Light", "--",
                sys.executable, "-c", script]) == 0
    out = capsys.readouterr().out
    assert "transition coverage Light: 0/3 (0.0 %)" in out, out
    assert ("transition coverage Light: the command imported its file as module 'lamp' too, "
            "another class whose runs are not counted: name the chart as it imports it "
            f"(--chart=lamp:Light, with PYTHONPATH=app_{module}: the directory it is imported "
            "from)") in out, out
