"""The ``calexec`` console script: the argparse front, help with defaults, "did you mean",
one-line user errors with their documented exit codes (never a traceback), the one-line
``pip install`` of a missing extra, progress lines in a log, and ``--served-model-name``.

User errors run ``python -m calexec`` in a child process: what a user sees on stderr is
checked whole, and a command's process-wide settings (GIL interval, malloc) stay out of this
process."""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from calexec import __version__, cli, cliargs
from calexec.drivers.tools.accept.gate_rig import Progress

TIMEOUT_S = 120


def calexec(*argv: str, pre: str = "", timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """``calexec ARGV`` in a child; ``pre`` is Python run first (e.g. to block an extra)."""
    code = f"{pre}\nimport sys\nfrom calexec.cli import main\nsys.exit(main({list(argv)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr and len(lines) == 1, stderr
    return lines[0]


# ---- the front -------------------------------------------------------------------------------
def test_every_command_resolves_to_a_main():
    for name, command in cli.COMMANDS.items():
        assert callable(importlib.import_module(command.module).main), name
        assert command.help and command.extra in (None, "server", "plots", "ray")


def test_help_version_and_unknown_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in cli.COMMANDS) and "exit codes" in out
    assert cli.main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"calexec {__version__}"
    assert cli.main([]) == 2 and "usage: calexec" in capsys.readouterr().err
    assert cli.main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, suggestion", [
    (["serv"], "did you mean 'serve'?"),
    (["acept", "--quick"], "did you mean 'accept'?"),
    (["bench", "overheda"], "did you mean 'bench overhead'?"),
    (["sim", "write-calbn", "x"], "did you mean 'sim write-calbin'?"),
])
def test_mistyped_command_gets_a_suggestion(argv, suggestion, capsys):
    assert cli.main(argv) == 2
    assert suggestion in one_line(capsys.readouterr().err)


