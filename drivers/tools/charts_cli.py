"""``calexec charts draw MODULE:CLASS`` and ``calexec charts paths MODULE:CLASS``: the
statechart toolkit on any python-statemachine chart class, run from the project directory
that declares it (``MODULE`` is imported from the current directory, see
``calexec.machines.chartref``).

``draw`` writes ``<out>/<Class>.dot`` and ``.svg`` (``--png``: and ``.png``; refused, exit 2,
when ``<Class>.dot`` there is the diagram of another class of that name, from another module),
or with
``--check`` exits 1 when those files (and the chart's ``.png`` there, with ``--png`` or
without) are not what the chart renders now (compares DOT text and the DOT sha256 the
SVG/PNG carry; needs no graphviz). ``paths`` prints the shortest path
to every state, to every transition, and a transition tour (walks from the initial state that
together take every transition), as text or, with ``--json``, as data a test can iterate
(``calexec.machines.paths.as_data``; ``--max-configurations N``: the bound on a hierarchical
chart's configurations explored, 5000 by default; ``--max-steps N``: the most steps written,
20000 by default, the tour's walks kept first, then the shortest, the output saying what was left out; 0:
no bound). ``draw --timeout S``: the seconds graphviz
may take per format (60 by default). A walk whose chart must choose otherwise as it starts
(a guarded eventless transition out of the initial state) begins with a start step,
``(start)[!healthy]`` (JSON: ``"event": null``): outcomes to set before the chart starts.

Exit codes: 0 done; 1 ``--check`` found a stale file; 2 bad input (one line naming it: not
``MODULE:CLASS``, module not importable, no such class, not a chart class, a construct the
toolkit does not support yet, graphviz missing or failing, ``--out`` empty or not writable);
130 interrupted. ``draw`` writes every file or none.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import re
import shlex
import shutil
import sys
from pathlib import Path

from calexec.cliargs import (
    EXIT_CONFIG,
    EXIT_FAILED,
    UserError,
    make_dir,
    non_negative_int,
    output_path,
    positive_int,
    progress_s,
    refuse_non_directory,
    say,
    seconds,
    shell_word,
    staged_report,
    writable_file,
)
from calexec.cliargs import parser as cli_parser
from calexec.machines.chartref import ChartRefError, load_chart
from calexec.machines.compiled import CompiledChart, compiled
from calexec.machines.diagrams import (
    GRAPHVIZ_TIMEOUT_S,
    SHA_PATTERN,
    GraphvizError,
    declared_in,
    png_from_dot,
    png_sha,
    render_chart_dot,
    svg_from_dot,
)
from calexec.machines.paths import (
    MAX_CONFIGURATIONS,
    MAX_STEPS,
    PathsData,
    PathStep,
    as_data,
    explore,
)


def chart_from(ref: str) -> CompiledChart:
    """The compiled chart ``ref`` (``MODULE:CLASS``) names, or ``UserError`` (exit 2). What
    the chart's module prints as it is imported goes to stderr: stdout is the command's
    answer (``paths --json`` is read as JSON)."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            declaration = load_chart(ref)
        return compiled(declaration)
    except (ChartRefError, ValueError, TypeError) as err:  # bad reference, unsupported chart
        raise UserError(str(err).splitlines()[0] if str(err) else repr(err)) from None


#: the title every chart's DOT carries on its second line (machines/diagrams.py ``_dot_header``)
_TITLE = re.compile(r'^label="(?P<name>[^"]*) \(declared in (?P<file>[^"]*)\)"', re.MULTILINE)


