"""What the CLI probe of stop 64 found in the command-line entry points, each pinned
(docs/traceability.md, "Found at stop 64 (cli)")."""

from __future__ import annotations

import io
import os
import re
import resource
import select
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

import needs
from calexec import cli
from calexec.contracts.goldens import goldens_path
from calexec.contracts.manifest import default_manifest_path, load_manifest
from calexec.drivers import calrt as calrt_pkg
from calexec.drivers.calrt.runtime import CalRT
from calexec.drivers.device_spec import DeviceSpec
from calexec.drivers.synthetic import calbin as synthetic
from calexec.drivers.tools.accept.gate_rig import unpinned_golden
from calexec.machines.executor import DeviceExecutor, ExecutorConfig

CALRT_DIR = os.path.dirname(calrt_pkg.__file__)  # drivers/calrt: Makefile and the C sources


def _emulator_library(build: Path, directory: Path) -> str:
    """The bundled emulator built as a calrt.h shared library (in ``build``: make takes no
    space in its path), copied into ``directory``: what a ``--runtime-lib`` names."""
    subprocess.run(["make", "-s", "-C", CALRT_DIR, "lib", f"O={build}"], check=True,
                   capture_output=True, timeout=300)
    return shutil.copy(build / "libcalrt_emu.so", directory / "libcalrt_emu.so")


def test_an_unpinned_golden_on_a_runtime_library_names_it_in_the_command_to_record(tmp_path):
    """``calexec serve --runtime-lib L --calbin m5.calbin`` (or the executor on
    ``$CALEXEC_CALRT_LIB``) before the golden is pinned said ``run `calexec golden record
    --calbin m5.calbin` ...``: typed as given, that command pins what the *bundled emulator*
    computes (the golden is the runtime's), never the library's. The command named carries
    ``--runtime-lib L`` (shell-quoted: the directory has a space), and run as named it makes the
    start pass; on the bundled emulator it names none."""
    where = tmp_path / "my dir"
    where.mkdir()
    lib = str(_emulator_library(tmp_path / "build", where))
    calbin, manifest = where / "m5.calbin", where / "my.toml"
    synthetic.write(str(calbin), synthetic.default_spec(seed=5))
    manifest.write_text(Path(default_manifest_path()).read_text(encoding="utf-8"),
                        encoding="utf-8")

    def start(runtime: CalRT) -> tuple[bool, str]:
        executor = DeviceExecutor(runtime, load_manifest(manifest),
                                  ExecutorConfig(calbin_path=str(calbin)))
        try:
            status = executor.start()
            return status.ok, status.message
        finally:
            executor.shutdown(10.0)

    ok, message = start(CalRT.load(lib))
    assert not ok
    said = re.search(r"run `calexec (golden record [^`]*)`", message)
    assert said is not None, message
    assert said[1].endswith(f" --runtime-lib {shlex.quote(lib)}"), message
    assert cli.main(shlex.split(said[1])) == 0  # the command as the message names it
    ok, message = start(CalRT.load(lib))
    assert ok, message
    ok, message = start(CalRT.load())
    assert "--runtime-lib" not in message, message


def test_accept_names_the_runtime_library_and_quotes_the_paths_of_the_command_to_record(
        tmp_path):
    """``calexec accept --calbin X --manifest M --runtime-lib L`` on a calbin with no pinned
    golden said ``run `calexec golden record --calbin X` --manifest M first``: the closing
    backtick before ``--manifest``, no ``--runtime-lib`` (the golden recorded as named is the
    bundled emulator's, and the gates still refused), the paths unquoted (a space made two
    words). The command is now whole between the backticks, quoted, with the library."""
    where = tmp_path / "my dir"
    where.mkdir()
    calbin, manifest, lib = where / "m5.calbin", where / "my.toml", str(where / "libx.so")
    synthetic.write(str(calbin), synthetic.default_spec(seed=5))
    manifest.write_text(Path(default_manifest_path()).read_text(encoding="utf-8"),
                        encoding="utf-8")
    line = unpinned_golden(str(calbin), DeviceSpec(manifest_path=str(manifest),
                                                   calbin_path=str(calbin), runtime_lib=lib))
    assert line is not None
    said = re.search(r"run `calexec (golden record [^`]*)` first$", line)
    assert said is not None, line
    assert shlex.split(said[1]) == ["golden", "record", "--calbin", str(calbin), "--manifest",
                                    str(manifest), "--runtime-lib", lib]
    line = unpinned_golden(str(calbin), DeviceSpec(calbin_path=str(calbin)))
    assert line is not None and line.endswith(
        f"run `calexec golden record --calbin {shlex.quote(str(calbin))}` first"), line


