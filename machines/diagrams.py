"""Render any chart, given as its python-statemachine class or its ``CompiledChart``: DOT
text, SVG and PNG bytes (no files, no CLI: ``calexec diagrams`` writes and checks calexec's own
in diagrams/, drivers/tools/render_diagrams.py; ``calexec charts draw MODULE:CLASS`` any chart,
drivers/tools/charts_cli.py).

The DOT is generated here from the compiled chart (``calexec.machines.compiled.compiled``,
derived from the declaration), so a diagram can only show declared transitions. It is
deterministic text; the SVG is rendered by graphviz ``dot`` and carries the sha256 of the DOT it
was rendered from in a comment, so a staleness check compares DOT text only and never depends on
graphviz's SVG bytes. A PNG of a chart (for docs/diagrams.md) carries the same sha256 in a PNG ``tEXt`` chunk.

Rendering rules (each diagram's legend states them):

- A double border is a final state; the black dot points at the initial state; a turquoise
  fill is the current state (live view only).
- An edge label is ``Event [guard, ...]``: the transition is taken only when every guard
  holds. ``[else]`` marks the unguarded fallback of an event that also has a guarded
  transition from the same state (declaration order: first passing candidate wins).
- Several transitions between the same two states are drawn as ONE edge whose label has one
  line per transition. Labels are tied to their edge by a leader line (graphviz ``decorate``).
- **Grouping**: the same transition (event, guards, target) declared from at least
  ``GROUP_MIN`` states is drawn as ONE bold edge leaving a dashed box around those states
  (graphviz cluster, ``ltail``); the box's title names the event(s). Boxes must nest, so
  when two such source sets overlap without nesting, the larger is boxed first and the
  other is boxed on its part inside (if still ``GROUP_MIN`` states), its other sources keep
  their own edges (job chart: ``Fail`` from the four states before submit is one edge from
  the inner box; ``CancelRequested -> Failed`` keeps its own).
"""

from __future__ import annotations

import hashlib
import html
import re
import shutil
import struct
import subprocess
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

from calexec.machines.chart_support import bound_name
from calexec.machines.compiled import ChartLike, CompiledChart, Transition, compiled

_SHA_COMMENT = "<!-- calexec-dot-sha256: {} -->"
SHA_PATTERN = re.compile(r"<!-- calexec-dot-sha256: ([0-9a-f]{64}) -->")
_PNG_KEY = b"calexec-dot-sha256"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FIX_COMMAND = "calexec diagrams"
#: a transition declared from this many states (or more) is drawn once, from a box
GROUP_MIN = 3
ACTIVE_FILL = "turquoise"
#: SVG ids: a state's node group (a compound or parallel state's cluster) is ``NODE_ID +
#: state``; an edge's group is ``EDGE_ID`` + the
#: ids of the transitions it draws joined by ``_`` (``CompiledChart.transitions[i].id``)
NODE_ID = "s_"
EDGE_ID = "t_"
#: edges and states of one job's path (/debug/jobs/{id})
PATH_COLOR = "red"
#: the label of a history state's default transition (``h.to(c)``: entered while the history
#: has recorded nothing yet), drawn dashed from the ``H`` circle
HISTORY_DEFAULT = "no history yet"
LEGEND_CLUSTER = "cluster_legend"
FONT = "Helvetica"


#: how long graphviz's ``dot`` may take to lay out one format (hundreds of states with edges
#: crossing back may not lay out in that time)
GRAPHVIZ_TIMEOUT_S = 60


class GraphvizError(RuntimeError):
    """graphviz ``dot`` is missing or failed."""


def declared_in(chart: CompiledChart) -> str:
    """Where the chart is declared, as the diagram's title says it: the file of its class's
    module relative to the import root (``calexec/machines/charts.py``, ``order_workflow.py``).
    A byte of the file's name that is no UTF-8 (a module imported from ``caf\xe9.py`` written
    in Latin-1: Python names it with a lone surrogate, which no UTF-8 text can hold) reads
    ``?``: the DOT, SVG and PNG are UTF-8."""
    declaration = chart.declaration
    path = declaration.__module__.replace(".", "/") + ".py"
    # a chart its module binds under another name than its class's (``Hotfix =
    # make_pipeline("Pipeline", ...)``: a factory's charts share the name it gave them) is told
    # apart by that name: its diagram files, named after the class, are another such chart's
    # (until stop 70 drawing the second into one --out replaced the first's without a word)
    name = bound_name(declaration)
    if name not in (declaration.__name__, declaration.__qualname__):
        path = f"{path} as {name}"
    return path.encode("utf-8", errors="replace").decode("utf-8")