def stale(chart: CompiledChart, out: Path, png: bool) -> list[str]:
    """One message per file of ``chart`` in ``out`` that is missing or not current."""
    dot = render_chart_dot(chart)
    sha = hashlib.sha256(dot.encode("utf-8")).hexdigest()
    stem = out / chart.declaration.__name__
    problems = []
    dot_path, svg_path = stem.with_suffix(".dot"), stem.with_suffix(".svg")
    if not dot_path.is_file():
        problems.append(f"{shell_word(dot_path)}: missing")
    elif (text := dot_path.read_text(encoding="utf-8", errors="replace")) != dot:
        title = _TITLE.search(text)
        if title is not None and title.group("file") != declared_in(chart):
            problems.append(f"{shell_word(dot_path)}: the diagram of another chart named "
                            f"{chart.declaration.__name__}, declared in {title.group('file')} "
                            f"(this one is declared in {declared_in(chart)})")
        else:
            problems.append(f"{shell_word(dot_path)}: differs from the declared chart")
    if not svg_path.is_file():
        problems.append(f"{shell_word(svg_path)}: missing")
    else:
        found = SHA_PATTERN.search(svg_path.read_text(encoding="utf-8", errors="replace"))
        if found is None or found.group(1) != sha:
            problems.append(f"{shell_word(svg_path)}: not rendered from the current DOT")
    if png:
        png_path = stem.with_suffix(".png")
        if not png_path.is_file():
            problems.append(f"{shell_word(png_path)}: missing")
        elif png_sha(png_path.read_bytes()) != sha:
            problems.append(f"{shell_word(png_path)}: not rendered from the current DOT")
    return problems


def other_chart_file(chart: CompiledChart, dot_path: Path) -> str | None:
    """The file declaring another chart of the same class name whose diagram ``dot_path``
    holds, or None (no file there, unreadable, or this chart's)."""
    if not dot_path.is_file():  # none there yet, or a FIFO/device (never read: it may block)
        return None
    try:
        with dot_path.open("rb") as handle:  # (the title is on the second line)
            head = handle.read(64 * 1024).decode("utf-8", errors="replace")
        found = _TITLE.search(head)
    except OSError:  # unreadable: writing it says so
        return None
    if found is None or found.group("file") == declared_in(chart):
        return None
    return found.group("file")


def refuse_another_chart(chart: CompiledChart, ref: str, dot_path: Path) -> None:
    """``UserError`` (exit 2) when ``dot_path`` holds the diagram of another chart of the same
    class name (declared in another module): drawing would overwrite it silently."""
    other = other_chart_file(chart, dot_path)
    if other is None:
        return
    raise UserError(
        f"{ref}: {dot_path} is the diagram of another chart named {chart.declaration.__name__}, "
        f"declared in {other} (this one is declared in {declared_in(chart)}); "
        f"draw one of them into another --out, or delete {dot_path} to replace it")


