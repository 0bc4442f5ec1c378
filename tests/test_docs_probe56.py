"""Stop 56's docs probe: defects a newcomer met following README.md, docs/framework.md,
docs/server.md, docs/embedding.md and docs/operations.md as written. Real executor on the
bundled emulator, in process (no socket), every wait bounded."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from fastapi.testclient import TestClient
from statemachine import State, StateMachine

from calexec import cli
from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.drivers.synthetic import calbin as cb
from calexec.machines.chartref import ChartRefError, load_chart
from calexec.machines.inspector import Inspector
from test_server_support import started_executor

TOKEN = "docs-probe-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_a_reload_rolled_back_says_why_the_calbin_was_refused_and_what_to_do(tmp_path):
    """docs/server.md: a reload whose calbin has no pinned golden is refused and rolls back
    (500 ``recovery.rolled_back``). Its message said only ``'m5.calbin' was refused
    (golden.unpinned); ... serves again``, and the log line the same: the operator was not
    told the calbin's sha256 nor to run ``calexec golden record --calbin ...``, which the same
    calbin at ``calexec serve --calbin`` says. The refusal's own message is now in it."""
    unpinned = tmp_path / "m5.calbin"
    sha = cb.write(str(unpinned), cb.default_spec(seed=cb.DEFAULT_SEED ^ 0x3C))
    executor = started_executor(tmp_path)
    try:
        app = create_app(executor, ServerConfig(admin_token=TOKEN))
        with TestClient(app) as client:
            answer = client.post("/admin/reload", json={"calbin": str(unpinned)}, headers=AUTH)
            assert answer.status_code == 500, answer.text
            error = answer.json()["error"]
            assert error["code"] == "recovery.rolled_back" and error["param"] == "calbin"
            message = error["message"]
            assert "golden.unpinned" in message, message
            assert sha in message, message
            assert f"calexec golden record --calbin {unpinned}" in message, message
            assert client.get("/ready").status_code == 200
    finally:
        executor.shutdown(10.0)


