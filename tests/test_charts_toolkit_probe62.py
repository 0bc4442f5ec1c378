"""Stop 62, toolkit probe: an ``--equivalent`` entry naming no mutant; the live inspector's
``?active=`` given a configuration (a parallel chart's run is in several states); a
newcomer's insulin pump (a bolus compound with a deep history beside a parallel occlusion
monitor, a final fatal alarm) through the toolkit's commands."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("starlette")  # the inspector's app ([server] extra)

from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Mount  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from calexec.cli import main as cli  # noqa: E402
from calexec.drivers.tools import charts_mutate  # noqa: E402
from calexec.machines import diagrams  # noqa: E402
from calexec.machines.chartref import load_chart  # noqa: E402
from calexec.machines.compiled import compiled  # noqa: E402
from calexec.machines.diagrams import render_chart_dot  # noqa: E402
from calexec.machines.inspector import AppOptions, Inspector, inspector_app, state_of  # noqa: E402
from calexec.machines.mutants import derive  # noqa: E402

PUMP = '''
from statemachine import HistoryState, State, StateChart


class InsulinPump(StateChart):
    class running(State.Parallel):
        class delivery(State.Compound):
            basal = State(initial=True)

            class bolus(State.Compound):
                priming = State(initial=True)
                dosing = State()
                primed = priming.to(dosing, cond="reservoir_ok")
                h = HistoryState(type="deep")
                fresh = h.to(priming)

            suspended = State()
            start_bolus = basal.to(bolus, cond="dose_valid and not over_max")
            bolus_done = bolus.to(basal)
            suspend = basal.to(suspended) | bolus.to(suspended)
            resume_bolus = suspended.to(bolus.h, cond="bolus_pending")
            resume = suspended.to(basal, unless="bolus_pending")

        class monitor(State.Compound):
            clear = State(initial=True)
            suspect = State()
            pressure_high = clear.to(suspect)
            pressure_ok = suspect.to(clear)

    fatal = State(final=True)
    occluded = running.to(fatal, cond="occlusion_confirmed")


class PumpModel:
    def __init__(self):
        self.state = None
        self.requested = 5

    def reservoir_ok(self):
        return True

    def dose_valid(self):
        return self.requested > 0

    def over_max(self):
        return False

    def bolus_pending(self):
        return False

    def occlusion_confirmed(self):
        return False
'''


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str = PUMP) -> ModuleType:
    """``source`` as a module of a name of its own (the import is cached), the commands run
    from its directory."""
    name = f"pump_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(source, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


def _equivalents(tmp_path: Path, *entries: tuple[str, str]) -> str:
    (tmp_path / "equivalent.toml").write_text("".join(
        f'[[mutant]]\nchart = "{chart}"\nid = "{mutant_id}"\nreason = "listed"\n\n'
        for chart, mutant_id in entries), encoding="utf-8")
    return "equivalent.toml"


def _mutate(module: ModuleType, *flags: str) -> list[str]:
    return ["charts", "mutate", "--chart", f"{module.__name__}:InsulinPump", "--jobs", "1",
            "--json", "--test-cmd", f"{sys.executable} -c 'import {module.__name__}'", *flags]


@pytest.mark.parametrize("narrowed", [[], ["--mutant", "drop:clear-pressure_high->suspect"],
                                      ["--sample", "1"], ["--kind", "drop"]])
def test_an_equivalent_entry_naming_no_mutant_is_refused_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        narrowed: list[str]) -> None:
    """Found at stop 62: an ``--equivalent`` entry whose id names no mutant of its chart (a
    typo, ``dosng``; or a mutant of the chart before it changed) was ignored without a word,
    the survivor it meant to document reported undocumented and the entry never checked
    again. It is bad input as ``--mutant`` of no mutant is: one line naming the file, the
    entry's chart and id, the id it resembles, exit 2, before any test command runs, however
    the run is narrowed."""
    module = _module(tmp_path, monkeypatch)
    listed = _equivalents(tmp_path, ("InsulinPump", "target:h-fresh->priming:dosng"))
    assert cli(_mutate(module, "--equivalent", listed, *narrowed)) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith(
        "calexec charts mutate: --equivalent='equivalent.toml': the entry chart = "
        "'InsulinPump', id = 'target:h-fresh->priming:dosng' names no mutant of InsulinPump "
        f"({module.__name__}:InsulinPump) (did you mean 'target:h-fresh->priming:dosing'?): "
        "correct it or remove it"), lines[0]
    assert "unmutated run" not in captured.err and captured.out == ""


@pytest.mark.parametrize("narrowed", [["--mutant", "drop:clear-pressure_high->suspect"],
                                      ["--kind", "drop", "--targets-per-transition", "1"]])
def test_an_entry_for_a_mutant_a_narrowed_run_leaves_out_is_taken_without_a_word(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        narrowed: list[str]) -> None:
    """The check asks every mutant of the chart, not those the run picked: an entry for a
    target mutant beyond ``--targets-per-transition``, another kind or another ``--mutant``
    (and an entry of a chart this run does not mutate) is no error, and no warning."""
    module = _module(tmp_path, monkeypatch)
    far = "target:running-occluded->fatal:suspect"  # not among the 2 targets a run takes
    assert far in {m.id for m in derive(module.InsulinPump, 0)}
    assert far not in {m.id for m in derive(module.InsulinPump)}
    listed = _equivalents(tmp_path, ("InsulinPump", far),
                          ("InsulinPump", "guard-false:suspended-resume->basal:!bolus_pending"),
                          ("OtherChart", "drop:a-go->b"))
    assert cli(_mutate(module, "--equivalent", listed, *narrowed)) == 0
    captured = capsys.readouterr()
    assert "warning" not in captured.err and "names no mutant" not in captured.err, captured.err
    assert json.loads(captured.out)["mutants"], captured.out[:300]


def test_a_list_naming_none_of_the_runs_charts_is_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A list whose every entry names another chart (the class name mistyped, ``Insulinpump``,
    or the run's chart named otherwise, ``pump=...``) documents nothing of this run: a
    warning naming the charts on both sides (a list may serve other charts: not refused)."""
    module = _module(tmp_path, monkeypatch)
    listed = _equivalents(tmp_path, ("Insulinpump", "drop:clear-pressure_high->suspect"))
    assert cli(_mutate(module, "--equivalent", listed, "--mutant",
                       "drop:clear-pressure_high->suspect")) == 0
    err = capsys.readouterr().err
    assert ("calexec charts mutate: warning: --equivalent='equivalent.toml': no entry names a "
            "chart of this run (InsulinPump); its entries name Insulinpump") in err, err