def draw(argv: list[str]) -> int:
    parser = cli_parser("calexec charts draw", __doc__)
    parser.add_argument("chart", metavar="MODULE:CLASS", help="the chart class to draw")
    parser.add_argument("--out", type=output_path, default=Path("diagrams"),
                        help="directory of <Class>.dot/.svg(/.png)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the files in --out are not what the chart renders now")
    parser.add_argument("--png", action="store_true",
                        help="also write <Class>.png (--check checks one that is there anyway)")
    parser.add_argument("--timeout", type=seconds, default=float(GRAPHVIZ_TIMEOUT_S),
                        metavar="S", help="seconds graphviz's dot may take to lay out each "
                        "format (a chart of hundreds of states with many crossing edges may "
                        "need more); past it nothing is written")
    args = parser.parse_args(argv)
    chart = chart_from(args.chart)
    if args.check:
        # (a file there: every diagram "missing", exit 1, and the fix named refused, exit 2)
        refuse_non_directory("--out", args.out)
        # a PNG of this chart in --out is checked too, --png or not: drawn once with --png,
        # it went stale unseen (the fix line named no --png, and redrew the others alone)
        png = args.png or (args.out / f"{chart.declaration.__name__}.png").is_file()
        problems = stale(chart, args.out, png)
        for problem in problems:
            print(f"stale: {problem}", file=sys.stderr)
        if problems:
            dot_path = args.out / f"{chart.declaration.__name__}.dot"
            if other_chart_file(chart, dot_path) is not None:
                # drawing there is refused (the other chart's diagram would be overwritten):
                # the fix the line named was that refusal, exit 2
                print(f"fix: draw it into another directory (calexec charts draw "
                      f"{shlex.quote(args.chart)} --out DIR), or delete {shell_word(dot_path)} to "
                      "replace the other chart's diagram", file=sys.stderr)
                return EXIT_FAILED
            print(f"fix: calexec charts draw {shlex.quote(args.chart)} --out "
                  f"{shell_word(args.out)}" + (" --png" if png else ""),
                  file=sys.stderr)
            return EXIT_FAILED
        print(f"{chart.name}: diagrams in {shell_word(args.out)} are up to date")
        return 0
    dot = render_chart_dot(chart)
    stem = args.out / chart.declaration.__name__
    refuse_another_chart(chart, args.chart, stem.with_suffix(".dot"))
    refuse_non_directory("--out", args.out)  # before a layout of up to a minute
    size = f"{len(chart.states)} states, {len(chart.transitions)} transitions"
    if len(chart.states) > LARGE_STATES or len(chart.transitions) > LARGE_TRANSITIONS:
        print(f"calexec charts draw: laying out {chart.name} ({size}) with graphviz's dot, "
              f"at most {args.timeout:g} s per format ...", file=sys.stderr, flush=True)
    try:  # every format first: a chart graphviz cannot lay out writes nothing
        contents: dict[str, str | bytes] = {".dot": dot,
                                            ".svg": svg_from_dot(dot, args.timeout)}
        if args.png:
            contents[".png"] = png_from_dot(dot, args.timeout)
    except GraphvizError as err:
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        if shutil.which("dot") is None:
            raise UserError(f"drawing needs graphviz's dot: {why}") from None
        more = (f" (give it more: --timeout {2 * args.timeout:g})"
                if "did not finish within" in why else "")
        raise UserError(f"graphviz's dot could not draw {chart.name} ({size}): {why}{more}; "
                        f"nothing written (`charts paths` and `charts draw --check` need no "
                        f"graphviz)") from None
    make_dir("--out", args.out)  # (a file there: 'not a directory', not 'File exists')
    written = [stem.with_suffix(suffix) for suffix in contents]
    for path in written:  # each writable (not a directory) before any is replaced
        writable_file("--out", path, args.out)
    # every file or none: a Ctrl-C or a full disk while they are written leaves the old ones
    with staged_report("--out", args.out) as scratch:
        for path in written:
            data = contents[path.suffix]
            (Path(scratch) / path.name).write_bytes(
                data.encode("utf-8") if isinstance(data, str) else data)
    for path in written:  # one line each, whatever the path holds
        print(shell_word(path))
    return 0


#: a chart larger than this gets a line on stderr before graphviz lays it out (which may take
#: up to ``GRAPHVIZ_TIMEOUT_S`` per format: hundreds of states with many crossing edges), and
#: before ``charts paths`` finds its paths
LARGE_STATES, LARGE_TRANSITIONS = 100, 200


def _text(data: PathsData) -> str:
    def steps(walk: list[PathStep], none: str = "(no step: the chart starts so)") -> str:
        if not walk:
            return none
        return " ".join(
            ("(start)" if s["event"] is None else f"{s['event']}")
            + (f"[{','.join(k if v else '!' + k for k, v in s['guards'].items())}]"
               if s["guards"] else "")
            for s in walk)

    lines = [f"{data['chart']} ({data['class']}): initial {data['initial']}, finals "
             f"{', '.join(data['finals']) or 'none'}", "", "shortest path to every state:"]
    lines += [f"  {state}: {steps(walk, '(no step: entered as the chart starts)')}"
              for state, walk in data["states"].items()]
    lines += ["", "shortest path taking every transition:"]
    lines += [f"  {t['from']} --{t['event'] or '(eventless)'}--> {t['to']}: "
              f"{steps(t['path'], '(no step: taken as the chart starts)')}"
              for t in data["transitions"]]
    tour = len(data["tour"])
    left = data["left_out"]["tour"] if "left_out" in data else 0
    lines += ["", f"transition tour ({f'{tour} of {tour + left}' if left else tour} walk(s) "
              f"from {data['initial']}):"]
    lines += [f"  {i + 1}. {steps(walk)} (ends in {end})"
              for i, (walk, end) in enumerate(zip(data["tour"], data["ends"]["tour"]))]
    if "left_out" in data:
        lines += ["", _left_out(data)]
    return "\n".join(lines)


