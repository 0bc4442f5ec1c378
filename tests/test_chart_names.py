"""Chart states and events as generated names (issue 15 §5): machines/chart_names.py is what
the declarations generate, a misspelt name fails at import, and the control core names states
and events through it (no string literal of a state or event left in machines/)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from calexec.drivers.tools import write_chart_names as tool
from calexec.machines import chart_names
from calexec.machines.compiled import CHARTS, name_constants, names_source

ROOT = Path(__file__).resolve().parent.parent


def test_the_committed_module_is_what_the_declarations_generate():
    assert (ROOT / "machines" / "chart_names.py").read_text(encoding="utf-8") == names_source(), \
        "machines/chart_names.py is stale: run `calexec charts names`"
    assert tool.main(["charts", "names", "--check"]) == 0


def test_every_state_and_event_has_exactly_one_constant():
    values = name_constants()
    for _name, chart in CHARTS.items():
        assert set(chart.states) | set(chart.events) <= set(values.values())
    assert chart_names.JOB_CANCEL_REQUESTED == "CancelRequested"
    assert chart_names.SLOT_EV_GIVE_BACK == "give_back"
    assert chart_names.LIFECYCLE_READY == "Ready" and chart_names.KV_ROLLED_BACK == "RolledBack"
    assert {k for k in vars(chart_names) if k.isupper()} == set(values)


def test_a_misspelt_name_fails_at_import():
    code = "from calexec.machines.chart_names import JOB_SUBMITED"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode != 0 and "ImportError" in run.stderr and "JOB_SUBMITED" in run.stderr


def test_a_stale_module_fails_at_import_and_check_says_how_to_fix(tmp_path, monkeypatch,
                                                                  capsys):
    stale = names_source().replace('JOB_QUEUED = "Queued"', 'JOB_QUEUED = "Waiting"')
    out = tmp_path / "chart_names.py"
    out.write_text(stale, encoding="utf-8")
    assert tool.main(["charts", "names", "--check", "--out", str(out)]) == 1
    assert "fix: calexec charts names" in capsys.readouterr().err
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="JOB_QUEUED"):
        importlib.import_module("chart_names")
    assert tool.main(["charts", "names", "--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == names_source()


#: files of the control core that must name states and events through chart_names
CORE = ["machines/pool.py", "machines/kv.py", "machines/device_lifecycle.py", "machines/job.py",
        "machines/executor.py"]


@pytest.mark.parametrize("path", CORE)
def test_the_core_names_states_and_events_by_constant(path):
    """No string literal equal to a state or event compared against a chart's state or sent
    as an event (``run.state == "Free"``, ``run.send("lease")``) is left in the file."""
    names = set(name_constants().values())
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            subjects = [p for p in parts if isinstance(p, ast.Attribute) and p.attr == "state"]
            if subjects:
                for p in parts:
                    elts = p.elts if isinstance(p, (ast.Tuple, ast.List, ast.Set)) else [p]
                    found += [(node.lineno, e.value) for e in elts
                              if isinstance(e, ast.Constant) and e.value in names]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("send", "can", "select") and node.args \
                and isinstance(node.args[0], ast.Constant) and node.args[0].value in names:
            found.append((node.lineno, node.args[0].value))
    assert found == [], f"{path}: use machines/chart_names.py constants: {found}"


def test_check_of_a_file_that_is_not_utf8_is_stale_not_an_internal_error(tmp_path, capsys):
    """``--check`` read the file as UTF-8: a binary one raised UnicodeDecodeError out of the
    command (``internal error``, exit 70 through the CLI)."""
    out = tmp_path / "chart_names.py"
    out.write_bytes(b"\xff\xfe\x00 not python")
    assert tool.main(["charts", "names", "--check", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "differs from the declared charts" in err and "fix: calexec charts names" in err


def test_a_write_cut_short_leaves_the_previous_module_whole(tmp_path):
    """``charts names`` wrote the module in place: a write cut short (a full disk; here the
    process's file-size limit) left a truncated ``chart_names.py`` that no longer imports, in
    place of a good one. The new text now goes to a scratch file beside it, which replaces
    the module only once it is whole; the error names ``--out`` (exit 2)."""
    out = tmp_path / "chart_names.py"
    previous = "# the previous module, whole\n" * 4
    out.write_text(previous, encoding="utf-8")
    limit = len(names_source().encode("utf-8")) // 2
    code = ("import resource, signal, sys\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
            "from calexec.cli import main\n"
            f"sys.exit(main(['charts', 'names', '--out', {str(out)!r}]))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2, run.stderr
    assert "--out" in run.stderr and "Traceback" not in run.stderr
    assert out.read_text(encoding="utf-8") == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chart_names.py"]  # no scratch left