def test_calexecs_own_equivalent_list_names_mutants_of_its_charts() -> None:
    """calexec's documented list passes the check its default run now makes."""
    root = Path(__file__).resolve().parents[1]
    charts = [charts_mutate.Chart(name, target, load_chart(target))
              for name, target in charts_mutate.CALEXEC_CHARTS.items()]
    equivalents = charts_mutate.load_equivalents(root / charts_mutate.DEFAULT_EQUIVALENT)
    assert equivalents
    charts_mutate.refuse_unknown_equivalents(  # no ValueError
        equivalents, charts, Path(charts_mutate.DEFAULT_EQUIVALENT))


# ---- the live inspector's ?active= on a parallel chart -------------------------------------
@pytest.fixture
def pump_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    module = _module(tmp_path, monkeypatch)
    drawn: list[str | None] = []

    def svg(chart, active):
        render_chart_dot(chart, active)  # what render_chart_svg lays out
        drawn.append(active)
        return f"<svg>{active}</svg>"

    inspector = Inspector()
    machine = module.InsulinPump(module.PumpModel())
    machine.send("start_bolus")
    inspector.register(module.InsulinPump, runs=lambda: [machine], count_instances=False)
    inspector.register(module.InsulinPump, runs=lambda: [machine], name="mine",
                       active=lambda: state_of(machine), count_instances=False)
    app = Starlette(routes=[Mount("/charts", inspector_app(inspector, AppOptions(svg=svg)))])
    with TestClient(app) as client:
        yield client, drawn, state_of(machine)
    inspector.close()


