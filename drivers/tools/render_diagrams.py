"""``calexec diagrams [--out DIR] [--check] [--png DIR]``: write the declared charts to
diagrams/ (DOT + SVG, and PNGs for docs/diagrams.md with ``--png DIR``), or ``--check`` that
the committed files are what the declarations render (compares DOT text and the DOT sha256
the SVG/PNG carry; needs no graphviz binary). Rendering: ``calexec.machines.diagrams``.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from pathlib import Path

from calexec.cliargs import shell_word
from calexec.machines.compiled import CHARTS
from calexec.machines.diagrams import (
    FIX_COMMAND,
    SHA_PATTERN,
    GraphvizError,
    png_from_dot,
    png_sha,
    render_chart_dot,
    svg_from_dot,
)


def write_all(out: Path, png: Path | None = None) -> list[Path]:
    """Render every chart to ``out/<chart>.dot`` and ``out/<chart>.svg`` (and
    ``png/<chart>.png`` when ``png`` is given); return the files written. Everything is
    rendered, and every file found writable (``UserError`` naming ``--out`` or ``--png``
    otherwise), before the first is written: a graphviz failure or a directory in the way
    leaves the old diagrams as they were, never some charts new and some old; so does a
    Ctrl-C or a full disk while they are written (every file is written into a scratch
    directory, then all replace the old ones together: ``cliargs.staged_report``)."""
    from calexec.cliargs import UserError, make_dir, staged_report, writable_file

    targets = [(out / f"{name}.{ext}", "--out", out) for name in CHARTS for ext in ("dot", "svg")]
    if png is not None:
        targets += [(png / f"{name}.png", "--png", png) for name in CHARTS]
    made = [d for d in dict.fromkeys((out, png)) if d is not None and not d.exists()]
    contents: dict[Path, str | bytes] = {}
    try:
        # the paths first (a bad --out or --png is named even without graphviz), then the
        # rendering: either failing leaves no directory made and no file written
        make_dir("--out", out)  # (a file there: 'not a directory', not 'File exists')
        if png is not None:
            make_dir("--png", png)
        for path, flag, given in targets:
            writable_file(flag, path, given)
        for name in CHARTS:
            dot = render_chart_dot(CHARTS[name])
            contents[out / f"{name}.dot"] = dot
            contents[out / f"{name}.svg"] = svg_from_dot(dot)
            if png is not None:
                # 96 dpi: the diagrams' 12-14 pt text is ~16-19 px high, legible without zoom
                contents[png / f"{name}.png"] = png_from_dot(dot)
    except (UserError, GraphvizError):
        for directory in made:  # refused: no empty directory left behind either
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise
    # every file or none (each directory's): a Ctrl-C or a full disk while they are written
    # left some charts' files new and the rest old, or one cut short
    with contextlib.ExitStack() as stack:
        scratch = {directory: Path(stack.enter_context(staged_report(flag, directory)))
                   for directory, flag in dict.fromkeys(
                       [(out, "--out"), *([(png, "--png")] if png is not None else [])])}
        for path, data in contents.items():
            staged = scratch[path.parent] / path.name
            if isinstance(data, bytes):
                staged.write_bytes(data)
            else:
                staged.write_text(data, encoding="utf-8")
    return list(contents)


def stale_files(out: Path, png: Path | None = None) -> list[str]:
    """Problems with the committed diagrams in ``out`` (and PNGs in ``png``), one message per
    stale file."""
    problems = []
    for name in CHARTS:
        if png is not None:
            png_path = png / f"{name}.png"
            expected = hashlib.sha256(render_chart_dot(CHARTS[name]).encode("utf-8")).hexdigest()
            if not png_path.is_file():
                problems.append(f"{shell_word(png_path)}: missing")
            elif png_sha(png_path.read_bytes()) != expected:
                problems.append(f"{shell_word(png_path)}: not rendered from the current DOT")
        dot_path, svg_path = out / f"{name}.dot", out / f"{name}.svg"
        fresh = render_chart_dot(CHARTS[name])
        if not dot_path.is_file():
            problems.append(f"{shell_word(dot_path)}: missing")
        elif dot_path.read_text(encoding="utf-8", errors="replace") != fresh:
            problems.append(f"{shell_word(dot_path)}: differs from the declared chart")
        if not svg_path.is_file():
            problems.append(f"{shell_word(svg_path)}: missing")
            continue
        found = SHA_PATTERN.search(svg_path.read_text(encoding="utf-8", errors="replace"))
        expected = hashlib.sha256(fresh.encode("utf-8")).hexdigest()
        if found is None or found.group(1) != expected:
            problems.append(f"{shell_word(svg_path)}: not rendered from the current DOT")
    return problems


def main(argv: list[str]) -> int:
    """Entry point; ``argv`` starts with the command word ``diagrams``. Exit 0, 1 when
    ``--check`` finds a stale file, 2 when ``--out`` cannot be written or graphviz's ``dot``
    is missing (one line, no traceback)."""
    from calexec.cliargs import (
        EXIT_CONFIG,
        UserError,
        cannot_write,
        output_path,
        refuse_non_directory,
    )
    from calexec.cliargs import parser as cli_parser

    parser = cli_parser("calexec diagrams", __doc__)
    parser.add_argument("--out", type=output_path, default=Path("diagrams"),
                        help="output directory")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if any diagram in --out (and --png DIR) is stale (compares "
                             "DOT text and the DOT sha256 the SVG/PNG carry; needs no graphviz "
                             "binary)")
    parser.add_argument("--png", type=output_path, default=None, metavar="DIR",
                        help="also write <chart>.png to DIR (docs/img for docs/diagrams.md)")
    args = parser.parse_args(argv[1:])
    try:
        if args.check:
            # (a file there: every diagram "missing", exit 1, and the fix named refused, exit 2)
            refuse_non_directory("--out", args.out)
            if args.png is not None:
                refuse_non_directory("--png", args.png)
            problems = stale_files(args.out, args.png)
            for problem in problems:
                print(f"stale: {problem}", file=sys.stderr)
            if problems:
                if not args.out.exists():  # (run from another project than calexec's)
                    print(f"note: there is no directory {shell_word(args.out)} here: calexec diagrams "
                          f"checks the diagrams of calexec's own charts ({', '.join(CHARTS)}), "
                          "committed in calexec's checkout; for a chart of your own: "
                          "calexec charts draw MODULE:CLASS --out DIR --check",
                          file=sys.stderr)
                print(f"fix: {FIX_COMMAND} --out {shell_word(args.out)}"
                      + (f" --png {shell_word(args.png)}" if args.png else ""), file=sys.stderr)
                return 1
            print(f"diagrams in {shell_word(args.out)}"
                  f"{f' and {shell_word(args.png)}' if args.png else ''} are up to "
                  "date")
            return 0
        # (a newcomer's `calexec diagrams` in their own project: until stop 72 calexec's four
        # charts landed in their diagrams/ unsaid, beside their own)
        first = not any((args.out / f"{name}.dot").exists() for name in CHARTS)
        written = write_all(args.out, args.png)  # (renders everything, then makes --out)
        if first:
            print(f"note: calexec diagrams draws calexec's own charts ({', '.join(CHARTS)}), "
                  f"none of which {shell_word(args.out)} held; for a chart of your own: "
                  "calexec charts draw MODULE:CLASS --out DIR", file=sys.stderr)
    except UserError as err:  # an output directory that cannot be made
        print(f"calexec diagrams: {err}", file=sys.stderr)
        return err.code
    except GraphvizError as err:  # first: 'dot not found' is also an OSError
        print(f"calexec diagrams: graphviz's dot failed (install graphviz): "
              f"{str(err.args[0] if err.args else err).splitlines()[0]}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as err:
        flag, value = "--out", args.out
        if args.png is not None and err.filename is not None and (
                Path(str(err.filename)) == args.png or args.png in Path(str(err.filename)).parents):
            flag, value = "--png", args.png  # the PNG directory failed, not --out
        print(f"calexec diagrams: {cannot_write(value, err, flag)}", file=sys.stderr)
        return EXIT_CONFIG
    for path in written:  # one line each, whatever the path holds (a newline: $'a\nb')
        print(shell_word(path))
    return 0
