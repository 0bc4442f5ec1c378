"""Stop 74 (left): defects stop 73 found and left, each proven here.

* numbers a command reads itself (``bench soak --max-tokens LO-HI``, its ``--decode-us``
  phases, ``bench overhead --decode-us``, ``bench server --concurrency``, ``charts mutate
  --timeout``/``--error-codes``, a coverage gate's percentage, ``$CALEXEC_EXPLORE_WATCHDOG_S``,
  the load generator's flags) went through Python's ``int()``/``float()``, which read ``1_0``
  as 10 and ``٣`` (an Arabic-Indic digit) as 3, where every other number of the command line
  is refused unless written in ASCII digits;
* a Responses ``function_call_output`` whose ``call_id`` names no ``function_call`` was taken
  (OpenAI answers it 400 "No tool call found for function call output with call_id ...");
* ``charts cover`` imported every chart in every Python process of the test command, so a
  chart module starting a thread that is no daemon as it is imported hung each process that
  never used the chart (a helper a test runs), and the test command with it;
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

#: what Python's int() and float() read that the command line does not: an underscore between
#: digits, and a Unicode digit that is not ASCII (ARABIC-INDIC DIGIT THREE)
NOT_ASCII = ["1_0", "\u0663"]


def _cli(argv: list[str]) -> tuple[int, str, str]:
    from calexec import cli
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


# ---- 1. numbers a command reads itself, in ASCII digits ------------------------------------
@pytest.mark.parametrize("value", NOT_ASCII)
@pytest.mark.parametrize(("flag", "template"), [
    ("--max-tokens", "{v}"), ("--max-tokens", "4-{v}"), ("--max-tokens", "{v}-8"),
    ("--decode-us", "{v}"), ("--decode-us", "0,{v}"), ("--decode-us", "0:{v},2000"),
    ("--rss-bound-mib", "{v}"),
])
def test_bench_soak_refuses_a_number_not_in_ascii_digits_naming_flag_and_value(
        flag, template, value):
    """``bench soak --max-tokens 1_0-2_0`` ran requests of 10 to 20 tokens and
    ``--decode-us 0:٣`` gave the first phase a share of 3: refused before the run, exit 2, one
    line naming the flag and the value."""
    given = template.format(v=value)
    code, out, err = _cli(["bench", "soak", "--json", flag, given])
    assert code == 2 and out == "", (code, out, err)
    assert len(err.strip().splitlines()) == 1, err
    assert flag in err and (repr(given) in err or given in err), err


def test_bench_soak_still_takes_its_numbers_written_in_ascii():
    from calexec.drivers.tools.bench import soak
    assert soak.parse_range(" 4-8") == (4, 8)
    phases = soak.parse_phases("0:1.5, 2000:0.5")
    assert [(p.decode_us, p.share) for p in phases] == [(0, 0.75), (2000, 0.25)]


@pytest.mark.parametrize("value", NOT_ASCII)
@pytest.mark.parametrize("argv", [
    ["bench", "overhead", "--decode-us", "2000,{v}"],
    ["bench", "server", "--concurrency", "1,{v}"],
    ["charts", "mutate", "--timeout", "{v}"],
    ["charts", "mutate", "--error-codes", "3,{v}"],
    ["charts", "mutate", "--fail-under", "{v}"],
    ["charts", "cover", "--chart", "calexec.machines.charts:JobChart", "--min", "{v}", "--",
     "true"],
])
def test_every_list_or_percentage_a_command_reads_refuses_what_is_not_ascii(argv, value):
    """The comma lists and percentages a command parses itself took ``1_0`` and ``٣``;
    now refused as a flag's integer is, exit 2, one line naming the flag."""
    argv = [a.format(v=value) for a in argv]
    flag = next(a for a in argv if "{v}" not in a and a.startswith("--") and
                argv[argv.index(a) + 1].endswith(value))
    code, out, err = _cli(argv)
    assert code == 2 and out == "", (code, out, err)
    assert len(err.strip().splitlines()) == 1, err
    assert flag in err, err


@pytest.mark.parametrize("value", [*NOT_ASCII, "9\u0660", "5_0%"])
def test_a_coverage_gate_refuses_a_percentage_not_in_ascii_digits(value):
    """``--chart-coverage-min``, ``chart_coverage_min`` (pyproject), ``charts cover --min``
    and ``charts mutate --fail-under`` read ``1_0`` as 10 %."""
    from calexec.machines.coverage import gate_percentage
    assert gate_percentage(value) is None
    assert gate_percentage(" 90 % ") == 90.0 and gate_percentage("1e1") == 10.0


@pytest.mark.parametrize("value", NOT_ASCII)
def test_the_explorer_watchdog_variable_refuses_a_number_not_in_ascii(monkeypatch, value):
    from calexec.drivers.tools import explore
    monkeypatch.setattr(explore, "WATCHDOG_S", None)
    monkeypatch.setenv(explore.WATCHDOG_ENV, value)
    with pytest.raises(ValueError, match=rf"^{explore.WATCHDOG_ENV}="):
        explore.watchdog_s()
    monkeypatch.setenv(explore.WATCHDOG_ENV, " 120 ")
    assert explore.watchdog_s() == 120.0


