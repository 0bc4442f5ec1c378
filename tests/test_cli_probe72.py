"""Stop 72 (cli): a device fault the metrics missed, an interrupt that left an executor
running, and bad CLI input as a user on a terminal and a CI script give it
(docs/traceability.md, "Found at stop 72 (cli)"). Loopback servers only; every wait bounded;
never a timing figure.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

import needs

needs.module("httpx", "server")  # /metrics and the reload go over HTTP ([server])
import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from calexec.drivers.calrt.runtime import Fault, FaultMode  # noqa: E402
from test_server_support import ServeLikeServer  # noqa: E402

ADMIN = "probe72"


def _device_faults(text: str) -> dict[tuple[str, str, str], float]:
    return {(s.labels["category"], s.labels["code"], s.labels["raw"]): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "calexec_device_faults_total"}


def test_a_configure_the_device_refused_is_counted_in_the_device_faults(tmp_path):
    """A model switch (``POST /admin/reload``) whose configure the device refused (rc 24,
    ``calrt.map_failed``: §8 DEVICE) reset the device and configured again, and served on,
    but ``calexec_device_faults_total`` never counted the refusal (nor did the log have the
    fault's line): no fault controller heard of it, since no job carried it. It is now
    reported as every device fault is, counted once with its category, code and raw code."""
    from calexec.drivers.serving.server import ServerConfig, create_app
    from calexec.drivers.tools.chaos import chaos_executor

    executor = chaos_executor(tmp_path)
    emu = executor.device.emu
    calbin = executor.gen.calbin_path
    app = create_app(executor, ServerConfig(admin_token=ADMIN))
    try:
        with ServeLikeServer(app) as server, httpx.Client(base_url=server.url,
                                                          timeout=60) as http:
            assert _device_faults(http.get("/metrics").text) == {}
            # the switch's first buffer map is refused; the configure after the reset maps
            assert emu.set_fault(Fault.MAP_FAIL, FaultMode.NTH, 1, 0, 0) == 0
            answer = http.post("/admin/reload", json={"calbin": calbin},
                               headers={"Authorization": f"Bearer {ADMIN}"})
            emu.clear_all_faults()
            assert answer.status_code == 200, answer.text
            assert http.get("/ready").status_code == 200
            faults = _device_faults(http.get("/metrics").text)
    finally:
        emu.clear_all_faults()
        executor.shutdown(5.0)
    assert faults == {("device", "calrt.map_failed", "24"): 1.0}, faults
    assert executor.recoveries[-1]["refused"] == ["calrt.map_failed"], executor.recoveries[-1]


#: the child of the interrupt test: ``calexec diagrams live`` whose warm-up (the start's golden
#: run) says so on stderr and waits on stdin, where the parent's SIGINT finds it
WARM_UP_BARRIER = """
import sys
from calexec.machines.device_lifecycle import DeviceLifecycle
real = DeviceLifecycle.warm_up
def warm_up(self):
    sys.stderr.write("probe72: warming up\\n")
    sys.stderr.flush()
    sys.stdin.readline()  # (the barrier: the parent's SIGINT ends it)
    return real(self)
DeviceLifecycle.warm_up = warm_up
from calexec import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def _read_until(stream, marker: str, timeout: float) -> str:
    """What ``stream`` (a pipe's binary file) gave until a line holding ``marker``, or
    until ``timeout`` seconds passed (the caller asserts the marker)."""
    seen = b""
    end = time.monotonic() + timeout
    while marker.encode() not in seen and time.monotonic() < end:
        ready, _, _ = select.select([stream], [], [], max(0.0, end - time.monotonic()))
        if not ready:
            break
        chunk = os.read(stream.fileno(), 4096)
        if not chunk:
            break
        seen += chunk
    return seen.decode(errors="replace")


def _interrupted_in_warm_up(argv: list[str], cwd, env: dict[str, str] | None = None
                            ) -> tuple[int, bytes, str]:
    """``calexec ARGV`` in a child whose executor's warm-up stops at a barrier, where a SIGINT
    (a Ctrl-C) lands: (exit code, stdout, stderr). Every wait bounded."""
    env = dict(os.environ if env is None else env)
    env.pop("CALEXEC_DEBUG", None)
    child = subprocess.Popen([sys.executable, "-W", "always::ResourceWarning", "-c",
                              WARM_UP_BARRIER, *argv], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd)
    try:
        before = _read_until(child.stderr, "probe72: warming up", 120)
        assert "probe72: warming up" in before, before
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    return child.returncode, out, before + err.decode(errors="replace")


def test_diagrams_live_interrupted_in_its_warm_up_shuts_its_executor_down(tmp_path):
    """``calexec diagrams live`` interrupted (Ctrl-C) while its executor warmed up (the start's
    golden run, before the server and the load) left the executor as it was: never shut
    down, its device open and its threads running until the interpreter's exit (the
    ``ResourceWarning`` "was never shut down" at exit), since only the load after the start
    was in the ``try`` whose ``finally`` shuts it down. It now shuts down on every way out:
    exit 130, one line, no warning. (Chromium is never reached: a stand-in on PATH.)"""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "chromium").write_text("#!/bin/sh\nexit 1\n")
    (fake / "chromium").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ.get('PATH', '')}"}
    code, out, err = _interrupted_in_warm_up(
        ["diagrams", "live", "--out", str(tmp_path / "live.png"), "--job-out", "",
         "--seconds", "1", "--clients", "1"], tmp_path, env)
    assert code == 130, (code, err)
    assert "never shut down" not in err, err
    assert "Traceback" not in err, err
    assert out == b""
    assert not (tmp_path / "live.png").exists()