def blocked(*modules: str) -> str:
    """Python run first in a child: ``modules`` are not installed (as without an extra)."""
    return f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {modules!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
        return None
sys.meta_path.insert(0, Block())
"""


def calexec(pre: str, *argv: str) -> subprocess.CompletedProcess:
    code = f"{pre}\nimport sys\nfrom calexec.cli import main\nsys.exit(main({list(argv)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr and len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("argv", [("--gates", "chaos"), ()], ids=["chaos", "every gate"])
def test_accept_with_the_chaos_gate_and_no_server_extra_says_which_pip_install(argv):
    """README: a command whose extra is missing says which ``pip install`` to run and exits 2.
    ``calexec accept --quick`` (every gate) or ``--gates chaos`` without the [server] extra
    ran the other gates, then printed ``FAIL  chaos_a  problems = 0``, exit 1, the reason
    (``needs the [server] extra``) only in the JSON report. It is refused before any gate
    runs, naming the install and, when other gates were asked for, the ``--gates`` without
    chaos."""
    run = calexec(blocked("fastapi", "uvicorn", "starlette"), "accept", "--quick",
                  "--phase", "a", *argv)
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
    line = one_line(run.stderr)
    assert line.startswith("calexec accept: the chaos gate (a fault soak of the reference "
                           "server) needs the optional [server] extra: "
                           "pip install 'calexec[server]'"), line
    if argv:
        assert "--gates" not in line, line
    else:
        assert line.endswith("; or leave the gate out: --gates "
                             "correctness,lengths,crosstalk,injections,soak"), line
    assert "FAIL" not in run.stdout, run.stdout


@pytest.mark.parametrize("command", [("bench", "faults", "--json", "--faults", "2"),
                                     ("bench", "soak", "--json")], ids=["faults", "soak"])
def test_a_server_client_command_without_httpx_says_which_pip_install(command):
    """The [server] extra brings httpx for the loopback clients of ``bench faults``, ``bench
    soak`` and the chaos gate (pyproject.toml, README); an install without it (the server's
    packages installed by hand) ended those commands in ``internal error: ModuleNotFoundError:
    No module named 'httpx'``, exit 70, where README promises the ``pip install`` line, exit 2."""
    run = calexec(blocked("httpx"), *command)
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
    assert one_line(run.stderr) == (f"calexec {command[0]} {command[1]}: needs the optional "
                                    "[server] extra: pip install 'calexec[server]'")


@pytest.mark.parametrize(("source", "said"), [
    ("import sys\nsys.exit()\n", "(SystemExit at shop_exit.py:2: sys.exit() with no code)"),
    ("raise ValueError()\n", "(ValueError at shop_exit.py:1: no message)")],
    ids=["sys.exit()", "bare ValueError"])
def test_a_chart_module_that_ends_its_import_without_a_message_is_said_so(tmp_path, monkeypatch,
                                                                       source, said):
    """docs/framework.md: a module that ends the import itself is one line naming where and
    its message (`SystemExit at shop.py:3: 2`). A bare ``sys.exit()`` (or an exception with
    no text) read ``(SystemExit at shop.py:2: )``, the line ending in an empty message."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_chart puts tmp_path first
    (tmp_path / "shop_exit.py").write_text(source, encoding="utf-8")
    with pytest.raises(ChartRefError) as caught:
        load_chart("shop_exit:Light", cwd=str(tmp_path))
    message = str(caught.value)
    sys.modules.pop("shop_exit", None)
    assert message.endswith(said), message


@pytest.mark.parametrize("count, said", [(1.5, "1.5"), ("3", '"3"'), (True, "true"),
                                         (2.0, "2.0")], ids=["float", "str", "bool", "2.0"])
def test_an_inspector_count_that_is_no_integer_is_named_not_drawn(count, said):
    """docs/framework.md: a ``counts`` function answering a count that is no integer leaves
    that chart's counts empty and names the error in ``live.json``. The count went through
    ``int()``: 1.5 was drawn as 1 live run, ``"3"`` as 3 and ``True`` as 1, silently. An
    integer (numpy's too) is still taken. The state and count are written as JSON (since
    stop 59: ``"locked"=true``, not ``'locked'=True``)."""
    class Turnstile(StateMachine):
        locked = State(initial=True)
        unlocked = State()
        coin = locked.to(unlocked)
        push = unlocked.to(locked)

    inspector = Inspector()
    inspector.register(Turnstile, counts=lambda: {"locked": count}, name="bad")
    inspector.register(Turnstile, counts=lambda: {"locked": np.int64(4), "unlocked": 2},
                       name="good")
    charts = inspector.live()["charts"]
    assert charts["bad"]["counts"] == {}, charts["bad"]
    assert charts["bad"]["error"] == ("bad: the counts= function given to register answered a "
                                      f'count that is no integer: "locked"={said}')
    assert charts["good"]["counts"] == {"locked": 4, "unlocked": 2}, charts["good"]
    assert "error" not in charts["good"] or charts["good"]["error"] is None


@pytest.mark.requires_tool("dot")
def test_check_of_a_diagram_another_chart_holds_names_a_fix_that_is_not_refused(
        tmp_path, monkeypatch, capsys):
    """docs/framework.md: two charts of one class name from two modules share their diagram
    files; drawing the second where the first's are is refused (exit 2) and ``--check`` says
    the file is the other chart's. That ``--check`` then printed ``fix: calexec charts draw
    billing_p56.orders:Order --out diagrams``, the very command that is refused: its fix
    now says to draw into another directory or delete the other chart's file."""
    for package in ("shop_p56", "billing_p56"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("", encoding="utf-8")
        (tmp_path / package / "orders.py").write_text(
            "from statemachine import State, StateMachine\n\n"
            "class Order(StateMachine):\n"
            "    a = State(initial=True)\n"
            "    b = State(final=True)\n"
            f"    go = a.to(b)\n    {package} = a.to(a)\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in list(sys.modules):
        if name.split(".")[0] in ("shop_p56", "billing_p56"):
            monkeypatch.delitem(sys.modules, name)
    try:
        assert cli.main(["charts", "draw", "shop_p56.orders:Order"]) == 0
        capsys.readouterr()
        assert cli.main(["charts", "draw", "billing_p56.orders:Order", "--check"]) == 1
        err = capsys.readouterr().err
        fix = [line for line in err.splitlines() if line.startswith("fix: ")]
        assert fix == ["fix: draw it into another directory (calexec charts draw "
                       "billing_p56.orders:Order --out DIR), or delete diagrams/Order.dot to "
                       "replace the other chart's diagram"], err
        # the command the old fix named is refused
        assert cli.main(["charts", "draw", "billing_p56.orders:Order", "--out",
                         "diagrams"]) == 2
    finally:
        for name in list(sys.modules):
            if name.split(".")[0] in ("shop_p56", "billing_p56"):
                del sys.modules[name]


def test_cover_names_a_reference_it_can_import_for_a_chart_the_tests_import_otherwise(
        tmp_path, monkeypatch, capsys):
    """docs/framework.md: when the tests import the chart's file under another module name,
    ``charts cover``'s summary names the other module and the reference to give. The tests
    here put ``app_p56/`` on ``sys.path`` themselves and import ``kettle_p56``; the summary
    said ``--chart=kettle_p56:Kettle``, which ``charts cover`` refused (``cannot import module
    'kettle_p56'``): it is found only from that directory. The summary now says with which
    ``PYTHONPATH``."""
    (tmp_path / "app_p56").mkdir()
    (tmp_path / "app_p56" / "__init__.py").write_text("", encoding="utf-8")
    (tmp_path / "app_p56" / "kettle_p56.py").write_text(
        "from statemachine import State, StateMachine\n\n"
        "class Kettle(StateMachine):\n"
        "    cold = State(initial=True)\n"
        "    hot = State(final=True)\n"
        "    heat = cold.to(hot)\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    tests = ("import sys; sys.path.insert(0, 'app_p56'); from kettle_p56 import Kettle; "
             "Kettle().send('heat')")
    try:
        code = cli.main(["charts", "cover", "--chart", "app_p56.kettle_p56:Kettle", "--",
                         sys.executable, "-c", tests])
        out = capsys.readouterr().out
        assert code == 0, out
        assert ("name the chart as it imports it (--chart=kettle_p56:Kettle, with "
                "PYTHONPATH=app_p56: the directory it is imported from)") in out, out
        # the reference, with that PYTHONPATH, is taken and counts the tests' run
        monkeypatch.setenv("PYTHONPATH", "app_p56")
        sys.path.insert(0, str(tmp_path / "app_p56"))
        code = cli.main(["charts", "cover", "--chart", "kettle_p56:Kettle", "--",
                         sys.executable, "-c", tests])
        out = capsys.readouterr().out
        assert code == 0 and "transition coverage Kettle: 1/1 (100.0 %)" in out, out
    finally:
        for name in list(sys.modules):
            if name.split(".")[0] in ("app_p56", "kettle_p56"):
                del sys.modules[name]