#: paths a user may give: a space, a quote, a newline, a tab, a byte that is not UTF-8
ODD_NAMES = ["my dir", "it's", "two\nlines", "tab\there", os.fsdecode(b"latin\xe9")]


def _bash_reads(word: str) -> bytes:
    """What bash makes of ``word`` as one shell word: the bytes of the path it names."""
    done = subprocess.run(["bash", "-c", f"printf %s {word}"], capture_output=True,
                          timeout=30, check=True)
    return done.stdout


@pytest.mark.parametrize("name", ODD_NAMES, ids=repr)
def test_diagrams_prints_each_file_written_as_one_shell_word_on_its_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str):
    """``calexec diagrams --out DIR`` prints the files it wrote, one a line, for a script to
    read: with a newline in DIR each file took two lines (a script read two paths, neither
    there), a space split it into two words; ``--check`` and its ``stale:`` lines the same.
    Each is now one shell word on its line (``shlex.quote``; ``$'...'`` for a control
    character or a byte that is not UTF-8), which bash reads back as the path."""
    needs.tool("dot")  # (diagrams renders each chart's SVG beside its DOT)
    out = tmp_path / name
    assert cli.main(["diagrams", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    written = sorted(out.iterdir())
    assert len(lines) == len(written)
    assert sorted(_bash_reads(line) for line in lines) == sorted(map(os.fsencode, written))
    (out / "job.dot").unlink()
    assert cli.main(["diagrams", "--out", str(out), "--check"]) == 1
    [stale, fix] = capsys.readouterr().err.splitlines()
    word = stale.removeprefix("stale: ").removesuffix(": missing")
    assert _bash_reads(word) == os.fsencode(out / "job.dot"), stale
    assert fix.startswith("fix: ")


def test_golden_record_names_the_goldens_file_as_one_shell_word(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """``calexec golden record ... --out F``'s line ended ``-> F`` as the path was: a newline
    in F split the line a script reads; now ``-> `` and F as one shell word."""
    out = tmp_path / "two\nlines.goldens.toml"
    assert cli.main(["golden", "record", "--calbin", _synthetic(tmp_path), "--out",
                     str(out)]) == 0
    [line] = capsys.readouterr().out.splitlines()
    assert _bash_reads(line.rsplit(" -> ", 1)[1]) == os.fsencode(out), line


def _synthetic(directory: Path) -> str:
    path = directory / "m.calbin"
    synthetic.write(str(path), synthetic.default_spec(seed=5))
    return str(path)


class _Server:
    """What ``SampleRun`` uses of the server: ``drain_soon``, called as the sample ends."""

    def __init__(self) -> None:
        self.drains = 0

    def drain_soon(self) -> None:
        self.drains += 1


def test_serve_once_reads_the_sample_once_its_thread_ended():
    """``serve --once`` read its sample's outcome as soon as the server had drained: a SIGTERM
    drains the server while the sample's thread may still be reading its answer or printing
    it, and the run said ``the sample request failed (see above)``, exit 4, while the thread
    went on to print a 200 (and the ``drained:`` line could come between its lines). The
    outcome is now read once the thread ended (joined within the request's timeout): here
    the answer comes only after the drain was read, and the run ends 0 with ``drained:``
    last."""
    from calexec.serve import SampleRun

    out = io.StringIO()
    sample = SampleRun(30.0, out)
    answered = threading.Event()

    def request(url: str) -> bool:
        sample.sent = True
        answered.wait(30.0)  # (until the server "drained" and its outcome was asked)
        print("response (HTTP 200)", file=out)
        return True

    sample.request = request  # type: ignore[method-assign]
    server = _Server()
    sample.start(server, "http://127.0.0.1:1")  # type: ignore[arg-type]

    def answer_once_waited_for(frame: types.FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_name == "join":  # (the outcome is asked)
            answered.set()

    sys.setprofile(answer_once_waited_for)  # (this thread's calls only)
    try:
        code = sample.result("executor Stopped")
    finally:
        sys.setprofile(None)
    assert answered.is_set() and code == 0
    assert out.getvalue().splitlines() == ["response (HTTP 200)",
                                           "drained: executor Stopped; exit 0"]
    assert server.drains == 1


def test_serve_once_whose_sample_was_never_sent_says_so(capsys: pytest.CaptureFixture[str]):
    """A signal before the server served: no sample was sent, and the line said ``the sample
    request failed (see above)`` with nothing above; it says it was not sent."""
    from calexec.serve import SampleRun

    assert SampleRun(30.0, io.StringIO()).result("executor Stopped") == 4
    assert capsys.readouterr().err == ("calexec serve --once: the sample request was not sent: "
                                       "the server drained before it served\n")


def _default_calbin(directory: Path) -> Path:
    """The default synthetic calbin (the packaged manifest pins its golden)."""
    path = directory / "model.calbin"
    synthetic.write(str(path), synthetic.default_spec())
    return path


@pytest.mark.parametrize("trace", ["model.calbin", "./model.calbin", "link.calbin", "m.toml"])
def test_bench_pingpong_refuses_a_trace_that_is_one_of_its_inputs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        trace: str):
    """``bench pingpong --calbin model.calbin --trace model.calbin`` (a slip of the tab key)
    ran the benchmark, then wrote the trace over the model, exit 0: the calbin was gone. So
    did the manifest, or the calbin through a link. The trace naming an input is refused
    before the run, one line naming both flags, the input untouched."""
    monkeypatch.chdir(tmp_path)
    calbin = _default_calbin(tmp_path)
    (tmp_path / "link.calbin").symlink_to(calbin.name)
    manifest = tmp_path / "m.toml"  # (the packaged one, its goldens beside it)
    manifest.write_bytes(Path(default_manifest_path()).read_bytes())
    shutil.copy(goldens_path(default_manifest_path()), goldens_path(manifest))
    before = calbin.read_bytes(), manifest.read_bytes()
    code = cli.main(["bench", "pingpong", "--seqs", "1", "--tokens", "2", "--solo-tokens", "2",
                     "--calbin", calbin.name, "--manifest", manifest.name, "--trace", trace])
    captured = capsys.readouterr()
    assert code == 2, captured
    [line] = captured.err.splitlines()
    given = "--manifest='m.toml'" if trace == "m.toml" else "--calbin='model.calbin'"
    assert line.startswith(f"calexec bench pingpong: --trace={trace!r}: the same file as "
                           f"{given}, which the run reads"), line
    assert (calbin.read_bytes(), manifest.read_bytes()) == before and captured.out == ""


def test_a_trace_write_cut_short_leaves_the_previous_trace(tmp_path: Path):
    """``bench pingpong --trace t.json`` opened the trace for writing (truncating the previous
    one) and wrote the JSON into it: a full disk (here a file size limit: the same error at
    the same write) left a trace cut short where the previous one was, which no viewer
    opens. The trace is written beside it and renamed over it once whole: the previous one
    stays, no scratch file is left, one line naming ``--trace``, exit 2."""
    calbin = _default_calbin(tmp_path)
    trace = tmp_path / "t.json"
    trace.write_text('{"traceEvents": []}')

    def small_files() -> None:  # (in the child: a write past 4 KiB fails with EFBIG)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    done = subprocess.run(
        [sys.executable, "-m", "calexec", "bench", "pingpong", "--seqs", "1", "--tokens", "2",
         "--solo-tokens", "2", "--calbin", str(calbin), "--trace", str(trace)],
        capture_output=True, text=True, timeout=300, preexec_fn=small_files, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1] == (f"calexec bench pingpong: --trace={str(trace)!r}: "
                                            "cannot write it: File too large")
    assert trace.read_text() == '{"traceEvents": []}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.calbin", "t.json"]


@pytest.mark.parametrize("argv", [
    ["sim", "write-calbin", "-"],
    ["bench", "pingpong", "--trace", "-"],
    ["golden", "record", "--calbin", "m.calbin", "--out", "-"],
    ["charts", "names", "--out", "-"],
    ["charts", "draw", "calexec.machines.charts:JobChart", "--out", "-"],
    ["diagrams", "--out", "-"],
    ["diagrams", "--png", "-"],
    ["conform", "--quick", "--report", "-"],
    ["accept", "--quick", "--report", "-"],
    ["charts", "mutate", "--report", "-"],
    ["serve", "--dump-dir", "-"],
    ["diagrams", "live", "--job-out", "-"],
], ids=lambda argv: " ".join(argv[:2]))
def test_an_output_path_of_dash_is_refused_not_made_a_file_named_dash(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        argv: list[str]):
    """``-`` for an output (``sim write-calbin - | sha256sum``, ``--trace -``, ``--report -``),
    stdout to most tools, made a file or a directory named ``-`` in the working directory,
    nothing said (exit 0: the sha256, the trace's table, the pinned golden printed as if
    written where asked). These outputs are files stdout cannot hold: ``-`` is refused while
    the command line is parsed, one line naming the flag, nothing made."""
    from calexec.cliargs import missing_extra

    if argv[:2] == ["serve", "--dump-dir"] or argv[:2] == ["diagrams", "live"]:
        if missing_extra("server") is not None:
            pytest.skip("needs the [server] extra")
    monkeypatch.chdir(tmp_path)
    code = cli.main(argv)
    captured = capsys.readouterr()
    assert code == 2, captured
    [line] = captured.err.splitlines()
    assert "'-' is not stdout here" in line and line.startswith(f"calexec {argv[0]}"), line
    assert captured.out == "" and not os.path.lexists(tmp_path / "-")


def test_charts_cover_interrupted_ends_what_its_test_command_started(tmp_path: Path):
    """``charts cover --chart C -- COMMAND`` sent a SIGTERM (or a Ctrl-C to calexec alone:
    ``timeout``, a supervisor, ``kill -INT``) while the command ran: ``subprocess.call``
    killed the command's first process only, and what it had started (here a shell's
    background job; pytest-xdist's workers) ran on after exit 130. The command now runs in a
    process group of its own, killed whole: the job it started ends with it."""
    fifo = tmp_path / "started"
    os.mkfifo(fifo)
    command = f"sleep 600 & echo $! > {shlex.quote(str(fifo))}; wait"
    log = tmp_path / "stderr"
    with open(log, "w", encoding="utf-8") as stderr:  # (a file: the job would hold a pipe)
        proc = subprocess.Popen(
            [sys.executable, "-m", "calexec", "charts", "cover", "--chart",
             "calexec.machines.charts:JobChart", "--", "bash", "-c", command],
            stdout=subprocess.DEVNULL, stderr=stderr, cwd=tmp_path)
    try:
        with open(fifo, encoding="utf-8") as started:  # (until the job runs: a barrier)
            job = int(started.read())
        watch = os.pidfd_open(job)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    err = log.read_text(encoding="utf-8")
    try:
        ended, _, _ = select.select([watch], [], [], 60.0)  # (readable once the job ended)
        if not ended:
            os.kill(job, signal.SIGKILL)  # (not left behind by the test either)
    finally:
        os.close(watch)
    assert proc.returncode == 130 and err.splitlines()[-1] == "calexec charts cover: interrupted"
    assert ended, "the test command's background job outlived calexec charts cover"


def test_a_refused_run_leaves_no_report_directory_it_made(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """``accept --report new/dir --runtime-lib /nonexistent``: the
    report directory, made before the run so that a bad one is named at once, stayed behind
    when a flag checked after it was refused (exit 2) or the run was interrupted (exit 130),
    an empty directory (its parents too) the user never got a report in. A directory the
    command made and wrote nothing in is removed when it ends; one that was there stays."""
    made, there = tmp_path / "new" / "dir", tmp_path / "there"
    there.mkdir()
    for report in (made, there):
        code = cli.main(["accept", "--quick", "--report", str(report), "--runtime-lib",
                         "/nonexistent"])
        captured = capsys.readouterr()
        assert code == 2 and "/nonexistent" in captured.err, captured
    assert not (tmp_path / "new").exists() and there.is_dir()