@pytest.mark.parametrize("argv", [
    ["bench", "recovery", "--json", "--recoveries", "1"],
    ["bench", "pingpong", "--json", "--seqs", "1", "--tokens", "2", "--solo-tokens", "2"],
    ["serve", "--once", "--port", "0"],
], ids=lambda argv: "-".join(argv[:2]))
def test_a_command_interrupted_in_its_executors_warm_up_shuts_it_down(tmp_path, argv):
    """Every command that starts an executor (``serve``, ``bench``, ``accept``, ``golden
    record``, ...) interrupted while its start warmed up left it unshut as ``diagrams live``
    did: ``DeviceExecutor.start()`` raised the KeyboardInterrupt with the lifecycle Warming,
    its threads running and its device open, and the caller, given no executor state to act
    on, shut nothing down (most called ``start()`` before their ``try``). A start that an
    exception its barrier does not take (KeyboardInterrupt, SystemExit) ends now shuts the
    executor down before it raises it."""
    code, out, err = _interrupted_in_warm_up(argv, tmp_path)
    assert code == 130, (code, err)
    assert "never shut down" not in err, err
    assert "Traceback" not in err, err
    assert [line for line in err.splitlines()
            if line.strip() and not line.startswith(("probe72:", "INJECTED"))] == [
        f"calexec {' '.join(argv[:2]) if argv[0] == 'bench' else argv[0]}: interrupted"], err


# ---- one line naming the flag, its value and what to give -----------------------------------
ORDER_WORKFLOW = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "examples", "charts", "order_workflow.py")
CHART = "order_workflow:OrderWorkflow"

#: (command line, what its one line says besides the command's name), each exit 2
MESSAGES = {
    "mutate-test-cmd-dash": (
        ["charts", "mutate", "--chart", CHART, "--test-cmd", "-"],
        ["--test-cmd='-': '-' is no program", "give the command that tests the chart"]),
    "cover-command-dash": (
        ["charts", "cover", "--chart", CHART, "--", "-"],
        ["test command '-': '-' is no program", "give it after `--`"]),
    "cover-test-cmd": (
        ["charts", "cover", "--chart", CHART, "--test-cmd", "python -m pytest"],
        ["--test-cmd: charts cover takes no --test-cmd", "give the test command after `--`"]),
    "windows-path-no-file": (
        ["charts", "draw", "orders\\workflow.py:X"],
        ["'orders\\\\workflow.py' is a Windows path", "no file orders/workflow.py",
         "e.g. orders.workflow:X"]),
    "windows-path-of-a-file": (
        ["charts", "mutate", "--chart", "shop\\orders.py:OrderWorkflow", "--test-cmd", "true"],
        ["--chart='shop\\\\orders.py:OrderWorkflow': 'shop\\\\orders.py' is a Windows path",
         "the file shop/orders.py is there", "e.g. shop.orders:OrderWorkflow"]),
    "equivalent-not-toml": (
        ["charts", "mutate", "--chart", CHART, "--test-cmd", "true", "--equivalent", "passwd"],
        ["--equivalent='", "/passwd': not TOML (", "give a TOML file of [[mutant]] tables"]),
    "equivalent-other-toml": (
        ["charts", "mutate", "--chart", CHART, "--test-cmd", "true", "--sample", "1",
         "--equivalent", "pyproject.toml"],
        ["--equivalent='", "/pyproject.toml': no list of equivalent mutants (it has 'project'",
         "give a TOML file of [[mutant]] tables"]),
    "help-value": (
        ["--help=1"], ["argument --help: ", "--help is a switch and takes no value: give "
                                           "--help alone"]),
    "command-help-value": (
        ["demo", "--help=1"], ["argument --help: ", "give --help alone"]),
}


@pytest.mark.parametrize("case", list(MESSAGES))
def test_bad_input_is_one_line_naming_the_flag_its_value_and_what_to_give(
        tmp_path, monkeypatch, capsys, case):
    """``charts mutate --test-cmd -`` ran ``-`` (``cannot run '-': No such file or
    directory``), ``charts cover -- -`` too, and ``charts cover --test-cmd CMD`` was
    ``unrecognized arguments``; a chart named by a Windows path (``orders\\workflow.py:X``)
    was told to write ``orders\\workflow:X``, a module name no import takes; ``--equivalent``
    given a file that is not TOML said only the parser's ``Expected '=' after a key``, and a
    TOML file of another kind (pyproject.toml) was taken as an empty list; ``--help=1`` was
    argparse's ``argument -h/--help: ignored explicit argument '1'``. Each is now one line
    naming the flag and its value and what to give, exit 2."""
    from calexec import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "order_workflow.py").write_text(open(ORDER_WORKFLOW, encoding="utf-8").read())
    (tmp_path / "shop").mkdir()
    (tmp_path / "shop" / "orders.py").write_text((tmp_path / "order_workflow.py").read_text())
    (tmp_path / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "shop"\n')
    argv, says = MESSAGES[case]
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (code, err)
    assert out == ""
    assert len(err.splitlines()) == 1, err
    for part in says:
        assert part in err, (part, err)
