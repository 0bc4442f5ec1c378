"""The toolkit's commands on a newcomer's python-statemachine 3 charts (stop 46, charts3):
``tests/data/charts3/`` (see tests/test_charts3_runs.py for what each fixture declares)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from statemachine import State, StateChart

from calexec.machines.chartref import load_chart
from calexec.machines.compiled import compiled
from calexec.machines.diagrams import render_chart_dot
from calexec.machines.paths import (
    MAX_CONFIGURATIONS,
    GuardTable,
    as_data,
    drive,
    transition_tour,
)

FIXTURES = Path(__file__).parent / "data" / "charts3"


def _calexec(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(FIXTURES), os.environ.get("PYTHONPATH", "")]))}
    return subprocess.run([sys.executable, "-m", "calexec", *args], cwd=FIXTURES, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_paths_of_a_chart_whose_histories_multiply_its_configurations_say_why() -> None:
    chart = load_chart("big_chart:BigChart", cwd=str(FIXTURES))
    with pytest.raises(ValueError) as raised:
        as_data(chart)
    message = str(raised.value)
    assert f"BigChart: more than {MAX_CONFIGURATIONS} configurations reachable" in message
    assert "12 history states" in message and "h0, h1" in message
    assert "charts draw, cover and mutate still take the chart" in message


def test_paths_of_a_chart_whose_parallel_regions_combine_past_the_bound_say_why() -> None:
    chart = load_chart("big_chart:GridChart", cwd=str(FIXTURES))
    with pytest.raises(ValueError) as raised:
        as_data(chart)
    message = str(raised.value)
    assert f"GridChart: more than {MAX_CONFIGURATIONS} configurations reachable" in message
    assert "the states of the regions of its 1 parallel state(s) grid combine" in message


def test_paths_of_the_order_flow_reach_done_state_and_error_transitions() -> None:
    chart = load_chart("order_flow:OrderFlow", cwd=str(FIXTURES))
    data = as_data(chart)
    taken = {(step["from"], step["event"], step["to"])
             for walk in data["tour"] for step in walk}
    assert ("draft", "submit", "checking") in taken
    # error.execution is reached by sending it (python-statemachine takes it as any event)
    assert ("fulfilment", "error.execution", "broken") in taken


def test_cover_counts_done_state_error_execution_and_eventless_transitions() -> None:
    done = _calexec("charts", "cover", "--chart", "order_flow:OrderFlow", "--chart",
                    "media_player:MediaPlayer", "--", sys.executable, "-m", "pytest", "-q",
                    "-p", "no:cacheprovider", "drive_fixtures.py::test_order",
                    "drive_fixtures.py::test_media")
    assert "transition coverage OrderFlow: 6/12 (50.0 %)" in done.stdout, done.stdout + done.stderr
    untaken = [line.strip() for line in done.stdout.splitlines() if "untaken" in line]
    # taken: submit, the unless-guarded eventless screening -> cleared, done.state.checking,
    # pack, charge and the error.execution that charge's raising action caused
    assert "untaken: screening --(eventless) [is_fraud]--> flagged" in untaken
    assert not any("done.state.checking" in line or "error.execution" in line
                   or "!is_fraud" in line for line in untaken)
    assert "transition coverage MediaPlayer: 10/19 (52.6 %)" in done.stdout


@pytest.mark.requires_tool("dot")  # `charts draw` writes the SVG too
def test_draw_of_the_big_chart_and_the_fixtures_writes_their_files(tmp_path: Path) -> None:
    for ref in ("media_player:MediaPlayer", "order_flow:OrderFlow", "big_chart:BigChart"):
        done = _calexec("charts", "draw", ref, "--out", str(tmp_path))
        assert done.returncode == 0, done.stderr
        name = ref.split(":")[1]
        dot = (tmp_path / f"{name}.dot").read_text()
        assert "digraph" in dot


def test_a_command_on_a_chart_class_python_statemachine_refuses_is_one_line_exit_2() -> None:
    done = _calexec("charts", "paths", "bad_chart:Broken")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad_chart:Broken" in lines[0] and "orphan" in lines[0]
    assert "Traceback" not in done.stderr


def test_an_internal_self_transition_is_drawn_apart_from_an_external_one() -> None:
    """``tick = track.to.itself(internal=True)`` exits and enters nothing; ``restart =
    track.to.itself()`` exits and re-enters the track (its regions back to their initial
    states): the diagram drew both as one plain self loop, so a reader could not tell them
    apart. The internal one is marked, and the legend says what the mark means."""
    chart = load_chart("media_player:MediaPlayer", cwd=str(FIXTURES))
    dot = render_chart_dot(chart)
    loop = next(line for line in dot.splitlines() if line.startswith("track__anchor -> track__"))
    assert 'label="Tick (internal)\\lRestart\\l"' in loop
    assert "Event (internal)" in dot and "not exited and entered again" in dot
    # a chart without internal transitions keeps its legend as it was
    assert "(internal)" not in render_chart_dot(load_chart("order_flow:OrderFlow",
                                                           cwd=str(FIXTURES)))


def test_guarded_alternatives_of_one_event_are_drawn_in_the_order_they_are_tried() -> None:
    """``play`` from ``stopped``: ``[has_license, network_up, !low_battery]`` first, then
    ``[has_license, offline]``, then the fallback. When both guard sets hold the first wins;
    drawn as two plain ``Play [..]`` lines the diagram read as if either could be taken. The
    eventless alternatives of ``screening`` likewise."""
    media = render_chart_dot(load_chart("media_player:MediaPlayer", cwd=str(FIXTURES)))
    assert ('label="Play #1 [has_license, network_up, !low_battery]\\lPlay #2 [has_license, '
            'offline]\\l"') in media
    assert 'label="Play [else]\\l"' in media
    assert "tried in this order: the first whose guards hold is taken" in media
    orders = render_chart_dot(load_chart("order_flow:OrderFlow", cwd=str(FIXTURES)))
    assert 'label="(eventless) #1 [is_fraud]\\l"' in orders
    assert 'label="(eventless) #2 [!is_fraud]\\l"' in orders
    # one guarded transition per state and event: no number, no legend row
    assert 'label="(eventless) [is_vip]\\lDeliver\\l"' in orders
    big = render_chart_dot(load_chart("big_chart:BigChart", cwd=str(FIXTURES)))
    assert "#1" not in big and "tried in this order" not in big


class Weighed(StateChart):
    """A validator that needs event data (``weight``, no default)."""

    a = State(initial=True)
    b = State()
    c = State(final=True)
    go = a.to(b, validators="needs_weight")
    end = b.to(c)

    def needs_weight(self, weight: int) -> None:
        if weight <= 0:
            raise ValueError(f"weight must be positive, got {weight}")


def test_a_step_whose_validator_needs_event_data_is_named_when_drive_fails() -> None:
    """python-statemachine raises the validator's ``TypeError`` (missing ``weight``) for a
    ``send("go")`` without data, as ``drive`` sends it: the error said nothing of the path,
    the step or why; it now carries a note naming them."""
    (walk,) = transition_tour(Weighed)
    with pytest.raises(TypeError) as raised:
        drive(compiled(Weighed).run(GuardTable.for_chart(Weighed)), walk)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "missing 1 required positional argument: 'weight'" in str(raised.value)
    assert "step 1 of 2 of a Weighed path, a --go--> b" in notes
    assert "drive sends each event with no data" in notes