def _escaped(text: str) -> str:
    """``text`` inside a DOT double-quoted label, drawn as written: a backslash is graphviz's
    escape (``\\l``, ``\\N``, ...) and ``&`` begins an entity (``&lt;``), so both are escaped
    (until stop 71 a state named ``C:\\logs`` was drawn ``C:`` / ``ogs``, its ``\\l`` a line
    end, and ``&lt;`` as ``<``)."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("&", "&amp;")


def _q(text: str) -> str:
    """A DOT double-quoted string of ``text``, drawn as written."""
    return '"' + _escaped(text) + '"'


def _q_lines(lines: Iterable[str]) -> str:
    """A DOT double-quoted label of ``lines``, each ended by graphviz's left-justified line
    end ``\\l`` (the only escape of the label: the lines' own text is drawn as written)."""
    return '"' + "".join(f"{_escaped(line)}\\l" for line in lines) + '"'


#: DOT's keywords (case-insensitive): as a bare ID, ``node [...]`` would set every node's defaults
_DOT_KEYWORDS = frozenset({"node", "edge", "graph", "digraph", "subgraph", "strict"})
_PLAIN_ID = re.compile(r"[A-Za-z_\u0080-\U0010ffff][A-Za-z_0-9\u0080-\U0010ffff]*\Z")


def _id(name: str) -> str:
    """``name`` as a DOT ID: bare when DOT reads it as one (calexec's charts), else quoted (a
    state or chart called ``node``, ``edge``, ``Graph``, ...)."""
    if _PLAIN_ID.match(name) and name.lower() not in _DOT_KEYWORDS:
        return name
    return _q(name)


def _pseudo(chart: CompiledChart, name: str) -> str:
    """The DOT ID of the renderer's own node ``name`` (``initial``, ``legend``): ``name``
    itself unless a state of the chart is called so (then a quoted ID no state can have)."""
    states = set(chart.states) | {h.id for state in chart.declaration.states_map.values()
                                  for h in state.history}
    return name if name not in states else _q(f"{name}:calexec")


def _state_text(chart: CompiledChart, state_id: str) -> str:
    """How a state is labelled: its id (what paths, coverage and tests name it by), preceded
    by the name the chart gives it when it gives one of its own (``rot_ = State("Rot")``:
    ``Rot (rot_)``); python-statemachine's default name (``in_flight`` -> ``In flight``) is
    no name of its own."""
    state = chart.declared_states().get(state_id) if hasattr(
        chart.declaration, "states_map") else None
    name = str(getattr(state, "name", "") or "")
    if not name or name == state_id.replace("_", " ").capitalize() or name == state_id:
        return state_id
    return f"{name} ({state_id})"


def _event_names(chart: CompiledChart) -> dict[str, str]:
    """Event id -> the name the chart gives it (``Event(..., name="Start the engine")``), else
    python-statemachine's default for an id (``kv_grow`` -> ``Kv grow``), as its own diagrams
    print it; every event of the chart's transitions, in one pass over its declaration (a
    label is drawn per transition: a pass per label per event was cubic, 20 s for 800)."""
    given: dict[str, str] = {}
    for transition in chart.declared:
        for declared in transition.events:
            if getattr(declared, "name", None):
                given.setdefault(str(declared), str(declared.name))
    return {event: given.get(event) or event.replace("_", " ").capitalize()
            for event in dict.fromkeys(t.event for t in chart.transitions) if event}


def _event_label(chart: CompiledChart, event: str) -> str:
    """``event``'s name (``_event_names``); followed by its id, ``Go on (go.on)``, when another
    event of the chart has the same name (``go.on`` and ``go_on`` are both ``Go on``: two
    edges that read as one event)."""
    names = _event_names(chart)
    name = names.get(event) or event.replace("_", " ").capitalize()
    if any(other != event and other_name == name for other, other_name in names.items()):
        return f"{name} ({event})"
    return name


def transition_label(chart: CompiledChart, transition: Transition) -> str:
    """``Event [guards]`` of one transition (``Event #2 [guards]`` when its state has several
    guarded alternatives for the event: the order they are tried in, the first whose guards
    hold being taken); ``[else]`` for an unguarded fallback;
    ``(eventless)`` for a transition of no event; `` (internal)`` after an internal one
    (``internal=True`` or no target: its source is neither exited nor entered again, where
    an external self transition on the same edge is)."""
    text = _event_label(chart, transition.event) if transition.event else "(eventless)"
    slot = chart.table.get((transition.source, transition.event), ())
    if transition.guards:
        if sum(1 for t in slot if t.guards) > 1:  # which is tried first decides, when both hold
            text = f"{text} #{slot.index(transition) + 1}"
        text = f"{text} [{', '.join(transition.guards)}]"
    elif transition.event and any(t.guards for t in slot if t.id < transition.id):
        text = f"{text} [else]"
    return f"{text} (internal)" if internal(chart, transition) else text


def internal(chart: CompiledChart, transition: Transition) -> bool:
    """Whether ``transition`` is internal: declared ``internal=True``, or with no target
    (python-statemachine exits and enters nothing for either)."""
    if transition.id >= len(chart.declared):
        return False
    declared = chart.declared[transition.id]
    return bool(getattr(declared, "internal", False)) or getattr(declared, "target", 0) is None


def groups(chart: CompiledChart) -> list[tuple[tuple[str, ...], tuple[Transition, ...]]]:
    """The boxes of ``chart``: (states in the box, transitions drawn from the box), outer
    boxes first. Deterministic (declaration order breaks ties)."""
    by_key: dict[tuple[str, str, tuple[str, ...]], list[Transition]] = {}
    for t in chart.transitions:
        by_key.setdefault((t.event, t.target, t.guards), []).append(t)
    order = {state: i for i, state in enumerate(chart.states)}
    candidates = [ts for ts in by_key.values()
                  if len(ts) >= GROUP_MIN and all(t.source != t.target for t in ts)
                  and ts[0].target not in {t.source for t in ts}]
    candidates.sort(key=lambda ts: (-len(ts), ts[0].id))
    boxes: list[tuple[frozenset[str], list[Transition]]] = []
    for ts in candidates:
        sources = frozenset(t.source for t in ts)
        for box, _ in boxes:
            if not (sources <= box or box <= sources or not sources & box):
                sources = sources & box  # keep the part that nests
        if len(sources) < GROUP_MIN:
            continue
        if ts[0].target in sources:
            continue
        chosen = [t for t in ts if t.source in sources]
        for box, members in boxes:
            if box == sources:
                members.extend(chosen)
                break
        else:
            boxes.append((sources, chosen))
    boxes.sort(key=lambda b: (-len(b[0]), min(t.id for t in b[1])))
    return [(tuple(sorted(box, key=order.__getitem__)), tuple(members))
            for box, members in boxes]


def _legend(chart: CompiledChart, boxed: bool, finals: list[str],
            drawn: frozenset[str] = frozenset()) -> list[str]:
    """One HTML-like table node: each drawing convention next to a sample of it, kept below
    the chart (invisible edges from the final states) so the chart itself comes first.
    ``drawn``: what a hierarchical chart draws beside (``compound``, ``parallel``,
    ``history``, ``default``: a history's ``no history yet`` arrow), each given its row."""
    cell = '<TD ALIGN="LEFT">{}</TD>'
    rows = [
        ('<TD>&#9679;&#8594; <B>S</B></TD>', "initial state S"),
        ('<TD><TABLE BORDER="1" CELLBORDER="0" CELLPADDING="2" STYLE="ROUNDED"><TR><TD>'
         '<TABLE BORDER="1" CELLBORDER="0" STYLE="ROUNDED"><TR><TD>S</TD></TR></TABLE>'
         '</TD></TR></TABLE></TD>', "final state (double border)"),
        (f'<TD BGCOLOR="{ACTIVE_FILL}" STYLE="ROUNDED" BORDER="1">S</TD>',
         "current state (live view only)"),
        ("<TD>Event [g, h]</TD>", "taken only when guards g and h both hold"),
        ("<TD>Event [else]</TD>", "taken when the guarded alternative is refused"),
        ("<TD>two lines</TD>", "one edge, one transition per label line"),
    ]
    if any(sum(1 for t in slot if t.guards) > 1 for slot in chart.table.values()):
        rows.append(("<TD>Event #1 [g], #2 [h]</TD>",
                     "tried in this order: the first whose guards hold is taken"))
    if any(internal(chart, t) for t in chart.transitions):
        rows.append(("<TD>Event (internal)</TD>",
                     "internal: its source is not exited and entered again"))
    if "compound" in drawn:
        rows.append(('<TD><TABLE BORDER="1" CELLBORDER="0" STYLE="ROUNDED"><TR><TD>&#9679; '
                     'S</TD></TR></TABLE></TD>',
                     "compound state: its children inside, the dot at its initial child; a "
                     "<B>bold</B> edge leaving the box: from every state inside"))
    if "parallel" in drawn:
        rows.append(('<TD><TABLE BORDER="1" CELLBORDER="1" STYLE="ROUNDED,DASHED"><TR><TD>'
                     'A</TD><TD>B</TD></TR></TABLE></TD>',
                     "parallel state: one box per region, every region active at once"))
    if "history" in drawn:
        rows.append(("<TD>(H)  (H*)</TD>",
                     "history state: entered, it re-enters the child last active (H*: and "
                     "that child's own, deep)"))
    if "default" in drawn:
        rows.append((f"<TD>- - {HISTORY_DEFAULT} - &#8594;</TD>",
                     "where a history state enters before it recorded one"))
    if boxed:
        rows.append(('<TD>dashed box &#8594;</TD>',
                     "<B>bold</B> edge leaving a dashed box: declared from EVERY state in it"))
    body = "".join(f"<TR>{sample}{cell.format(text)}</TR>" for sample, text in rows)
    legend = _pseudo(chart, "legend")  # a compound state "legend" is a cluster_legend too
    cluster = LEGEND_CLUSTER if legend == "legend" else _q(f"{LEGEND_CLUSTER}:calexec")
    return [
        f"subgraph {cluster} {{",
        'label="Legend"; style="rounded"; color="gray50"; fontsize=12;',
        f'{legend} [shape=plaintext, style="", fontsize=11, label=<<TABLE BORDER="0" '
        f'CELLBORDER="0" CELLSPACING="3">{body}</TABLE>>];',
        "}",
        *(f"{_id(state)} -> {legend} [style=invis];" for state in finals),
    ]


def _dot_header(chart: CompiledChart) -> list[str]:
    """The first lines of every chart's DOT, flat or nested: title, layout, node and edge
    defaults, the initial pseudo-state."""
    title = chart.declaration.__name__
    return [
        f"digraph {_id(title)} {{",
        f'label={_q(f"{title} (declared in {declared_in(chart)})")}; labelloc=t; '
        f"fontsize=16; fontname={FONT};",
        "rankdir=TB; compound=true; newrank=true; nodesep=0.35; ranksep=0.55; "
        "splines=true; forcelabels=true;",
        f"node [fontname={FONT}, fontsize=14, shape=rectangle, style=\"rounded, filled\", "
        "fillcolor=white, penwidth=1.5];",
        f"edge [fontname={FONT}, fontsize=12, decorate=true, arrowsize=0.8];",
        f'{_pseudo(chart, "initial")} [label="", shape=point, width=0.15, style=filled, '
        'fillcolor=black];',
    ]


class ActiveStatesError(ValueError):
    """States to highlight that no run of the chart is in at once: ``unknown`` names no state
    of the chart (by id), or ``apart`` is two states of it never active together (two
    children of one compound, or of the chart: only a parallel state's regions are)."""

    def __init__(self, chart: str, states: tuple[str, ...], unknown: tuple[str, ...] = (),
                 apart: tuple[str, str] | None = None) -> None:
        self.chart, self.unknown, self.apart, self.states = chart, unknown, apart, states
        if unknown:
            text = (f"active_state={unknown[0]!r} is" if len(unknown) == 1 else
                    f"active_state: {', '.join(map(repr, unknown))} are") + f" not one of {states}"
        else:
            first, second = apart or ("", "")
            text = (f"active_state: {first!r} and {second!r} are never active at once (one "
                    f"configuration: the states of a parallel state's regions, and their "
                    f"ancestors)")
        super().__init__(f"{chart}: {text}")


def _given_states(active: object, argument: str) -> list[str]:
    """The state ids or configurations ``active`` gives (a str, or an iterable of them; None:
    none), else a ``TypeError`` naming ``argument`` and its value."""
    if active is None:
        return []
    if isinstance(active, str):
        return [active]
    given: list[str] = []
    for item in list(active) if isinstance(active, Iterable) else [active]:
        if not isinstance(item, str):
            raise TypeError(f"{argument}={active!r:.60}: {item!r:.40} is no state id (a str); "
                            f"expected a state id, a configuration ('a,b'), several ids or None")
        given.append(item)
    return given


def active_configuration(chart: ChartLike, active: str | Iterable[str] | None
                         ) -> tuple[str, ...]:
    """The states to highlight, in the chart's order: ``active`` is one state id, a
    configuration as the inspector and ``StatechartRun.state`` name it (``"a,b"``: the ids
    joined by commas), or several of either; a blank part is none. Raises
    ``ActiveStatesError`` naming every id the chart does not have, or two states no run is in
    at once."""
    chart = compiled(chart)
    names: list[str] = []
    for given in _given_states(active, "active"):
        parts = [given] if given in chart.states else given.split(",")
        names += [part.strip() for part in parts if part.strip()]
    unknown = tuple(dict.fromkeys(name for name in names if name not in chart.states))
    if unknown:
        raise ActiveStatesError(chart.name, chart.states, unknown=unknown)
    chosen = set(names)
    by_id = chart.declared_states()
    lines = {name: _ancestors(by_id[name]) for name in chosen}
    ordered = [name for name in chart.states if name in chosen]
    for i, first in enumerate(ordered):
        for second in ordered[i + 1:]:
            if first in lines[second] or second in lines[first]:
                continue  # one holds the other
            common = next((a for a in lines[first] if a in lines[second]), None)
            if common is None or not by_id[common].parallel:
                raise ActiveStatesError(chart.name, chart.states, apart=(first, second))
    return tuple(ordered)


def _ancestors(state: Any) -> list[str]:
    """The ids of ``state``'s ancestors, its parent first."""
    found = []
    parent = getattr(state, "parent", None)
    while parent is not None:
        found.append(str(parent.id))
        parent = getattr(parent, "parent", None)
    return found


def _filled(chart: CompiledChart, active: tuple[str, ...]) -> frozenset[str]:
    """The states of ``active`` drawn filled: the innermost (an ancestor given with a state
    it holds is the box around it, left unfilled so the state stands out)."""
    by_id = chart.declared_states()
    held = {a for name in active for a in _ancestors(by_id[name])}
    return frozenset(name for name in active if name not in held)


def _node_line(chart: CompiledChart, state: str, active: frozenset[str], visited: set[str],
               notes: Mapping[str, str]) -> str:
    """The DOT line of ``state``: a double ring when final, filled when active, drawn in
    ``PATH_COLOR`` when on the path, its ``notes`` text inside it (flat and nested charts)."""
    attrs_ = []
    if state in chart.finals:
        attrs_.append("peripheries=2")
    if state in active:
        attrs_.append(f"fillcolor={ACTIVE_FILL}")
    if state in visited:
        attrs_.append(f"color={PATH_COLOR}, penwidth=2.5")
    label = _q(_state_text(chart, state))
    if state in notes:  # inside the node, so it cannot be mistaken for another's
        lines = "".join(f'<BR/><FONT POINT-SIZE="11" COLOR="{PATH_COLOR}">{html.escape(line)}'
                        "</FONT>" for line in notes[state].split("\n"))
        label = f"<{html.escape(_state_text(chart, state))}{lines}>"
    return f"{_id(state)} [{', '.join([f'label={label}', f'id={_q(NODE_ID + state)}'] + attrs_)}];"


def render_chart_dot(chart: ChartLike, active_state: str | Iterable[str] | None = None,
                     taken: Iterable[int] = (), notes: Mapping[str, str] | None = None) -> str:
    """Deterministic DOT of one chart (a chart class or its ``CompiledChart``);
    ``active_state`` (a state id, or a configuration: ``"a,b"`` or several ids, as
    ``active_configuration`` reads it) is highlighted, the innermost states of it filled, the
    edges of the ``taken`` transition ids drawn in ``PATH_COLOR``, ``notes`` (state -> text)
    written next to their state (the path of one job, its refusing guards)."""
    chart = compiled(chart)
    active_state = _given_states(active_state, "active_state")
    taken = frozenset(taken)
    notes = dict(notes or {})
    visited = {s for t in chart.transitions if t.id in taken for s in (t.source, t.target)}
    active = _filled(chart, active_configuration(chart, active_state))
    if nested(chart):
        return _render_nested_dot(chart, active, taken, notes, visited)
    boxes = groups(chart)
    boxed_ids = {t.id for _, members in boxes for t in members}
    out = _dot_header(chart)

    def node(state: str) -> str:
        return _node_line(chart, state, active, visited, notes)

    placed: set[str] = set()

    def emit_box(index: int, indent: str) -> None:
        states, members = boxes[index]
        events = ", ".join(dict.fromkeys(_event_label(chart, t.event) for t in members))
        out.append(f"{indent}subgraph cluster_group_{index} {{")
        out.append(f'{indent}label={_q(f"{events}: from every state in this box")}; '
                   'style="dashed, rounded"; color="gray40"; fontsize=12;')
        inner = [j for j in range(index + 1, len(boxes))
                 if set(boxes[j][0]) < set(states)
                 and not any(set(boxes[j][0]) < set(boxes[k][0]) < set(states)
                             for k in range(index + 1, len(boxes)))]
        for j in inner:
            emit_box(j, indent + "  ")
        for state in states:
            if state not in placed:
                placed.add(state)
                out.append(indent + "  " + node(state))
        out.append(f"{indent}}}")

    top = [i for i in range(len(boxes))
           if not any(set(boxes[i][0]) < set(boxes[k][0]) for k in range(len(boxes)))]
    for i in top:
        emit_box(i, "")
    for state in chart.states:
        if state not in placed:
            out.append(node(state))
    out.append(f"{_pseudo(chart, 'initial')} -> {_id(chart.initial)};")
    # one edge per (source, target); boxed transitions leave their box once
    edges: dict[tuple[str, str], list[str]] = {}
    ids: dict[tuple[str, str], list[int]] = {}
    tails: dict[tuple[str, str], str] = {}
    for index, (states, members) in enumerate(boxes):
        for t in members:
            key = (f"cluster_group_{index}", t.target)
            label = transition_label(chart, t)
            labels = edges.setdefault(key, [])
            if label not in labels:
                labels.append(label)
            ids.setdefault(key, []).append(t.id)
            tails[key] = states[len(states) // 2]
    for t in chart.transitions:
        if t.id not in boxed_ids:
            edges.setdefault((t.source, t.target), []).append(transition_label(chart, t))
            ids.setdefault((t.source, t.target), []).append(t.id)
    for (source, target), labels in edges.items():
        text = _q_lines(labels)
        # the SVG group of the edge is named after the transition ids it draws (live rates)
        edge_id = _q(EDGE_ID + "_".join(map(str, sorted(ids[(source, target)]))))
        path = (f", color={PATH_COLOR}, fontcolor={PATH_COLOR}, penwidth=3.5"
                if taken.intersection(ids[(source, target)]) else "")
        if source.startswith("cluster_group_"):
            out.append(f"{_id(tails[(source, target)])} -> {_id(target)} [label={text}, id={edge_id}, "
                       f"ltail={source}, penwidth=2.5{path}];")
        else:
            out.append(f"{_id(source)} -> {_id(target)} [label={text}, id={edge_id}{path}];")
    out += _legend(chart, bool(boxes), [s for s in chart.states if s in chart.finals])
    out.append("}")
    return "\n".join(out) + "\n"


def nested(chart: CompiledChart) -> bool:
    """Whether ``chart`` has compound, parallel or history states (drawn as clusters)."""
    return any(state.states or state.history
               for state in chart.declaration.states_map.values())


def _render_nested_dot(chart: CompiledChart, active: frozenset[str], taken: frozenset[int],
                       notes: Mapping[str, str], visited: set[str]) -> str:
    """DOT of a hierarchical chart: a compound state is a solid rounded box holding its
    children and a black dot at its initial child; a parallel state a dashed box holding one
    box per region; a history pseudo-state a small circle ``H`` (shallow) or ``H*`` (deep) in
    its parent's box. An edge from or to a state with children leaves or enters its box
    (graphviz ``ltail``/``lhead`` on the box's anchor node)."""
    declaration = chart.declaration
    out = _dot_header(chart)
    by_id = {state.id: state for state in declaration.states_map.values()}
    history_ids: set[str] = set()

    def anchor(state_id: str) -> str:
        state = by_id.get(state_id)
        if state is None or not state.states:
            return _id(state_id)
        # the box's own point node; a state of the chart called ``<box>__anchor`` keeps that
        # name (``_pseudo``: the point takes a quoted ID no state can have)
        return _pseudo(chart, f"{state_id}__anchor")

    def node(state_id: str) -> str:
        return _node_line(chart, state_id, active, visited, notes)

    def emit(state: Any, indent: str) -> None:
        if not state.states:
            out.append(indent + node(state.id))
            return
        kind = " (parallel)" if state.parallel else ""
        style = '"dashed, rounded"' if state.parallel else '"rounded"'
        color = f"color={PATH_COLOR}; penwidth=2.5; " if state.id in visited else ""
        fill = f'style="{style[1:-1]}, filled"; fillcolor="{ACTIVE_FILL}"; ' \
            if state.id in active else f"style={style}; "
        out.append(f"{indent}subgraph cluster_{state.id} {{")
        # the box's SVG group carries the state's id, as a leaf's node does: the live page
        # paints its count there (until stop 64 a compound or parallel state had no badge)
        out.append(f"{indent}  label={_q(_state_text(chart, state.id) + kind)}; {fill}{color}fontsize=13; "
                   f"id={_q(NODE_ID + state.id)};")
        if state.parallel:
            out.append(f'{indent}  {anchor(state.id)} [label="", shape=point, width=0.01, '
                       f'style=invis];')
        else:
            out.append(f'{indent}  {anchor(state.id)} [label="", shape=point, width=0.12, '
                       f'style=filled, fillcolor=black];')
        for child in state.states:
            emit(child, indent + "  ")
        for history in state.history:
            history_ids.add(history.id)
            mark = "H*" if history.type.is_deep else "H"
            out.append(f"{indent}  {_id(history.id)} [label={_q(mark)}, shape=circle, width=0.35, "
                       f"fixedsize=true, fontsize=11, id={_q(NODE_ID + history.id)}];")
        out.append(f"{indent}}}")
        if not state.parallel:
            initial = next((t for t in state.transitions if t.initial), None)
            for target in (initial.targets if initial is not None else []):
                head = f", lhead=cluster_{target.id}" if target.states else ""
                out.append(f"{anchor(state.id)} -> {anchor(target.id)} [arrowsize=0.6{head}];")

    for state in declaration.states:
        emit(state, "")
    initial_id = chart.initial
    head = f" [lhead=cluster_{initial_id}]" if by_id[initial_id].states else ""
    out.append(f"{_pseudo(chart, 'initial')} -> {anchor(initial_id)}{head};")
    edges: dict[tuple[str, str], list[str]] = {}
    ids: dict[tuple[str, str], list[int]] = {}
    for t in chart.transitions:
        label = transition_label(chart, t)
        edges.setdefault((t.source, t.target), []).append(label)
        ids.setdefault((t.source, t.target), []).append(t.id)
    for (source, target), labels in edges.items():
        text = _q_lines(labels)
        edge_id = _q(EDGE_ID + "_".join(map(str, sorted(ids[(source, target)]))))
        extra = ""
        if source in history_ids:
            # a history state's default (``h.to(c)``): where it enters while nothing is
            # recorded; python-statemachine takes it as part of the entry, as it enters a
            # compound's initial child, so it is drawn as that arrow is, with what it means
            # (and its id: coverage and the live view count it as a transition)
            if by_id[target].states:
                extra += f", lhead=cluster_{target}"
            if taken.intersection(ids[(source, target)]):
                extra += f", color={PATH_COLOR}, fontcolor={PATH_COLOR}, penwidth=3.5"
            out.append(f"{_id(source)} -> {anchor(target)} [label={_q(HISTORY_DEFAULT)}, "
                       f"style=dashed, arrowsize=0.6, fontsize=10, id={edge_id}{extra}];")
            continue
        inside = by_id.get(target) is not None and by_id[source] is not by_id[target] and (
            by_id[source] in by_id[target].ancestors() or by_id[target] in by_id[source].ancestors())
        if by_id[source].states and not inside:
            extra += f", ltail=cluster_{source}, penwidth=2.5"
        if target in by_id and by_id[target].states and not inside:
            extra += f", lhead=cluster_{target}"
        if taken.intersection(ids[(source, target)]):
            extra += f", color={PATH_COLOR}, fontcolor={PATH_COLOR}, penwidth=3.5"
        out.append(f"{anchor(source)} -> {anchor(target)} [label={text}, id={edge_id}{extra}];")
    drawn = {"history"} if history_ids else set()
    if any(source in history_ids for source, _ in edges):
        drawn.add("default")
    for state in by_id.values():
        if state.states:
            drawn.add("parallel" if state.parallel else "compound")
    out += _legend(chart, False, [s for s in chart.states if s in chart.finals],
                   frozenset(drawn))
    out.append("}")
    return "\n".join(out) + "\n"


def run_graphviz(dot: str, fmt: str, timeout_s: float | None = None) -> bytes:
    """``dot -T<fmt>`` of ``dot`` text; ``GraphvizError`` when graphviz is missing or fails,
    or has not finished within ``timeout_s`` seconds (None: :data:`GRAPHVIZ_TIMEOUT_S`)."""
    timeout = GRAPHVIZ_TIMEOUT_S if timeout_s is None else timeout_s
    exe = shutil.which("dot")
    if exe is None:
        raise GraphvizError("graphviz 'dot' is not on PATH (Debian: apt-get install graphviz)")
    try:
        done = subprocess.run([exe, f"-T{fmt}"], input=dot.encode("utf-8"), capture_output=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise GraphvizError(f"dot -T{fmt} did not finish within {timeout:g} s") from None
    if done.returncode != 0:
        raise GraphvizError(f"dot -T{fmt} exited {done.returncode}: "
                            f"{done.stderr.decode('utf-8', 'replace').strip()}")
    return done.stdout


def _dot_text(dot: object, function: str) -> None:
    """``dot`` of ``svg_from_dot``/``png_from_dot``: DOT text, else a ``TypeError`` naming it."""
    if not isinstance(dot, str):
        raise TypeError(f"{function}(dot={dot!r:.60}): expected DOT text (a str, as "
                        f"render_chart_dot returns it)")


def svg_from_dot(dot: str, timeout_s: float | None = None) -> str:
    """SVG of ``dot`` with the DOT's sha256 in a comment (``timeout_s``: as
    :func:`run_graphviz`'s)."""
    _dot_text(dot, "svg_from_dot")
    svg = run_graphviz(dot, "svg", timeout_s).decode("utf-8")
    comment = _SHA_COMMENT.format(hashlib.sha256(dot.encode("utf-8")).hexdigest())
    head, sep, body = svg.partition("?>")  # keep the XML declaration first, if any
    return f"{head}{sep}\n{comment}{body}" if sep else f"{comment}\n{svg}"


def png_from_dot(dot: str, timeout_s: float | None = None) -> bytes:
    """PNG at 96 dpi with the DOT's sha256 in a ``tEXt`` chunk right after ``IHDR``
    (``timeout_s``: as :func:`run_graphviz`'s)."""
    _dot_text(dot, "png_from_dot")
    png = run_graphviz(dot.replace("{\n", "{\ndpi=96;\n", 1), "png", timeout_s)
    if not png.startswith(_PNG_SIGNATURE) or png[12:16] != b"IHDR":
        raise GraphvizError("dot -Tpng did not return a PNG")
    end_ihdr = 8 + 12 + struct.unpack(">I", png[8:12])[0]
    data = _PNG_KEY + b"\0" + hashlib.sha256(dot.encode("utf-8")).hexdigest().encode("ascii")
    chunk = (struct.pack(">I", len(data)) + b"tEXt" + data
             + struct.pack(">I", zlib.crc32(b"tEXt" + data)))
    return png[:end_ihdr] + chunk + png[end_ihdr:]


def png_sha(png: bytes) -> str | None:
    """The DOT sha256 stored by ``png_from_dot``, or None."""
    found = re.search(re.escape(_PNG_KEY) + rb"\0([0-9a-f]{64})", png[:4096])
    return found.group(1).decode("ascii") if found else None


def render_path_svg(chart: ChartLike, steps: Iterable[Mapping[str, object]]) -> str:
    """SVG of ``chart`` (a chart class or its ``CompiledChart``) with one run's path drawn on it. ``steps`` are
    ``DeviceExecutor.job_trail`` steps (``event``, ``from``, ``to``, ``refused_by``; a followed
    run's step into a history state has ``via``, the history, and ``to``, what it re-entered): the taken
    transitions in ``PATH_COLOR``, the last state filled, and inside each state the events
    refused there with their guards (and, for an ``[else]`` fallback, the guards of the
    alternatives passed over, which therefore did not hold)."""
    chart = compiled(chart)
    taken: set[int] = set()
    notes: dict[str, str] = {}
    last: str | None = None
    for step in steps:
        event, source, target = step["event"], step["from"], step["to"]
        via = step.get("via")  # a history state the step re-entered ``to`` through
        if not (isinstance(event, str) and isinstance(source, str)
                and (target is None or isinstance(target, str))
                and (via is None or isinstance(via, str))):
            raise TypeError(f"{chart.name}: step {dict(step)!r:.200}: 'event' and 'from' must "
                            "be names (str), 'to' a state name or None (a refused event), "
                            "'via' a history state's name or None")
        line = None
        if target is not None:
            candidates = chart.table.get((source, event), ())
            declared = target if via is None else via
            chosen = next((t for t in candidates if t.target == declared), None)
            if chosen is None:
                raise ValueError(f"{chart.name}: step {source} --{event}--> {declared} is not "
                                 "a declared transition")
            taken.add(chosen.id)
            entered = target.split(",")[-1] if via is not None else target
            last = _drawn_state(chart, entered if entered in chart.states else declared)
            passed_over = [g for t in candidates if t.id < chosen.id for g in t.guards]
            if passed_over:
                line = f"{_event_label(chart, event)}: [{', '.join(passed_over)}] refused"
        else:
            guards = step.get("refused_by")
            why = (f"[{', '.join(map(str, guards))}]" if isinstance(guards, (list, tuple))
                   and guards else "(not declared here)")
            line = f"refused: {_event_label(chart, event)} {why}"
        if line is not None:
            notes[source] = f"{notes[source]}\n{line}" if source in notes else line
    return svg_from_dot(render_chart_dot(chart, last, taken, notes))


def _drawn_state(chart: CompiledChart, target: str) -> str:
    """The state a path that ended by a transition to ``target`` is drawn filled in: the
    target, or for a history state (a pseudo-state, no node of its own to fill) the compound
    state it belongs to, which the run is then in."""
    if target in chart.states:
        return target
    for state in chart.declaration.states_map.values():
        if any(history.id == target for history in getattr(state, "history", ()) or ()):
            return str(state.id)
    raise ValueError(f"{chart.name}: a step's target {target!r} is not one of {chart.states}")


def render_chart_svg(chart: ChartLike, active_state: str | Iterable[str] | None = None) -> str:
    """SVG text of one chart (a chart class or its ``CompiledChart``; for a live view),
    ``active_state`` (a state or a configuration, as ``render_chart_dot`` takes it)
    highlighted.

    Raises ``TypeError`` for what is not a chart, ``ValueError`` for an unknown state and
    ``GraphvizError`` when ``dot`` is missing or fails.
    """
    return svg_from_dot(render_chart_dot(chart, active_state))
