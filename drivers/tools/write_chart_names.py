"""``calexec charts names [--check] [--out FILE]``: write machines/chart_names.py, one constant
per state and event of every declared chart (``calexec.machines.compiled.names_source``), or
``--check`` that the committed file is current (exit 1 and the fix command when stale)."""

from __future__ import annotations

import sys
from pathlib import Path

from calexec.cliargs import EXIT_CONFIG, cannot_write, command_main
from calexec.cliargs import parser as cli_parser
from calexec.machines.compiled import names_source

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "machines" / "chart_names.py"


@command_main
def main(argv: list[str]) -> int:
    parser = cli_parser("calexec charts names", __doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="the generated module (default: machines/chart_names.py of this "
                             "source tree)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if --out differs from what the declarations generate")
    args = parser.parse_args(argv[2:])
    fresh = names_source()
    if args.check:
        try:
            current = args.out.read_text(encoding="utf-8", errors="replace")
        except OSError as err:
            current = None
            print(f"stale: {args.out}: {err.strerror or err}", file=sys.stderr)
        if current != fresh:
            if current is not None:
                print(f"stale: {args.out} differs from the declared charts", file=sys.stderr)
            print(f"fix: calexec charts names --out {args.out}", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date")
        return 0
    try:
        args.out.write_text(fresh, encoding="utf-8")
    except OSError as err:
        print(f"calexec charts names: {cannot_write(args.out, err, '--out')}", file=sys.stderr)
        return EXIT_CONFIG
    print(args.out)
    return 0
