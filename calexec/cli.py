"""The ``calexec`` console script: an argparse front (``--help``, ``--version``, the command
list, "did you mean" for a mistyped command) over one module per subcommand.

Each subcommand lives in its own module with ``main(argv: list[str]) -> int``; ``argv`` starts
with the command words (``["sim", "bench", "--json"]``), so one module can serve several
commands. The module parses the rest with its own parser from ``calexec.cliargs.parser`` (help
with defaults, one-line errors). This file only dispatches.

Registering a subcommand is one line in ``COMMANDS`` (calexec/commands.py)::

    "golden record": Command("calexec.drivers.tools.golden", "record the golden of a calbin"),

with ``extra="server"`` (or ``"plots"``, ``"ray"``) when the module needs an optional extra:
without it the command prints the ``pip install`` line and exits 2 instead of importing.

Errors never end in a traceback: ``UserError`` (``calexec.cliargs``) and argparse errors print
one line naming the offender; an unexpected exception prints one line and exits 70 (set
``CALEXEC_DEBUG=1`` to see the traceback). Exit codes: 0 success; 1 the command's check failed
(gate, stale diagram, oracle mismatch); 2 bad usage or configuration; 3 runtime refusal (the
executor did not start or ended Failed); 4 ``serve --once``'s sample request failed; 70 an
internal error (a bug); 130 interrupted (Ctrl-C, or a SIGTERM, SIGHUP or SIGQUIT to any command
but ``serve``: ``cliargs.sigterm_interrupts``);
141 the reader closed stdout (``| head``); a stdout that cannot be written (a full disk, an I/O
error: :class:`StdoutError`), or an output file, is one line naming it and the OS error
(``cliargs.cannot_write``), exit 2. A stderr that cannot be written only silences the messages
(:class:`_Stderr`).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import importlib
import os
import sys
from typing import Any

from calexec import __version__
from calexec.cliargs import (
    EXIT_CONFIG,
    Parser,
    UserError,
    as_user_error,
    cannot_write,
    missing_extra,
    remove_empty_output_dirs,
    sigterm_interrupts,
)
from calexec.commands import COMMANDS, lookup
from calexec.machines.envflag import EnvFlagError, env_flag

EXIT_INTERNAL, EXIT_INTERRUPTED = 70, 130
#: 1: an internal error raises with its traceback (else one line)
DEBUG_ENV = "CALEXEC_DEBUG"
#: an OSError with one of these errnos is a full disk or quota: one line, exit 2, never 70
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
#: the reader of stdout closed it (128 + SIGPIPE, what a shell reports for a process it killed)
EXIT_BROKEN_PIPE = 141


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so flushing it at exit does not fail on the closed pipe again
    (the way Python's documentation handles SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real stdout: nothing to flush
        pass


class StdoutError(OSError):
    """A write to stdout failed (other than the reader leaving, ``BrokenPipeError``): EIO, a
    full disk. Raised by :class:`_Stdout`, so the error is told from a file's."""


