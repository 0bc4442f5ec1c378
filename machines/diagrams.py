"""``calexec diagrams [--out DIR] [--check]``: render the declared charts to DOT + SVG.

DOT comes from python-statemachine's ``DotGraphMachine`` (pydot); the object ids it embeds in
helper node names are renumbered in order of appearance, so the DOT is deterministic. The SVG is
rendered by graphviz ``dot`` and carries the sha256 of the DOT it was rendered from in a
comment, so ``--check`` compares DOT text only and never depends on graphviz's SVG bytes.
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path
from types import SimpleNamespace

from statemachine.contrib.diagram import DotGraphMachine, GraphvizError, run_graphviz

from calexec.machines.compiled import CHARTS

_OBJECT_ID = re.compile(r"(?<=_)\d{6,}")
_SHA_COMMENT = "<!-- calexec-dot-sha256: {} -->"
_SHA_PATTERN = re.compile(r"<!-- calexec-dot-sha256: ([0-9a-f]{64}) -->")
FIX_COMMAND = "calexec diagrams"


def _stable(dot: str) -> str:
    numbers: dict[str, str] = {}
    return _OBJECT_ID.sub(lambda m: numbers.setdefault(m.group(0), str(len(numbers))), dot)


def _chart(chart_name: str):
    if chart_name not in CHARTS:
        raise ValueError(f"chart_name={chart_name!r} is not one of {sorted(CHARTS)}")
    return CHARTS[chart_name]


def render_chart_dot(chart_name: str, active_state: str | None = None) -> str:
    """Deterministic DOT of one chart; ``active_state`` (a state id) is highlighted."""
    chart = _chart(chart_name)
    if active_state is None:
        machine = chart.declaration
    elif active_state not in chart.states:
        raise ValueError(f"{chart_name}: active_state={active_state!r} is not one of {chart.states}")
    else:
        # An instance is needed to highlight a state; its guards are never evaluated.
        guards = SimpleNamespace(**{name: (lambda: False) for name in chart.guard_names})
        machine = chart.declaration(guards, start_value=active_state)
    return _stable(DotGraphMachine(machine).get_graph().to_string())


def _svg_from_dot(dot: str) -> str:
    svg = run_graphviz(dot, "svg").decode("utf-8")
    comment = _SHA_COMMENT.format(hashlib.sha256(dot.encode("utf-8")).hexdigest())
    head, sep, body = svg.partition("?>")  # keep the XML declaration first, if any
    return f"{head}{sep}\n{comment}{body}" if sep else f"{comment}\n{svg}"


def render_chart_svg(chart_name: str, active_state: str | None = None) -> str:
    """SVG text of one chart (for a live view), ``active_state`` highlighted.

    Raises ``ValueError`` for an unknown chart or state and graphviz's ``GraphvizError`` when
    ``dot`` is missing or fails.
    """
    return _svg_from_dot(render_chart_dot(chart_name, active_state))


def write_all(out: Path) -> list[Path]:
    """Render every chart to ``out/<chart>.dot`` and ``out/<chart>.svg``; return the files."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in CHARTS:
        dot = render_chart_dot(name)
        (out / f"{name}.dot").write_text(dot, encoding="utf-8")
        (out / f"{name}.svg").write_text(_svg_from_dot(dot), encoding="utf-8")
        written += [out / f"{name}.dot", out / f"{name}.svg"]
    return written


def stale_files(out: Path) -> list[str]:
    """Problems with the committed diagrams in ``out``, one message per stale file."""
    problems = []
    for name in CHARTS:
        dot_path, svg_path = out / f"{name}.dot", out / f"{name}.svg"
        fresh = render_chart_dot(name)
        if not dot_path.is_file():
            problems.append(f"{dot_path}: missing")
        elif dot_path.read_text(encoding="utf-8") != fresh:
            problems.append(f"{dot_path}: differs from the declared chart")
        if not svg_path.is_file():
            problems.append(f"{svg_path}: missing")
            continue
        found = _SHA_PATTERN.search(svg_path.read_text(encoding="utf-8"))
        expected = hashlib.sha256(fresh.encode("utf-8")).hexdigest()
        if found is None or found.group(1) != expected:
            problems.append(f"{svg_path}: not rendered from the current DOT")
    return problems


def main(argv: list[str]) -> int:
    """Entry point; ``argv`` starts with the command word ``diagrams``. Exit 0, 1 when
    ``--check`` finds a stale file, 2 when ``--out`` cannot be written or graphviz's ``dot``
    is missing (one line, no traceback)."""
    from calexec.cliargs import EXIT_CONFIG, parser as cli_parser

    parser = cli_parser("calexec diagrams", __doc__)
    parser.add_argument("--out", type=Path, default=Path("diagrams"), help="output directory")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if any diagram in --out is stale (compares DOT text; "
                             "needs no graphviz binary)")
    args = parser.parse_args(argv[1:])
    try:
        if args.check:
            problems = stale_files(args.out)
            for problem in problems:
                print(f"stale: {problem}", file=sys.stderr)
            if problems:
                print(f"fix: {FIX_COMMAND} --out {args.out}", file=sys.stderr)
                return 1
            print(f"diagrams in {args.out} are up to date")
            return 0
        written = write_all(args.out)
    except GraphvizError as err:  # first: 'dot not found' is also an OSError
        print(f"calexec diagrams: graphviz's dot failed (install graphviz): "
              f"{str(err.args[0] if err.args else err).splitlines()[0]}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as err:
        print(f"calexec diagrams: --out={str(args.out)!r}: {err.strerror or err}"
              f"{f' ({err.filename})' if err.filename else ''}", file=sys.stderr)
        return EXIT_CONFIG
    for path in written:
        print(path)
    return 0