@pytest.mark.parametrize("query", [
    "active=running,delivery,bolus,priming,monitor,clear",
    "active=priming,clear",
    "active=priming&active=clear",
    "active=clear&active=priming,running",
    "active=%20priming%20,%20clear",
])
def test_the_inspector_highlights_a_configuration_given_as_it_names_one(pump_app, query):
    """Found at stop 62: ``?active=`` took one state, where a parallel chart's run is in
    several (``live.json`` and a run's ``state`` name its configuration ``a,b``): the
    configuration the inspector itself wrote was a 400 ``not a state``, and ``active=``
    repeated ``given more than once``. Both forms are taken now, in the chart's order."""
    client, drawn, _ = pump_app
    answer = client.get(f"/charts/InsulinPump.svg?{query}")
    assert answer.status_code == 200, (query, answer.text)
    assert drawn[-1] in ("running,delivery,bolus,priming,monitor,clear", "priming,clear",
                         "running,priming,clear"), drawn


def test_the_inspector_takes_an_active_function_answering_a_runs_configuration(pump_app):
    """``register(..., active=lambda: state_of(machine))``, the documented way to name a
    run's state, answers ``running,delivery,...`` for a parallel chart: it was named as "a
    state the chart does not have" in ``live.json`` and nothing was highlighted."""
    client, drawn, configuration = pump_app
    assert "," in configuration
    live = client.get("/charts/live.json").json()["charts"]
    assert "error" not in live["mine"], live["mine"]
    assert client.get("/charts/mine.svg").status_code == 200
    assert set(drawn[-1].split(",")) == set(configuration.split(",")), drawn


@pytest.mark.parametrize(("query", "error"), [
    ("active=priming,nope,clera", 'active="priming,nope,clera": "nope", "clera" are not '
                                  'states of "InsulinPump" (its states, by id: running, '),
    ("active=priming&active=nope", 'active="priming,nope": "nope" is not a state of '
                                   '"InsulinPump" (its states, by id: running, '),
    ("active=nope", 'active="nope": not a state of "InsulinPump" (its states, by id: '),
    ("active=priming,dosing", 'active="priming,dosing": "priming" and "dosing" are never '
                              "active at once: a run is in one child of the chart and of each "
                              "compound state, in every region of a parallel state"),
    ("active=fatal&active=clear", 'active="fatal,clear": "clear" and "fatal" are never active '
                                  "at once"),
])
def test_the_inspector_refuses_a_configuration_naming_what_is_wrong(pump_app, query, error):
    """Unknown ids are each named (not only the first, nor the whole value as one state), and
    two states no run is in at once are a 400 naming both."""
    client, _, _ = pump_app
    answer = client.get(f"/charts/InsulinPump.svg?{query}")
    assert answer.status_code == 400, (query, answer.text)
    assert answer.json()["error"].startswith(error), answer.json()