class _Stdout:
    """``sys.stdout`` while a command runs: the same stream, but its write errors are
    :class:`StdoutError` (a file write that fails the same way is not one), and the first is
    kept in ``failed``: argparse's ``--help``/``--version`` swallow it, ``main`` does not."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.failed: OSError | None = None

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._stream, name)(*args)
        except BrokenPipeError as exc:
            self.failed = self.failed or exc
            raise
        except OSError as exc:
            error = StdoutError(exc.errno, exc.strerror or str(exc))
            self.failed = self.failed or error
            raise error from exc

    def write(self, text: str) -> int:
        try:
            return int(self._call("write", text))
        except UnicodeEncodeError:  # (nothing written: the text is encoded whole first)
            return int(self._call("write", self._encodable(text)))

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def _encodable(self, text: str) -> str:
        """``text`` with what stdout's encoding cannot take written as ``\\xa7``, as Python
        writes it to stderr: stdout in ASCII (``PYTHONIOENCODING=ascii``, a console's code
        page) failed on the first ``\u00a7`` of a ``--help``, exit 70 or a traceback. The
        JSON on stdout is ASCII already (``ensure_ascii``)."""
        encoding = getattr(self._stream, "encoding", None) or "utf-8"
        return text.encode(encoding, "backslashreplace").decode(encoding)

    def flush(self) -> None:
        self._call("flush")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _Stderr:
    """``sys.stderr`` while a command runs: the same stream, but a write that fails (its reader
    left: ``2> >(head -1)``; a full disk: ``2>/dev/full``; a closed log pipe) stops the
    command's messages and progress there instead of ending the command. Progress is a side
    channel: its failure ended the run with exit 141 ("the reader of stdout left") or 1 ("a
    check failed", the interpreter's own exit for the unreportable error) and the result on
    stdout was never printed. The stream's descriptor then points at /dev/null, so the
    interpreter's final flush of what was buffered does not fail again."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.failed: OSError | None = None

    def _lost(self, exc: OSError) -> None:
        self.failed = exc
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # no descriptor: nothing flushes it later
            pass

    def write(self, text: str) -> int:
        if self.failed is None:
            try:
                return int(self._stream.write(text))
            except OSError as exc:
                self._lost(exc)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self.failed is None:
            try:
                self._stream.flush()
            except OSError as exc:
                self._lost(exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


_EPILOG = """\
'calexec COMMAND --help' lists a command's flags with their defaults.

exit codes: 0 success; 1 a check failed (gate, stale diagram, oracle mismatch); 2 bad usage or
configuration; 3 runtime refusal (executor did not start or ended Failed); 4 serve --once's
sample request failed; 70 internal error (CALEXEC_DEBUG=1 shows the traceback); 130 interrupted;
141 the reader of stdout left (| head).
"""


def _groups() -> dict[str, list[str]]:
    """First word -> second words of the two-word commands (``sim`` -> bench, write-calbin)."""
    groups: dict[str, list[str]] = {}
    for name in COMMANDS:
        first, _, second = name.partition(" ")
        if second:
            groups.setdefault(first, []).append(second)
    return groups


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: ``--version`` and one subparser per command (for the help)."""
    p = Parser(prog="calexec", epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
               description="calexec: the control core of an asynchronous Calculet NPU executor, "
                           "its reference server and the tools that measure it")
    p.add_argument("--version", action="version", version=f"calexec {__version__}")
    sub = p.add_subparsers(title="commands", metavar="COMMAND")
    for name, command in COMMANDS.items():
        note = f" [needs calexec[{command.extra}]]" if command.extra and missing_extra(
            command.extra) else ""
        sub.add_parser(name, help=command.help + note, add_help=False)
    return p


def _unknown(argv: list[str]) -> int:
    groups = _groups()
    if argv[0] in groups:
        word = argv[1] if len(argv) > 1 else ""
        if word in ("", "-h", "--help"):
            out = sys.stdout if word else sys.stderr
            print(f"usage: calexec {argv[0]} {{{','.join(groups[argv[0]])}}} ...\n", file=out)
            for second in groups[argv[0]]:
                print(f"  {argv[0]} {second:<14} {COMMANDS[f'{argv[0]} {second}'].help}",
                      file=out)
            return 0 if word else EXIT_CONFIG
        offender, candidates = f"{argv[0]} {word}", [f"{argv[0]} {s}" for s in groups[argv[0]]]
    else:
        offender, candidates = argv[0], [*COMMANDS, *groups]
    close = difflib.get_close_matches(offender, candidates, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    print(f"calexec: unknown command {offender!r}{hint}; see calexec --help", file=sys.stderr)
    return EXIT_CONFIG


class _ClosedStdout:
    """``sys.stdout`` of a process started with descriptor 1 closed (``calexec ... >&-``):
    Python makes it None, and ``print`` to None writes nothing, so a command's result was
    lost with exit 0. Every write fails as a write to a closed descriptor does (EBADF), so
    the result that cannot be written is one line, exit 2, as a full stdout's is."""

    encoding = "utf-8"

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))