@pytest.mark.parametrize("value", NOT_ASCII)
@pytest.mark.parametrize("argv", [
    ["--url", "http://127.0.0.1:1", "--requests", "{v}", "--concurrency", "1",
     "--max-tokens", "1"],
    ["--url", "http://127.0.0.1:1", "--requests", "1", "--concurrency", "1",
     "--max-tokens", "1", "--warmup", "{v}"],
])
def test_the_load_generator_refuses_a_count_not_in_ascii(argv, value, capsys):
    """``python -m calexec.drivers.tools.bench.loadgen`` (docs/benchmarks.md) read its counts
    with ``int()``."""
    from calexec.drivers.tools.bench import loadgen
    with pytest.raises(SystemExit) as exc:
        loadgen.main([a.format(v=value) for a in argv])
    assert exc.value.code == 2
    assert "not an integer" in capsys.readouterr().err


def test_the_api_floor_refuses_seconds_not_in_ascii(capsys):
    from calexec.drivers.tools.bench import api_floor
    with pytest.raises(SystemExit) as exc:
        api_floor.main(["--socket", "/nonexistent", "--max-seconds", "1_0"])
    assert exc.value.code == 2
    assert "--max-seconds" in capsys.readouterr().err


# ---- 2. a Responses function_call_output answering no call ---------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import needs
    needs.module("httpx", "server")
    from test_server_support import openai_server

    with openai_server(tmp_path_factory.mktemp("left74")) as (live, _, _):
        yield live.url


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    import httpx
    answer = httpx.post(f"{url}{path}", json=body, timeout=60)
    return answer.status_code, answer.json()


USER = {"role": "user", "content": "add 1 and 2"}
CALL = {"type": "function_call", "call_id": "call_1", "name": "add",
        "arguments": '{"a": 1, "b": 2}'}
TOOLS = [{"type": "function", "name": "add", "parameters": {"type": "object"}}]


@pytest.mark.parametrize(("items", "index"), [
    ([USER, {"type": "function_call_output", "call_id": "call_1", "output": "3"}], 1),
    ([USER, CALL, {"type": "function_call_output", "call_id": "call_1", "output": "3"},
      {"type": "function_call_output", "call_id": "call_2", "output": "4"}], 3),
])
def test_a_function_call_output_naming_no_call_is_refused_as_openai_refuses_it(
        server, items, index):
    """An output whose ``call_id`` no ``function_call`` item of the input has (an agent that
    dropped the call item, a mistyped id) was answered, the model reading a tool's answer to
    a call it never made; OpenAI refuses it, 400 ``No tool call found for function call
    output with call_id ...``: so does this server, naming the item (``previous_response_id``
    is refused here, nothing is stored, so the input is where the call must be)."""
    code, answer = _post(server, "/v1/responses", {"input": items, "tools": TOOLS,
                                                   "max_output_tokens": 2})
    assert code == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == f"input.{index}.call_id"
    assert error["message"].startswith(f"input[{index}].call_id=")
    assert "No tool call found for function call output with call_id" in error["message"]


def test_a_function_call_output_with_its_call_is_still_answered(server):
    code, answer = _post(server, "/v1/responses", {
        "input": [USER, CALL, {"type": "function_call_output", "call_id": "call_1",
                               "output": "3"}], "tools": TOOLS, "max_output_tokens": 2})
    assert code == 200, answer


# ---- 3. charts cover and a chart module starting a thread as it is imported ---------------
BEATING = """
import threading

from statemachine import State, StateChart


class Beat(StateChart):
    idle = State(initial=True)
    busy = State()
    go = idle.to(busy)
    back = busy.to(idle)


STOP = threading.Event()
# a heartbeat that is no daemon (it ends by itself after a while: a bounded test)
threading.Thread(target=STOP.wait, args=(90,), name="heartbeat").start()
"""

DRIVE = """
import subprocess, sys
import beat74
machine = beat74.Beat()
machine.send("go")
helper = subprocess.run([sys.executable, "-c", "print(42)"], capture_output=True, text=True,
                        timeout=60)
beat74.STOP.set()
sys.exit(0 if helper.stdout == "42\\n" else 3)
"""


def _cover(cwd: Path, *command: str) -> tuple[int, str, str]:
    """``calexec charts cover --chart beat74:Beat -- COMMAND`` as a user runs it, in a
    process group of its own that is killed if it has not ended in 60 s."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(cwd), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "calexec", "charts", "cover", "--chart",
                             "beat74:Beat", "--", *command], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"charts cover did not end in 60 s (a process of the command waited for "
                    f"the chart module's thread): {out} {err}")
    return proc.returncode, out, err


def test_cover_does_not_import_the_chart_in_a_process_that_never_uses_it(tmp_path):
    """A chart module starting a heartbeat thread (no daemon) as it is imported: under
    ``charts cover`` every Python process of the command imported it at start-up, so a
    helper process a test runs (``python -c 'print(42)'``) never exited, nor the command
    (docs/framework.md said to make the thread a daemon). Now only a process that imports the
    chart's module tracks it, once it has: the helper runs as without ``charts cover``."""
    (tmp_path / "beat74.py").write_text(textwrap.dedent(BEATING), encoding="utf-8")
    (tmp_path / "drive74.py").write_text(textwrap.dedent(DRIVE), encoding="utf-8")
    code, out, err = _cover(tmp_path, sys.executable, "drive74.py")
    assert code == 0, (out, err)
    assert "transition coverage Beat: 1/2 (50.0 %)" in out, out
    assert "untaken: busy --back--> idle" in out, out


def test_cover_of_a_command_that_never_imports_the_chart_says_so(tmp_path):
    (tmp_path / "beat74.py").write_text(textwrap.dedent(BEATING), encoding="utf-8")
    code, out, err = _cover(tmp_path, sys.executable, "-c", "print(42)")
    assert code == 2 and out == "42\n", (out, err)
    assert ("calexec charts cover: no process of the command imported module 'beat74', which "
            "declares beat74:Beat") in err, err
