"""Tests of the traffic light (compound, parallel and history states) through calexec's public
API only (docs/framework.md, "Hierarchical charts"): the junction's rules on the compiled run,
every state and every transition by generated paths, python-statemachine and the compiled run
agreeing on random events with event data, the committed diagram's staleness check and the
transition coverage gate."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from traffic_light import Junction, TrafficLight

from calexec.machines.compiled import compiled
from calexec.machines.coverage import recording, report
from calexec.machines.paths import as_data, drive, transition_tour

HERE = Path(__file__).resolve().parent
#: set in the nested run below (coverage gate), which must not start runs again
NESTED = "TRAFFIC_LIGHT_NESTED"
nested_only = pytest.mark.skipif(bool(os.environ.get(NESTED)), reason="inside a nested run")


class ForcedJunction(Junction):
    """A junction whose guards answer what a generated path asks (``outcomes``; a guard not
    named holds): how ``paths.drive`` sets them."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: dict[str, bool] = {}

    def pedestrian_waiting(self) -> bool:
        return self.outcomes.get("pedestrian_waiting", True)

    def cars_stopped(self) -> bool:
        return self.outcomes.get("cars_stopped", True)


def running() -> tuple[object, Junction]:
    junction = Junction()
    run = compiled(TrafficLight).run(junction)
    run.send("power_on")
    return run, junction


# ---- the junction's rules -----------------------------------------------------------------
def test_cars_keep_green_until_a_pedestrian_presses() -> None:
    run, junction = running()
    assert run.send("tick") is None  # refused, and a StateChart ignores a refused event
    assert "green" in run.configuration
    run.send("press", side="east")
    run.send("tick")
    assert "yellow" in run.configuration and junction.requests == ["east"]


def test_walk_shows_only_while_the_cars_have_red() -> None:
    run, junction = running()
    run.send("press", side="west")
    run.send("step")
    assert "waiting" in run.configuration  # cars still green
    run.send("tick")
    run.send("tick")
    run.send("step")
    assert {"red", "walk"} <= set(run.configuration)
    assert junction.log == ["pressed on the west side", "cars stop", "beep beep: walk"]


def test_repair_resumes_the_cars_where_they_were_and_resets_the_pedestrians() -> None:
    run, _ = running()
    for event in ("press", "tick", "tick", "step", "fault"):
        run.send(event)
    assert run.configuration == ("flashing", "flash_on")
    run.send("blink")
    run.send("repair")
    assert {"operating", "red", "dont_walk"} <= set(run.configuration)


def test_a_retired_light_is_final() -> None:
    run = compiled(TrafficLight).run(Junction())
    run.send("retire")
    assert run.final and run.configuration == ("retired",)


# ---- generated paths: every state, every transition ----------------------------------------
PATHS = as_data(TrafficLight)


@pytest.mark.parametrize("state", list(PATHS["states"]))
def test_shortest_path_reaches_each_state(state: str) -> None:
    model = ForcedJunction()
    light = TrafficLight(model)
    for step in PATHS["states"][state]:
        model.outcomes = step["guards"]
        light.send(step["event"])
    assert state in light.configuration_values


def test_transition_tour_takes_every_transition() -> None:
    chart = compiled(TrafficLight)
    with recording([chart]) as recorder:
        for walk in transition_tour(chart):
            run = chart.run(ForcedJunction())
            assert drive(run, walk) == walk.end  # type: ignore[arg-type]
    (coverage,) = report([chart], recorder)
    assert coverage.complete, coverage.untaken


# ---- python-statemachine and the compiled run agree ----------------------------------------
EVENTS = sorted(str(e) for e in TrafficLight.events)


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(EVENTS), st.sampled_from(["north", "east"])),
                      max_size=25))
def test_compiled_run_and_python_statemachine_agree(steps: list[tuple[str, str]]) -> None:
    real_model, compiled_model = Junction(), Junction()
    light = TrafficLight(real_model)
    run = compiled(TrafficLight).run(compiled_model)
    for event, side in steps:
        light.send(event, side=side)
        run.send(event, side=side)
        assert run.configuration == tuple(light.configuration_values)
        assert compiled_model.log == real_model.log


# ---- the toolkit's commands, as a user's CI runs them --------------------------------------
def test_committed_diagram_is_current() -> None:
    """``calexec charts draw traffic_light:TrafficLight --out diagrams`` wrote it."""
    done = subprocess.run([sys.executable, "-m", "calexec", "charts", "draw",
                           "traffic_light:TrafficLight", "--out", "diagrams", "--check"],
                          cwd=HERE, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@nested_only
def test_coverage_gate_passes_at_100_percent(tmp_path: Path) -> None:
    for name in ("traffic_light.py", "test_traffic_light.py"):
        shutil.copy(HERE / name, tmp_path / name)
    shutil.copytree(HERE / "diagrams", tmp_path / "diagrams")
    (tmp_path / "pytest.ini").write_text("[pytest]\npythonpath = .\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env[NESTED] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--chart-coverage=traffic_light:TrafficLight", "--chart-coverage-min=100"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    n = len(compiled(TrafficLight).transitions)
    assert done.returncode == 0, done.stdout[-3000:]
    assert f"transition coverage TrafficLight: {n}/{n}" in done.stdout
