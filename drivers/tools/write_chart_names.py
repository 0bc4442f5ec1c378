"""``calexec charts names [--check] [--out FILE]``: write machines/chart_names.py, one constant
per state and event of every declared chart (``calexec.machines.compiled.names_source``), or
``--check`` that the committed file is current (exit 1 and the fix command when stale or
missing). Exit 2: ``--out`` empty, or a path that cannot be written (or, with ``--check``,
read as a text file: a directory, a device, a FIFO), in one line naming it."""

from __future__ import annotations

import argparse
import os
import stat
import sys
from pathlib import Path

from calexec.cliargs import UserError, command_main, output_path, shell_word, staged_report
from calexec.cliargs import parser as cli_parser
from calexec.machines.compiled import CHARTS, names_source

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "machines" / "chart_names.py"


def current_text(path: Path, size: int) -> str | None:
    """The text of the module ``--out`` names (None when there is none), as far as it can
    equal a module of ``size`` bytes: at most ``size + 1`` bytes are read (a longer file is
    stale, not read to its end), bytes that are not UTF-8 replaced (a stale file, not an
    error). ``UserError`` (exit 2) naming ``--out`` for what is no file: a directory, a device
    (``/dev/zero`` was read until the kernel killed the command), a FIFO (waited on)."""
    given = str(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as err:
        raise UserError(f"--out={given!r}: cannot read it: {err.strerror or err}") from None
    if stat.S_ISDIR(mode):
        raise UserError(f"--out={given!r}: is a directory, not a generated chart names module")
    if not stat.S_ISREG(mode):
        raise UserError(f"--out={given!r}: not a regular file ({stat.filemode(mode)}), not a "
                        f"generated chart names module")
    try:
        with open(path, "rb") as handle:
            return handle.read(size + 1).decode("utf-8", errors="replace")
    except OSError as err:
        raise UserError(f"--out={given!r}: cannot read it: {err.strerror or err}") from None


@command_main
def main(argv: list[str]) -> int:
    parser = cli_parser("calexec charts names", __doc__)
    parser.add_argument("--out", type=output_path, default=DEFAULT_OUT,
                        help="the generated module (default: machines/chart_names.py of this "
                             "source tree)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if --out differs from what the declarations generate")
    parser.add_argument("chart", nargs="?", help=argparse.SUPPRESS)  # (refused, below)
    args = parser.parse_args(argv[2:])
    if args.chart is not None:  # (until stop 72 argparse's "unrecognized arguments" alone)
        raise UserError(f"{args.chart!r}: charts names takes no chart: it writes the names of "
                        f"calexec's own charts ({', '.join(CHARTS)}); a chart of your own "
                        f"is a class whose states and events are its attributes "
                        f"(calexec charts paths MODULE:CLASS --json lists them)")
    fresh = names_source()
    if args.check:
        current = current_text(args.out, len(fresh.encode("utf-8")))
        if current is None:
            print(f"stale: {shell_word(args.out)}: missing", file=sys.stderr)
        if current != fresh:
            if current is not None:
                print(f"stale: {shell_word(args.out)} differs from the declared charts",
                      file=sys.stderr)
            print(f"fix: calexec charts names --out {shell_word(args.out)}", file=sys.stderr)
            return 1
        print(f"{shell_word(args.out)} is up to date")
        return 0
    if args.out.name in ("", "..") or args.out.is_dir():  # ('.', '/', a directory)
        raise UserError(f"--out={str(args.out)!r}: is a directory, not a generated chart "
                        f"names module")
    # a scratch file beside it replaces the module only once it is whole: a write cut short
    # (a full disk) leaves the previous module, never a truncated one that does not import
    with staged_report("--out", args.out.parent, given=args.out) as scratch:
        (Path(scratch) / args.out.name).write_bytes(fresh.encode("utf-8"))
    print(shell_word(args.out))
    return 0