def _fill_closed_descriptors() -> frozenset[int]:
    """Point each of descriptors 0, 1, 2 found closed (``<&-``, ``>&-``, ``2>&-``, a
    supervisor that closed them) at /dev/null, and return which were. Left closed, the next
    file calexec opened took the lowest free one: a report, a calbin or a socket became the
    stdin, stdout or stderr a child process inherits (``charts cover``'s command writes its
    output there)."""
    closed = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            closed.append(fd)
    for fd in closed:
        try:
            null = os.open(os.devnull, os.O_RDWR)
        except OSError:  # (no /dev/null: nothing better to do)
            break
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
    return frozenset(closed)


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` (default ``sys.argv[1:]``) and return its exit code. stdout is
    flushed here, not at interpreter exit: a reader that left (``| head``) is exit 141 whether
    it left during the command or before its buffered output was written, and a stdout that
    cannot take the output (a full disk, an I/O error) is one line, exit 2.

    A thread a chart's module started as it was imported (a heartbeat, a scheduler: not a
    daemon) would keep the process from exiting once the command is done (until stop 72
    ``calexec charts paths shop:Order`` printed its paths and hung): it is named in a
    warning, and the command line's process (``argv`` None) exits without waiting for it."""
    code = _main(argv)
    left = _threads_left_by_charts()
    if left:
        words = list(sys.argv[1:] if argv is None else argv)
        name = lookup(words) if words else None
        prog = f"calexec {name}" if name else "calexec"
        for module, thread in left:
            _warn(f"{prog}: warning: module {module!r} started thread {thread.name!r} as it "
                  f"was imported, and it still runs: "
                  + ("not waiting for it (a thread that is no daemon keeps a process from "
                     "exiting)" if argv is None else "a process would wait for it as it exits")
                  + f"; start it with daemon=True, or outside the import of {module}")
        if argv is None:  # the command line: done, whatever the module's thread does
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    stream.flush()
            os._exit(code)
    return code


def _threads_left_by_charts() -> list[Any]:
    """The still running non-daemon threads chart modules started as they were imported
    (``chartref.threads_left_running``; none when no chart was loaded)."""
    if "calexec.machines.chartref" not in sys.modules:
        return []
    from calexec.machines.chartref import threads_left_running

    return list(threads_left_running())


def _warn(line: str) -> None:
    """One line on stderr, unless stderr cannot take it (the result stands)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        print(line, file=sys.stderr)


def _main(argv: list[str] | None) -> int:
    closed = _fill_closed_descriptors()
    real, real_err = sys.stdout, sys.stderr
    if real is None and 1 in closed:
        stdout: _Stdout | None = _Stdout(_ClosedStdout())
    else:
        stdout = _Stdout(real) if real is not None else None
    if stdout is not None:
        sys.stdout = stdout
    stderr = _Stderr(real_err) if real_err is not None else None
    if stderr is not None:
        sys.stderr = stderr
    try:
        code = _run(argv)
        if sys.stdout is not None:
            sys.stdout.flush()
        if stdout is not None and stdout.failed is not None:  # a failure someone swallowed
            raise stdout.failed
        return code
    except BrokenPipeError:  # the reader left (`calexec ... | head`): quietly, as SIGPIPE would
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as exc:  # the final flush: stdout on a full disk (`> /dev/full`), an I/O error
        _quiet_stdout()
        print(f"calexec: {cannot_write(None, exc)}", file=sys.stderr)
        return EXIT_CONFIG
    finally:
        if stdout is not None and sys.stdout is stdout:
            sys.stdout = real
        if stderr is not None and sys.stderr is stderr:
            sys.stderr = real_err


def _run(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        parser = build_parser()
        if not argv:
            parser.print_help(sys.stderr)
            return EXIT_CONFIG
        try:
            parser.parse_args(argv[:1])  # --help / --version exit 0; another flag: error 2
        except SystemExit as exc:
            return int(exc.code or 0)
        return EXIT_CONFIG  # pragma: no cover - parse_args always exits for a lone flag
    name = lookup(argv)
    if name is None:
        return _unknown(argv)
    command = COMMANDS[name]
    prog = f"calexec {name}"
    try:
        if command.extra:
            install = missing_extra(command.extra)
            if install is not None:
                raise UserError(f"needs the optional [{command.extra}] extra: {install}")
        module = importlib.import_module(command.module)
        # a SIGTERM (`timeout 600 calexec ...`, a supervisor, `kill PID`) is an interrupt as a
        # Ctrl-C is, so the command's temporary directory is removed and its child processes
        # end with it (they left /tmp/calexec-* behind, and `bench server`'s load generators
        # and `bench overhead`'s build ran on); `serve` drains on it instead (docs/operations.md);
        # a SIGHUP (the terminal closed) and a SIGQUIT (Ctrl-\) likewise
        with contextlib.nullcontext() if name == "serve" else sigterm_interrupts():
            try:
                return int(module.main(argv) or 0)
            finally:  # (a report directory made for a run that wrote nothing: not left)
                remove_empty_output_dirs()
    except UserError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return exc.code
    except SystemExit as exc:  # argparse's --help (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader left (`calexec ... | head`): quietly, as SIGPIPE would
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except Exception as exc:  # a bug: one line, the traceback on request
        user = as_user_error(exc)  # (a bad flag found late: a DeviceSpecError)
        if user is not None:
            print(f"{prog}: {user}", file=sys.stderr)
            return user.code
        if isinstance(exc, StdoutError):  # stdout itself failed (EIO, full): no output to give
            _quiet_stdout()
            if isinstance(sys.stdout, _Stdout):
                sys.stdout.failed = None  # (said here, not again by main)
            print(f"{prog}: {cannot_write(None, exc)}", file=sys.stderr)
            return EXIT_CONFIG
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:  # the environment, not a bug
            where = f" ({exc.filename})" if exc.filename else ""
            print(f"{prog}: cannot write: {exc.strerror}{where}", file=sys.stderr)
            try:  # (stdout may be the full one: its buffer must not fail again at exit)
                if sys.stdout is not None:
                    sys.stdout.flush()
            except OSError:
                _quiet_stdout()
            return EXIT_CONFIG
        try:  # (read as every on/off variable is: until stop 67 =0 showed the traceback)
            debug = env_flag(DEBUG_ENV, False, on="see the traceback",
                             off="see this one line")
        except EnvFlagError as err:
            print(f"{prog}: {err}", file=sys.stderr)
            debug = False
        if debug:
            raise
        first = str(exc).splitlines()[0] if str(exc) else ""
        print(f"{prog}: internal error: {type(exc).__name__}: {first} "
              "(set CALEXEC_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover - `python -m calexec.cli`
    sys.exit(main())