def _left_out(data: PathsData) -> str:
    """The line saying what ``--max-steps`` left out of ``data`` (which has ``left_out``)."""
    left = data["left_out"]
    return (f"left out past --max-steps {left['max_steps']}: the walks to "
            f"{len(left['states'])} state(s), the paths of {left['transitions']} "
            f"transition(s) and {left['tour']} tour walk(s), {left['steps']} steps in all "
            "(the tour is kept first, then the shortest; raise --max-steps, or 0 for no bound)")


def _explored(name: str, bound: int, explored: int, to_go: int) -> None:
    say("calexec charts paths", f"{name}: {explored} configuration(s) explored, {to_go} found "
        f"still to explore (at most {bound}: --max-configurations) ...")


def paths(argv: list[str]) -> int:
    parser = cli_parser("calexec charts paths", __doc__)
    parser.add_argument("chart", metavar="MODULE:CLASS", help="the chart class")
    parser.add_argument("--json", action="store_true", help="print JSON (machines.paths.as_data)")
    parser.add_argument("--max-configurations", type=positive_int, default=MAX_CONFIGURATIONS,
                        metavar="N", help="the most configurations of a hierarchical chart "
                        "explored (its active states and what its history states recorded); "
                        "past it the paths are refused, naming what multiplies them")
    parser.add_argument("--max-steps", type=non_negative_int, default=MAX_STEPS, metavar="N",
                        help="the most steps written in all (every walk starts from the "
                        "initial state: a chain of N states has about N*N/2 steps); the "
                        "tour's walks are kept first, then the shortest, the output says what "
                        "was left out "
                        f"(default {MAX_STEPS}; 0: no bound)")
    args = parser.parse_args(argv)
    every_s = progress_s()  # (a bad $CALEXEC_PROGRESS_S refused before the run, not in it)
    chart = chart_from(args.chart)
    if len(chart.states) > LARGE_STATES or len(chart.transitions) > LARGE_TRANSITIONS:
        # (a 1000-state chain's paths took a minute and a half, --json 120 MB, without a word)
        print(f"calexec charts paths: finding the paths of {chart.name} ({len(chart.states)} "
              f"states, {len(chart.transitions)} transitions): a path to each state and "
              f"transition, each from the start, so a long chain's take a while ...",
              file=sys.stderr, flush=True)
    try:
        # a hierarchical chart's configurations first, saying how far it got every 10 s
        # ($CALEXEC_PROGRESS_S: a chart of 60 compounds each left by guarded eventless
        # transitions took a minute and a half with nothing after the line above; as_data
        # reads them explored)
        explore(chart, args.max_configurations, progress=functools.partial(
            _explored, chart.name, args.max_configurations), every_s=every_s)
        data = as_data(chart, args.max_configurations, args.max_steps or None)
    except ValueError as err:  # an unreachable state, a shadowed transition
        raise UserError(str(err)) from None
    if "left_out" in data:  # (said on stderr too: a --json reader's terminal shows nothing)
        say("calexec charts paths", _left_out(data))
    print(json.dumps(data, indent=2) if args.json else _text(data))
    return 0


def main(argv: list[str]) -> int:
    """``argv`` starts with the command words (``["charts", "draw", ...]``)."""
    words, rest = argv[:2], argv[2:]
    if words == ["charts", "draw"]:
        return draw(rest)
    if words == ["charts", "paths"]:
        return paths(rest)
    raise UserError(f"unknown command {' '.join(words)!r}", EXIT_CONFIG)
