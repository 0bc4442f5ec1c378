"""What every ``calexec`` subcommand's argument parsing shares.

- :func:`parser`: an ``argparse`` parser whose help shows each flag's default and whose errors
  are one line (``calexec serve: error: argument --port: ...``) with a "did you mean" for a
  mistyped flag, exit 2.
- :class:`UserError`: raised by a subcommand for a bad setting (exit 2, :data:`EXIT_CONFIG`) or
  a runtime refusal (exit 3, :data:`EXIT_REFUSED`); ``calexec.cli`` prints its one line, as it
  does for a ``DeviceSpecError`` (:func:`as_user_error`).
- :func:`add_device_args` / :func:`device_spec`: ``--manifest``, ``--calbin``,
  ``--runtime-lib`` (and for ``serve`` ``--reset-kind`` / ``--conform-report``) on every entry
  point that opens a device, turned into a validated ``DeviceSpec``.
- :func:`require_extra`: the one-line ``pip install`` a command prints when an optional extra
  it needs is not installed.
- :func:`cannot_write` / :func:`writable_file`: output a command cannot write (a report, a
  diagram, a PNG, stdout): one line naming the path (or ``stdout``) and the OS error, exit 2;
  ``writable_file`` finds it out before a long run.
- :func:`make_dir` / :func:`output_dir` / :func:`cannot_make_dir`: an output directory flag
  (``--out``, ``--report``, ``--dump-dir``) whose directory cannot be made: one line naming
  the flag and its value, ``not a directory`` when a file is there, exit 2.
- :func:`shell_word`: a path in a line of output (a file written, a file stale) as one shell
  word on that line, whatever it holds (a space, a newline, a byte that is not UTF-8).
- :func:`staged_report`: a command's output files (``--report DIR``, ``diagrams``' and
  ``charts draw``'s diagrams, ``charts names``' module) written all together or not at all: a Ctrl-C or an
  error while they are written leaves ``DIR`` as it was; a report's, written, replace the
  older report whole (its files this run did not write are removed, nothing else in
  ``DIR``).

Exit codes, the same for every subcommand: 0 success; 1 the command ran and its check failed
(a gate, a stale diagram, an oracle mismatch); 2 bad usage or configuration (named in the
message); 3 a runtime refusal (the executor did not start, or its lifecycle ended Failed);
``serve --once`` adds 4 (the sample request failed).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import functools
import importlib.util
import os
import re
import shlex
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from calexec.commands import lookup

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_REFUSED = 0, 1, 2, 3

#: how close (``difflib`` ratio) an unknown flag must be to one of the command's to be offered
#: as "did you mean" (a typo: ``--tokns`` 0.93, ``--mni`` 0.8; ``--out`` against
#: ``--timeout``, 0.71, is no typo of it)
FLAG_CUTOFF = 0.75

#: optional extras and the modules whose absence means the extra is not installed
EXTRAS: dict[str, tuple[str, ...]] = {
    # httpx: the loopback clients of `bench faults`, `bench soak`, `diagrams live` and the
    # chaos gate (without it they ended in an internal error, exit 70)
    "server": ("fastapi", "uvicorn", "prometheus_client", "httpx"),
    "plots": ("matplotlib",),
    "ray": ("ray",),
}


class UserError(Exception):
    """A one-line error for the user, and the exit code that goes with it."""

    def __init__(self, message: str, code: int = EXIT_CONFIG) -> None:
        super().__init__(message)
        self.code = code


def as_user_error(exc: BaseException) -> UserError | None:
    """``exc`` as the :class:`UserError` it means, or None for a bug: a ``UserError`` itself,
    or a ``DeviceSpecError`` (a ``--runtime-lib``/``--manifest``/``--calbin``/``$CALEXEC_CALRT_LIB``
    found bad only when a command opens it: one line naming the flag, exit 2), or an
    ``EnvFlagError`` (an on/off ``CALEXEC_*`` variable set to another value than 0 or 1)."""
    if isinstance(exc, UserError):
        return exc
    # (looked up, not imported: an exception of that class means its module is loaded, and an
    # internal error must not import the device layer to be reported)
    device_spec = sys.modules.get("calexec.drivers.device_spec")
    if device_spec is not None and isinstance(exc, device_spec.DeviceSpecError):
        return UserError(str(exc))
    # an on/off CALEXEC_* variable given another value than 0 or 1, read when the executor is
    # built (CALEXEC_CHECK_LOCK_ORDER=false: an internal error, exit 70, until stop 67)
    envflag = sys.modules.get("calexec.machines.envflag")
    if envflag is not None and isinstance(exc, envflag.EnvFlagError):
        return UserError(str(exc))
    return None


def missing_extra(extra: str) -> str | None:
    """The pip command that installs ``extra``, or None when it is installed."""
    for name in EXTRAS[extra]:
        try:
            if importlib.util.find_spec(name) is None:
                break
        except (ImportError, ValueError):  # blocked, or a broken half-installed module
            break
    else:
        return None
    return f"pip install 'calexec[{extra}]'"


def require_extra(extra: str, what: str) -> None:
    """Raise :class:`UserError` (exit 2) naming the install command when ``extra`` is absent."""
    command = missing_extra(extra)
    if command is not None:
        raise UserError(f"{what} needs the optional [{extra}] extra: {command}")


def default_unshown(default: Any) -> bool:
    """Whether a flag's ``default`` says nothing worth printing in its help: None, a switch's
    False, '' or argparse's SUPPRESS. A numeric 0 is a default like any other: compared with
    ``in (None, False, ...)`` it equals False, so ``demo --decode-us`` (0) and every
    ``--seed`` (0) printed no default at all."""
    return (default is None or default is False or default is argparse.SUPPRESS
            or (isinstance(default, str) and default == ""))


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Help text with each flag's default appended, unless :func:`default_unshown` or it is
    already said."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" not in text and "(default" not in text and action.option_strings
                and not default_unshown(action.default)):
            text += " (default: %(default)s)"
        return text


class _Given(argparse.Namespace):
    """A namespace that remembers each value stored in it once ``armed_``."""

    given_: dict[str, list[Any]]
    armed_: bool

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "given_", {})
        object.__setattr__(self, "armed_", False)

    def __setattr__(self, name: str, value: Any) -> None:
        if self.armed_:
            self.given_.setdefault(name, []).append(value)
        super().__setattr__(name, value)


class Parser(argparse.ArgumentParser):
    """One-line errors with suggestions; exit 2 through ``SystemExit`` as argparse does.

    A flag that takes one value (``--port N``, ``--host H``, a switch and its ``--no-``
    form) given twice with different values takes the last, as argparse and every
    argparse-based server (vLLM's, uvicorn's) do: a wrapper script that puts its defaults
    first and the caller's arguments after relies on it. It is no longer silent: one
    warning line on stderr names the flag, both values and the one taken (until stop 62
    ``--host 127.0.0.1 ... --host 0.0.0.0`` bound every interface without a word). The same
    value twice, and a flag that collects (``action="append"``, ``"count"``, ...), say
    nothing.

    A flag is taken only as spelled in full (``allow_abbrev=False``): ``--dec 0`` is refused,
    ``unrecognized arguments: --dec 0 (abbreviations are not taken: did you mean
    --decode-us?)``. argparse's prefix matching made a command line's meaning depend on the
    flags the command had: a script's ``--dec`` meant ``--decode-us`` until a later version
    added another flag starting so (then it was refused as ambiguous), and a typo that is a
    prefix of another flag was taken for it without a word.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        #: (flag, holds, why): ``flag`` given while ``holds(args)`` is false is refused
        self._only_with: list[tuple[str, Callable[[argparse.Namespace], bool], str]] = []
        #: the dests of the flags the command line gave, this parse (:meth:`_get_values`)
        self._given_dests: set[str] = set()
        self._words: list[str] = []
        #: the flags shown before ``--`` in the hint of a command given without it (a
        #: command-running tool's: ``charts cover``'s ``--chart MODULE:CLASS``); None: no hint
        self.command_after: str | None = None
        #: the dests whose values are secrets (:meth:`secret`), never shown in a message
        self._secret_dests: set[str] = set()

    def secret(self, flag: str) -> None:
        """Never show ``flag``'s value in a message of the parser (the warning of a flag given
        twice with different values, the hint of a value starting with '-'): ``serve
        --api-key``'s key, which its own checks never echo either, was written to stderr (a
        supervisor's log) by the warning of ``--api-key k1 --api-key k2``."""
        self._secret_dests.add(self._option_string_actions[flag].dest)

    def only_with(self, flag: str, holds: Callable[[argparse.Namespace], bool],
                  why: str) -> None:
        """Refuse ``flag`` given on the command line (any value, its default too) when
        ``holds`` of the parsed arguments is false: a usage error, ``argument FLAG: WHY``,
        exit 2, before the command runs. For a flag that does nothing without another
        (``serve --dump-prompts`` without ``--dump-dir``) or against another (``bench
        overhead --relay-work-us`` with ``--no-relay-floor``): taken and ignored, the
        operator believed it applied."""
        self._only_with.append((flag, holds, why))

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        #: the words parsed, for :meth:`error`'s hints
        self._words = [str(w) for w in (sys.argv[1:] if args is None else args)]
        if namespace is not None:  # a caller's namespace: argparse's own rules
            return super().parse_known_args(args, namespace)
        given = _Given()
        self._given_dests = set()
        # the defaults, set before the check is armed (argparse sets only the missing ones)
        for action in self._actions:
            if action.dest is not argparse.SUPPRESS and action.default is not argparse.SUPPRESS:
                setattr(given, action.dest, action.default)
        for dest, value in self._defaults.items():
            setattr(given, dest, value)
        object.__setattr__(given, "armed_", True)
        _, extras = super().parse_known_args(args, given)
        object.__setattr__(given, "armed_", False)
        collecting = tuple(self._registry_get("action", kind)
                           for kind in ("append", "append_const", "extend", "count"))
        for dest, values in given.given_.items():
            actions = [a for a in self._actions if a.dest == dest and a.option_strings]
            if not actions or any(isinstance(a, collecting) for a in actions):
                continue
            if any(value != values[0] for value in values[1:]):
                flags = "/".join(next((o for o in a.option_strings if o.startswith("--")),
                                      a.option_strings[0]) for a in actions)
                times = "twice" if len(values) == 2 else f"{len(values)} times"
                if dest in self._secret_dests:
                    warning = (f"{flags} given {times} with different values (not shown: "
                               "a secret): the last is taken")
                else:
                    shown = ", then ".join(_shown(value) for value in values)
                    warning = (f"{flags} given {times} with different values "
                               f"({shown}): the last, {_shown(values[-1])}, is taken")
                sys.stderr.write(f"{self.prog}: warning: "
                                 f"{warning.translate(_CONTROL_ESCAPES)}\n")
        result = argparse.Namespace(**{k: v for k, v in vars(given).items()
                                        if k not in ("given_", "armed_")})
        for flag, holds, why in self._only_with:
            # (not ``given_``: argparse sets a string default again, converted by its type,
            # after the command line, as if it had been given)
            if self._option_string_actions[flag].dest in self._given_dests and not holds(result):
                self.error(f"argument {flag}: {why}")
        return result, extras

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        if action.option_strings:  # (called for each flag the command line gives, only)
            self._given_dests.add(action.dest)
        # `--iters=--`: Python 3.11's argparse drops the '--' as the end of options and hands
        # the action an empty list, past its type (an internal error, exit 70, when the command
        # compared it); the value given is the word '--', checked as any other value
        if action.option_strings and action.nargs is None and arg_strings == ["--"]:
            value = self._get_value(action, "--")
            self._check_value(action, value)
            return value
        return super()._get_values(action, arg_strings)

    def _after_switch(self, words: list[str]) -> str:
        """`` (--png is a switch and takes no value: 'd' after it is no value of it)`` when
        the first unrecognized word of ``words``, no flag (it does not start with ``-``),
        follows a switch (a flag that takes no value) on the command line; "" otherwise."""
        if not words or words[0].startswith("-"):  # (argparse reads no such word as a
            # value: an unknown flag after a switch was called the switch's value)
            return ""
        for before, word in zip(self._words, self._words[1:]):
            action = self._option_string_actions.get(before)
            if word == words[0] and action is not None and action.nargs == 0:
                return (f" ({before} is a switch and takes no value: {word!r} after it is no "
                        f"value of it)")
        return ""

    def _dash_value_hint(self, message: str) -> str:
        """For argparse's "argument --api-key: expected one argument" when the word after the
        flag starts with '-' and is no flag of the command (an API key ``-k3y``, ``--note
        -draft``, ``--decode-us -1e3``): argparse reads it as a flag, so the flag "has no
        value", which sent the user looking for a value they had given. The hint says how to
        give it: ``--api-key=-k3y``."""
        names = message.removeprefix("argument ").partition(":")[0].split("/")
        words = self._words[:self._words.index("--")] if "--" in self._words else self._words
        for i, word in enumerate(words[:-1]):
            value = words[i + 1]
            if (word in names and value.startswith("-") and value != "-"
                    and value.partition("=")[0] not in self._option_string_actions):
                secret = self._option_string_actions[word].dest in self._secret_dests
                written = f"{word}=VALUE" if secret else shlex.quote(f"{word}={value}")
                return f" (a value that starts with '-' is read as a flag: write {written})"
        return ""

    def error(self, message: str) -> NoReturn:
        if message.startswith("argument ") and message.endswith(": expected one argument"):
            message += self._dash_value_hint(message)
        # (--help's name is "-h/--help": until stop 72 --help=1 kept argparse's words alone)
        switch = re.fullmatch(r"argument (?:-\w/)?(--[\w-]+): ignored explicit argument (.*)",
                              message)
        if switch:  # (--png=d: "ignored" read as if the run went on without it)
            message = (f"argument {switch[1]}: ignored explicit argument {switch[2]} (refused: "
                       f"{switch[1]} is a switch and takes no value: give {switch[1]} alone)")
        if message.startswith("unrecognized arguments:"):
            flags = [s for s in self._option_string_actions if s.startswith("--")]
            words = message.split(":", 1)[1].split()
            after = words[words.index("--") + 1:] if "--" in words else []
            flag = next((w.split("=")[0] for w in after
                         if w.split("=")[0] in self._option_string_actions), None)
            if flag is not None:  # (was "abbreviations are not taken: did you mean" it)
                message += (f" ({flag} after `--` is an argument, not a flag, and this command "
                            f"takes no such argument: put {flag} before `--`)")
                words = []
            for word in words:
                name = word.split("=")[0]
                longer = sorted(f for f in flags if f.startswith(name)) if len(name) > 2 else []
                if name.startswith("--") and longer:  # (an abbreviation, taken until stop 67)
                    message += (" (abbreviations are not taken: did you mean "
                                f"{' or '.join(longer[:3])}{' or ...' if len(longer) > 3 else ''}?)")
                    break
                # (0.75: difflib's default 0.6 offered --timeout for --out, which shares
                # only its letters; a typo of a flag, --tokns, --mni, scores 0.8 and more)
                close = difflib.get_close_matches(name, flags, n=1, cutoff=FLAG_CUTOFF)
                if close:
                    message += f" (did you mean {close[0]}?)"
                    break
            else:
                after_switch = self._after_switch(words)
                if after_switch:  # (charts draw X --png d: d read as the switch's value)
                    message += after_switch
                elif self.command_after and words and "--" not in self._words:
                    # (`charts cover --chart M:C python -c ...`: "unrecognized arguments: -c
                    # ...", nothing said that a command's own flags go after `--`)
                    message += (f" (a command with flags of its own goes after `--`: "
                                f"{self.prog} {self.command_after} -- COMMAND ...)")
        # one line whatever was typed: a control character in an argument (a newline in an
        # unknown word, an escape sequence) is shown escaped, never written to the terminal
        message = message.translate(_CONTROL_ESCAPES)
        self.exit(EXIT_CONFIG, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _shown(value: Any) -> str:
    """A stored value as a usage error shows it: a string quoted, the rest as Python prints."""
    return repr(value) if isinstance(value, str) else str(value)


#: control characters (C0, DEL, C1) and the Unicode line separators escaped in a usage error
_CONTROL_ESCAPES = {c: repr(chr(c))[1:-1]
                    for c in (*range(0x20), *range(0x7f, 0xa0), 0x2028, 0x2029)}


def parser(prog: str, doc: str | None) -> Parser:
    """A subcommand's parser: ``doc``'s first paragraph is the description."""
    description = (doc or "").strip().split("\n\n")[0].replace("``", "")
    return Parser(prog=prog, description=description, formatter_class=_Formatter)


# ---- value types: argparse turns their ValueError/ArgumentTypeError into a one-line error ----
#: an integer as a command line or an environment variable writes it: ASCII decimal digits,
#: a sign, blanks around (Python's ``int()`` also reads "1_0" as 10 and "٣", an Arabic-Indic
#: digit, as 3: until stop 73 ``--iters 1_0`` ran 10 and ``CALEXEC_PROGRESS_S=1_0`` was 10 s)
INTEGER_TEXT = re.compile(r"\s*[+-]?[0-9]+\s*")
#: a number so written (``float()`` reads the same "1_0" and "٣"): ASCII digits, a point, an
#: exponent, or ``inf``/``nan`` (each flag's range then refuses those, naming it)
NUMBER_TEXT = re.compile(r"\s*[+-]?(([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?"
                         r"|inf|infinity|nan)\s*", re.IGNORECASE)


def ascii_integer(text: str) -> int | None:
    """``text`` as an int when it is one as :data:`INTEGER_TEXT` writes it, else None: what a
    value a command reads itself (a part of a comma list, ``LO-HI``, an environment variable)
    goes through, so that it refuses ``1_0`` and ``٣`` as every flag does (until stop 74
    ``bench soak --max-tokens 1_0-2_0`` ran 10 to 20 tokens)."""
    if not INTEGER_TEXT.fullmatch(text):
        return None
    try:
        return int(text)
    except ValueError:  # (more digits than int() reads: 4300)
        return None


def ascii_number(text: str) -> float | None:
    """``text`` as a float when it is one as :data:`NUMBER_TEXT` writes it (``inf`` and
    ``nan`` included: the caller's range refuses them naming its flag), else None."""
    if not NUMBER_TEXT.fullmatch(text):
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _integer(text: str) -> int:
    """``text`` as an int, or the one-line refusal naming it (argparse would say ``invalid
    positive_int value``, the name of this module's function, not what was wrong)."""
    value = ascii_integer(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
    return value


def _number(text: str) -> float:
    value = ascii_number(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    return value


def port(text: str) -> int:
    value = _integer(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (0..65535)")
    return value


def positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """A count or seed that may be 0 (a seed: numpy's ``default_rng`` refuses a negative one)."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def int_in(low: int, high: int) -> Callable[[str], int]:
    """The argparse type of an integer flag in ``low..high``."""

    def bounded(text: str) -> int:
        value = _integer(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {value}")
        return value

    return bounded


#: the most each count flag of a benchmark takes: its loop runs until the count is done, and
#: a count of no bound (``bench logits --iters 99999999999999999999``) ran for ever, its
#: progress line counting towards a total it never reaches. Each maximum is far past the
#: issue's own figure (``bench soak``: 250000 requests; ``bench faults``: 1000 faults), and
#: said in the flag's ``--help`` (docs/benchmarks.md lists them)
MAX_COUNTS: dict[str, int] = {
    "bench charts --iters": 10_000_000,
    "bench logits --iters": 1_000_000,
    "bench overhead --runs": 1000,
    "bench recovery --recoveries": 100_000,
    "bench server --requests": 1_000_000,
    "bench server --rounds": 1000,
    "bench faults --faults": 100_000,
    "bench soak --requests": 10_000_000,
}


def count(flag: str) -> Callable[[str], int]:
    """The argparse type of a benchmark's count flag ``flag`` (``"bench logits --iters"``):
    an integer in 1..:data:`MAX_COUNTS` ``[flag]`` (below 1 refused as :func:`positive_int`
    refuses it)."""
    high = MAX_COUNTS[flag]

    def bounded(text: str) -> int:
        value = positive_int(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"must be in 1..{high}, got {value}")
        return value

    return bounded


def add_inflight_capacity(parser: argparse.ArgumentParser) -> None:
    """``--inflight-capacity {1,2}``: ``ExecutorConfig.inflight_capacity`` (1: Phase A, the
    default; 2: Phase B, two jobs on the device), for ``serve``, ``bench soak`` and ``bench
    faults``."""
    parser.add_argument("--inflight-capacity", type=int_in(1, 2), default=1, metavar="{1,2}",
                        help="jobs on the device at once: 1 (Phase A, default) or 2 (Phase B, "
                             "ExecutorConfig.inflight_capacity; enable after `calexec accept "
                             "--phase b` and `calexec conform` passed on the device)")


#: the most concurrent loopback clients a load command starts (``--clients``), as ``bench
#: server --concurrency`` takes: each is an OS thread with its own connection, so
#: ``--clients 100000`` started threads for minutes, silent, before the first request
MAX_CLIENTS = 256


def clients(text: str) -> int:
    """A ``--clients`` flag's value: an integer in 1..:data:`MAX_CLIENTS`."""
    return int_in(1, MAX_CLIENTS)(text)


def utf8_text(text: str) -> str:
    """A free-text flag's value (``golden record --note``) that a UTF-8 file can hold: an
    argument with a byte that is not UTF-8 reaches Python as a lone surrogate (``\\udcff``),
    which no UTF-8 or TOML file can store, and is refused naming it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r}: not UTF-8 text (byte 0x{ord(text[exc.start]) & 0xFF:02x} at character "
            f"{exc.start + 1})") from None
    return text


def nonempty(text: str) -> str:
    """A path flag's value: '' (an unset variable in a script) is refused, never taken for
    'no value' or for the working directory (``Path('')`` is ``.``)."""
    if not text:
        raise argparse.ArgumentTypeError("empty path (omit the flag for its default)")
    return text


def nonempty_path(text: str) -> Path:
    """:func:`nonempty` as a ``Path``."""
    return Path(nonempty(text))


def not_stdout(text: str) -> str:
    """An output path flag's value: ``-`` (stdout, as most tools take it) is refused, not
    made a file or directory named ``-`` in the working directory with nothing said (the
    output is files, which stdout cannot hold); ``./-`` names such a file."""
    if text == "-":
        raise argparse.ArgumentTypeError(
            "'-' is not stdout here: it would be a path named '-' in the working directory "
            "(this output is written as files); give a path (./- for that name)")
    return text


def output_file(text: str) -> str:
    """An output path flag's value: :func:`nonempty` and :func:`not_stdout`."""
    return not_stdout(nonempty(text))


def output_path(text: str) -> Path:
    """:func:`output_file` as a ``Path``."""
    return Path(output_file(text))


def positive_float(text: str) -> float:
    value = _number(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


#: the emulator's largest latency knob (``decode_us`` and the others in docs/emulator.md)
MAX_LATENCY_US = 60_000_000


def latency_us(text: str) -> int:
    """An emulated latency flag (``--decode-us``) in microseconds: an integer in
    0..:data:`MAX_LATENCY_US`, the range the emulator's device config takes (above it the
    device used to refuse to open, exit 3, in words that did not name the flag)."""
    value = _integer(text)
    if not 0 <= value <= MAX_LATENCY_US:
        raise argparse.ArgumentTypeError(f"must be in 0..{MAX_LATENCY_US} us, got {value}")
    return value


#: the longest duration a seconds flag (``--grace``, ``--timeout``, ``--soak-seconds``, ...)
#: takes: about 11.6 days. Longer is no run anyone waits for, and a longer timer overflows the
#: waits under it: a subprocess's wait polls in milliseconds in a C int, at most about 24.8
#: days (``conform --timeout 1e7`` was ``internal error: OverflowError``, exit 70, as ``1e30``
#: was for every seconds flag).
MAX_SECONDS = 1e6


def wait_s(bound: float) -> float:
    """A wait's bound in seconds derived from a count (``60 s`` per request of a ``--requests``
    the user chose), made one the standard library's waits take: at most
    :data:`MAX_SECONDS`. Unclamped, ``bench server --requests 150000`` ended its first load
    block in ``internal error: OverflowError: timeout is too large`` (a subprocess's wait
    takes at most about 24.8 days), ``--requests 1e30`` in ``timestamp out of range for
    platform time_t`` (a thread's join)."""
    return min(bound, MAX_SECONDS)


def seconds(text: str) -> float:
    """A duration flag's value in seconds: a finite number > 0 and at most
    :data:`MAX_SECONDS`."""
    value = _number(text)
    if not 0 < value <= MAX_SECONDS:  # (NaN fails both comparisons)
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds > 0 and at most {MAX_SECONDS:g}, got {text!r}")
    return value


def cannot_make_dir(flag: str, path: str | os.PathLike[str], exc: BaseException) -> UserError:
    """The :class:`UserError` (exit 2) of an output directory ``flag`` names that cannot be
    made, to raise ``from None``: one line naming ``flag`` and ``path``; "not a directory"
    when something else is there already (the OS says "File exists"), else the OS error::

        --out='x.txt': not a directory
        --report='/proc/x': cannot make the directory: No such file or directory
    """
    given = os.fsdecode(path)
    if isinstance(exc, FileExistsError):  # (makedirs with exist_ok: only a non-directory)
        return UserError(f"{flag}={given!r}: not a directory")
    return UserError(f"{flag}={given!r}: cannot make the directory: "
                     f"{getattr(exc, 'strerror', None) or exc}")


def refuse_non_directory(flag: str, path: str | os.PathLike[str]) -> None:
    """Raise :func:`cannot_make_dir`'s "not a directory" when something other than a directory
    is at the output directory ``flag`` names (a missing one passes: it is made later, or is
    stale for a ``--check``)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise cannot_make_dir(flag, path, FileExistsError())


def make_dir(flag: str, path: str | os.PathLike[str]) -> None:
    """Make the output directory ``flag`` names (with its parents), or raise
    :func:`cannot_make_dir`'s error."""
    try:
        os.makedirs(path, exist_ok=True)
    except (OSError, ValueError) as exc:  # (ValueError: a NUL in the path)
        raise cannot_make_dir(flag, path, exc) from None


#: the directories :func:`output_dir` made (each missing parent too), deepest last: those
#: still empty when the command ends are removed (:func:`remove_empty_output_dirs`)
_MADE_OUTPUT_DIRS: list[str] = []


def output_dir(flag: str, path: str, files: tuple[str, ...] = ()) -> None:
    """Make the directory a command writes its report into, before the run (a run can last
    hours), and check that each of ``files`` in it can be written (:func:`writable_file`):
    one line naming ``flag`` and ``path`` (UserError, exit 2) when not (:func:`make_dir`).
    Made here, it is removed again when the command ends with nothing written in it (a
    Ctrl-C during the run, a flag refused after it: ``calexec`` calls
    :func:`remove_empty_output_dirs`), so no empty report directory is left behind."""
    missing, parent = [], os.path.abspath(path)
    while not os.path.lexists(parent) and parent != os.path.dirname(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    make_dir(flag, path)
    _MADE_OUTPUT_DIRS.extend(reversed(missing))
    for name in files:
        writable_file(flag, os.path.join(path, name), path)


def remove_empty_output_dirs() -> None:
    """Remove each directory :func:`output_dir` made that is still empty, deepest first (the
    command is over: it wrote nothing there); one that holds a file stays."""
    while _MADE_OUTPUT_DIRS:
        try:
            os.rmdir(_MADE_OUTPUT_DIRS.pop())
        except OSError:  # (not empty: the report, or the user's file; gone already)
            continue


@contextlib.contextmanager
def staged_report(flag: str, directory: str | os.PathLike[str],
                  files: tuple[str, ...] = (), *,
                  given: str | os.PathLike[str] | None = None) -> Iterator[str]:
    """A scratch directory inside the output directory ``directory``, for the block to write
    the command's files into (a report's, ``diagrams``' and ``charts draw``'s diagrams,
    ``charts names``' module: every command that replaces a set of files goes through here). When the block
    ends without an exception they replace the files of the same names in ``directory``
    together, and each of ``files`` (the names a report of this kind may have, say
    ``timing.png``) this run did not write is removed, so no file of an older run sits beside
    the new report as if it were its own; any other file in ``directory`` is the user's and
    stays. A Ctrl-C that arrives meanwhile is held until they all are, then interrupts as
    usual. When the block raises (a ``KeyboardInterrupt`` too) the scratch directory is
    removed and ``directory`` keeps what it had: an interrupted or failed write never leaves
    output that looks complete, half new and half old or cut short. A new file gets the mode
    ``open()`` gives it (the umask applied). ``directory`` that cannot be made, or written
    in, is :func:`cannot_write`'s one line naming ``flag`` with its value ``given`` (default
    ``directory``; the file, when the flag names one: ``charts names --out FILE``)
    (UserError, exit 2)."""
    shown = directory if given is None else given
    make_dir(flag, directory)
    try:
        scratch = tempfile.mkdtemp(prefix=".partial-", dir=directory)
    except OSError as exc:  # (named as the output, not the scratch name the user never gave)
        unnamed = OSError(exc.errno, exc.strerror or str(exc))
        raise cannot_write(shown, unnamed, flag) from None
    try:
        try:
            yield scratch
        except OSError as exc:  # (a full disk: named as the report's file, not the scratch one)
            if exc.filename is None:  # (a write's error names no file: the output's, then)
                raise cannot_write(shown, exc, flag) from None
            name = os.fsdecode(exc.filename)
            if os.path.dirname(os.path.abspath(name)) != os.path.abspath(scratch):
                raise
            named = OSError(exc.errno, exc.strerror or str(exc),
                            os.path.join(directory, os.path.basename(name)))
            raise cannot_write(shown, named, flag) from None
        names = sorted(os.listdir(scratch))
        # an older run's file of the report this run did not write (a timing.png of a run
        # with a timeline, under a new report without one); a directory there is not one
        stale = [name for name in sorted(set(files) - set(names))
                 if os.path.lexists(target := os.path.join(directory, name))
                 and (os.path.islink(target) or not os.path.isdir(target))]
        for name in names:  # (what is no file in a file's place: found before any file moves)
            target = os.path.join(directory, name)
            if os.path.isdir(target) and not os.path.islink(target):
                named = OSError(errno.EISDIR, os.strerror(errno.EISDIR), target)
                raise cannot_write(shown, named, flag) from None
            try:
                link, mode = os.lstat(target).st_mode, os.stat(target).st_mode
            except OSError:  # (none there yet, or a dangling link: replaced)
                continue
            if (not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)
                    and (stat.S_ISLNK(link) or not stat.S_ISFIFO(mode))):
                # a device, a socket, a link to one or to a FIFO (/dev/stdout): the rename
                # would put a file in its place (as root, in place of /dev/null itself); a
                # FIFO of its own in the output directory is replaced as a stale file is
                named = OSError(errno.EINVAL, f"not a regular file ({stat.filemode(mode)}), "
                                f"which the new file would replace", target)
                raise cannot_write(shown, named, flag) from None
        with interrupts_held():
            for name in names:
                target = os.path.join(directory, name)
                try:
                    os.replace(os.path.join(scratch, name), target)
                except OSError as exc:  # (named as the report's file, not the scratch one)
                    named = OSError(exc.errno, exc.strerror or str(exc), target)
                    raise cannot_write(shown, named, flag) from None
            for name in stale:
                target = os.path.join(directory, name)
                try:
                    os.unlink(target)
                except FileNotFoundError:  # (removed meanwhile: what was asked)
                    pass
                except OSError as exc:
                    raise UserError(f"{flag}={os.fsdecode(shown)!r}: cannot remove "
                                    f"{target!r} of an older run: "
                                    f"{exc.strerror or exc}") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


#: the signals :func:`sigterm_interrupts` makes a Ctrl-C: a supervisor's or ``timeout``'s
#: SIGTERM, the terminal's SIGHUP (its window closed, the ssh connection lost) and SIGQUIT
#: (Ctrl-\); each would end calexec where it stood, its child processes running on
ENDING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGQUIT")
                       if hasattr(signal, name))


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """A SIGTERM, SIGHUP or SIGQUIT (:data:`ENDING_SIGNALS`) during the block (``timeout``, a
    supervisor, a terminal closed) raises ``KeyboardInterrupt`` in the main thread, as a
    Ctrl-C does, so a command whose child processes would outlive it ends them on its
    interrupt path and exits 130 (``conform``: its experiment child ran on, then printed a
    traceback; ``charts mutate``'s test command ran on after a SIGHUP ended calexec, exit
    129). A signal ignored when the block starts (``nohup`` ignores SIGHUP, a background job
    of a non-interactive shell SIGQUIT) stays ignored. Nothing changes off the main thread
    or where no handler can be set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    previous: dict[int, Any] = {}
    try:
        for sig in ENDING_SIGNALS:
            if sig == signal.SIGTERM or signal.getsignal(sig) != signal.SIG_IGN:
                previous[sig] = signal.signal(sig, interrupt)
    except (ValueError, OSError):
        for sig, kept in previous.items():
            signal.signal(sig, kept)
        yield
        return
    try:
        yield
    finally:
        for sig, kept in previous.items():
            signal.signal(sig, kept)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold a SIGINT, and a SIGTERM, SIGHUP or SIGQUIT a Python handler takes
    (:func:`sigterm_interrupts`'), for
    the block and deliver the first after, as the handler in place would have: what must not
    be cut in two (files renamed into place, a child started and recorded to be ended) runs
    whole. The main thread only (elsewhere Python runs no handler); a signal with a handler
    not set from Python is not held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous: dict[int, Any] = {}
    try:
        for sig in (signal.SIGINT, *ENDING_SIGNALS):
            handler = signal.getsignal(sig)
            if handler is not None and (sig == signal.SIGINT or callable(handler)):
                previous[sig] = signal.signal(sig, lambda num, frame: received.append(num))
    except (ValueError, OSError):  # (no signals here: nothing to hold)
        for held, kept in previous.items():
            signal.signal(held, kept)
        previous.clear()
    try:
        yield
    finally:
        for held, kept in previous.items():
            signal.signal(held, kept)
    if received:
        handler = previous[received[0]]
        if callable(handler):
            handler(received[0], None)
        elif handler == signal.SIG_DFL and received[0] == signal.SIGINT:
            raise KeyboardInterrupt


def cannot_write(path: str | os.PathLike[str] | None, exc: BaseException,
                 flag: str | None = None) -> UserError:
    """The :class:`UserError` (exit 2) of output that cannot be written, to raise ``from None``:
    one line naming the file (``exc.filename`` when the OS names one, else ``path``; ``path``
    None: stdout) and the OS error, after ``flag=path`` when a flag gave the path::

        --report='out': cannot write 'out/mutation.md': Is a directory
        --out='live.png': cannot write it: Is a directory
        cannot write to stdout: Input/output error
    """
    reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    filename = getattr(exc, "filename", None)
    named = filename if filename is not None else path
    target = None if named is None else os.fsdecode(named)
    what = "to stdout" if target is None else repr(target)
    if flag is not None and path is not None:
        given = os.fsdecode(path)
        return UserError(f"{flag}={given!r}: cannot write "
                         f"{'it' if target == given else what}: {reason}")
    return UserError(f"cannot write {what}: {reason}")


def cannot_run(program: str, exc: OSError, cwd: str | os.PathLike[str] | None = None) -> str:
    """Why a test command's ``program`` could not be started (``exc`` from ``Popen``), for a
    one-line error: the OS error, and what the program is when that error misleads: a
    directory (``Permission denied``), or a file of the directory the command runs in
    (``cwd``) that is not on PATH (``No such file or directory``, of a file that is there;
    until stop 71 the OS error alone)."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    where = os.path.join(os.fspath(cwd) if cwd is not None else os.getcwd(), program)
    if program and os.path.isdir(where):
        return f"{reason}: {program!r} is a directory, not a program"
    if (program and "/" not in program and os.sep not in program and os.path.isfile(where)
            and isinstance(exc, FileNotFoundError)):
        give = f"python {program}" if program.endswith(".py") else f"./{program}"
        return (f"{reason}: {program!r} is not on PATH, but a file of that name is in the "
                f"directory the command runs in: give {give}")
    return reason


#: what a character becomes inside ``$'...'`` (:func:`shell_word`), besides ``\\xHH``
_ANSI_C = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def shell_word(path: str | os.PathLike[str]) -> str:
    """``path`` as one shell word on one line, for a line of output that names a file (a file
    written, a file stale): ``shlex.quote``'s (a plain path unchanged, one with a space or a
    ``'`` single-quoted); a path with a control character (a newline) or a byte that is not
    UTF-8 in bash's ``$'...'`` (zsh, ksh and POSIX sh since 2024 read it too), so the line a
    script reads holds the whole path, never a part of it on the next line."""
    text = os.fsdecode(path)
    if text.isprintable():
        return shlex.quote(text)
    escaped = []
    for char in text:
        if char in _ANSI_C:
            escaped.append(_ANSI_C[char])
        elif char.isprintable():
            escaped.append(char)
        else:  # (a byte not UTF-8 is a surrogate escape: the byte itself)
            try:
                escaped.extend(f"\\x{byte:02x}" for byte in os.fsencode(char))
            except UnicodeEncodeError:  # (a lone surrogate no file name holds)
                escaped.append(f"\\u{ord(char):04x}")
    return "$'" + "".join(escaped) + "'"


def writable_file(flag: str, path: str | os.PathLike[str],
                  given: str | os.PathLike[str] | None = None) -> None:
    """Find out before a run that the file ``path`` can be written: its directory exists and it
    is not a directory itself; raises :func:`cannot_write`'s error naming ``flag`` with its
    value ``given`` (default ``path``; a report directory, say, when ``path`` is a file in it).
    (Opened for appending, never truncated; a file made by the probe is removed.)"""
    existed = os.path.lexists(path)
    try:
        if existed and not stat.S_ISREG(mode := os.stat(path).st_mode) and not stat.S_ISDIR(mode):
            return  # a FIFO or a device (/dev/stdout): opening it may block; the write will tell
        with open(path, "ab"):
            pass
    except (OSError, ValueError) as exc:  # (ValueError: a NUL in the path)
        raise cannot_write(path if given is None else given, exc, flag) from None
    if not existed:
        try:
            os.unlink(path)
        except OSError:
            pass


def refuse_input_as_output(flag: str, path: str | os.PathLike[str],
                           inputs: Iterable[tuple[str, str | os.PathLike[str] | None]]) -> None:
    """``UserError`` (exit 2) when the output file ``flag`` names (``path``) is one of the
    run's ``inputs`` (``(flag, path)``, a None path not given): the output written at the end
    replaced the file the run read (``bench pingpong --calbin m.calbin --trace m.calbin``:
    the model overwritten by a trace, exit 0). Found before the run; the same file through
    another name (a link, ``./``) too."""
    for given, value in inputs:
        if value is None or not os.path.exists(value) or not os.path.exists(path):
            continue
        try:
            same = os.path.samefile(path, value)
        except OSError:  # (gone meanwhile: nothing to replace)
            continue
        if same:
            raise UserError(f"{flag}={os.fsdecode(path)!r}: the same file as "
                            f"{given}={os.fsdecode(value)!r}, which the run reads: the output "
                            "would replace it; give another path")


def read_small_text(flag: str, path: str | os.PathLike[str], limit: int, what: str) -> str:
    """The UTF-8 text of the small input file ``flag`` names (a token file, a TOML list): a
    regular file or a pipe (``<(command)``), at most ``limit`` bytes. Refused in one line
    naming ``flag`` and its value (UserError, exit 2), never a hang or a read without end: a
    directory, a device (``/dev/zero``), a longer file, text that is not UTF-8, a FIFO that
    gave nothing (opened without waiting for a writer: one no process writes to is told apart
    from an empty file, which it is not). A leading UTF-8 byte order mark (an editor's, as
    Notepad saves) is not part of the text."""
    given = os.fsdecode(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO: do not wait for a writer)
    except (OSError, ValueError) as exc:  # (ValueError: a NUL in the path)
        raise UserError(f"{flag}={given!r}: cannot read it: "
                        f"{getattr(exc, 'strerror', None) or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        fifo = stat.S_ISFIFO(mode)
        if stat.S_ISDIR(mode):
            raise UserError(f"{flag}={given!r}: is a directory, not {what}")
        if not (stat.S_ISREG(mode) or fifo):
            raise UserError(f"{flag}={given!r}: not a regular file ({stat.filemode(mode)}), "
                            f"not {what}")
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise UserError(f"{flag}={given!r}: cannot read it: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if size > limit:
        raise UserError(f"{flag}={given!r}: longer than {limit} bytes, not {what}")
    if fifo and size == 0:  # (said "is empty" of a FIFO whose writer had not started yet)
        raise UserError(f"{flag}={given!r}: a FIFO that gave nothing (no process was writing to "
                        f"it when it was read); give a regular file, or start the writer first "
                        f"(a shell's <(command) is one)")
    try:
        # (the mark dropped after decoding: "utf-8-sig" counted the bad byte from after it)
        return b"".join(chunks).decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise UserError(f"{flag}={given!r}: not UTF-8 text ({exc.reason} at byte "
                        f"{exc.start}), not {what}") from None


# ---- the device an entry point opens ---------------------------------------------------------
def add_device_args(p: argparse.ArgumentParser, *, calbin: bool = True, manifest: bool = True,
                    reset: bool = False) -> None:
    """``--runtime-lib``, ``--manifest``, ``--calbin`` (and ``--reset-kind``,
    ``--conform-report`` with ``reset``) with the bundled emulator's defaults."""
    group = p.add_argument_group("device (defaults: the bundled emulator and its synthetic model)")
    group.add_argument("--runtime-lib", metavar="PATH",
                       help="CalRT library implementing drivers/calrt/calrt.h to dlopen "
                            "(default: $CALEXEC_CALRT_LIB, else the bundled emulator)")
    if manifest:
        group.add_argument("--manifest", metavar="PATH",
                           help="model manifest TOML, docs/manifest.md (default: the packaged "
                                "synthetic Qwen3 manifest)")
    if calbin:
        group.add_argument("--calbin", metavar="PATH",
                           help="calbin to load (default: the synthetic calbin, written to a "
                                "temporary directory)")
    if reset:
        group.add_argument("--reset-kind", choices=("reset", "reset_ccu",
                                                    "reset_configuration", "none"),
                           help="the reset a recovery uses (default: the bundled emulator's "
                                "'reset'; with an external library the --conform-report "
                                "verdict, else 'none': a fault that needs a reset ends Failed)")
        group.add_argument("--conform-report", metavar="PATH",
                           help="a `calexec conform --report DIR` directory (or its "
                                "conformance.json): the reset kind its verdicts prove safe")


def device_spec(args: argparse.Namespace, synthetic: str | None = None) -> Any:
    """The validated ``DeviceSpec`` of :func:`add_device_args`' flags; raises UserError.
    ``synthetic``: the command runs only the synthetic model, for this reason (said when a
    ``--calbin`` is not one)."""
    from calexec.drivers.device_spec import DeviceSpec, DeviceSpecError

    spec = DeviceSpec(manifest_path=getattr(args, "manifest", None),
                      calbin_path=getattr(args, "calbin", None),
                      runtime_lib=getattr(args, "runtime_lib", None),
                      reset_kind=getattr(args, "reset_kind", None),
                      conform_report=getattr(args, "conform_report", None))
    try:
        spec.check()
        if synthetic is not None:
            spec.check_synthetic_calbin(synthetic)
    except DeviceSpecError as exc:
        raise UserError(str(exc)) from None
    return spec


def check_calbin(spec: Any) -> None:
    """Refuse the ``--calbin`` of ``spec`` (a ``DeviceSpec``; a given one: the default synthetic
    calbin is the packaged manifest's) that the runtime's loader refuses (a garbage or cut
    file) or the manifest does not describe (``sim write-calbin --hidden 63`` under the
    packaged manifest), before the executor starts: the check ``serve --calbin`` and a model
    switch run (machines/switch_check.py). Raises UserError naming the flag, exit 3 as ``serve
    --calbin`` exits for it (a failed start said the CalRT configure error twice, the
    executor's log line and the Status, the flag not named)."""
    refusal = spec.calbin_refusal()
    if refusal is not None:
        raise UserError(refusal, EXIT_REFUSED)


def say(prog: str, message: str) -> None:
    """One line on stderr, prefixed with the command."""
    print(f"{prog}: {message}", file=sys.stderr, flush=True)


#: seconds between two progress lines of a long loop (:class:`Ticker`), unless the environment
#: variable ``CALEXEC_PROGRESS_S`` says otherwise (0: a line every step)
PROGRESS_S = 10.0
PROGRESS_ENV = "CALEXEC_PROGRESS_S"


def progress_s() -> float:
    """Seconds between two progress lines: ``$CALEXEC_PROGRESS_S`` (a number of seconds >= 0
    and at most :data:`MAX_SECONDS`; anything else a :class:`UserError` naming it), else
    :data:`PROGRESS_S`."""
    text = os.environ.get(PROGRESS_ENV, "").strip()
    if not text:
        return PROGRESS_S
    value = ascii_number(text)
    if value is None or not 0 <= value <= MAX_SECONDS:  # (NaN fails both)
        raise UserError(f"{PROGRESS_ENV}={text!r}: must be a number of seconds >= 0 and at most "
                        f"{MAX_SECONDS:g}")
    return value


class Ticker:
    """Progress of a long loop (``bench charts --iters 10000000``) on stderr, through
    :func:`say`: ``prog: what done/total`` at most once every ``every_s`` seconds (default:
    :func:`progress_s`), and once
    when the loop is done (unless ``last`` is False: a command whose short runs should stay as
    quiet as they were). Call it with the count done after each step; it only reads the clock
    until a line is due. Such loops printed one line when they started, then nothing for
    minutes."""

    def __init__(self, prog: str, what: str, total: int, every_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, last: bool = True) -> None:
        self.prog, self.what, self.total = prog, what, total
        self.every_s = progress_s() if every_s is None else every_s
        self.clock, self.last = clock, last
        self._due = clock() + self.every_s

    def __call__(self, done: int) -> None:
        if (self.last and done >= self.total) or self.clock() >= self._due:
            self._due = self.clock() + self.every_s
            say(self.prog, f"{self.what} {done}/{self.total}")


def command_main(fn: Callable[[list[str]], int]) -> Callable[[list[str]], int]:
    """Decorate a subcommand's ``main(argv)``: a :class:`UserError` (or what
    :func:`as_user_error` takes for one) becomes its one line on stderr (``calexec <command>:
    message``) and its exit code, whether the module is called through ``calexec.cli`` or
    directly."""

    @functools.wraps(fn)
    def main(argv: list[str]) -> int:
        try:
            return fn(argv)
        except Exception as exc:
            user = as_user_error(exc)
            if user is None:
                raise
            say(f"calexec {lookup(argv) or argv[0]}", str(user))
            return user.code

    return main