def test_mistyped_flag_gets_a_suggestion(capsys):
    assert cli.main(["demo", "--seqs", "2", "--tokns", "3"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("calexec demo: error:") and "did you mean --tokens?" in line


def test_group_word_lists_its_subcommands(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"bench {w}" in out for w in ("charts", "overhead", "logits", "recovery",
                                               "pingpong", "server"))


def _parsers(monkeypatch) -> dict[str, argparse.ArgumentParser]:
    """Each command's own parser, captured at parse time (the command never runs)."""
    seen: dict[str, argparse.ArgumentParser] = {}

    class Captured(Exception):
        pass

    def capture(self, args=None, namespace=None):
        seen[current] = self
        raise Captured

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    for current in cli.COMMANDS:
        words = current.split()
        with pytest.raises(Captured):
            importlib.import_module(cli.COMMANDS[current].module).main(
                [*words, *(["PATH"] if current == "sim write-calbin" else [])])
    return seen


def test_every_flag_of_every_command_has_help_and_shows_its_default(monkeypatch):
    parsers = _parsers(monkeypatch)
    assert set(parsers) == set(cli.COMMANDS)
    for name, parser in parsers.items():
        for action in parser._actions:
            assert action.help, f"calexec {name}: {action.option_strings or action.dest} has no help"
        text = parser.format_help()
        for action in parser._actions:
            if action.option_strings and not cliargs.default_unshown(action.default):
                assert "default" in (action.help or "") or "(default:" in text, (name, action.dest)
    serve_help = parsers["serve"].format_help()
    for flag in ("--manifest", "--calbin", "--runtime-lib", "--reset-kind", "--conform-report",
                 "--served-model-name"):
        assert flag in serve_help
    assert "(default: 127.0.0.1)" in serve_help and "(default: 30.0)" in serve_help
    for name in ("demo", "accept", "bench overhead", "bench recovery", "bench pingpong",
                 "bench server"):
        text = parsers[name].format_help()
        assert all(f in text for f in ("--manifest", "--calbin", "--runtime-lib")), name
    assert "--calbin" in parsers["conform"].format_help()
    assert "--runtime-lib" in parsers["conform"].format_help()


# ---- user errors: one line naming the offender, exit 2 (configuration) ------------------------
def _not_a_dir(tmp_path: Path) -> str:
    (tmp_path / "file").write_text("x")
    return str(tmp_path / "file" / "out")


def _bad_manifest(tmp_path: Path) -> str:
    path = tmp_path / "bad.toml"
    path.write_text('name = "m"\ncalrt_version = "0.7.6"\nvocab_size = -3\nhidden_size = 64\n')
    return str(path)


@pytest.mark.parametrize("argv, named", [
    (["serve", "--runtime-lib", "/nonexistent"], "--runtime-lib='/nonexistent': no such file"),
    (["serve", "--port", "70000"], "70000 is not a TCP port"),
    (["sim", "write-calbin", "/nonexistent/x"], "cannot write '/nonexistent/x'"),
    (["diagrams", "--out", "{not_a_dir}"], "--out="),
    (["serve", "--once", "--device-config", "decode_us=5;kv_blockz=4"], "kv_blockz='4' refused"),
    (["serve", "--device-config", "kv_blocks"], "item 'kv_blocks' is not key=value"),
    (["serve", "--timeout", "601"], "--timeout=601: above the server's largest request deadline"),
    (["serve", "--manifest", "{bad_manifest}"], "submodel: missing required key"),
    (["serve", "--reset-kind", "reset", "--conform-report", "/nonexistent"], "not both"),
    (["serve", "--conform-report", "/nonexistent"], "/nonexistent"),
    (["demo", "--calbin", "/nonexistent/c.calbin"], "--calbin='/nonexistent/c.calbin'"),
    (["demo", "--manifest", "/nonexistent.toml"], "--manifest='/nonexistent.toml'"),
    (["accept", "--runtime-lib", "/nonexistent"], "--runtime-lib='/nonexistent'"),
    (["bench", "overhead", "--runtime-lib", "/nonexistent"], "--runtime-lib='/nonexistent'"),
    (["conform", "--runtime-lib", "/nonexistent"], "--runtime-lib='/nonexistent': does not exist"),
    (["accept", "--soak-seconds", "inf"], "--soak-seconds"),
    # issue 24 item 7: keys no request could ever match (headers are latin-1, clients ASCII)
    (["serve", "--once", "--api-key", "caf\u00e9-key"], "--api-key has U+00E9 at character 4"),
    (["serve", "--once", "--api-key", "k\x07ey"], "--api-key has U+0007 at character 2"),
    (["serve", "--once", "--api-key", " key"], "--api-key starts or ends with whitespace"),
    # issue 24 item 7: refused before the executor starts (it used to start, then exit 3)
    (["serve", "--host", "256.1.1.1"], "--host='256.1.1.1': not an IPv4 address"),
    (["serve", "--host", "192.0.2.7"], "--host='192.0.2.7' --port=8000: cannot listen there"),
    # issue 24 item 7: ids 3..6 would each get a 400 blaming the client for a server setting
    (["serve", "--once", "--device-config", "max_seqs=3", "--max-sequences", "6"],
     "--max-sequences=6: the device's KvManager takes sequence ids 0..2 (max_seqs=3"),
])
def test_user_errors_are_one_line_naming_the_offender_exit_2(argv, named, tmp_path):
    argv = [a.format(not_a_dir=_not_a_dir(tmp_path), bad_manifest=_bad_manifest(tmp_path))
            for a in argv]
    done = calexec(*argv)
    line = one_line(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert line.startswith(f"calexec {cli.lookup(argv)}:") and named in line, line


@pytest.mark.parametrize("text, named", [
    ("caf\u00e9\n", "has U+00E9 at character 4"),
    ("  \n", "is empty"),
])
def test_an_admin_token_file_no_request_could_match_is_refused_exit_2(tmp_path, text, named):
    """A token that can never match a request's header (non-ASCII: headers arrive latin-1)
    locked every admin request out with 401/403; refused before the executor starts, naming
    the file (the file's outer whitespace, its line end, is not part of the token)."""
    path = tmp_path / "token"
    path.write_text(text, encoding="utf-8")
    done = calexec("serve", "--once", "--admin-token-file", str(path))
    line = one_line(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert line.startswith(f"calexec serve: --admin-token-file={str(path)!r}") \
        and named in line, line


def test_a_port_in_use_is_named_before_the_executor_starts_exit_2():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = calexec("serve", "--port", str(port), "--log-level", "info")
    line = one_line(done.stderr)  # nothing logged: the executor never started
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert line.startswith(f"calexec serve: --host='127.0.0.1' --port={port}: cannot listen"), line


@pytest.mark.parametrize("line, bad, named", [
    ("input input_ids S32 1 1,40960", "input input_ids X32 1 1,40960",
     "line 9: tensor 'input_ids': dtype 'X32' is not one of U8, S32, F32, BF16, F16, S64"),
    ("input positions S32 0 1,1", "input positions F32 0 1,1",
     "model 'qwen3_decode_s40960_b1' tensor 'positions': dtype F32, the emulator executes S32"),
])
def test_a_calbin_with_a_bad_dtype_is_refused_naming_it(tmp_path, line, bad, named):
    """Issue 24 item 7: the emulator refuses such a calbin with 19 (INVALID_CALBIN) alone; the
    refusal now names the tensor and its dtype (exit 3: the executor did not start)."""
    from calexec.drivers.synthetic import calbin

    path = tmp_path / "bad.calbin"
    text = calbin.dumps(calbin.default_spec()).decode()
    assert line in text
    path.write_text(text.replace(line, bad, 1))
    done = calexec("serve", "--once", "--calbin", str(path), "--allow-unpinned-golden")
    assert done.returncode == 3, (done.returncode, done.stderr)
    assert named in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_library_that_is_not_one_is_named_exit_2(tmp_path):
    fake = tmp_path / "libfake.so"
    fake.write_bytes(b"not an ELF")
    # any free port: the bind comes first (its "cannot listen there" would hide the library's
    # refusal when another process holds 8000, as it did on CI's host)
    done = calexec("serve", "--port", "0", "--runtime-lib", str(fake))
    assert done.returncode == 2 and f"--runtime-lib='{fake}': cannot load" in one_line(done.stderr)


def test_an_unexpected_exception_is_one_line_exit_70(monkeypatch, capsys):
    module = importlib.import_module(cli.COMMANDS["demo"].module)
    monkeypatch.setattr(module, "main", lambda argv: 1 / 0)
    assert cli.main(["demo"]) == 70
    line = one_line(capsys.readouterr().err)
    assert "internal error: ZeroDivisionError" in line and "CALEXEC_DEBUG=1" in line


# ---- optional extras: the core works without them, a command that needs one says so ----------
BLOCK_EXTRAS = """
import sys
class _Block:
    BLOCKED = ("fastapi", "uvicorn", "prometheus_client", "starlette", "matplotlib", "tqdm", "ray")
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None
sys.meta_path.insert(0, _Block())
"""

#: modules that exist to serve HTTP or run Ray: the only ones allowed to need an extra
SERVER_ONLY = {"calexec.drivers.serving.server", "calexec.serve", "calexec.drivers.serving.metrics",
               "calexec.drivers.tools.bench.server_overhead", "calexec.drivers.fleet.ray_serve",
               "calexec.drivers.fleet.edge", "calexec.drivers.fleet.ingress",
               "calexec.drivers.tools.chaos", "calexec.drivers.tools.chaos_clients",
               "calexec.drivers.serving.openai_api", "calexec.drivers.serving.responses_api",
               "calexec.drivers.serving.resume", "calexec.drivers.serving.service",
               "calexec.drivers.serving.admin", "calexec.drivers.serving.debug",
               "calexec.drivers.serving.error_bodies", "calexec.drivers.serving.wire"}


def test_the_core_and_the_tools_import_without_any_extra():
    code = BLOCK_EXTRAS + """
import importlib, pkgutil, json
import calexec, calexec.contracts, calexec.machines, calexec.drivers
failed = {}
for pkg in (calexec, calexec.contracts, calexec.machines, calexec.drivers):
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError as exc:
            failed[info.name] = str(exc)
print(json.dumps(failed))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    failed = json.loads(done.stdout)
    assert set(failed) <= SERVER_ONLY, failed
    assert "calexec.machines.executor" not in failed


def test_a_command_without_its_extra_prints_the_pip_line_exit_2(tmp_path):
    serve = calexec("serve", "--once", pre=BLOCK_EXTRAS)
    assert serve.returncode == 2
    assert one_line(serve.stderr) == ("calexec serve: needs the optional [server] extra: "
                                      "pip install 'calexec[server]'")
    report = calexec("accept", "--gates", "lengths", "--report", str(tmp_path), pre=BLOCK_EXTRAS)
    assert report.returncode == 2 and "pip install 'calexec[plots]'" in one_line(report.stderr)
    demo = calexec("demo", "--seqs", "1", "--tokens", "2", pre=BLOCK_EXTRAS)
    assert demo.returncode == 0 and "oracle match: yes" in demo.stdout, demo.stderr


# ---- progress in a log file ------------------------------------------------------------------
def test_progress_into_a_log_is_plain_periodic_lines():
    now = [0.0]
    log = io.StringIO()  # not a TTY
    progress = Progress(2, stream=log, every_s=10.0, clock=lambda: now[0])
    for gate in ("correctness_a", "lengths_a"):
        for step in range(1000):  # 100 s of steps, one every 0.1 s
            progress.update(gate, step, 1000)
            now[0] += 0.1
        progress.gate_done()
    progress.close()
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert 10 <= len(lines) <= 24, lines  # one per 10 s, plus one per gate
    assert lines[-1] == "[accept] 100.0% lengths_a done (2/2 gates)"
    assert all(line.startswith("[accept] ") for line in lines)


# ---- serve: --served-model-name ----------------------------------------------------------------
def test_served_model_name_is_what_the_api_reports():
    done = calexec("serve", "--once", "--served-model-name", "my-model")
    assert done.returncode == 0, done.stderr
    assert '"model": "my-model"' in done.stdout


def test_output_cut_short_by_the_reader_is_not_an_internal_error():
    """``calexec charts paths ... | head -1``: the reader closing the pipe ends the command
    quietly with 141 (as a process killed by SIGPIPE), not "internal error: BrokenPipeError"."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "calexec", "charts", "paths", "calexec.machines.charts:JobChart"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader leaves before the command writes (it takes a second to start)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "internal error" not in err and "Traceback" not in err, err


# ---- bad-input sweep: odd environments and flag values ---------------------------------------
def _env_without(*names: str) -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k not in names}


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["sim", "-h"],
                                  ["demo", "--help"], ["--version"]])
def test_a_reader_gone_before_any_output_is_exit_141_without_a_traceback(argv):
    """``calexec ... | head -1`` with stdout block-buffered (no PYTHONUNBUFFERED, a user's
    shell): the failed flush at exit used to print "Exception ignored ... BrokenPipeError" and
    exit 120, and a group's help (``calexec bench --help``) a traceback. The read end is closed
    before the child starts, so every write fails."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "calexec", *argv], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=TIMEOUT_S,
                              env=_env_without("PYTHONUNBUFFERED"))
    finally:
        os.close(write_end)
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert done.returncode == 141, (done.returncode, done.stderr)


def _not_calrt_libraries(tmp_path: Path) -> list[str]:
    """A file that is no shared library, and a real one without calrt.h's symbols."""
    import _ctypes

    text = tmp_path / "libtext.so"
    text.write_text("not an ELF\n")
    return [str(text), _ctypes.__file__]


#: the smallest runs of the commands that open a device (they fail at the library's load)
DEVICE_COMMANDS = [
    ["demo", "--seqs", "1", "--tokens", "1"],
    ["sim", "bench", "--iters", "1", "--profile-iters", "1"],
    ["bench", "overhead", "--tokens", "1", "--runs", "1", "--zero-tokens", "1", "--no-floor",
     "--decode-us", "1"],
    ["bench", "recovery", "--recoveries", "1"],
    ["bench", "pingpong", "--seqs", "1", "--tokens", "1", "--solo-tokens", "1"],
]


@pytest.mark.parametrize("argv", DEVICE_COMMANDS, ids=lambda argv: " ".join(argv[:2]))
def test_a_runtime_lib_that_cannot_load_is_named_exit_2_on_every_command(argv, tmp_path):
    """The library is dlopen'ed after the flags are checked; its DeviceSpecError used to be an
    internal error (exit 70: demo, sim bench) or a failed check (exit 1: bench *)."""
    for lib in _not_calrt_libraries(tmp_path):
        done = calexec(*argv, "--runtime-lib", lib)
        line = one_line(done.stderr)
        assert done.returncode == 2, (argv, lib, done.returncode, done.stderr)
        assert f"--runtime-lib='{lib}': cannot load" in line, line


def test_calexec_calrt_lib_that_cannot_load_is_named_exit_2(tmp_path):
    lib = _not_calrt_libraries(tmp_path)[0]
    code = (f"import os, sys\nos.environ['CALEXEC_CALRT_LIB'] = {lib!r}\n"
            "from calexec.cli import main\nsys.exit(main(['demo', '--seqs', '1']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 2, done.stderr
    assert f"$CALEXEC_CALRT_LIB='{lib}': cannot load" in one_line(done.stderr)


@pytest.mark.parametrize("argv, named", [
    # numpy's default_rng refuses a negative seed: it was an internal error (exit 70)
    (["bench", "logits", "--iters", "1", "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["bench", "overhead", "--tokens", "1", "--runs", "1", "--zero-tokens", "1", "--no-floor",
      "--decode-us", "1", "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["bench", "recovery", "--recoveries", "1", "--seed", "-1"], "argument --seed: must be >= 0"),
    # the emulator refused the device config: exit 3 and two lines, the flag not named
    (["demo", "--seqs", "1", "--decode-us", "-5"], "argument --decode-us: must be in 0..60000000 us, got -5"),
])
def test_a_negative_count_is_refused_at_parse_time_exit_2(argv, named):
    done = calexec(*argv)
    line = one_line(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert named in line, line


@pytest.fixture
def synthetic_calbin(tmp_path: Path) -> str:
    from calexec.drivers.synthetic import calbin

    path = tmp_path / "synthetic.calbin"
    calbin.write(str(path), calbin.default_spec())
    return str(path)


@pytest.mark.parametrize("extra, named", [
    # were internal errors (exit 70), the last two after the warm-up had run
    (["--runtime-lib", "{not_calrt}"], "--runtime-lib='{not_calrt}': cannot load"),
    (["--out", "{tmp}"], "--out='{tmp}': "),
    (["--out", "{not_toml}"], "--out='{not_toml}': "),
    # was exit 1, "executor did not start", the flag not named
    (["--device-config", "decode_us=-1"], "--device-config: decode_us='-1' refused"),
])
def test_golden_record_bad_flags_are_one_line_exit_2(extra, named, synthetic_calbin, tmp_path):
    not_toml = tmp_path / "goldens.toml"
    not_toml.write_text("this is not TOML\n")
    values = {"not_calrt": _not_calrt_libraries(tmp_path)[1], "tmp": str(tmp_path),
              "not_toml": str(not_toml)}
    extra = [a.format(**values) for a in extra]
    done = calexec("golden", "record", "--calbin", synthetic_calbin, *extra)
    line = one_line(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert line.startswith("calexec golden record: ") and named.format(**values) in line, line
    assert not_toml.read_text() == "this is not TOML\n"


@pytest.mark.parametrize("argv, named", [
    # the KvManager refused iters + 1 tokens mid-run: internal error (exit 70)
    (["--iters", "1", "--profile-iters", "40960"], "--profile-iters: must be in 1..40959, got 40960"),
    (["--iters", "40960", "--profile-iters", "1"], "--iters: must be in 1..40959, got 40960"),
    # calbin_load refused it: 'internal error: DriverError ... code 12' (exit 70)
    (["--iters", "1", "--profile-iters", "1", "--calbin", "{not_calbin}"],
     "--calbin='{not_calbin}': "),
])
def test_sim_bench_bad_flags_are_one_line_exit_2(argv, named, tmp_path):
    not_calbin = tmp_path / "x.calbin"
    not_calbin.write_text("not a calbin\n")
    argv = [a.format(not_calbin=not_calbin) for a in argv]
    done = calexec("sim", "bench", *argv)
    line = one_line(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert named.format(not_calbin=not_calbin) in line, line


@pytest.mark.parametrize("argv, named", [
    # sequence ids past the KvManager's max_seqs (64): pingpong exited 1 with a 120 kB line (one
    # failed reset per id), demo 1 with "prefill failed: kv.seq_id_out_of_range"
    (["bench", "pingpong", "--seqs", "63", "--tokens", "1", "--solo-tokens", "1"],
     "--seqs=63: the device's KvManager takes sequence ids 0..63"),
    (["demo", "--seqs", "64", "--tokens", "1"],
     "--seqs=64: the device's KvManager takes sequence ids 0..63"),
    # written after the whole run: internal error (exit 70)
    (["bench", "pingpong", "--seqs", "1", "--tokens", "1", "--solo-tokens", "1", "--trace",
      "{tmp}"], "--trace='{tmp}': "),
    (["bench", "pingpong", "--seqs", "1", "--tokens", "1", "--solo-tokens", "1", "--trace",
      "{tmp}/no/trace.json"], "--trace='{tmp}/no/trace.json': "),
])
def test_sequence_and_trace_flags_are_one_line_exit_2(argv, named, tmp_path):
    argv = [a.format(tmp=tmp_path) for a in argv]
    done = calexec(*argv)
    line = one_line(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stderr[:2000])
    assert named.format(tmp=tmp_path) in line, line


def test_conform_with_a_library_that_is_not_calrt_is_exit_2(tmp_path):
    """A directory, a text file, a real .so without calrt.h's symbols: the run used to go on,
    every question 'inconclusive', exit 0 with a list of 'safe settings'."""
    text_file, not_calrt = _not_calrt_libraries(tmp_path)
    for lib, named in ((str(tmp_path), f"'{tmp_path}': not a regular file"),
                       (text_file, f"--lib='{text_file}': cannot load it: "),
                       (not_calrt, f"--lib='{not_calrt}': cannot load it: ")):
        done = calexec("conform", "--quick", "--only", "parallel", "--lib", lib)
        line = one_line(done.stderr)
        assert done.returncode == 2, (lib, done.returncode, done.stderr)
        assert line.startswith("calexec conform: ") and named in line, line


@pytest.mark.parametrize("argv, named", [
    # said "[Errno 2] No such file or directory: '...'" / "[Errno 21] Is a directory": no flag
    (["serve", "--admin-token-file", "{tmp}/none"], "--admin-token-file='{tmp}/none': "),
    (["serve", "--admin-token-file", "{tmp}"], "--admin-token-file='{tmp}': "),
    # "[Errno 17] File exists: '...'"
    (["serve", "--dump-dir", "{file}"], "--dump-dir='{file}': "),
    # "gil switch interval=-5 us: must be >= 0"
    (["serve", "--gil-switch-us", "-5"], "argument --gil-switch-us: must be in 0..1000000, "
                                         "got -5"),
    # "seed must be a u64, got -1", "hidden must be >= 1, got 0"
    (["sim", "write-calbin", "{tmp}/c.calbin", "--seed", "-1"], "argument --seed: "),
    (["sim", "write-calbin", "{tmp}/c.calbin", "--hidden", "0"], "argument --hidden: "),
    # "not a calbin: header is ..."
    (["accept", "--gates", "correctness", "--calbin", "{file}"], "--calbin='{file}': "),
    # "--lib '...' does not exist": conform's flag was not in cliargs' style
    (["conform", "--lib", "{tmp}/none.so"], "--lib='{tmp}/none.so': does not exist"),
    # served, exit 0: every response said "model": ""
    (["serve", "--once", "--served-model-name", " "], "--served-model-name=' ': "),
    (["serve", "--once", "--served-model-name", "qwen\n3"],
     "--served-model-name='qwen\\n3': must be printable"),
])
def test_a_bad_value_found_past_the_parser_still_names_its_flag(argv, named, tmp_path):
    file = tmp_path / "file"
    file.write_text("x\n")
    values = {"tmp": str(tmp_path), "file": str(file)}
    argv = [a.format(**values) for a in argv]
    done = calexec(*argv)
    line = one_line(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert line.startswith(f"calexec {cli.lookup(argv)}: ") and named.format(**values) in line, line


@pytest.mark.parametrize("argv, named", [
    # its own argparse parser: the usage line, then the error (two lines)
    (["bench", "charts", "--iters", "0"], "argument --iters: must be >= 1, got 0"),
    # argparse named the type function ("invalid positive_int value: 'x'"), not the problem
    (["bench", "charts", "--iters", "x"], "argument --iters: 'x' is not an integer"),
    (["bench", "pingpong", "--tokens", "1e9"], "argument --tokens: '1e9' is not an integer"),
    (["bench", "overhead", "--seed", "s"], "argument --seed: 's' is not an integer"),
    # a negative seed ran (random.Random takes one) where bench overhead's refuses it
    (["bench", "faults", "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["bench", "soak", "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["serve", "--port", "http"], "argument --port: 'http' is not an integer"),
    (["serve", "--grace", "soon"], "argument --grace: 'soon' is not a number"),
    # "invalid _u64 value: 'abc'" (the type function's name); sizes the emulator's loader
    # refuses were written, exit 0: a calbin every command then failed to load (exit 3)
    (["sim", "write-calbin", "/nonexistent/c.calbin", "--seed", "abc"],
     "argument --seed: 'abc' is not an integer"),
    (["sim", "write-calbin", "/nonexistent/c.calbin", "--hidden", "1000000000"],
     "argument --hidden: must be in 1..26843545, got 1000000000"),
    (["sim", "write-calbin", "/nonexistent/c.calbin", "--tile-d0", "7236677"],
     "argument --tile-d0: must be in 1..7236676, got 7236677"),
    # nan passed the '< 0' check: the whole soak ran, then its rss check failed (exit 1)
    (["bench", "soak", "--requests", "1", "--faults", "1", "--clients", "1", "--decode-us", "0",
      "--max-tokens", "1", "--rss-bound-mib", "nan"], "argument --rss-bound-mib: "),
    (["bench", "soak", "--requests", "1", "--faults", "1", "--clients", "1", "--decode-us", "0",
      "--max-tokens", "1", "--rss-bound-mib", "-1"], "argument --rss-bound-mib: must be >= 0"),
])
def test_bench_charts_and_soak_flags_are_one_line_exit_2(argv, named):
    done = calexec(*argv)
    line = one_line(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert line.startswith(f"calexec {cli.lookup(argv)}: error: ") and named in line, line


@pytest.mark.parametrize("size", ["hidden", "tile_d0"])
def test_write_calbins_largest_sizes_are_what_the_emulators_loader_takes(size, tmp_path):
    """``sim write-calbin``'s bounds are the emulator's (a tensor of at most 2**40 elements):
    the largest value loads, one more is refused by the loader as by the flag."""
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.drivers.synthetic import calbin

    largest = {"hidden": calbin.MAX_HIDDEN, "tile_d0": calbin.MAX_TILE_D0}[size]
    path = tmp_path / "c.calbin"
    path.write_bytes(calbin.dumps(calbin.default_spec(**{size: largest})))
    runtime = CalRT.load()
    assert not isinstance(runtime.inspect_calbin(str(path)), str)
    text = path.read_text()
    bigger = text  # (its meta line, and the dimension of the tensor it sizes)
    for before, after in ((f" {largest}\n", f" {largest + 1}\n"),
                          (f",{largest}\n", f",{largest + 1}\n"),
                          (f",{largest},", f",{largest + 1},")):
        bigger = bigger.replace(before, after)
    assert bigger != text
    path.write_text(bigger)
    assert "INVALID_CALBIN" in runtime.inspect_calbin(str(path))
    with pytest.raises(ValueError, match=size):
        calbin.default_spec(**{size: largest + 1})


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["--version"], ["sim", "write-calbin", "{tmp}/c.calbin"]])
def test_a_full_stdout_is_one_line_not_a_traceback(argv, tmp_path):
    """stdout on a full disk (``> /dev/full``), block-buffered: the flush at the end of the
    run used to fail after main returned ('Exception ignored ... OSError', exit 120)."""
    argv = [a.format(tmp=tmp_path) for a in argv]
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "calexec", *argv], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=TIMEOUT_S,
                              env=_env_without("PYTHONUNBUFFERED"))
    line = one_line(done.stderr)
    assert "Exception ignored" not in done.stderr
    assert done.returncode == 2 and "cannot write to stdout: No space left on device" in line, (
        done.returncode, done.stderr)


@pytest.mark.parametrize("argv", [["accept", "--gates", "lengths", "--phase", "a"],
                                  ["conform", "--quick", "--only", "parallel"]])
def test_a_report_directory_that_cannot_be_made_is_refused_before_the_run(argv, tmp_path):
    """``--report`` naming an existing file: the whole run went first (24 h for ``accept
    --full``), then 'cannot write the report' (accept, exit 2) or '[Errno 17] File exists'
    (conform, exit 1)."""
    file = tmp_path / "file"
    file.write_text("x\n")
    done = calexec(*argv, "--report", str(file))
    line = one_line(done.stderr)  # (no progress line: nothing ran)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert line.endswith(f"--report='{file}': not a directory"), line


@pytest.mark.parametrize("argv, flag", [
    (["diagrams", "--out", "{file}"], "--out"),
    (["diagrams", "--out", "{tmp}/out", "--png", "{file}"], "--png"),
    (["charts", "draw", "calexec.machines.charts:JobChart", "--out", "{file}"], "--out"),
    (["charts", "mutate", "--chart", "job", "--test-cmd", "true", "--report", "{file}"],
     "--report"),
    (["serve", "--once", "--dump-dir", "{file}"], "--dump-dir"),
])
def test_an_output_directory_that_is_a_regular_file_is_not_a_directory(argv, flag, tmp_path):
    """An output directory flag naming an existing regular file said the OS's 'File exists'
    (from makedirs; charts draw, diagrams: 'cannot write it: File exists'): one line naming
    the flag and its value, 'not a directory', exit 2, before anything is written."""
    file = tmp_path / "x.txt"
    file.write_text("x\n")
    argv = [a.format(tmp=tmp_path, file=file) for a in argv]
    done = calexec(*argv)
    line = one_line(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert line == f"calexec {cli.lookup(argv)}: {flag}='{file}': not a directory", line
    assert file.read_text() == "x\n"


def _unwritable_dump_dir(tmp_path: Path, how: str) -> Path:
    if how == "read-only directory":
        directory = tmp_path / "ro"
        directory.mkdir()
        directory.chmod(0o555)
        return directory
    return Path("/sys")  # sysfs: no one, root included, makes a file there


#: where no dump file can be made here: a 0555 directory (root writes into one all the same,
#: so not as root) and Linux's /sys (not even root makes a file there); chosen at collection,
#: so no case is a skip (CI's second step requires none)
_UNWRITABLE = ((["read-only directory"] if os.geteuid() != 0 else [])
               + (["/sys"] if Path("/sys").is_dir() else []))


@pytest.mark.parametrize("how", _UNWRITABLE)
def test_a_dump_dir_nothing_can_be_written_to_is_refused_before_the_server_binds(how,
                                                                                 tmp_path):
    """``serve --dump-dir`` a directory where no file can be made: the server started and
    served, each request's record dropped with a warning; refused at start in one line naming
    the flag, its value and the OS's reason, exit 2, before the sample request."""
    directory = _unwritable_dump_dir(tmp_path, how)
    try:
        done = calexec("serve", "--once", "--dump-dir", str(directory))
    finally:
        if directory != Path("/sys"):
            directory.chmod(0o755)
    line = one_line(done.stderr)
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout,
                                                        done.stderr)
    assert line.startswith(f"calexec serve: --dump-dir='{directory}': cannot write "
                           f"'{directory}/calexec-dump-"), line
    assert line.endswith(("Permission denied", "Read-only file system")), line


def test_conform_only_repeated_runs_the_experiment_once():
    """``--only parallel --only parallel`` (a repeated flag, e.g. from a script): the experiment
    ran twice and the report listed each of its questions twice."""
    done = calexec("conform", "--quick", "--json", "--only", "parallel", "--only", "parallel")
    assert done.returncode == 0, done.stderr
    ids = [q["id"] for q in json.loads(done.stdout)["questions"]]
    assert ids and len(ids) == len(set(ids)), ids
    assert done.stderr.count("experiment parallel ...") == 1, done.stderr


def test_accept_gates_repeated_runs_the_gate_once():
    """``--gates lengths,lengths``: the gate ran twice ('2/2 gates'), the report kept one."""
    done = calexec("accept", "--gates", "lengths,lengths", "--phase", "a")
    assert done.returncode == 0, done.stderr
    assert "(1/1 gates)" in done.stderr and "/2 gates" not in done.stderr, done.stderr


@pytest.mark.parametrize("phases, named", [
    ("0:inf", "--decode-us='0:inf': share 'inf' of 0 must be > 0 and finite"),  # was exit 70
    ("0:nan", "--decode-us='0:nan': share 'nan' of 0 must be > 0 and finite"),
])
def test_bench_soak_phase_shares_must_be_finite(phases, named):
    done = calexec("bench", "soak", "--requests", "1", "--faults", "1", "--clients", "1",
                   "--max-tokens", "1", "--decode-us", phases)
    line = one_line(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert named in line, line


def test_serve_dump_dir_with_home_at_the_filesystem_root(tmp_path):
    """HOME=/ (a container's or a service account's): every path is 'under' it, so any
    --dump-dir was refused 'is under a home directory'. /home and /root stay refused."""
    pre = "import os\nos.environ['HOME'] = '/'"
    done = calexec("serve", "--once", "--dump-dir", str(tmp_path / "dumps"), pre=pre)
    assert done.returncode == 0, done.stderr
    refused = calexec("serve", "--once", "--dump-dir", "/root/calexec-dumps", pre=pre)
    assert refused.returncode == 2 and "under a home directory" in one_line(refused.stderr)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_during_the_command_is_one_line_exit_2(tmp_path):
    """stdout unbuffered on a full disk: the command's own print failed, 'internal error:
    OSError: [Errno 28] No space left on device' exit 70. A full disk is never a bug."""
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "calexec", "sim", "write-calbin", str(tmp_path / "c.calbin")],
            stdout=full, stderr=subprocess.PIPE, text=True, timeout=TIMEOUT_S,
            env={**_env_without("PYTHONUNBUFFERED"), "PYTHONUNBUFFERED": "1"})
    line = one_line(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert line.startswith("calexec sim write-calbin: ") and "No space left on device" in line
    assert "internal error" not in line, line


def test_serve_says_the_address_it_listens_on():
    """``serve --port 0`` (an ephemeral port) never said which port it got: uvicorn is handed
    the bound socket, so its 'running on' line is not printed either."""
    import os
    import selectors
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "calexec", "serve", "--port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    seen = b""
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stderr, selectors.EVENT_READ)
            deadline = time.monotonic() + TIMEOUT_S
            while (time.monotonic() < deadline and proc.poll() is None
                   and b"Application startup complete" not in seen):
                if sel.select(timeout=1.0):
                    seen += os.read(proc.stderr.fileno(), 65536)
    finally:
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=TIMEOUT_S)[1]
    text = (seen + rest).decode(errors="replace")
    assert proc.returncode == 0, text
    listening = [line for line in text.splitlines() if "listening on http://127.0.0.1:" in line]
    assert listening and not listening[0].rstrip().endswith(":0"), text


@pytest.mark.parametrize("config, named", [
    ("garbage", "--config: item 'garbage' is not key=value"),
    ("decode_us=5;kv_blockz=4", "--config: kv_blockz='4' refused by the runtime"),
])
def test_conform_config_the_runtime_refuses_is_exit_2(config, named):
    """A typo in --config: every experiment's device_open failed, every question
    'inconclusive', exit 0 with a list of 'safe settings'."""
    done = calexec("conform", "--quick", "--only", "parallel", "--config", config)
    assert done.returncode == 2, (done.returncode, done.stderr)
    last = [line for line in done.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("calexec conform: ") and named in last, done.stderr
    assert "experiment parallel" not in done.stderr, done.stderr


@pytest.mark.parametrize("argv", DEVICE_COMMANDS[2:], ids=lambda argv: " ".join(argv[:2]))
def test_a_calbin_that_is_not_synthetic_is_named_exit_2_by_the_emulator_benches(argv, tmp_path):
    """The benches run the emulator and check tokens against the synthetic oracle: a calbin
    of any other kind was 'executor start failed: ... FILE_FORMAT', two lines, exit 1."""
    path = tmp_path / "x.calbin"
    path.write_text("not a calbin\n")
    done = calexec(*argv, "--calbin", str(path))
    line = one_line(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert f"--calbin='{path}': not a synthetic calbin" in line, line


@pytest.mark.parametrize("argv", [
    DEVICE_COMMANDS[3], DEVICE_COMMANDS[4],
    ["bench", "server", "--requests", "1", "--concurrency", "1", "--rounds", "1",
     "--max-tokens", "1", "--decode-us", "0"],
], ids=lambda argv: " ".join(argv[:2]))
def test_an_executor_that_does_not_start_is_exit_3_in_the_benches(argv, tmp_path):
    """A synthetic calbin of another seed has no pinned golden (§9.2): the executor refuses
    to start. The benches exited 1 (a failed check); calexec's contract says 3."""
    from calexec.drivers.synthetic import calbin

    path = tmp_path / "seed5.calbin"
    calbin.write(str(path), calbin.default_spec(seed=5))
    done = calexec(*argv, "--calbin", str(path))
    assert done.returncode == 3, (done.returncode, done.stderr)
    assert "golden.unpinned" in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("argv, named", [
    # said "$CALEXEC_CALRT_LIB=None: cannot load ...": the wrong flag, the wrong value
    (["demo", "--seqs", "1", "--runtime-lib", ""], "--runtime-lib='': empty"),
    (["serve", "--once", "--runtime-lib", ""], "--runtime-lib='': empty"),
    # ran on the bundled emulator, exit 0, as if the flag had not been given
    (["conform", "--quick", "--only", "parallel", "--lib", ""], "--lib='': empty"),
])
def test_an_empty_library_flag_is_named_not_ignored(argv, named):
    done = calexec(*argv)
    line = one_line(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert named in line, line


@pytest.mark.parametrize("argv", [
    # Path('') is '.': the dump sink wrote calexec-dump-PID.jsonl into the working directory,
    # past DumpSink's "an explicit directory is required" (S12)
    ["serve", "--once", "--dump-dir", ""],
    ["serve", "--once", "--admin-token-file", ""],
    # os.path.abspath('') is the working directory: taken for a tokenizer directory
    ["serve", "--once", "--tokenizer", ""],
    # ignored ('if args.report:'): the run went on and wrote no report, exit 0
    ["accept", "--gates", "lengths", "--phase", "a", "--report", ""],
    ["conform", "--quick", "--only", "parallel", "--report", ""],
    ["bench", "pingpong", "--seqs", "1", "--tokens", "1", "--solo-tokens", "1", "--trace", ""],
    ["golden", "record", "--calbin", "x.calbin", "--out", ""],
], ids=lambda argv: f"{argv[0]} {argv[-2]}")
def test_an_empty_path_flag_is_refused_exit_2(argv, tmp_path):
    done = subprocess.run([sys.executable, "-m", "calexec", *argv], capture_output=True,
                          text=True, timeout=TIMEOUT_S, cwd=tmp_path)
    line = one_line(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert f"argument {argv[-2]}: empty path" in line, line
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


# ---- stop 38: output that cannot be written is one line naming it, exit 2 ---------------------
@pytest.mark.parametrize("argv, file", [
    (["accept", "--gates", "lengths", "--phase", "a"], "report.json"),
    (["conform", "--quick", "--only", "parallel"], "conformance.json"),
])
def test_a_report_file_that_cannot_be_written_is_refused_before_the_run(argv, file, tmp_path):
    """``--report DIR`` where ``DIR/<file>`` is a directory: the run went first, then
    ``cannot write the report`` without the file (accept) or ``[Errno 21] Is a directory``
    exit 1, a failed check (conform)."""
    report = tmp_path / "report"
    (report / file).mkdir(parents=True)
    done = calexec(*argv, "--report", str(report))
    line = one_line(done.stderr)  # (no progress line: nothing ran)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert line.endswith(f"--report={str(report)!r}: cannot write {str(report / file)!r}: "
                         "Is a directory"), line


@pytest.mark.parametrize("argv, file", [
    (["accept", "--gates", "lengths", "--phase", "a"], "report.md"),
    (["conform", "--quick", "--only", "parallel"], "conformance.md"),
])
def test_a_report_that_cannot_be_written_after_the_run_is_one_line_exit_2(argv, file, tmp_path):
    """The same file broken during the run (the check before it skipped here): one line naming
    the file, exit 2, never a traceback nor conform's exit 1 (a check failed)."""
    report = tmp_path / "report"
    (report / file).mkdir(parents=True)
    pre = "import calexec.cliargs as c\nc.writable_file = lambda *args: None"
    done = calexec(*argv, "--report", str(report), pre=pre)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, (done.returncode, done.stderr)
    last = done.stderr.strip().splitlines()[-1]
    assert last == (f"calexec {argv[0]}: --report={str(report)!r}: cannot write "
                    f"{str(report / file)!r}: Is a directory"), last


def _stdout_hung_up(argv: list[str]) -> subprocess.CompletedProcess:
    """``calexec ARGV`` writing to a terminal that hung up: the slave end of a pty whose master
    is closed, where every write is EIO."""
    import os

    master, slave = os.openpty()
    os.close(master)
    try:
        return subprocess.run([sys.executable, "-m", "calexec", *argv], stdout=slave,
                              stderr=subprocess.PIPE, text=True, timeout=TIMEOUT_S)
    finally:
        os.close(slave)


@pytest.mark.skipif(not hasattr(__import__("os"), "openpty"), reason="needs a pty")
@pytest.mark.parametrize("argv, prefix", [
    (["charts", "paths", "calexec.machines.charts:JobChart"], "calexec charts paths: "),
    (["--version"], "calexec: "),
    (["demo", "--help"], "calexec: "),
])
def test_a_stdout_with_an_io_error_is_one_line_exit_2(argv, prefix):
    """EIO on stdout (a terminal gone): 'internal error: OSError: [Errno 5]', exit 70; and
    argparse's --help/--version swallowed it, exit 0 with nothing written."""
    done = _stdout_hung_up(argv)
    line = one_line(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert line == f"{prefix}cannot write to stdout: Input/output error", line


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_stdout_during_the_command_names_stdout(tmp_path):
    """A full disk under stdout (unbuffered): the line said 'cannot write: No space left on
    device', not what could not be written."""
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "calexec", "charts", "paths",
             "calexec.machines.charts:JobChart"],
            stdout=full, stderr=subprocess.PIPE, text=True, timeout=TIMEOUT_S,
            env={**_env_without("PYTHONUNBUFFERED"), "PYTHONUNBUFFERED": "1"})
    line = one_line(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert line == "calexec charts paths: cannot write to stdout: No space left on device", line


def test_cannot_write_names_the_flag_the_file_and_the_os_error(tmp_path):
    """The shared one line of every command's unwritable output (calexec.cliargs)."""
    import errno

    from calexec import cliargs

    (tmp_path / "file").write_text("x")
    under_a_file = tmp_path / "file" / "out.png"
    with pytest.raises(cliargs.UserError) as caught:
        cliargs.writable_file("--out", under_a_file)
    assert caught.value.code == 2
    assert str(caught.value) == f"--out={str(under_a_file)!r}: cannot write it: Not a directory"
    cliargs.writable_file("--out", tmp_path / "new.png")
    assert not (tmp_path / "new.png").exists()  # the probe leaves nothing behind
    import os

    os.mkfifo(tmp_path / "fifo")
    cliargs.writable_file("--out", tmp_path / "fifo")  # not opened: no reader, it would block
    eio = OSError(errno.EIO, "Input/output error")
    assert str(cliargs.cannot_write(None, eio)) == "cannot write to stdout: Input/output error"
    inside = IsADirectoryError(errno.EISDIR, "Is a directory", str(tmp_path / "r" / "a.json"))
    assert str(cliargs.cannot_write(tmp_path / "r", inside, "--report")) == (
        f"--report={str(tmp_path / 'r')!r}: cannot write {str(tmp_path / 'r' / 'a.json')!r}: "
        "Is a directory")


# ---- stop 42: input files that are not files (a FIFO, a device), or not text ----------------
def _fifo(tmp_path: Path) -> str:
    import os

    path = tmp_path / "fifo"
    os.mkfifo(path)
    return str(path)


def _binary(tmp_path: Path) -> str:
    path = tmp_path / "binary"
    path.write_bytes(b"\x81\xff\x00not text")
    return str(path)


@pytest.mark.skipif(not Path("/dev/zero").exists() or not hasattr(__import__("os"), "mkfifo"),
                    reason="needs /dev/zero and mkfifo")
@pytest.mark.parametrize("argv, named", [
    # waited for a writer forever / read /dev/zero without end (memory, then the 20 s probe)
    (["serve", "--once", "--tokenizer", "{fifo}"], "--tokenizer='{fifo}': it is not a regular file"),
    (["serve", "--once", "--tokenizer", "/dev/zero"], "--tokenizer='/dev/zero': it is not a regular"),
    # a FIFO no one writes to: gave nothing (a pipe, `<(command)`, is still read); /dev/zero: refused
    (["serve", "--once", "--admin-token-file", "{fifo}"], "--admin-token-file='{fifo}': a FIFO that gave"),
    (["serve", "--once", "--admin-token-file", "/dev/zero"],
     "--admin-token-file='/dev/zero': not a regular file"),
    # hung on the FIFO; /dev/zero: "internal error: MemoryError", exit 70
    (["charts", "mutate", "--chart", "calexec.machines.charts:JobChart", "--test-cmd", "true",
      "--sample", "1", "--equivalent", "/dev/zero"], "--equivalent='/dev/zero': not a regular"),
    (["golden", "record", "--calbin", "{calbin}", "--out", "{fifo}"],
     "--out='{fifo}': cannot update it: {fifo}: <file>='prw"),
    (["golden", "record", "--calbin", "{calbin}", "--out", "/dev/zero"],
     "--out='/dev/zero': cannot update it: /dev/zero: <file>='crw"),
    # "internal error: UnicodeDecodeError", exit 70
    (["golden", "record", "--calbin", "{calbin}", "--out", "{binary}"],
     "--out='{binary}': cannot update it: {binary}: <toml>: not UTF-8 text"),
    (["charts", "mutate", "--chart", "calexec.machines.charts:JobChart", "--test-cmd", "true",
      "--sample", "1", "--equivalent", "{binary}"], "--equivalent='{binary}': not UTF-8 text"),
    # named the flag but not the file: "--manifest: 'utf-8' codec can't decode byte 0x81 ..."
    (["demo", "--seqs", "1", "--tokens", "1", "--manifest", "{binary}"],
     "--manifest: {binary}: <toml>: not UTF-8 text"),
], ids=lambda v: " ".join(v[:3]) if isinstance(v, list) else None)
def test_an_input_file_that_is_a_fifo_a_device_or_not_text_is_one_line_exit_2(
        argv, named, tmp_path, synthetic_calbin):
    given = {"fifo": _fifo(tmp_path), "binary": _binary(tmp_path), "calbin": synthetic_calbin}
    before = Path(given["binary"]).read_bytes()
    argv = [a.format(**given) for a in argv]
    done = calexec(*argv, timeout=60)
    line = one_line(done.stderr)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert line.startswith(f"calexec {cli.lookup(argv)}: ") and named.format(**given) in line, line
    assert Path(given["binary"]).read_bytes() == before  # (nothing written over it)


def test_a_small_text_file_may_be_a_pipe_but_not_too_long(tmp_path):
    """``read_small_text``: ``--admin-token-file <(command)`` (a pipe) is read; a file longer
    than the limit is refused naming the flag, not read into memory whole."""
    import os

    from calexec import cliargs

    read, write = os.pipe()
    os.write(write, b"secret\n")
    os.close(write)
    try:
        assert cliargs.read_small_text("--x", f"/dev/fd/{read}", 64, "a token") == "secret\n"
    finally:
        os.close(read)
    long = tmp_path / "long"
    long.write_bytes(b"a" * 65)
    with pytest.raises(cliargs.UserError) as caught:
        cliargs.read_small_text("--x", long, 64, "a token")
    assert str(caught.value) == f"--x={str(long)!r}: longer than 64 bytes, not a token"


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_NOFILE is POSIX")
def test_serve_outlasts_more_idle_connections_than_a_default_open_file_limit():
    """``calexec serve`` under a soft open-file limit of 256 (many hosts start a process at
    1024): 400 idle connections (a slowloris, or clients that open and wait) took every
    descriptor, and a new client's ``/health`` was reset, until the idle ones timed out
    (``HEAD_TIMEOUT_S``, 30 s). ``serve`` raises its soft limit toward the hard one (at most
    65536, as vLLM's API server does) and says so; the health check is answered."""
    import os
    import re
    import resource
    import selectors
    import signal
    import socket
    import time
    import urllib.request

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"this host's hard open-file limit is {hard}: no room to raise 256")

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    proc = subprocess.Popen([sys.executable, "-m", "calexec", "serve", "--port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=low_limit)
    assert proc.stderr is not None
    seen, socks = b"", []
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stderr, selectors.EVENT_READ)
            deadline = time.monotonic() + TIMEOUT_S
            while (time.monotonic() < deadline and proc.poll() is None
                   and not re.search(rb"listening on http://127\.0\.0\.1:\d+\n", seen)):
                if sel.select(timeout=1.0):
                    seen += os.read(proc.stderr.fileno(), 65536)
        port = int(re.search(rb"listening on http://127\.0\.0\.1:(\d+)", seen).group(1))
        for _ in range(400):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5.0))
        time.sleep(0.5)  # the server accepts them
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10.0) as reply:
            assert reply.status == 200
    finally:
        for sock in socks:
            sock.close()
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=TIMEOUT_S)[1]
    text = (seen + rest).decode(errors="replace")
    assert proc.returncode == 0, text
    assert "open-file limit 256 -> " in text, text
