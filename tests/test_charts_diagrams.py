"""``calexec diagrams``: deterministic DOT, SVG tied to its DOT, and the staleness check."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from calexec.drivers.tools import render_diagrams as diagrams_cli
from calexec.machines import diagrams
from calexec.machines.compiled import CHARTS

REPO_DIAGRAMS = Path(__file__).resolve().parent.parent / "diagrams"
REPO_PNGS = Path(__file__).resolve().parent.parent / "docs" / "img"  # docs/diagrams.md


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):  # its users are marked requires_tool("dot"): SVG rendering
    out = tmp_path_factory.mktemp("diagrams")
    assert diagrams_cli.main(["diagrams", "--out", str(out)]) == 0
    return out


@pytest.mark.requires_tool("dot")
def test_render_then_check_passes(rendered):
    assert sorted(p.name for p in rendered.iterdir()) == sorted(
        f"{name}.{ext}" for name in CHARTS for ext in ("dot", "svg")
    )
    assert diagrams_cli.main(["diagrams", "--out", str(rendered), "--check"]) == 0


def test_dot_is_deterministic_and_complete():
    for name, chart in CHARTS.items():
        dot = diagrams.render_chart_dot(CHARTS[name])
        assert dot == diagrams.render_chart_dot(CHARTS[name])
        assert not re.search(r"_\d{6,}", dot), "object ids leaked into the DOT"
        for state in chart.states:
            assert re.search(rf"^\s*{state} \[", dot, re.M), state


@pytest.mark.requires_tool("dot")
def test_modified_dot_fails_check(rendered, tmp_path, capsys):
    for path in rendered.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    dot = tmp_path / "job.dot"
    dot.write_text(dot.read_text().replace("Succeeded", "Succeded", 1))
    assert diagrams_cli.main(["diagrams", "--out", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "job.dot: differs" in err and "fix: calexec diagrams --out" in err


@pytest.mark.requires_tool("dot")
def test_svg_missing_or_from_another_dot_fails_check(rendered, tmp_path, capsys):
    for path in rendered.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    (tmp_path / "kv_txn.svg").unlink()
    (tmp_path / "lifecycle.svg").write_text((tmp_path / "job.svg").read_text())
    assert diagrams_cli.main(["diagrams", "--out", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "kv_txn.svg: missing" in err and "lifecycle.svg: not rendered" in err
    assert err.count("stale: ") == 2  # the untouched charts are not reported


@pytest.mark.requires_tool("dot")
def test_live_view_highlights_the_active_state():
    svg = diagrams.render_chart_svg(CHARTS["job"], active_state="Submitted")
    assert svg.startswith("<?xml") and "calexec-dot-sha256" in svg
    active = diagrams.render_chart_dot(CHARTS["job"], active_state="Submitted")
    assert re.search(r"^\s*Submitted \[.*fillcolor=turquoise", active, re.M)
    assert not re.search(r"^\s*Created \[.*fillcolor=turquoise", active, re.M)
    with pytest.raises(ValueError, match="active_state='Nowhere'"):
        diagrams.render_chart_dot(CHARTS["job"], active_state="Nowhere")
    with pytest.raises(TypeError, match="'nope' is not a python-statemachine chart class"):
        diagrams.render_chart_svg("nope")


def test_committed_diagrams_are_current():
    assert diagrams_cli.stale_files(REPO_DIAGRAMS, REPO_PNGS) == [], \
        "run: calexec diagrams --png docs/img"


# ---- structure a reviewer relies on (issue 18) -----------------------------------------------
_CLUSTER = re.compile(r"^\s*subgraph (cluster_\w+) \{|^\s*\}|^\s*(\w+) \[label=", re.M)
_EDGE = re.compile(r'^(\w+) -> (\w+) \[label="((?:[^"\\]|\\.)*)"(.*)\];$', re.M)


def parse(dot: str):
    """(cluster -> its states, incl. nested boxes; edges as (tail, head, label lines, ltail))."""
    members: dict[str, set[str]] = {}
    stack: list[str] = []
    for m in _CLUSTER.finditer(dot):
        if m.group(1):
            stack.append(m.group(1))
            members[m.group(1)] = set()
        elif m.group(2):
            for name in stack:
                members[name].add(m.group(2))
        elif stack:
            stack.pop()
    edges = []
    for tail, head, label, rest in _EDGE.findall(dot):
        lines = [line for line in label.split("\\l") if line]
        ltail = re.search(r"ltail=(\w+)", rest)
        edges.append((tail, head, lines, ltail.group(1) if ltail else None))
    return members, edges


def test_diagram_shows_exactly_the_declared_transitions():
    """Expanding every box edge to the states in its box gives back the compiled table."""
    for name, chart in CHARTS.items():
        members, edges = parse(diagrams.render_chart_dot(CHARTS[name]))
        drawn = set()
        for tail, head, lines, ltail in edges:
            sources = members[ltail] if ltail else {tail}
            drawn |= {(source, line, head) for source in sources for line in lines}
        declared = {(t.source, diagrams.transition_label(chart, t), t.target)
                    for t in chart.transitions}
        assert drawn == declared, name


def test_job_chart_draws_one_cancel_and_one_fail_edge_from_boxes():
    members, edges = parse(diagrams.render_chart_dot(CHARTS["job"]))
    cancel = [e for e in edges if "Cancel" in e[2]]
    assert len(cancel) == 1
    assert members[cancel[0][3]] == {"Created", "Admitted", "Preparing", "Queued", "Submitted",
                                     "Completing"}
    fail_from_box = [e for e in edges if e[3] and any(line.startswith("Fail") for line in e[2])]
    assert len(fail_from_box) == 1
    assert members[fail_from_box[0][3]] == {"Created", "Admitted", "Preparing", "Queued"}
    # the only other Fail is the end of a cancelled job, merged with its Wait-returned twin
    others = [e for e in edges if not e[3] and any(line.startswith("Fail") for line in e[2])]
    assert [(e[0], e[1], len(e[2])) for e in others] == [("CancelRequested", "Failed", 2)]


def test_lifecycle_and_slot_group_their_any_state_transitions():
    members, edges = parse(diagrams.render_chart_dot(CHARTS["lifecycle"]))
    fail = [e for e in edges if any(line.startswith("Fail") for line in e[2])]
    assert len(fail) == 1 and members[fail[0][3]] == {"Configuring", "Warming", "Ready",
                                                      "Draining", "Recovering"}
    members, edges = parse(diagrams.render_chart_dot(CHARTS["buffer_slot"]))
    quarantine = [e for e in edges if "Quarantine" in e[2]]
    assert len(quarantine) == 1 and members[quarantine[0][3]] == {"Free", "Leased", "InFlight"}


def test_every_diagram_has_a_legend_and_attached_labels():
    for name in CHARTS:
        dot = diagrams.render_chart_dot(CHARTS[name])
        assert "subgraph cluster_legend {" in dot, name
        assert re.search(r"final state \(double border\)", dot)
        assert re.search(r"taken only when guards", dot)
        assert "edge [" in dot and "decorate=true" in dot, name  # leader line to its edge
        # no two edges between the same pair of states (their labels would be ambiguous)
        _, edges = parse(dot)
        pairs = [(e[3] or e[0], e[1]) for e in edges]
        assert len(pairs) == len(set(pairs)), name
    assert "[else]" in diagrams.render_chart_dot(CHARTS["buffer_slot"])  # give_back's fallback


@pytest.mark.requires_tool("dot")
def test_svg_text_stays_legible(rendered):
    for name in CHARTS:
        svg = (rendered / f"{name}.svg").read_text()
        sizes = [float(s) for s in re.findall(r'font-size="([\d.]+)"', svg)]
        assert sizes and min(sizes) >= 11.0, (name, min(sizes))
        # natural size (no graphviz "size" shrink): points map 1:1 to CSS pixels at 100 %
        assert "viewBox" in svg and not re.search(r"^size=", diagrams.render_chart_dot(CHARTS[name]),
                                                  re.M)


@pytest.mark.requires_tool("dot")
def test_png_option_writes_one_png_per_chart_and_check_covers_them(tmp_path, capsys):
    from PIL import Image

    out, img = str(tmp_path / "d"), tmp_path / "img"
    assert diagrams_cli.main(["diagrams", "--out", out, "--png", str(img)]) == 0
    for name in CHARTS:
        with Image.open(img / f"{name}.png") as image:  # a valid PNG with its DOT's digest
            image.load()
            assert image.format == "PNG" and image.text.get("calexec-dot-sha256"), name
    assert diagrams_cli.main(["diagrams", "--out", out, "--png", str(img), "--check"]) == 0
    (img / "job.png").write_bytes((img / "kv_txn.png").read_bytes())
    (img / "lifecycle.png").unlink()
    assert diagrams_cli.main(["diagrams", "--out", out, "--png", str(img), "--check"]) == 1
    err = capsys.readouterr().err
    assert "job.png: not rendered from the current DOT" in err and "lifecycle.png: missing" in err
    assert "--png" in err


@pytest.mark.requires_tool("dot")
def test_svg_ids_name_every_state_and_every_transition_once(rendered):
    """The live view finds a state's node and a transition's edge by these ids."""
    for name, chart in CHARTS.items():
        svg = (rendered / f"{name}.svg").read_text()
        for state in chart.states:
            assert f'id="{diagrams.NODE_ID}{state}"' in svg, (name, state)
        edge_ids = re.findall(rf'<g id="{diagrams.EDGE_ID}([\d_]+)" class="edge"', svg)
        drawn = [int(i) for group in edge_ids for i in group.split("_")]
        assert sorted(drawn) == [t.id for t in chart.transitions], name


def _statements(dot: str) -> list[str]:
    return [line.strip() for line in dot.splitlines()]


def test_states_named_like_dot_keywords_or_the_renderers_own_nodes_stay_states():
    """A newcomer's chart with states ``node``, ``edge``, ``initial`` and ``legend``: written
    bare, ``node [label="node", ...]`` set every node's defaults instead of declaring a state,
    ``initial`` was merged with the initial-state dot (``initial -> initial``) and ``legend``
    with the legend table; a chart class called ``Graph`` made ``digraph Graph {`` (a
    syntax error for dot)."""
    from statemachine import State, StateMachine

    class Graph(StateMachine):
        initial = State(initial=True)
        node = State()
        edge = State()
        legend = State(final=True)
        start = initial.to(node)
        link = node.to(edge)
        show = edge.to(legend)

    dot = diagrams.render_chart_dot(Graph)
    lines = _statements(dot)
    assert lines[0] == 'digraph "Graph" {'
    for state in ("node", "edge"):
        assert f'"{state}" [label="{state}", id="s_{state}"];' in lines, dot
        assert not any(line.startswith(f"{state} [label=\"{state}\"") for line in lines), dot
    assert '"node" -> "edge" [label="Link\\l", id="t_1"];' in lines, dot
    # one node statement per name: the state, and the renderer's own under another ID
    assert [line for line in lines if line.startswith("initial [")] == [
        'initial [label="initial", id="s_initial"];']
    assert [line for line in lines if line.startswith("legend [")] == [
        'legend [label="legend", id="s_legend", peripheries=2];']
    assert '"initial:calexec" -> initial;' in lines and "initial -> initial;" not in lines
    assert 'legend -> "legend:calexec" [style=invis];' in lines


def test_a_compound_state_named_legend_keeps_its_own_cluster():
    from statemachine import State, StateChart

    class Map(StateChart):
        class legend(State.Compound):
            folded = State(initial=True)
            open_ = State()
            unfold = folded.to(open_)

        hidden = State(initial=True)
        show = hidden.to(legend)

    lines = _statements(diagrams.render_chart_dot(Map))
    assert lines.count("subgraph cluster_legend {") == 1
    assert 'subgraph "cluster_legend:calexec" {' in lines


def test_a_state_named_like_a_box_s_anchor_stays_a_state_outside_the_box():
    """A newcomer's chart with a compound ``box`` and a top-level state ``box__anchor`` (the
    renderer's name for the box's own point): the state was merged with the point, drawn
    inside the box, ``leave = box.to(box__anchor)`` became a loop on the box and ``stop`` left
    from the box instead of from the state."""
    from statemachine import State, StateChart

    class Anchors(StateChart):
        idle = State(initial=True)

        class box(State.Compound):
            inner = State(initial=True)
            other = State()
            flip = inner.to(other)

        box__anchor = State()
        done = State(final=True)
        enter = idle.to(box)
        leave = box.to(box__anchor)
        stop = box__anchor.to(done)

    dot = diagrams.render_chart_dot(Anchors)
    lines = _statements(dot)
    point = '"box__anchor:calexec"'
    assert [line for line in lines if line.startswith("box__anchor [")] == [
        'box__anchor [label="box__anchor", id="s_box__anchor"];'], dot
    assert f'{point} [label="", shape=point, width=0.12, style=filled, fillcolor=black];' \
        in lines, dot
    assert f'{point} -> box__anchor [label="Leave\\l", id="t_1", ltail=cluster_box, ' \
           'penwidth=2.5];' in lines, dot
    assert 'box__anchor -> done [label="Stop\\l", id="t_3"];' in lines, dot
    assert f'idle -> {point} [label="Enter\\l", id="t_0", lhead=cluster_box];' in lines, dot
    # the state is declared outside the box: after the box's closing brace
    box_end = lines.index("}", lines.index("subgraph cluster_box {"))
    assert lines.index('box__anchor [label="box__anchor", id="s_box__anchor"];') > box_end


def test_two_events_of_one_name_are_told_apart_by_their_ids():
    """A newcomer's chart with events ``go.on`` (``Event(..., id="go.on")``) and ``go_on``:
    python-statemachine names both ``Go on``, and the diagram drew ``a -> b "Go on"`` and
    ``a -> c "Go on"``, one event that seemed to lead two ways. Events whose names collide are
    labelled with their ids too; a name no other event has stays as it was."""
    from statemachine import Event, State, StateMachine

    class Dots(StateMachine):
        a = State(initial=True)
        b = State()
        c = State()
        dotted = Event(a.to(b), id="go.on")
        under = Event(a.to(c), id="go_on")
        back = b.to(a) | c.to(a)

    lines = _statements(diagrams.render_chart_dot(Dots))
    assert 'a -> b [label="Go on (go.on)\\l", id="t_0"];' in lines, lines
    assert 'a -> c [label="Go on (go_on)\\l", id="t_1"];' in lines, lines
    assert any(line.startswith('b -> a [label="Back\\l"') for line in lines), lines


def test_check_of_a_file_that_is_not_utf8_is_stale_not_an_internal_error(tmp_path, capsys):
    """``calexec diagrams --check`` read the committed files as UTF-8: an SVG saved
    compressed (svgz) or otherwise binary under the .svg name ended the check with
    ``internal error: UnicodeDecodeError`` (exit 70) instead of naming it stale."""
    committed = Path(__file__).resolve().parent.parent / "diagrams"
    for path in committed.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    assert diagrams_cli.main(["diagrams", "--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "job.svg").write_bytes(b"\x1f\x8b\x08\x00\xff\xfe binary")
    (tmp_path / "kv_txn.dot").write_bytes(b"\xff\xfe\x00 not text")
    capsys.readouterr()
    assert diagrams_cli.main(["diagrams", "--out", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "job.svg" in err and "kv_txn.dot: differs" in err, err


def test_a_png_directory_that_cannot_be_made_is_named_as_png_not_out(tmp_path, capsys):
    """``calexec diagrams --out d2 --png F`` with F a file: the one line blamed
    ``--out='d2'`` for F."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file\n")
    out = tmp_path / "out"
    assert diagrams_cli.main(["diagrams", "--out", str(out), "--png", str(blocker)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"calexec diagrams: --png={str(blocker)!r}: "), err


def test_an_event_named_by_the_chart_is_labelled_with_that_name():
    """``Event(a.to(b), name="Start the engine")``: python-statemachine's own diagram prints
    the name; ours printed the id (``Go``). An unnamed event keeps the default (``Kv grow``),
    in a flat chart, a hierarchical one and a run's path."""
    from statemachine import Event, State, StateChart, StateMachine

    class Engine(StateMachine):
        off = State(initial=True)
        on = State(final=True)
        go = Event(off.to(on), name="Start the engine")
        kv_grow = off.to(on, cond="cold")

    lines = _statements(diagrams.render_chart_dot(Engine))
    edge = next(line for line in lines if line.startswith("off -> on"))
    assert 'label="Start the engine\\lKv grow [cold]\\l"' in edge, edge
    assert "Go\\l" not in edge

    class Nested(StateChart):
        class running(State.Compound):
            idle = State(initial=True)
            busy = State()
            work = Event(idle.to(busy), name="Take a job")
        stopped = State(initial=True)
        boot = Event(stopped.to(running), name="Power on")

    dot = diagrams.render_chart_dot(Nested)
    assert "Take a job" in dot and "Power on" in dot, dot
    assert '"Work' not in dot and '"Boot' not in dot


@pytest.mark.requires_tool("dot")
def test_a_refused_event_on_a_run_s_path_is_labelled_with_its_declared_name():
    from statemachine import Event, State, StateMachine

    class Engine(StateMachine):
        off = State(initial=True)
        on = State(final=True)
        go = Event(off.to(on), name="Start the engine")

    svg = diagrams.render_path_svg(Engine, [{"event": "go", "from": "on", "to": None}])
    assert "refused: Start the engine (not declared here)" in svg


def test_a_state_the_chart_names_is_labelled_with_its_name_and_id():
    """``rot_ = State("Rot")`` (python-statemachine's docs name states so; ``rot_`` because
    the word is taken): the diagram said ``rot_``, the name the author gave it nowhere (as on
    a compound: ``class pending(State.Compound, name="Awaiting payment")``). A state with a
    name of its own reads ``Rot (rot_)``; python-statemachine's default name (``gelb`` ->
    ``Gelb``) is no name of its own, so calexec's charts are drawn as before."""
    from statemachine import State, StateChart

    class Ampel(StateChart):
        gelb = State(initial=True)
        rot_ = State("Rot")

        class warte(State.Compound, name="Warten auf Grün"):  # noqa: N801
            kurz = State(initial=True)
            lang = State("Lange warten", final=True)
            dehnen = kurz.to(lang)

        stop = gelb.to(rot_)
        warten = rot_.to(warte)

    lines = _statements(diagrams.render_chart_dot(Ampel))
    assert 'gelb [label="gelb", id="s_gelb"];' in lines, lines
    assert 'rot_ [label="Rot (rot_)", id="s_rot_"];' in lines, lines
    assert 'lang [label="Lange warten (lang)", id="s_lang", peripheries=2];' in lines, lines
    assert any(line.startswith('label="Warten auf Grün (warte)";') for line in lines), lines


@pytest.mark.requires_tool("dot")
@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_write_cut_short_leaves_every_old_diagram_as_it_was(tmp_path, capsys, monkeypatch,
                                                             failure):
    """A full disk (or a Ctrl-C) at the third file ``calexec diagrams`` wrote left the first
    two charts' files new and the rest old, the third cut short: ``--check`` then failed on
    diagrams no one had touched by hand. Every file or none now, as ``charts draw``."""
    out = tmp_path / "out"
    out.mkdir()
    names = [f"{name}.{ext}" for name in CHARTS for ext in ("dot", "svg")]
    for name in names:
        (out / name).write_text(f"old {name}\n", encoding="utf-8")
    real_write_text = Path.write_text
    calls = []

    def failing_write_text(self, data, *args, **kwargs):
        calls.append(self)
        if len(calls) == 3:
            real_write_text(self, data[:10], *args, **kwargs)  # (cut short, then the error)
            raise failure
        return real_write_text(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", failing_write_text)
    if isinstance(failure, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            diagrams_cli.main(["diagrams", "--out", str(out)])
    else:
        assert diagrams_cli.main(["diagrams", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"calexec diagrams: --out={str(out)!r}: cannot write "), err
        assert "No space left on device" in err and ".partial" not in err, err
    assert len(calls) == 3
    assert sorted(p.name for p in out.iterdir()) == sorted(names)  # (no scratch left)
    for name in names:
        assert (out / name).read_text(encoding="utf-8") == f"old {name}\n", name


def test_check_where_there_is_no_diagrams_directory_says_what_it_checks(tmp_path, capsys):
    """Found at stop 71 (the newcomer probe, left; fixed by the lead): ``calexec diagrams
    --check`` run from a newcomer's own project (no ``diagrams/`` there) listed calexec's
    eight chart files as missing and named a fix writing them into that project, nothing
    said that it checks calexec's own charts. It still exits 1 and names the fix (right in
    calexec's checkout), and now says what it checks and what draws a chart of one's own."""
    from calexec.drivers.tools.render_diagrams import main

    assert main(["diagrams", "--check", "--out", str(tmp_path / "diagrams")]) == 1
    err = capsys.readouterr().err
    assert "note: there is no" in err and "calexec's own charts (job, " in err, err
    assert "calexec charts draw MODULE:CLASS --out DIR --check" in err, err
    # a directory that is there but stale: no such note
    (tmp_path / "diagrams").mkdir()
    assert main(["diagrams", "--check", "--out", str(tmp_path / "diagrams")]) == 1
    assert "note:" not in capsys.readouterr().err