def test_a_configuration_is_drawn_with_its_innermost_states_filled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The drawing fills the innermost states of a configuration (an ancestor given with a
    state it holds stays the box around it), and the API names what it refuses."""
    chart = _module(tmp_path, monkeypatch).InsulinPump
    dot = render_chart_dot(chart, "running,delivery,bolus,dosing,monitor,suspect")
    filled = [line.split()[0] for line in dot.splitlines() if "turquoise" in line
              and not line.startswith("legend")]
    assert filled == ["dosing", "suspect"], filled
    assert diagrams.active_configuration(chart, ["suspect", "dosing,bolus"]) == (
        "bolus", "dosing", "suspect")
    with pytest.raises(diagrams.ActiveStatesError, match="'basal' and 'dosing' are never active"):
        render_chart_dot(chart, ["basal", "dosing"])
    assert compiled(chart).states[0] == "running"


def test_the_default_highlight_of_a_hierarchical_chart_is_its_busiest_configuration(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found at stop 62: without ``?active=`` the inspector highlights the state holding most
    runs, and on a hierarchical chart every run is in its top state: ``running`` (the whole
    parallel box) was filled whatever the runs did. It is now the busiest configuration:
    the busiest child of each compound, each region of a parallel state holding runs."""
    module = _module(tmp_path, monkeypatch)
    pumps = [module.InsulinPump(module.PumpModel()) for _ in range(3)]
    pumps[0].send("start_bolus")
    pumps[1].send("pressure_high")
    inspector = Inspector()
    entry = inspector.register(module.InsulinPump, runs=lambda: pumps, count_instances=False)
    assert entry.highlighted() == "running,delivery,basal,monitor,clear"
    pumps[2].send("start_bolus")
    assert entry.highlighted() == "running,delivery,bolus,priming,monitor,clear"
    idle = inspector.register(module.InsulinPump, runs=list, name="idle", count_instances=False)
    assert idle.highlighted() is None
    dot = render_chart_dot(module.InsulinPump, entry.highlighted())
    filled = [line.split()[0] for line in dot.splitlines() if "turquoise" in line
              and not line.startswith("legend")]
    assert filled == ["priming", "clear"], filled
    inspector.close()


def test_draw_check_checks_the_charts_png_that_is_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Found at stop 62 following docs/framework.md step 2 word for word (``draw``, ``draw
    --png``, then ``draw --check`` in CI): after the chart changed, ``--check`` without
    ``--png`` never looked at the PNG drawn before, and its ``fix:`` line redrew the DOT and SVG
    alone, so the stale PNG passed every later check. A PNG of the chart in ``--out`` is now
    checked whenever it is there, and the fix says ``--png``. (The files are written as a
    draw writes them, the SVG's DOT hash included, so no graphviz is needed.)"""
    import hashlib

    module = _module(tmp_path, monkeypatch)
    ref = f"{module.__name__}:InsulinPump"
    out = tmp_path / "diagrams"
    out.mkdir()
    dot = render_chart_dot(module.InsulinPump)
    sha = hashlib.sha256(dot.encode("utf-8")).hexdigest()
    (out / "InsulinPump.dot").write_text(dot, encoding="utf-8")
    (out / "InsulinPump.svg").write_text(f"<svg><!-- calexec-dot-sha256: {sha} --></svg>\n",
                                         encoding="utf-8")
    assert cli(["charts", "draw", ref, "--check"]) == 0  # no PNG there: none checked
    capsys.readouterr()
    (out / "InsulinPump.png").write_bytes(b"\x89PNG\r\n\x1a\n of the chart before it changed")
    assert cli(["charts", "draw", ref, "--check"]) == 1
    err = capsys.readouterr().err
    assert f"stale: {Path('diagrams') / 'InsulinPump.png'}: not rendered from the current " \
           "DOT" in err, err
    assert f"fix: calexec charts draw {ref} --out diagrams --png" in err, err


def test_a_mutant_id_with_a_typo_names_the_id_it_resembles(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--mutant`` of an id with a typo said ``no such mutant`` alone, where the same typo
    in the ``--equivalent`` list now names the id it resembles: both do."""
    module = _module(tmp_path, monkeypatch)
    assert cli(_mutate(module, "--mutant", "drop:clear-pressure_high->suspct")) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("calexec charts mutate: --mutant='drop:clear-pressure_high->suspct': no such "
                   "mutant; did you mean 'drop:clear-pressure_high->suspect'? (list them with "
                   "--json on a --sample run, or see derive())"), err
